"""A whole grpo.py step, split into generate / score / train / reload, from grpo.py's own metrics.jsonl.

Runs grpo.py for a few steps at the issue's settings (synthetic prompts, a random-weight model from tiny_model.py,
beta 0, token-mean loss, constant lr, one optimizer step per generation batch, --no-drop-zero-variance-groups so every
response is trained on) and prints the median seconds of each phase over the steps after the first (a warm-up):

    python bench/grpo_step.py                       # both sizes of SIZES
    python bench/grpo_step.py --sizes tiny --steps 3
    python bench/grpo_step.py --grpo-args --microbatch-size 16    # try an option

Each run starts a vLLM engine: where engines share a machine, wrap the command in `flock /tmp/vllm.lock`.
Standard library only at import, so bench/trl_side_by_side.py can import it from TRL's virtual environment.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generate", "score", "train", "reload")
MODELS = {  # tiny_model.py flags: the two sizes, and a few-hundred-million-parameter one (bench/reload.py)
    "tiny": ["--n-layers", "4"],
    "25m": ["--hidden-size", "512", "--n-layers", "8", "--n-heads", "8", "--n-kv-heads", "4", "--head-dim", "64",
            "--intermediate-size", "1536"],
    "300m": ["--hidden-size", "1024", "--n-layers", "24", "--n-heads", "16", "--n-kv-heads", "8", "--head-dim", "64",
             "--intermediate-size", "3072"],
}  # fmt: skip
SIZES = {  # the model's flags, then (prompts, group size, max new tokens, microbatch): the two rows
    "tiny": (MODELS["tiny"], (32, 8, 64, 64)),
    "25m": (MODELS["25m"], (16, 8, 128, 32)),
}
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class Args:
    sizes: list[str] = field(default_factory=lambda: list(SIZES))
    """keys of SIZES"""
    steps: int = 4
    """GRPO steps per run; the first is a warm-up and not counted"""
    work_dir: str | None = None
    """where the models and runs go (None: a temporary folder)"""
    grpo_args: list[str] = field(default_factory=list)
    """extra grpo.py arguments"""


def make_model(work: Path, size: str) -> str:
    """The size's random-weight model (tiny_model.py, seed 0), built once in work/."""
    model = work / f"model-{size}"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tiny_model.py"), "--out", str(model), *MODELS[size]],
                       check=True, capture_output=True)  # fmt: skip
    return str(model)


def run_in_own_process(script: str, args: list[str]) -> dict:
    """`python script *args` in a fresh process with the engine's environment (one vLLM engine per process), and the
    JSON object it prints on its last line: how reload.py, generate.py and overlap.py time one model each."""
    done = subprocess.run([sys.executable, script, *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **ENGINE_ENV})  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_grpo(model: str, size: str, steps: int, out: Path, extra: list[str] = ()) -> dict[str, list[float]]:
    """grpo.py at the size's settings; per-step seconds of each phase, and "step", their sum (the last step's
    time/step also holds the final evaluation: the sum leaves it out)."""
    n_prompts, group, max_tokens, micro = SIZES[size][1]
    cmd = [sys.executable, str(ROOT / "grpo.py"), "--model", model, "--dataset", "synthetic",
           "--template", "question", "--n-grpo-steps", str(steps), "--rollout-batch-size", str(n_prompts * group),
           "--train-batch-size", str(n_prompts * group), "--group-size", str(group), "--microbatch-size", str(micro),
           "--max-tokens", str(max_tokens), "--lr", "1e-5", "--lr-schedule", "constant", "--beta", "0",
           "--loss-aggregation", "token_mean", "--no-drop-zero-variance-groups", "--n-eval", "8",
           "--eval-max-tokens", "8", "--eval-every", "100000", "--save-every", "100000", "--output-dir", str(out),
           *extra]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, **ENGINE_ENV}, capture_output=True)
    (metrics_file,) = out.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics_file.open()][1:]  # [0]: the evaluation before step 1
    times = {phase: [r[f"time/{phase}"] for r in rows] for phase in PHASES}
    times["step"] = [sum(phase_times) for phase_times in zip(*times.values(), strict=True)]
    times["response_length"] = [r["rollout/response_length"] for r in rows]
    return times


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def describe(size: str) -> str:
    n_prompts, group, max_tokens, micro = SIZES[size][1]
    return (
        f"{size}: {n_prompts * group} completions ({n_prompts} x {group}), <= {max_tokens} tokens, microbatch {micro}"
    )


def main(args: Args) -> list[dict]:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="grpo_step_"))
    print(f"grpo.py seconds per step, median of steps 2..{args.steps}; load average {os.getloadavg()[0]:.1f}")
    rows = []
    for size in args.sizes:
        times = run_grpo(
            make_model(work, size), size, args.steps, work / f"grpo-{size}-{time.time_ns()}", args.grpo_args
        )
        m = {key: median_after_warmup(values) for key, values in times.items()}
        print(f"{describe(size)}\n  step {m['step']:6.2f}  generate {m['generate']:.2f} / score {m['score']:.2f} / "
              f"train {m['train']:.2f} / reload {m['reload']:.2f}; mean response {m['response_length']:.0f} tokens",
              flush=True)  # fmt: skip
        rows.append({"size": size, **m})
    return rows


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
