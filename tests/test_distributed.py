"""Data parallel under torchrun, proven on CPU with gloo: 2 ranks x half a batch make the update 1
rank makes on the whole batch (every loss aggregation; a rank with no rows too); whole runs of 2
ranks, each with its own vLLM engine, write one run folder and resume; a rank that dies or hangs
stops the run within a timeout, named."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

import grpo
import grpo_family

ROOT = Path(__file__).resolve().parents[1]
AGGREGATIONS = ["sequence_mean", "token_mean", "constant"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rollout_batch(n: int, seed: int = 0) -> tuple[dict, list[int]]:
    """n responses of different lengths to random prompts, with advantages and rewards, as grpo.main
    collates them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 300, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    outputs = [
        torch.randint(3, 300, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    batch = grpo_family.collate_token_ids(prompts, outputs, 0)
    # some above the IS cap
    batch["engine_log_probs"] = -5 - torch.rand(batch["response_mask"].shape, generator=g)
    # (n, 1), as collate_rollouts lays them out
    batch["advantages"] = torch.randn(n, generator=g).unsqueeze(1)
    batch["raw_rewards"] = torch.rand(n, generator=g).unsqueeze(1)
    return batch, [len(p) + len(o) - 1 for p, o in zip(prompts, outputs, strict=True)]


def one_update(model_dir: str, aggregation: str, n_rows: int) -> tuple[dict, dict]:
    """One GRPO step's grpo_update (grpo_family.py's: grpo.py's with the family's aggregations) on a
    fixed rollout batch, off-policy (2 minibatches x 2 epochs) with a KL reference: (its metrics,
    the new weights)."""
    args = grpo_family.Args(
        model=model_dir,
        rollout_batch_size=8,
        group_size=2,
        train_batch_size=4,
        microbatch_size=2,
        epochs_per_rollout_batch=2,
        loss_aggregation=aggregation,
        beta=0.1,
        lr=1.0,
        max_tokens=16,
    )
    policy, autocast = grpo_family.load_policy(model_dir, "cpu", False, 0)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).requires_grad_(
        False
    )
    # SGD: the weights move by the gradients themselves (Adam would blow a 1e-7 difference of a ~0
    # gradient up to lr)
    optimizer = torch.optim.SGD(policy.parameters(), lr=args.lr)
    batch, lengths = rollout_batch(n_rows)
    lrs = [args.lr] * 4
    metrics = grpo_family.grpo_update(
        policy, optimizer, batch, lengths, lrs, reference, args, 0, autocast
    )
    return metrics, {k: v.detach().clone() for k, v in policy.state_dict().items()}


def rank_main(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    """A spawned rank: what torchrun would set, then the updates of
    test_two_ranks_make_one_ranks_update."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    # read from the environment when grpo_family was imported
    grpo_family.RANK, grpo_family.WORLD_SIZE = rank, world_size
    torch.set_num_threads(1)
    grpo_family.init_distributed(120)
    results = {(agg, n): one_update(model_dir, agg, n) for agg in AGGREGATIONS for n in (12, 3)}
    if rank == 0:
        torch.save(results, out)


def test_two_ranks_make_one_ranks_update(tiny_model_dir, tmp_path):
    out = tmp_path / "two_ranks.pt"
    mp.spawn(rank_main, args=(2, free_port(), str(tiny_model_dir), str(out)), nprocs=2)
    two_ranks = torch.load(out)
    for aggregation in AGGREGATIONS:
        # 12 rows: 6 per minibatch, 3 per rank. 3 rows: minibatches of 2 and 1 (rank 1 trains on
        # none of the second).
        for n_rows in (12, 3):
            metrics, weights = one_update(str(tiny_model_dir), aggregation, n_rows)
            metrics2, weights2 = two_ranks[aggregation, n_rows]
            assert metrics2.keys() == metrics.keys()
            for key, value in metrics.items():
                assert metrics2[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (
                    aggregation,
                    n_rows,
                    key,
                )
            # 2 minibatches x 2 epochs
            assert metrics["train/n_updates"] == 4 and metrics["train/kl"] > 0
            start = AutoModelForCausalLM.from_pretrained(
                tiny_model_dir, dtype=torch.float32
            ).state_dict()
            moved = max((weights[k] - start[k]).abs().max().item() for k in weights)
            differ = max((weights2[k] - weights[k]).abs().max().item() for k in weights)
            assert moved > 1e-2 and differ < 1e-4 * moved, (aggregation, n_rows, moved, differ)


# --- Whole runs under torchrun: 2 ranks on CPU, each with its own vLLM engine (tests/under_torchrun.py) ---


def torchrun_command(
    n_ranks: int, output_dir: Path, *extra: str, model: Path, fail: dict | None = None
) -> tuple[list[str], dict]:
    """The command and environment of `torchrun --nproc-per-node n_ranks` of grpo.py for 3 short
    steps, checkpointing each."""
    args = [
        "--model",
        str(model),
        "--output-dir",
        str(output_dir),
        "--dataset",
        "synthetic",
        "--template",
        "question",
        "--n-grpo-steps",
        "3",
        "--rollout-batch-size",
        "16",
        "--group-size",
        "4",
        "--train-batch-size",
        "8",
        "--microbatch-size",
        "4",
        "--max-tokens",
        "8",
        "--lr",
        "1e-2",
        "--eval-every",
        "2",
        "--n-eval",
        "2",
        "--eval-max-tokens",
        "4",
        "--n-log-generations",
        "1",
        "--save-every",
        "1",
        *extra,
    ]
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **(fail or {}),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(n_ranks),
        "--master-port",
        str(free_port()),
        str(ROOT / "tests" / "under_torchrun.py"),
        "grpo",
        *args,
    ]
    return command, env


def torchrun(n_ranks: int, output_dir: Path, *extra: str, model: Path, fail: dict | None = None):
    """torchrun_command run to its end: (return code, output)."""
    command, env = torchrun_command(n_ranks, output_dir, *extra, model=model, fail=fail)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def two_rank_run(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_ranks")
    code, output = torchrun(2, out, model=tiny_model_dir)
    assert code == 0, output[-3000:]
    (run_dir,) = out.iterdir()  # one run folder, written by rank 0
    return run_dir


def test_two_ranks_run_as_one_rank_does(two_rank_run, tiny_model_dir, tmp_path):
    code, output = torchrun(1, tmp_path, model=tiny_model_dir)
    assert code == 0, output[-3000:]
    (one_rank_run,) = tmp_path.iterdir()
    # The same questions, and the same samples: each rank generated its half with the same
    # per-request seeds.
    assert read_jsonl(two_rank_run / "rollouts.jsonl") == read_jsonl(
        one_rank_run / "rollouts.jsonl"
    )
    two, one = (
        read_jsonl(two_rank_run / "metrics.jsonl"),
        read_jsonl(one_rank_run / "metrics.jsonl"),
    )
    assert [m["step"] for m in two] == [0, 1, 2, 3]  # one record per step: rank 0 writes them
    for a, b in zip(two[1:], one[1:], strict=True):
        assert a["train/n_updates"] == b["train/n_updates"] == 2  # 2 minibatches of 8 responses
        for key in ("train/grad_norm", "train/entropy", "train/clip_fraction"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        # evaluated every 2 steps and at the end: a metric logged by neither run must not pass
        assert ("eval/accuracy" in a) == ("eval/accuracy" in b) == (a["step"] in (2, 3))
        if "eval/accuracy" in a:
            assert a["eval/accuracy"] == pytest.approx(b["eval/accuracy"], abs=1e-6)
    # each rank checked its own engine, or it would have raised
    assert all(m["reload/logprob_gap"] < 1e-3 for m in two)
    # The final weights. The two runs sum the same per-token gradients in another order (each rank
    # its half, then all_reduce), so a gradient element differs by float32 rounding: ~n 2^-24 of
    # the sum of its terms' magnitudes (n <= 16 rows here: ~1e-6 relative). AdamW divides each
    # element by its own running RMS, which carries that relative error into the update, except
    # where an element's terms cancel to near zero: there a rounding can flip the update's sign,
    # up to 2 lr apart (lr 1e-2). So a typical element agrees to ~1e-6 of how far it moved and the
    # few flipped ones lift the mean, while a rank that trained on other rows would differ by about
    # the movement itself: the mean difference is asserted below 1e-3 of the mean movement, and no
    # element more than 2 lr per update apart (6 updates). Measured on an AVX2 EPYC, pinned to
    # AVX2 or not: mean 5.1e-7 apart against 0.026 moved (2e-5 of it), max 1.19e-4.
    final = lambda folder: AutoModelForCausalLM.from_pretrained(folder).state_dict()
    start = final(tiny_model_dir)
    two_weights = final(two_rank_run / "checkpoints" / "step_000003")
    one_weights = final(one_rank_run / "checkpoints" / "step_000003")
    apart = torch.cat([(two_weights[k] - one_weights[k]).abs().flatten() for k in one_weights])
    moved = torch.cat([(one_weights[k] - start[k]).abs().flatten() for k in one_weights])
    print(
        f"2 ranks vs 1: max {apart.max():.3g}, mean {apart.mean():.3g} apart; "
        f"moved max {moved.max():.3g}, mean {moved.mean():.3g}"
    )
    assert apart.mean() < 1e-3 * moved.mean()
    assert apart.max() < 2 * 1e-2 * 6


def test_a_rank_that_dies_stops_the_run_named_and_resume_finishes_it(
    two_rank_run, tiny_model_dir, tmp_path
):
    # Rank 1 is killed (SIGKILL) in step 2's evaluation, after the step-1 checkpoint: its 18th
    # reward call (1 in the first evaluation, 8 a step, 1 in step 2's evaluation).
    t0 = time.time()
    code, output = torchrun(
        2, tmp_path, model=tiny_model_dir, fail={"FAIL": "die", "FAIL_RANK": "1", "FAIL_AT": "18"}
    )
    assert code != 0 and "rank      : 1 (local_rank: 1)" in output and "SIGKILL" in output, output[
        -3000:
    ]
    print(f"killed run: {time.time() - t0:.0f} s")
    (run_dir,) = tmp_path.iterdir()
    # step 2's save never came
    assert [path.name for path in grpo.checkpoints(run_dir)] == ["step_000001"]
    code, output = torchrun(2, tmp_path, "--resume", str(run_dir), model=tiny_model_dir)
    assert code == 0 and "after step 1" in output, output[-3000:]
    assert read_jsonl(run_dir / "rollouts.jsonl") == read_jsonl(two_rank_run / "rollouts.jsonl")
    # the same steps, and in each trained step the same mean reward (a key missing from both runs
    # raises instead of comparing None with None)
    steps = lambda run: [m["step"] for m in read_jsonl(run / "metrics.jsonl")]
    rewards = lambda run: [
        m["rollout/reward_mean"] for m in read_jsonl(run / "metrics.jsonl") if m["step"]
    ]
    assert steps(run_dir) == steps(two_rank_run) == [0, 1, 2, 3]
    assert rewards(run_dir) == rewards(two_rank_run)


def test_a_rank_that_hangs_is_named_within_the_timeout(tiny_model_dir, tmp_path):
    """Rank 1 stops itself (SIGSTOP) in step 1's scoring, printing the time; rank 0 waits for it at
    the next gather for --rank-timeout-s, then names it. The output is read as it comes, so the
    time from the stop to the naming is measured: 30.0-30.3 s at 30 s (10 s flaked at a load of
    ~20: rank 0 can still be generating when rank 1 stops), asserted within the timeout + 5 s."""
    timeout_s = 30
    command, env = torchrun_command(
        2,
        tmp_path,
        "--rank-timeout-s",
        str(timeout_s),
        model=tiny_model_dir,
        fail={"FAIL": "hang", "FAIL_RANK": "1", "FAIL_AT": "3", "PYTHONUNBUFFERED": "1"},
    )
    named = f"Rank 1 failed to pass monitoredBarrier in {timeout_s * 1000} ms"
    lines, stopped_at, named_at = [], None, None
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        for line in process.stdout:
            lines.append(line)
            # torchrun may prefix a rank's lines ("[rank1]:")
            if "rank 1 stops at " in line:
                stopped_at = float(line.split()[-1])
            if named in line and named_at is None:
                named_at = time.time()
        code = process.wait(timeout=600)
    output = "".join(lines)
    assert code != 0 and stopped_at and named_at, (code, stopped_at, named_at, output[-3000:])
    elapsed = named_at - stopped_at
    print(f"rank 1 named {elapsed:.1f} s after it stopped (--rank-timeout-s {timeout_s})")
    assert elapsed < timeout_s + 5, output[-3000:]
