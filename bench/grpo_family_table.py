"""The table of docs/grpo_family.md from the runs of bench/grpo_family.sh: per variant, the final
greedy test accuracy (mean +- standard error over seeds), and the mean wall time of a run
(done.txt). Usage: python -m bench.grpo_family_table runs/grpo_family"""

import json
import statistics
import sys
from pathlib import Path


def main(out: Path) -> None:
    walls: dict[str, list[int]] = {}
    for line in (out / "done.txt").read_text().splitlines():
        name, _, _, _, rc, _, wall, _ = line.split()
        if rc == "0":
            walls.setdefault(name, []).append(int(wall))
    print("| variant | seeds | start | final test accuracy | wall per run |\n|---|---|---|---|---|")
    for name in walls:
        first, last = [], []
        for metrics in sorted((out / name).glob("*/metrics.jsonl")):
            evals = [
                r for r in map(json.loads, metrics.read_text().splitlines()) if "eval/accuracy" in r
            ]
            if len(evals) > 1:
                first.append(evals[0]["eval/accuracy"])
                last.append(evals[-1]["eval/accuracy"])
        se = statistics.stdev(last) / len(last) ** 0.5 if len(last) > 1 else float("nan")
        print(
            f"| {name} | {len(last)} | {100 * statistics.mean(first):.1f}% | {100 * statistics.mean(last):.1f}% "
            f"± {100 * se:.1f} | {statistics.mean(walls[name]):.0f} s |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
