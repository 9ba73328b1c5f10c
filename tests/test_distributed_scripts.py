"""sft.py, expert_iter.py and distill.py under torchrun, on CPU with gloo: a whole run of 2 ranks,
each with its own vLLM engine and half of each batch (expert_iter.py, distill.py: half of each
step's questions), writes one run folder and makes the updates a run of 1 rank makes
(tests/test_distributed.py does the same for grpo.py, and more)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
COMMON = (
    "--dataset synthetic --template question --microbatch-size 2 --lr 1e-3 --n-eval 2"
    " --eval-max-tokens 4 --n-log-generations 1"
).split()
# Per script: its arguments, the steps of its metrics.jsonl rows, its last checkpoint and the metrics
# that must agree. The final weights: 2 ranks sum the same per-token gradients as 1 rank in another
# order, so a gradient element differs by float32 rounding, ~n 2^-24 of the sum of its terms'
# magnitudes (~1e-6 relative); AdamW divides each element by its own running RMS, which carries
# that relative error into the update, except where an element's terms cancel to near zero and a
# rounding can flip its step (up to 2 lr). So the average element agrees to ~1e-6 of how far it
# moved, while a rank trained on other rows would be apart by about the movement itself: asserted,
# the mean difference below 1e-3 of the mean movement (tests/test_distributed.py checks the
# gradients themselves, with SGD). Measured on an AVX2 EPYC: sft 1e-7, expert_iter 7e-7, distill
# 1e-6 of it.
RUNS = {
    # 24 examples in 3 steps of 8, evaluated at 0, 2 and 3
    "sft": {
        "args": "--n-examples 24 --batch-size 8 --eval-every 2 --max-seq-len 128",
        "steps": [0, 1, 2, 3],
        "last": "checkpoints/step_000003",
        "keys": ["train/loss", "train/grad_norm", "eval/accuracy", "eval/sample_token_entropy"],
    },
    # 2 steps of 8 questions x 4 responses of 2 tokens (about half are all letters: reward 1,
    # kept), in batches of 4
    "expert_iter": {
        "args": "--n-ei-steps 2 --n-questions 8 --group-size 4 --max-tokens 2 --batch-size 4"
        " --warmup-steps 0 --max-seq-len 128",
        "steps": [0, 1, 2],
        "last": "checkpoints/step_000002",
        "keys": [
            "rollout/accuracy",
            "rollout/n_kept",
            "train/n_updates",
            "train/loss",
            "train/entropy",
            "train/grad_norm",
            "eval/accuracy",
        ],
    },
    # 2 steps of 4 questions x 4 responses of 8 tokens; the teacher: the tiny model, 4x sharper
    "distill": {
        "args": "--n-distill-steps 2 --rollout-batch-size 16 --group-size 4 --max-tokens 8"
        " --eval-every 2 --lr 1e-2",
        "steps": [0, 1, 2],
        "last": "checkpoints/step_000002",
        "keys": [
            "train/loss",
            "train/grad_norm",
            "train/entropy",
            "rollout/reverse_kl",
            "eval/reverse_kl",
            "eval/accuracy",
        ],
    },
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharper_teacher(model: Path) -> Path:
    """The model with its final norm 4x larger: sharper next-token distributions, the same
    tokens."""
    teacher = model.parent / "sharper_teacher"
    if not teacher.exists():
        weights = AutoModelForCausalLM.from_pretrained(model)
        with torch.no_grad():
            weights.model.norm.weight.mul_(4)
        weights.save_pretrained(teacher)
        AutoTokenizer.from_pretrained(model).save_pretrained(teacher)
    return teacher


def torchrun(script: str, n_ranks: int, output_dir: Path, model: Path) -> Path:
    """`torchrun --nproc-per-node n_ranks` of a script under tests/under_torchrun.py (letter-share
    reward): its run."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(n_ranks),
        "--master-port",
        str(free_port()),
        str(ROOT / "tests" / "under_torchrun.py"),
        script,
        "--model",
        str(model),
        "--output-dir",
        str(output_dir),
        *COMMON,
        *RUNS[script]["args"].split(),
        *(["--teacher", str(sharper_teacher(model))] if script == "distill" else []),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (run_dir,) = output_dir.iterdir()  # one run folder, written by rank 0
    return run_dir


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("script", RUNS)
def test_two_ranks_run_as_one_rank_does(script, tiny_model_dir, tmp_path):
    run = RUNS[script]
    two = torchrun(script, 2, tmp_path / "2_ranks", tiny_model_dir)
    one = torchrun(script, 1, tmp_path / "1_ranks", tiny_model_dir)
    metrics = {folder: read_jsonl(folder / "metrics.jsonl") for folder in (two, one)}
    # rank 0's records only
    assert [m["step"] for m in metrics[two]] == run["steps"]
    assert [m["step"] for m in metrics[one]] == run["steps"]
    for key in run["keys"]:
        assert any(key in m for m in metrics[one]), f"{script} logged no {key}"
    for a, b in zip(metrics[two], metrics[one], strict=True):
        for key in run["keys"]:
            assert (key in a) == (key in b), (a["step"], key)
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    # every rank trained on the kept set gathered from all: the one 1 rank keeps
    if script == "expert_iter":
        assert read_jsonl(two / "kept.jsonl") == read_jsonl(one / "kept.jsonl")
        assert all(m["train/n_updates"] > 0 for m in metrics[one][1:])
        # a last batch of 1: rank 1 has no rows
        assert any(m["rollout/n_kept"] % 4 == 1 for m in metrics[one][1:])
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    two_weights = AutoModelForCausalLM.from_pretrained(two / run["last"]).state_dict()
    one_weights = AutoModelForCausalLM.from_pretrained(one / run["last"]).state_dict()
    moved = torch.cat([(one_weights[k] - start[k]).abs().flatten() for k in start])
    apart = torch.cat([(two_weights[k] - one_weights[k]).abs().flatten() for k in start])
    print(
        f"{script}: 2 ranks vs 1 apart max {apart.max():.3g}, mean {apart.mean():.3g}; "
        f"moved max {moved.max():.3g}, mean {moved.mean():.3g}"
    )
    assert moved.max() > 1e-3, moved.max()
    assert apart.mean() < 1e-3 * moved.mean(), (apart.mean(), moved.mean())
