"""grpo.py with a judge as its reward (--judge-model): whole three-step runs on IFEval, against the
scripted judge of tests/judge_server.py (its verdicts, and its faults, on demand) and against vLLM's
own OpenAI-compatible server on the tiny model. What must hold: rewards that differ within groups
move the weights; a judge's failure is no reward (NaN), counted, never trained on, and too many
stop the run naming the endpoint; a run killed and resumed pays no verdict twice and ends with the
metrics of an uninterrupted one."""

import json
import math

import pytest
import torch
from conftest import interrupted_at_call
from judge_server import MODEL, JudgeServer

import grpo


def run_args(tiny_model_dir, shared_data, tmp_path, url, model=MODEL, **overrides):
    args = dict(
        model=str(tiny_model_dir),
        dataset="ifeval",
        template="question",
        data_dir=str(shared_data),
        output_dir=str(tmp_path),
        n_grpo_steps=3,
        rollout_batch_size=16,
        group_size=4,
        train_batch_size=16,
        microbatch_size=8,
        max_tokens=24,
        lr=1e-3,
        eval_every=1000,
        n_eval=2,
        eval_max_tokens=8,
        n_log_generations=1,
        judge_model=model,
        judge_base_url=url,
        save_every=1,
    )
    return grpo.Args(**{**args, **overrides})


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def moved(run, tiny_model_dir) -> float:
    """The largest change of any weight from the starting model to the run's last checkpoint."""
    (last,) = sorted((run / "checkpoints").iterdir())[-1:]
    start = grpo.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    end = grpo.AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32)
    ends = end.state_dict()
    return max((ends[k] - v).abs().max().item() for k, v in start.state_dict().items())


@pytest.fixture
def judge_server():
    server = JudgeServer()
    yield server
    server.shutdown()


def test_a_judged_run_learns_from_the_verdicts(tiny_model_dir, shared_data, tmp_path, judge_server):
    # The scripted judge (an IFEval rubric): 1 for a response without a comma, else 0. The random
    # model writes commas now and then: groups with a signal.
    run = grpo.main(run_args(tiny_model_dir, shared_data, tmp_path, judge_server.url))
    groups = read_jsonl(run / "rollouts.jsonl")
    assert len(groups) == 3 * 4
    for group in groups:
        # every reward is the verdict on the response's comma
        expected = [0.0 if "," in r else 1.0 for r in group["responses"]]
        assert group["rewards"] == expected
    assert any(len(set(g["rewards"])) > 1 for g in groups)
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "rollout/judge_failures" in m]
    assert len(metrics) == 3 and all(m["rollout/judge_failures"] == 0 for m in metrics)
    assert (
        sum(m["judge/calls"] for m in metrics)
        == judge_server.n_verdicts
        == 3 * 16 - sum(m["judge/cache_hits"] for m in metrics)
    )
    assert any(m["train/n_updates"] for m in metrics)
    assert moved(run, tiny_model_dir) > 1e-4


def test_failures_are_counted_left_out_and_too_many_stop_the_run(
    tiny_model_dir, shared_data, tmp_path, judge_server
):
    # The judge's first 32 answers are garbage: the first verdicts asked (8 at once, each tried 4
    # times) fail, the rest pass. A failure is no reward, and not trained on.
    judge_server.script = ["garbage"] * 32
    args = run_args(
        tiny_model_dir,
        shared_data,
        tmp_path,
        judge_server.url,
        n_grpo_steps=2,
        judge_max_failures=0.75,
    )
    run = grpo.main(args)
    groups = read_jsonl(run / "rollouts.jsonl")
    failed = [
        (r, t, a)
        for g in groups
        for r, t, a in zip(g["rewards"], g["trained"], g["advantages"], strict=True)
        if math.isnan(r)
    ]
    assert failed, "the script should have made some verdicts fail"
    assert all(not trained and advantage == 0 for _, trained, advantage in failed)
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "rollout/judge_failures" in m]
    n_failed = sum(m["rollout/judge_failures"] * 16 for m in metrics)
    assert n_failed == pytest.approx(len(failed))
    # the rewards' statistics are of the graded ones: never NaN
    assert all(math.isfinite(m["rollout/reward_mean"]) for m in metrics)

    # A judge that fails every verdict: the first step stops, naming the endpoint and the error.
    judge_server.script = []
    judge_server.always = "garbage"
    with pytest.raises(RuntimeError, match=f"judge at {judge_server.url}.*16 of 16"):
        grpo.main(run_args(tiny_model_dir, shared_data, tmp_path / "dead", judge_server.url))


def test_a_killed_judged_run_resumes_paying_no_verdict_twice(
    tiny_model_dir, shared_data, tmp_path, judge_server
):
    full = grpo.main(run_args(tiny_model_dir, shared_data, tmp_path / "full", judge_server.url))
    paid_full = judge_server.n_verdicts
    calls = {
        m["step"]: m["judge/calls"]
        for m in read_jsonl(full / "metrics.jsonl")
        if "judge/calls" in m
    }

    # Stop during step 2, after its verdicts are in the cache: the resumed run redoes step 2 from
    # the step-1 checkpoint, and its verdicts come from the cache.
    judge_server.n_verdicts = 0
    with interrupted_at_call(grpo, "reload_and_check", 3):  # at the start, after steps 1 and 2
        grpo.main(run_args(tiny_model_dir, shared_data, tmp_path / "stopped", judge_server.url))
    (stopped,) = (tmp_path / "stopped").iterdir()
    paid_before = judge_server.n_verdicts
    resumed = grpo.main(
        run_args(
            tiny_model_dir, shared_data, tmp_path / "stopped", judge_server.url, resume=str(stopped)
        )
    )
    assert resumed == stopped
    # the stopped run paid steps 1 and 2; the resumed one only step 3: step 2 came from the cache
    assert paid_before == calls[1] + calls[2]
    assert judge_server.n_verdicts == paid_full == calls[1] + calls[2] + calls[3]
    steps = {m["step"]: m for m in read_jsonl(resumed / "metrics.jsonl") if "judge/calls" in m}
    assert steps[2]["judge/calls"] == 0 and steps[2]["judge/cache_hits"] > 0
    assert steps[3]["judge/calls"] == calls[3]

    # and the run ends as the uninterrupted one: its rollouts and its metrics but the judge's bill
    assert read_jsonl(resumed / "rollouts.jsonl") == read_jsonl(full / "rollouts.jsonl")
    keep = lambda k: not k.startswith(("time/", "judge/")) and "per_second" not in k
    pairs = zip(
        read_jsonl(resumed / "metrics.jsonl"), read_jsonl(full / "metrics.jsonl"), strict=True
    )
    for a, b in pairs:
        assert {k: v for k, v in a.items() if keep(k)} == {k: v for k, v in b.items() if keep(k)}


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_judged_and_blended_runs_against_vllms_server(
    weight,
    tiny_model_dir,
    shared_data,
    tmp_path,
    vllm_server,
):
    # The tiny model as its own judge, through vLLM's structured outputs (a label is all it can
    # write): verdicts, so none fails. Greedy, the random model gives every response the same
    # label: alone (weight 1) the judge has no signal, and no group trains; blended, each reward
    # is half the IFEval checker's partial credit and half the verdict, and the groups differ.
    args = run_args(
        tiny_model_dir,
        shared_data,
        tmp_path,
        vllm_server,
        model="tiny",
        judge_weight=weight,
        ifeval_partial_credit=1.0,
    )
    run = grpo.main(args)
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "rollout/judge_failures" in m]
    assert len(metrics) == 3
    assert all(m["rollout/judge_failures"] == 0 and m["judge/calls"] > 0 for m in metrics)
    assert all(m["judge/tokens_in"] > 0 for m in metrics)
    groups = read_jsonl(run / "rollouts.jsonl")
    labels = {float(label) for label in grpo.verifiers.JUDGE_SCORES}
    if weight == 1:
        assert {r for g in groups for r in g["rewards"]} <= labels
        return
    # (1 - w) x the checker's share of instructions followed + w x a label
    checker = [
        grpo.verifiers.ifeval_reward(r, {**g_answer, "partial_credit": 1.0})["reward"]
        for g, g_answer in ((g, g["answer"]) for g in groups)
        for r in g["responses"]
    ]
    rewards = [r for g in groups for r in g["rewards"]]
    verdicts = [(r - 0.5 * c) / 0.5 for r, c in zip(rewards, checker, strict=True)]
    assert all(min(abs(v - label) for label in labels) < 1e-5 for v in verdicts)
    assert any(len(set(g["rewards"])) > 1 for g in groups)
    assert moved(run, tiny_model_dir) > 1e-4
