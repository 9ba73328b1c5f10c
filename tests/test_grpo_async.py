"""grpo_async.py: the engine samples the next step's rollouts while the trainer learns. With
--max-staleness 0 it is grpo.py, bit for bit; with 1 it trains on rollouts one step old and
corrects them; a resumed run replays the rollouts sampled ahead; a dead or hung engine thread
stops the run with its error. Whole runs with a real engine on IFEval with partial credit, where
a random tiny model's rewards differ within groups, so that the weights move."""

import gc
import json
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
from conftest import ROOT, interrupted_at_call

import grpo
import grpo_async

# the metrics only grpo_async.py logs, and the wall times
ASYNC_ONLY = ("rollout/staleness", "train/is_weight", "time/")


def run_args(module, tiny_model_dir, shared_data, tmp_path, **overrides):
    args = dict(
        model=str(tiny_model_dir),
        dataset="ifeval",
        template="question",
        data_dir=str(shared_data),
        ifeval_partial_credit=1.0,
        output_dir=str(tmp_path),
        n_grpo_steps=3,
        rollout_batch_size=16,
        group_size=4,
        train_batch_size=16,
        microbatch_size=8,
        max_tokens=32,
        lr=1e-3,
        eval_every=3,
        n_eval=4,
        eval_max_tokens=16,
        n_log_generations=1,
    )
    return module.Args(**{**args, **overrides})


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def computed(metrics: list[dict]) -> list[dict]:
    """Each step's metrics but wall times, throughput and grpo_async.py's own."""
    keep = lambda k: not k.startswith(ASYNC_ONLY) and not k.endswith("tokens_per_second")
    return [{k: v for k, v in m.items() if keep(k)} for m in metrics]


def final_weights(run):
    (checkpoint,) = sorted((run / "checkpoints").iterdir())[-1:]
    model = grpo.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return model.state_dict()


def test_staleness_zero_is_grpo_exactly(tiny_model_dir, shared_data, tmp_path):
    sync = grpo.main(run_args(grpo, tiny_model_dir, shared_data, tmp_path / "sync"))
    overlapped = grpo_async.main(
        run_args(grpo_async, tiny_model_dir, shared_data, tmp_path / "async", max_staleness=0)
    )
    metrics = read_jsonl(overlapped / "metrics.jsonl")
    # not a trivial agreement: the rewards differ within groups, the weights move
    assert any(m.get("rollout/frac_zero_std_groups", 1) < 1 for m in metrics)
    assert sum(m.get("train/n_updates", 0) for m in metrics) >= 2
    assert computed(metrics) == computed(read_jsonl(sync / "metrics.jsonl"))
    assert [m.get("rollout/staleness_max") for m in metrics[1:]] == [0, 0, 0]
    for name in ("rollouts.jsonl", "generations.jsonl"):
        assert read_jsonl(overlapped / name) == read_jsonl(sync / name), name
    start = grpo.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    a, b = final_weights(sync), final_weights(overlapped)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], v) for k, v in start.state_dict().items())


@pytest.mark.parametrize("train_batch_size", [16, 8])
def test_staleness_one_trains_on_rollouts_one_step_old_and_corrects_them(
    train_batch_size, tiny_model_dir, shared_data, tmp_path
):
    # one minibatch a step, or two: then p_old is a frozen pass (frozen_log_probs) before the
    # first, and the second trains off-policy on top of the staleness
    args = run_args(
        grpo_async,
        tiny_model_dir,
        shared_data,
        tmp_path,
        n_grpo_steps=4,
        train_batch_size=train_batch_size,
    )
    run = grpo_async.main(args)
    metrics = read_jsonl(run / "metrics.jsonl")[1:]
    # step 1's rollouts wait for no update; every later step's were sampled one step back
    assert [m["rollout/staleness_max"] for m in metrics] == [0, 1, 1, 1]
    assert all(m["rollout/staleness_mean"] == m["rollout/staleness_max"] for m in metrics)
    # the engine followed every reload (reload_and_check raises otherwise): the probe's gap
    gaps = [m["reload/logprob_gap"] for m in metrics if m["train/n_updates"]]
    assert gaps and all(gap <= 1e-3 for gap in gaps)
    # On-policy (step 1) the engine sampled from the trainer's weights: its importance weights
    # are 1 but for float rounding. A step whose sampler was an update behind (the step before
    # trained) has weights p_old / p_engine that move: the correction is at work.
    assert metrics[0]["train/n_updates"] and metrics[0]["train/is_weight_std"] < 1e-3
    stale = [
        m
        for before, m in zip(metrics, metrics[1:], strict=False)
        if before["train/n_updates"] and m["train/n_updates"]
    ]
    assert stale, "no stale step after an update: raise lr or the steps"
    for m in stale:
        # every minibatch of the step trained
        assert m["train/n_updates"] == 16 // train_batch_size
        assert m["train/is_weight_std"] > 0.01
        assert m["train/engine_logprob_gap"] > 10 * metrics[0]["train/engine_logprob_gap"]
    # the engine sampled while the trainer trained
    assert metrics[0]["time/overlap"] > 0


def test_resume_replays_the_rollouts_sampled_ahead(tiny_model_dir, shared_data, tmp_path):
    kwargs = dict(n_grpo_steps=3, save_every=1)
    full = grpo_async.main(
        run_args(grpo_async, tiny_model_dir, shared_data, tmp_path / "full", **kwargs)
    )
    # killed in step 2's reload: the checkpoint of step 1 holds step 2's rollouts, sampled ahead
    with interrupted_at_call(grpo_async, "reload_and_check", 3):
        grpo_async.main(
            run_args(grpo_async, tiny_model_dir, shared_data, tmp_path / "stopped", **kwargs)
        )
    (stopped,) = (tmp_path / "stopped").iterdir()
    assert (stopped / "sampled_ahead" / "step_000001.pt").exists()
    resumed = grpo_async.main(
        run_args(
            grpo_async,
            tiny_model_dir,
            shared_data,
            tmp_path / "stopped",
            resume=str(stopped),
            **kwargs,
        )
    )
    assert read_jsonl(resumed / "rollouts.jsonl") == read_jsonl(full / "rollouts.jsonl")
    assert computed(read_jsonl(resumed / "metrics.jsonl")) == computed(
        read_jsonl(full / "metrics.jsonl")
    )
    a, b = final_weights(full), final_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("failure", ["dies", "hangs"])
def test_a_dead_or_hung_engine_thread_stops_the_run_with_its_error(
    failure, tiny_model_dir, shared_data, tmp_path, monkeypatch
):
    real = grpo_async.generate_responses
    calls = []
    release = threading.Event()

    def second_call_fails(*args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            if failure == "hangs":
                release.wait(60)
            raise RuntimeError("the engine's GPU fell off the bus")
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo_async, "generate_responses", second_call_fails)
    args = run_args(grpo_async, tiny_model_dir, shared_data, tmp_path, engine_timeout_s=5)
    message = "fell off the bus" if failure == "dies" else "gave no rollouts in 5 s"
    try:
        with pytest.raises(RuntimeError, match=message):
            grpo_async.main(args)
    finally:
        release.set()
    # sampled in the engine's thread, not the trainer's
    assert calls == ["engine", "engine"]


def test_a_jobs_own_timeout_error_is_its_own_and_the_thread_ends_on_none():
    """wait_for raises a job's own TimeoutError (a verifier's socket, say) as it is, with its
    traceback, not as the engine's timeout; and the engine's thread ends on None, holding no job."""
    jobs, thread = grpo_async.start_engine_thread("cpu")
    assert thread.name == "engine" and thread.daemon and thread.is_alive()

    def slow_socket():
        raise TimeoutError("the sandbox's socket timed out")

    with pytest.raises(TimeoutError, match="sandbox's socket") as raised:
        grpo_async.wait_for(grpo_async.submit(jobs, slow_socket), thread, 5)
    assert "slow_socket" in str(raised.traceback[-1])
    # a job that does not end in time is the engine's timeout
    hang = threading.Event()
    with pytest.raises(RuntimeError, match="gave no rollouts in 0 s"):
        grpo_async.wait_for(grpo_async.submit(jobs, hang.wait, 10), thread, 0.1)
    hang.set()

    # the closure a job held is let go, and None ends the thread
    class Engine:
        pass

    engine = Engine()
    held = weakref.ref(engine)
    assert grpo_async.wait_for(
        grpo_async.submit(jobs, lambda e: type(e).__name__, engine), thread, 5
    )
    del engine
    gc.collect()
    assert held() is None
    jobs.put(None)
    thread.join(5)
    assert not thread.is_alive()


def test_a_thread_that_ended_without_a_result_is_noticed_in_a_second_not_at_the_timeout():
    """The engine's thread gone (here: it took None first) while a job waits: wait_for stops
    the run within about a second, not after --engine-timeout-s."""
    jobs, thread = grpo_async.start_engine_thread("cpu")
    jobs.put(None)
    future = grpo_async.submit(jobs, lambda: "never run")
    thread.join(5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="ended without finishing this job"):
        grpo_async.wait_for(future, thread, 30)
    assert time.monotonic() - start < 5


def test_a_run_that_fails_while_a_job_runs_ends_at_once_without_the_exit_hooks(tmp_path):
    """grpo_async.py's entry point (main_or_exit) prints the error and ends the process, without
    the interpreter's exit hooks, which would shut the engine down under its thread's job. The
    hook here stands for vLLM's: it waits for the job (120 s) and prints."""
    code = """
import atexit, time
import grpo_async

def main(args):
    jobs, thread = grpo_async.start_engine_thread("cpu")
    grpo_async.submit(jobs, time.sleep, 120)
    atexit.register(print, "the exit hooks ran")
    atexit.register(thread.join)
    time.sleep(0.5)
    raise RuntimeError("out of memory in the trainer")

grpo_async.main = main
grpo_async.main_or_exit(None)
"""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RuntimeError: out of memory in the trainer" in done.stderr
    assert "the exit hooks ran" not in done.stdout
    assert time.monotonic() - start < 90


def test_the_engine_and_the_trainer_on_one_gpu_refuse_to_sample_ahead(
    tiny_model_dir, shared_data, tmp_path, monkeypatch
):
    # On one GPU the two sides cannot overlap (vLLM's stream is every thread's, and the interpreter
    # lock): a staleness above 0 stops, naming --max-staleness 0, before any engine starts.
    shared = ("cuda:0", "cuda:0", 0.3, 0.5, False)
    monkeypatch.setattr(grpo_async, "resolve_devices", lambda args: shared)
    monkeypatch.setattr(grpo_async, "init_vllm", lambda *a, **k: pytest.fail("an engine started"))
    args = run_args(grpo_async, tiny_model_dir, shared_data, tmp_path, max_staleness=1)
    with pytest.raises(ValueError, match="share cuda:0.*--max-staleness 0"):
        grpo_async.main(args)


def test_the_update_weights_each_token_by_its_capped_importance_ratio(tiny_model_dir):
    """grpo_async's own update on rollouts whose sampler was off (staleness, or a bf16 engine):
    engine log-probs offset from p_old by +-0.1 to +-1.5, so that some ratios p_old / p_engine
    pass the cap of 2 and some fall below 1/2. One minibatch, on-policy (ratio 1): the loss is
    sum -A_i min(p_old / p_engine, 2) / n_tokens, and its mean weight and share above the cap
    are logged. Dropping the weight, removing the cap or truncating from below too would each
    change these numbers."""
    from test_grpo import rollout_batch

    args = grpo_async.Args(
        rollout_batch_size=8, group_size=2, train_batch_size=8, microbatch_size=3, max_grad_norm=1e9
    )
    batch, lengths = rollout_batch(8)
    policy, autocast = grpo_async.load_policy(str(tiny_model_dir), "cpu", False, 0)
    mask = batch["response_mask"]
    with torch.no_grad():
        old = grpo_async.get_response_log_probs(policy, batch["input_ids"], batch["labels"])
    old = old["log_probs"]
    g = torch.Generator().manual_seed(1)
    offsets = (torch.rand(mask.shape, generator=g) * 1.4 + 0.1) * torch.sign(
        torch.randn(mask.shape, generator=g)
    )
    batch["engine_log_probs"] = (old - offsets) * mask
    weights = torch.exp(old - batch["engine_log_probs"]).clamp(max=2.0)
    assert (weights[mask] > 2.0 - 1e-6).any() and (weights[mask] < 0.5).any()
    n_tokens = mask.sum()
    expected_loss = (-batch["advantages"] * weights * mask).sum() / n_tokens
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    metrics = grpo_async.grpo_update(
        policy, optimizer, batch, lengths, [0.0], None, args, 0, autocast
    )
    assert metrics["train/loss"] == pytest.approx(expected_loss.item(), rel=1e-4, abs=1e-6)
    assert metrics["train/is_weight_mean"] == pytest.approx(
        (weights * mask).sum().item() / n_tokens.item(), rel=1e-4
    )
    above = ((old - batch["engine_log_probs"] > torch.log(torch.tensor(2.0))) & mask).sum()
    assert metrics["train/frac_above_is_cap"] == pytest.approx(above.item() / n_tokens.item())
    mean = (weights * mask).sum() / n_tokens
    std = (((weights - mean) ** 2 * mask).sum() / n_tokens).sqrt()
    assert metrics["train/is_weight_std"] == pytest.approx(std.item(), rel=1e-3)
