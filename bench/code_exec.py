"""Programs per second through the code sandbox: MBPP's reference solutions, with and without
bubblewrap.

Each program is its reference `code` plus its three asserts, run by verifiers.run_programs (one
process per core). Prints, per mode, the number that passed and the throughput.

Usage:
    python -m bench.code_exec --data-dir ../shared/data
    python -m bench.code_exec --data-dir ../shared/data --limit 200 --timeout-s 5
"""

import os
import time
from dataclasses import dataclass

import tyro

import data
import verifiers


@dataclass
class Args:
    data_dir: str | None = None
    """data root with the folder mbpp/ (e.g. ../shared/data; None: the hub)"""
    limit: int | None = None
    """only the first N tasks (None: all 974)"""
    timeout_s: float = 30.0
    """wall clock per program (task 123's reference takes several seconds)"""
    n_workers: int | None = None
    """programs at once (None: one per core)"""


def main(args: Args) -> dict:
    examples = [
        ex for split in data.SPLITS["mbpp"] for ex in data.load("mbpp", split, args.data_dir)
    ]
    examples = sorted(examples, key=lambda ex: int(ex["id"].split("/")[1]))[: args.limit]
    sources = [ex["solution"] + "\n\n" + ex["tests"] + "\n" for ex in examples]
    bwrap, results = verifiers.BWRAP if verifiers.bwrap_usable(verifiers.BWRAP) else None, {}
    for mode in (["bwrap"] if bwrap else []) + ["limits only"]:
        verifiers.BWRAP = bwrap if mode == "bwrap" else None
        start = time.perf_counter()
        runs = verifiers.run_programs(sources, args.timeout_s, args.n_workers)
        seconds = time.perf_counter() - start
        failed = [ex["id"] for ex, run in zip(examples, runs, strict=True) if not run["passed"]]
        results[mode] = {
            "passed": len(sources) - len(failed),
            "failed": failed,
            "programs_per_s": len(sources) / seconds,
        }
        n_passed, rate = len(sources) - len(failed), len(sources) / seconds
        print(
            f"{mode:12} {n_passed}/{len(sources)} passed  {rate:6.1f} programs/s  ({seconds:.1f} s, "
            f"{args.n_workers or os.cpu_count()} workers)  failed: {failed}"
        )
    verifiers.BWRAP = bwrap
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
