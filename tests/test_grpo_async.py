"""grpo_async.py: the engine samples the next step's rollouts while the trainer learns. With
--max-staleness 0 it is grpo.py, bit for bit; with 1 it trains on rollouts one step old and
corrects them; a resumed run replays the rollouts sampled ahead; a dead or hung engine thread
stops the run with its error. Whole runs with a real engine on IFEval with partial credit, where
a random tiny model's rewards differ within groups, so that the weights move."""

import json
import threading

import pytest
import torch
from conftest import interrupted_at_call

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


def test_staleness_one_trains_on_rollouts_one_step_old_and_corrects_them(
    tiny_model_dir, shared_data, tmp_path
):
    run = grpo_async.main(
        run_args(grpo_async, tiny_model_dir, shared_data, tmp_path, n_grpo_steps=4)
    )
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
