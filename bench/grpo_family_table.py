"""The table of docs/grpo_family.md from the runs of bench/grpo_family.sh: per variant, the final
greedy test accuracy (mean +- standard error over seeds), the mean wall time of a run (done.txt),
and over every step of every seed the mean engine/trainer log-prob gap per token, the share of
tokens whose importance weight was capped or masked (train/frac_above_is_cap, logged off the
default) and the share the off-policy sequence mask left out. Usage: python -m
bench.grpo_family_table runs/grpo_family"""

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
    print(
        "| variant | seeds | start | final test accuracy | wall per run | engine gap per token"
        " | tokens capped or masked | tokens in sequences masked |\n|---|---|---|---|---|---|---|---|"
    )
    for name in walls:
        first, last = [], []
        steps = []
        for metrics in sorted((out / name).glob("*/metrics.jsonl")):
            records = list(map(json.loads, metrics.read_text().splitlines()))
            evals = [r for r in records if "eval/accuracy" in r]
            if len(evals) > 1:
                first.append(evals[0]["eval/accuracy"])
                last.append(evals[-1]["eval/accuracy"])
            steps += [r for r in records if "train/engine_logprob_gap" in r]
        se = statistics.stdev(last) / len(last) ** 0.5 if len(last) > 1 else float("nan")
        print(
            f"| {name} | {len(last)} | {100 * statistics.mean(first):.1f}% | {100 * statistics.mean(last):.1f}% "
            f"± {100 * se:.1f} | {statistics.mean(walls[name]):.0f} s | {mean(steps, 'train/engine_logprob_gap')}"
            f" | {mean(steps, 'train/frac_above_is_cap', percent=True)}"
            f" | {mean(steps, 'train/frac_off_policy_masked', percent=True)} |"
        )


def mean(records: list[dict], key: str, percent: bool = False) -> str:
    """The mean of key over the records that logged it: "-" where none did."""
    values = [r[key] for r in records if key in r]
    if not values:
        return "-"
    value = statistics.mean(values)
    return f"{100 * value:.2f}%" if percent else f"{value:.1e}"


if __name__ == "__main__":
    main(Path(sys.argv[1]))
