"""The README's file table is the map a reader starts from: its line counts are the files'."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `([^`]+)` \| (\d+) \|", re.M)


def n_lines(path: Path) -> int:
    if path.is_dir():
        return sum(n_lines(p) for p in sorted(path.iterdir()) if p.suffix in (".py", ".sh"))
    return len(path.read_text().splitlines())


def test_readme_file_table_counts_lines():
    rows = ROW.findall((ROOT / "README.md").read_text())
    assert len(rows) >= 9, rows
    wrong = {name: (int(n), n_lines(ROOT / name)) for name, n in rows}
    wrong = {name: counts for name, counts in wrong.items() if counts[0] != counts[1]}
    assert not wrong, f"README.md's file table (said, counted): {wrong}"
