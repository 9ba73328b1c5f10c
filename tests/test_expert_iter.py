"""expert_iter.py: the filter on a hand-scored batch, the SFT batch loss by hand, then whole runs on
the tiny model."""

import gc
import json
from contextlib import nullcontext

import pytest
import torch
from conftest import interrupted_at_call
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import expert_iter
import verifiers

# --- select_correct: only verifier-accepted responses, each distinct text once per question ---


def test_select_correct_keeps_exactly_the_accepted_responses_deduplicated():
    q1 = {
        "id": "q1",
        "prompt": "Tom has 40 apples. He buys 2 more. ...",
        "answer": "42",
        "verifier": "synthetic",
    }
    q2 = {
        "id": "q2",
        "prompt": "Anna has 9 coins. She loses 2. ...",
        "answer": "7",
        "verifier": "synthetic",
    }
    q3 = {
        "id": "q3",
        "prompt": "Ben has 5 books. He finds 2 more. ...",
        "answer": "7",
        "verifier": "synthetic",
    }
    right = " 40 + 2 = 42. </think> <answer> 42 </answer>"
    q1_responses = [
        right,  # correct
        " 40 + 2 = 41. </think> <answer> 41 </answer>",  # wrong number
        right,  # correct, a duplicate of the first: kept once
        " </think> <answer>42</answer>",  # correct, another text: kept
        " 40 + 2 = 42. </think> 42",  # right number, no answer tag: format fails
        " 40 + 2 = 42. </think> <answer> 42",  # tag never closed (cut off): scores 0
        " </think> <answer> 42 or 43 </answer>",  # hedging inside the tag: scores 0
    ]
    # none right
    q2_responses = [
        " 9 - 2 = 6. </think> <answer> 6 </answer>",
        " </think> <answer> seven </answer>",
    ]
    q3_responses = [" </think> <answer> 7 </answer>", " </think> <answer> 7 </answer>"]
    # also q2's right answer: dedup is per question, not global
    same_text_as_q3 = " </think> <answer> 7 </answer>"
    q2_responses.append(same_text_as_q3)
    examples, responses = [q1, q2, q3], [q1_responses, q2_responses, q3_responses]
    rewards = [
        [verifiers.score(r, ex)["reward"] for r in group]
        for ex, group in zip(examples, responses, strict=True)
    ]
    # what the verifier says, checked by hand
    assert rewards == [[1, 0, 1, 1, 0, 0, 0], [0, 0, 1], [1, 1]]

    # each response's length, for rollout/kept_length: the first of two equal texts is the one kept
    n_tokens = [[10, 11, 12, 13, 14, 15, 16], [20, 21, 22], [30, 31]]
    kept = expert_iter.select_correct(examples, ["P1", "P2", "P3"], responses, rewards, n_tokens)
    assert [(p["prompt"], p["response"]) for p in kept] == [
        ("P1", right),
        ("P1", " </think> <answer>42</answer>"),
        ("P2", same_text_as_q3),
        ("P3", same_text_as_q3),
    ]
    assert [p["example"]["id"] for p in kept] == ["q1", "q1", "q2", "q3"]
    assert [p["n_tokens"] for p in kept] == [10, 13, 22, 30]
    assert all(verifiers.score(p["response"], p["example"])["reward"] == 1 for p in kept)


def test_select_correct_uses_the_rewards_it_is_given():
    # The filter trusts the rewards, whatever computed them (the end-to-end test below swaps the
    # reward).
    ex = {"id": "q", "prompt": "", "answer": "1", "verifier": "synthetic"}
    kept = expert_iter.select_correct([ex], ["P"], [["a", "b", "c", "a"]], [[0.0, 1.0, 0.5, 1.0]])
    assert [p["response"] for p in kept] == ["b", "a"]


def test_questions_of_step_are_replayable_and_distinct():
    # What main draws each step: data.load_task's Task.questions, from expert_iter's own Args.
    task = data.load_task(expert_iter.Args(dataset="synthetic", n_eval=0), n_questions=64)
    draw = lambda seed, step: task.questions(64, 8, seed, step)
    a_examples, a_seeds = draw(1, 3)
    b_examples, b_seeds = draw(1, 3)
    assert (a_examples, a_seeds) == (b_examples, b_seeds)  # a resumed run replays the step
    ids = {ex["id"] for ex in a_examples}
    assert len(ids) == 64 and ids <= {ex["id"] for ex in task.train}
    assert len(a_seeds) == 64
    assert draw(1, 4)[0] != a_examples
    assert draw(2, 3)[0] != a_examples


# --- sft_batch_train_step: the mean NLL per response token (EOS included), however the batch is microbatched ---


def test_sft_batch_loss_is_the_token_mean_for_any_microbatching(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = [
        "Tom has 3 apples.",
        "Q: 12 + 30?",
        "Anna has 9 coins. She loses 2.",
        "Hi",
        "Ben has 5 books.",
    ]
    responses = [" He has 3.", " 42", " 9 - 2 = 7. </think> <answer> 7 </answer>", " ok", " 5"]
    batch = [
        {"prompt": p, "response": r + tokenizer.eos_token}
        for p, r in zip(prompts, responses, strict=True)
    ]

    # By hand: the mean of -log p over every response token, EOS included, with one forward pass.
    full = expert_iter.tokenize_prompt_and_output(
        prompts, [r + tokenizer.eos_token for r in responses], tokenizer
    )
    log_probs = expert_iter.get_response_log_probs(model, full["input_ids"], full["labels"], True)
    mask = full["response_mask"]
    expected_loss = -(log_probs["log_probs"] * mask).sum() / mask.sum()
    expected_entropy = (log_probs["token_entropy"] * mask).sum() / mask.sum()
    expected_loss.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    # the model is taught to stop
    assert full["labels"][3][mask[3]][-1].item() == tokenizer.eos_token_id

    for microbatch_size in (5, 2):  # one pass; or 2 + 2 + 1, the last microbatch short
        model.zero_grad()
        out = expert_iter.sft_batch_train_step(
            model, tokenizer, batch, microbatch_size, 1024, nullcontext(), True
        )
        assert out["loss"] == pytest.approx(expected_loss.item(), rel=1e-5)
        assert out["n_response_tokens"] == mask.sum().item()
        assert out["entropy_sum"] / out["n_response_tokens"] == pytest.approx(
            expected_entropy.item(), rel=1e-5
        )
        for p, g in zip(model.parameters(), expected_grads, strict=True):
            assert torch.allclose(p.grad, g, atol=1e-6)


# --- whole runs on the tiny model, real vLLM engine on the CPU ---

REAL_SCORE = verifiers.score


def parity_reward(response: str, example: dict) -> dict:
    """Stands in for the verifier in the runs below: reward 1 iff the response has an even number of
    characters.

    A random tiny model essentially never writes "<answer> N </answer>" with the right N, so under
    the real verifier nothing would be kept and the fine-tuning phase would never run; starting from
    an SFT'd model instead costs about a minute of CPU. This reward accepts about half of the
    responses, is decided by the text alone (so the test can re-score what was kept), and is what
    every kept-only-correct assertion below checks against.
    """
    return {**REAL_SCORE(response, example), "reward": float(len(response) % 2 == 0)}


def run_args(tiny_model_dir, tmp_path, **overrides) -> expert_iter.Args:
    settings = dict(
        model=str(tiny_model_dir),
        dataset="synthetic",
        output_dir=str(tmp_path),
        template="r1_zero",
        n_ei_steps=2,
        n_questions=8,
        group_size=4,
        max_tokens=24,
        n_sft_epochs=2,
        temperature=1.0,
        batch_size=8,
        microbatch_size=4,
        lr=1e-3,
        # counted in optimizer steps over the whole run: every update below is still warming up
        warmup_steps=20,
        max_seq_len=256,
        n_eval=4,
        eval_max_tokens=8,
        n_log_generations=2,
    )
    settings.update(overrides)
    return expert_iter.Args(**settings)


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture
def free_engines():
    yield
    gc.collect()  # each run's engine holds a 1 GiB KV cache until collected


@pytest.fixture(scope="module")
def straight_run(tiny_model_dir, tmp_path_factory):
    """Two EI steps under parity_reward, uninterrupted: checked below, and the reference for the
    resume test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verifiers, "score", parity_reward)
        run_dir = expert_iter.main(run_args(tiny_model_dir, tmp_path_factory.mktemp("straight")))
    gc.collect()
    return run_dir


def test_ei_run_samples_filters_trains_reloads_and_logs(straight_run, tiny_model_dir):
    metrics = read_jsonl(straight_run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert metrics[0]["reload/logprob_gap"] < 1e-4
    n_samples = 8 * 4
    keys = [
        "rollout/frac_solved",
        "rollout/accuracy",
        "rollout/format_rate",
        "rollout/response_length",
        "rollout/truncation_rate",
        "rollout/n_correct",
        "rollout/n_kept",
        "rollout/kept_length",
        "train/loss",
        "train/entropy",
        "train/grad_norm",
        "train/lr",
        "train/n_updates",
        "train/response_tokens",
        "reload/logprob_gap",
        "eval/accuracy",
        "eval/format_rate",
    ]
    n_updates = 0
    for m in metrics[1:]:
        assert set(keys) <= m.keys(), set(keys) - m.keys()
        # The engine followed the trainer at every reload: after each step's update, so it sampled
        # and evaluated with the weights being trained.
        assert m["reload/logprob_gap"] < 1e-4
        assert 0 < m["rollout/frac_solved"] <= 1 and 0 < m["rollout/accuracy"] < 1
        # Some responses were rejected; duplicates only ever shrink what is kept.
        assert 0 < m["rollout/n_kept"] <= m["rollout/n_correct"] < n_samples
        assert m["rollout/n_correct"] == pytest.approx(m["rollout/accuracy"] * n_samples)
        assert m["rollout/kept_length"] > 0 and 0 < m["rollout/response_length"] <= 24
        assert 0 <= m["rollout/truncation_rate"] <= 1
        assert 0 <= m["rollout/format_rate"] <= 1  # a number: NaN is written as null
        # 2 epochs over the kept responses in batches of 8, the last one of each epoch possibly
        # short.
        assert m["train/n_updates"] == 2 * -(-m["rollout/n_kept"] // 8)
        # the lr of the step's last update, the warmup counting the updates of every step before
        n_updates += m["train/n_updates"]
        assert m["train/lr"] == pytest.approx(1e-3 * (n_updates - 1) / 20)
        assert 0 < m["train/loss"] < 20 and 0 < m["train/entropy"] < 7.0  # log(1024 tokens) = 6.93
        # at least one token + EOS per response
        assert m["train/response_tokens"] > m["rollout/n_kept"]
        assert 0 <= m["eval/accuracy"] <= 1 and "eval/sample_token_entropy" in m
        for phase in ("generate", "score", "train", "reload", "eval"):
            assert m[f"time/{phase}"] >= 0
    # Only what the reward in force accepted was trained on, each distinct response once per
    # question and step.
    kept = read_jsonl(straight_run / "kept.jsonl")
    assert [sum(row["step"] == s for row in kept) for s in (1, 2)] == [
        m["rollout/n_kept"] for m in metrics[1:]
    ]
    assert all(parity_reward(row["response"], row)["reward"] == 1 for row in kept)
    assert len({(row["step"], row["id"], row["response"]) for row in kept}) == len(kept)
    # kept.jsonl is an sft.py --sft-file: prompts and responses, with what --filter-correct needs.
    assert all({"prompt", "response", "answer", "verifier"} <= row.keys() for row in kept)
    # The checkpoint of the last step is a Hugging Face folder holding the trained (changed)
    # weights.
    checkpoint = expert_iter.checkpoints(straight_run)[-1]
    assert checkpoint.name == "step_000002"
    trained = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(trained[name], initial[name]) for name in initial)


@pytest.mark.usefixtures("free_engines")
def test_skipped_reload_trips_the_check(tiny_model_dir, tmp_path, monkeypatch):
    # The first reload passes (the engine starts with the trainer's weights); the one after the
    # first update must not.
    monkeypatch.setattr(verifiers, "score", parity_reward)
    monkeypatch.setattr(expert_iter, "load_policy_into_vllm", lambda policy, llm, device: None)
    # no warmup: the first update must change the weights (a warmup's first lr is 0)
    one_step = dict(n_ei_steps=1, n_questions=4, n_sft_epochs=1, warmup_steps=0)
    with pytest.raises(RuntimeError, match="does not follow the trainer") as error:
        expert_iter.main(run_args(tiny_model_dir, tmp_path, **one_step))
    # the weights read back are the old ones
    assert "weights that differ []" not in str(error.value)


@pytest.mark.usefixtures("free_engines")
def test_resume_ends_where_an_uninterrupted_run_ends(
    straight_run, tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(verifiers, "score", parity_reward)
    # A real run, stopped in step 2 after its kept rows are written, before its update is
    # checked (reload_and_check: at the start, after step 1, after step 2) and saved.
    with interrupted_at_call(expert_iter, "reload_and_check", 3):
        expert_iter.main(run_args(tiny_model_dir, tmp_path))
    (stopped,) = tmp_path.iterdir()
    assert [p.name for p in expert_iter.checkpoints(stopped)] == ["step_000001"]
    assert {row["step"] for row in read_jsonl(stopped / "kept.jsonl")} == {1, 2}
    assert [m["step"] for m in read_jsonl(stopped / "metrics.jsonl")] == [0, 1]

    resumed = expert_iter.main(run_args(tiny_model_dir, tmp_path, resume=str(stopped)))
    assert resumed == stopped and [p.name for p in expert_iter.checkpoints(resumed)] == [
        "step_000001",
        "step_000002",
    ]
    # Step 2's kept rows were dropped and written again, once: the straight run's.
    assert read_jsonl(resumed / "kept.jsonl") == read_jsonl(straight_run / "kept.jsonl")
    # every metric of every step (times aside) is the straight run's, the warmup's lr included
    untimed = lambda run: [
        {k: v for k, v in m.items() if not k.startswith("time/") and "per_second" not in k}
        for m in read_jsonl(run / "metrics.jsonl")
    ]
    assert untimed(resumed) == untimed(straight_run)
    # Same questions, same samples, same kept set, same optimizer state: the same final weights,
    # bit for bit.
    final_a = AutoModelForCausalLM.from_pretrained(
        expert_iter.checkpoints(straight_run)[-1]
    ).state_dict()
    final_b = AutoModelForCausalLM.from_pretrained(
        expert_iter.checkpoints(resumed)[-1]
    ).state_dict()
    for name, tensor in final_a.items():
        assert torch.equal(tensor, final_b[name]), name
