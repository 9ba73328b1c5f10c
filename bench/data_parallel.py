"""Data parallel on this machine: GRPO at the ladder's shape under `torchrun --nproc-per-node N`,
for N = 1 and 2.

Each rank runs a trainer and its own in-process vLLM engine on the CPU (docs/distributed.md).
Prints, per N: the median seconds per GRPO step after the first, steps/s, and each rank's peak
resident memory (sampled every 0.2 s), from which the second rank's cost. The ladder's GRPO
arguments (ladder.py), evaluation only at the end.

    python -m bench.data_parallel --model runs/ladder__1__<time>/sft__1__<time>/checkpoints/step_000625
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import tyro

ROOT = Path(__file__).resolve().parents[1]
LADDER_GRPO = [
    "--dataset",
    "synthetic",
    "--template",
    "question",
    "--rollout-batch-size",
    "256",
    "--group-size",
    "8",
    "--train-batch-size",
    "64",
    "--microbatch-size",
    "64",
    "--lr",
    "1e-4",
    "--max-tokens",
    "64",
    "--eval-max-tokens",
    "64",
    "--n-eval",
    "64",
    "--save-every",
    "100000",
]


@dataclass
class Args:
    model: str
    """an SFT checkpoint of the ladder (or any tiny model folder)"""
    ranks: list[int] = field(default_factory=lambda: [1, 2])
    """numbers of ranks to run"""
    n_steps: int = 6
    """GRPO steps per run; the first is not timed"""


def run(model: str, n_ranks: int, n_steps: int) -> dict:
    """One torchrun of grpo.py: its metrics and each rank's peak resident memory in GB."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="bench_dp_")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(n_ranks),
        "--master-port",
        str(port),
        str(ROOT / "grpo.py"),
        "--model",
        model,
        "--output-dir",
        out,
        *LADDER_GRPO,
        "--n-grpo-steps",
        str(n_steps),
        "--eval-every",
        str(n_steps),
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    launcher, peak = (
        subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
        {},
    )
    while launcher.poll() is None:
        for child in psutil.Process(launcher.pid).children():
            try:
                rank = child.environ().get("RANK", "?")
                peak[rank] = max(peak.get(rank, 0), child.memory_info().rss / 1e9)
            except psutil.Error:
                pass
        time.sleep(0.2)
    if launcher.returncode:
        raise RuntimeError(launcher.stderr.read().decode()[-3000:])
    (run_dir,) = Path(out).iterdir()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"metrics": [m for m in metrics if m["step"] > 0], "peak_gb": dict(sorted(peak.items()))}


def main(args: Args) -> None:
    print(
        "| ranks | s / GRPO step | steps / s | generate s | train s | peak memory per rank (GB) |"
    )
    print("|---|---|---|---|---|---|")
    for n_ranks in args.ranks:
        result = run(args.model, n_ranks, args.n_steps)
        timed = result["metrics"][1:-1]  # not the first step (warm-up), nor the last (it evaluates)
        step, generate, train = (
            statistics.median(m[key] for m in timed)
            for key in ("time/step", "time/generate", "time/train")
        )
        peaks = ", ".join(f"{gb:.2f}" for gb in result["peak_gb"].values())
        print(
            f"| {n_ranks} | {step:.2f} | {1 / step:.3f} | {generate:.2f} | {train:.2f} | {peaks} |"
        )


if __name__ == "__main__":
    main(tyro.cli(Args))
