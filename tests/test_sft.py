"""sft.py: its functions by hand-checked numbers and properties, then whole runs on the tiny model
with real vLLM."""

import contextlib
import gc
import json
import math
import re
from dataclasses import replace

import pytest
import torch
from conftest import interrupted_at_call
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import sft
import verifiers


class CharTokenizer:
    """One token per character, ids by hand: enough to check tokenize_prompt_and_output's layout on
    paper."""

    def __init__(self, vocab: str, pad_token_id: int | None, eos_token_id: int | None):
        self.vocab, self.pad_token_id, self.eos_token_id = vocab, pad_token_id, eos_token_id

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[self.vocab.index(c) for c in text] for text in texts]}


# --- tokenize_prompt_and_output ---


def test_tokenize_layout_by_hand():
    tok = CharTokenizer("_abcde", pad_token_id=0, eos_token_id=5)  # _=0 a=1 b=2 c=3 d=4 e=5
    out = sft.tokenize_prompt_and_output(["ab", "a"], ["cd", "bcde"], tok)
    # full sequences: [a b c d _] (padded to 5) and [a b c d e]
    assert out["input_ids"].tolist() == [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert out["labels"].tolist() == [[2, 3, 4, 0], [2, 3, 4, 5]]
    # labels that are output tokens: c, d in row 0 (positions 1, 2); b, c, d, e in row 1 (positions
    # 0..3)
    assert out["response_mask"].tolist() == [[0, 1, 1, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize(("pad", "eos", "expected_pad"), [(None, 5, 5), (None, None, 0), (2, 5, 2)])
def test_tokenize_pad_fallbacks(pad, eos, expected_pad):
    tok = CharTokenizer("_abcde", pad_token_id=pad, eos_token_id=eos)
    out = sft.tokenize_prompt_and_output(["a", "abc"], ["b", "d"], tok)
    assert out["labels"][0].tolist() == [2, expected_pad, expected_pad]


def test_mask_keeps_eos_when_pad_equals_eos():
    # Qwen3 base: pad == EOS. The EOS the model must learn to emit stays in the mask; the padding
    # after it does not.
    tok = CharTokenizer("_abcde", pad_token_id=5, eos_token_id=5)
    out = sft.tokenize_prompt_and_output(["a", "abcd"], ["be", "e"], tok)
    assert out["labels"].tolist() == [[2, 5, 5, 5], [2, 3, 4, 5]]
    assert out["response_mask"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 1]]


def test_mask_covers_exactly_the_output_tokens_real_tokenizer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = ["Tom has 3 apples.", "Q: 12 + 30?"]
    outputs = [" He has 3. <|endoftext|>", " 42 <|endoftext|>"]
    out = sft.tokenize_prompt_and_output(prompts, outputs, tokenizer)
    for i, o in enumerate(outputs):
        n_out = len(tokenizer(o, add_special_tokens=False).input_ids)
        response_labels = out["labels"][i][out["response_mask"][i]].tolist()
        assert tokenizer.decode(response_labels) == o
        assert out["response_mask"][i].sum().item() == n_out
    assert tokenizer.eos_token_id == tokenizer.pad_token_id
    assert out["labels"][1][out["response_mask"][1]][-1].item() == tokenizer.eos_token_id


# --- tokenize_with_tool_output: a tool's output is read, not learned ---


def test_tool_output_leaves_the_mask_by_hand():
    tok = CharTokenizer("_abcde", pad_token_id=0, eos_token_id=5)  # _=0 a=1 b=2 c=3 d=4 e=5
    batch = [
        # the tool wrote "c" (characters [1, 2) of the response)
        {"prompt": "a", "response": "bcd", "tool_spans": [[1, 2]]},
        {"prompt": "ab", "response": "cde"},
    ]
    out = sft.tokenize_with_tool_output(batch, tok)
    assert out["input_ids"].tolist() == [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert out["labels"].tolist() == [[2, 3, 4, 0], [2, 3, 4, 5]]
    # row 0's labels b c d: c is the tool's; row 1 has no spans: tokenize_prompt_and_output's mask
    assert out["response_mask"].tolist() == [[1, 0, 1, 0], [0, 1, 1, 1]]
    plain = sft.tokenize_prompt_and_output(["ab"], ["cde"], tok)
    assert out["response_mask"][1].tolist() == plain["response_mask"][0].tolist()


def test_tool_output_is_tokenized_apart_as_the_tool_loop_appends_it(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # the model wrote " app", the tool " les": joined, " apples" is one token of its own
    response = " apples are 2." + tokenizer.eos_token
    batch = [{"prompt": "Tom has", "response": response, "tool_spans": [[4, 7]]}]
    out = sft.tokenize_with_tool_output(batch, tokenizer)
    pieces = [encode(" app"), encode("les"), encode(" are 2." + tokenizer.eos_token)]
    assert encode(" apples") != pieces[0] + pieces[1]
    n_prompt = len(encode("Tom has"))
    assert out["labels"][0, n_prompt - 1 :].tolist() == pieces[0] + pieces[1] + pieces[2]
    mask = out["response_mask"][0, n_prompt - 1 :].tolist()
    assert mask == [True] * len(pieces[0]) + [False] * len(pieces[1]) + [True] * len(pieces[2])
    # the loss's token count leaves the tool's tokens out
    assert out["response_mask"].sum().item() == len(pieces[0]) + len(pieces[2])


@pytest.mark.parametrize("spans", [[[3, 2]], [[0, 2], [1, 3]], [[0, 99]], [[0, "2"]], "0 2"])
def test_bad_tool_spans_name_the_file_and_line(tmp_path, spans):
    path = tmp_path / "traces.jsonl"
    good = {"prompt": "Q", "response": "1 + 2 = <<1 + 2>>3."}
    bad = {**good, "tool_spans": spans}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(data.DataError, match=r"traces.jsonl, line 2: field 'tool_spans'"):
        data.read_sft_file(str(path))


# --- compute_entropy, masked_normalize, get_response_log_probs ---


def test_entropy_values():
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [1e4, 0.0, 0.0, 0.0], [math.log(3), 0.0, -1e9, -1e9]]]
    )
    entropy = sft.compute_entropy(logits)
    # uniform over 4: log 4; one certain token: 0; p = (3/4, 1/4): -(3/4 log 3/4 + 1/4 log 1/4)
    expected = [math.log(4), 0.0, -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]
    assert torch.allclose(entropy[0], torch.tensor(expected), atol=1e-5)
    assert torch.isfinite(sft.compute_entropy(torch.randn(2, 3, 50) * 1e4)).all()


def test_masked_normalize_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    assert sft.masked_normalize(x, mask, 2.0).item() == (1 + 3 + 4) / 2
    assert sft.masked_normalize(x, mask, 2.0, dim=-1).tolist() == [0.5, 3.5]
    assert sft.masked_normalize(x, mask, 2.0, dim=0).tolist() == [2.0, 2.0]


def test_get_response_log_probs_matches_manual(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    input_ids = torch.tensor([[5, 9, 14, 20], [7, 7, 3, 1]])
    labels = torch.tensor([[9, 14, 20, 2], [7, 3, 1, 0]])
    for temperature in (1.0, 0.7):
        out = sft.get_response_log_probs(
            model, input_ids, labels, return_token_entropy=True, temperature=temperature
        )
        with torch.no_grad():
            logits = model(input_ids).logits / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
        assert out["log_probs"].shape == out["token_entropy"].shape == (2, 4)
        assert torch.allclose(out["log_probs"], expected, atol=1e-5)
        assert torch.allclose(out["token_entropy"], sft.compute_entropy(logits), atol=1e-5)


# --- sft_microbatch_train_step ---


def test_sft_step_by_hand():
    log_probs = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 1]])
    loss, meta = sft.sft_microbatch_train_step(
        log_probs, mask, gradient_accumulation_steps=2, normalize_constant=1.0
    )
    # NLL per sequence: 1 + 2 = 3 and 4; mean 3.5; divided by 2 accumulation steps.
    assert loss.item() == pytest.approx(1.75)
    assert meta["nll_per_sequence"].tolist() == [3.0, 4.0]
    # d loss / d log p = -mask / (B * constant * accumulation steps) = -1/4 where the mask is 1
    assert log_probs.grad.tolist() == [[-0.25, -0.25], [0.0, -0.25]]


def test_sft_step_unchanged_by_padding():
    torch.manual_seed(0)
    log_probs = -torch.rand(3, 5)
    mask = (torch.rand(3, 5) > 0.3).float()
    padded_lp = torch.cat([log_probs, -torch.rand(3, 4) * 9], dim=1).requires_grad_()
    padded_mask = torch.cat([mask, torch.zeros(3, 4)], dim=1)
    plain_lp = log_probs.clone().requires_grad_()
    loss, _ = sft.sft_microbatch_train_step(plain_lp, mask, 1, normalize_constant=3.0)
    padded_loss, _ = sft.sft_microbatch_train_step(
        padded_lp, padded_mask, 1, normalize_constant=3.0
    )
    assert padded_loss.item() == pytest.approx(loss.item())
    assert torch.allclose(padded_lp.grad[:, :5], plain_lp.grad)
    assert (padded_lp.grad[:, 5:] == 0).all()


def test_sft_step_microbatches_give_the_token_mean():
    # The script's normalize_constant = response tokens / batch size makes the accumulated loss the
    # mean NLL per response token of the whole batch, however the batch is split.
    torch.manual_seed(1)
    log_probs, mask = -torch.rand(4, 6), (torch.rand(4, 6) > 0.4).float()
    constant = mask.sum().item() / 4
    total = 0.0
    for rows in (slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)):
        loss, _ = sft.sft_microbatch_train_step(
            log_probs[rows].clone().requires_grad_(), mask[rows], 4, constant
        )
        total += loss.item()
    assert total == pytest.approx((-log_probs * mask).sum().item() / mask.sum().item())


def test_batch_not_a_multiple_of_the_microbatch_weighs_every_token_alike(tiny_model_dir):
    # 3 examples in microbatches of 2 and 1: the short last microbatch must not weigh its tokens
    # double. The loss is the batch's mean NLL per response token, and the gradient the one of a
    # single microbatch of 3.
    tokenizer = sft.AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = sft.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = [
        {"prompt": "1+1=", "response": " 2</answer>"},
        {"prompt": "7*6=", "response": " 42 and more</answer>"},
        {"prompt": "9-3=", "response": " 6, surely the answer</answer>"},
    ]
    tokens = sft.tokenize_prompt_and_output(
        [b["prompt"] for b in batch], [b["response"] for b in batch], tokenizer
    )
    with torch.no_grad():
        log_probs = sft.get_response_log_probs(policy, tokens["input_ids"], tokens["labels"])[
            "log_probs"
        ]
    mask = tokens["response_mask"]
    by_hand = (-log_probs * mask).sum().item() / mask.sum().item()
    grads = []
    for microbatch_size in (2, 3):
        out = sft.sft_batch_train_step(
            policy, tokenizer, batch, microbatch_size, 256, contextlib.nullcontext()
        )
        assert (
            out["loss"] == pytest.approx(by_hand, rel=1e-5)
            and out["n_response_tokens"] == mask.sum().item()
        )
        grads.append(
            torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
        )
        policy.zero_grad(set_to_none=True)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


# --- sft.main's training pairs, the engine stubbed out: what the first batch holds ---


class Stop(Exception):
    """Raised by the stand-in train step: the test has the batch it came for."""


def first_batch(args: sft.Args, monkeypatch) -> list[dict]:
    """The first batch sft.main trains on, as main prepares it; no engine starts (its calls are
    stubbed out)."""
    batches = []

    def record_and_stop(policy, tokenizer, batch, *rest):
        batches.append(batch)
        raise Stop

    monkeypatch.setattr(sft, "init_vllm", lambda *a: None)
    monkeypatch.setattr(sft, "reload_and_check", lambda *a: 0.0)
    monkeypatch.setattr(sft, "evaluate", lambda *a: {})
    monkeypatch.setattr(sft, "sft_batch_train_step", record_and_stop)
    with pytest.raises(Stop):
        sft.main(args)
    return batches[0]


@pytest.mark.parametrize("template", ["r1_zero", "question"])
def test_training_pairs_end_with_eos_and_it_is_in_the_loss(
    template, tiny_model_dir, tmp_path, monkeypatch
):
    args = sft.Args(
        model=str(tiny_model_dir),
        dataset="synthetic",
        template=template,
        n_examples=4,
        batch_size=4,
        output_dir=str(tmp_path),
    )
    batch = first_batch(args, monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # the pairs are the dataset's first 4 worked solutions, then EOS
    task = data.load_task(args, tokenizer)
    expected = {(task.prompt(ex), task.response(ex) + tokenizer.eos_token) for ex in task.train[:4]}
    assert {(p["prompt"], p["response"]) for p in batch} == expected
    tokens = sft.tokenize_prompt_and_output(
        [p["prompt"] for p in batch], [p["response"] for p in batch], tokenizer
    )
    for labels, mask in zip(tokens["labels"], tokens["response_mask"], strict=True):
        assert labels[mask.bool()][-1].item() == tokenizer.eos_token_id


def test_filter_correct_trains_only_on_what_the_verifier_accepts(
    tiny_model_dir, tmp_path, monkeypatch
):
    # Rows 0, 2, 4, 6 answer right, the others one too many: --filter-correct keeps exactly the 4
    # right ones.
    rows = [
        {
            "prompt": f"Q{i}",
            "response": f" </think> <answer> {i + i % 2} </answer>",
            "answer": str(i),
            "verifier": "synthetic",
        }
        for i in range(8)
    ]
    sft_file = tmp_path / "traces.jsonl"
    sft_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = sft.Args(
        model=str(tiny_model_dir),
        dataset="synthetic",
        sft_file=str(sft_file),
        filter_correct=True,
        batch_size=4,
        output_dir=str(tmp_path / "runs"),
    )
    # A row without "answer" cannot be filtered: the error names file, line and field, before the
    # engine starts.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(rows[0])
        + "\n"
        + json.dumps({"prompt": "Q", "response": "R", "verifier": "synthetic"})
    )
    monkeypatch.setattr(sft, "init_vllm", lambda *a: pytest.fail("the engine must not start"))
    with pytest.raises(data.DataError, match=re.escape(f"{bad}, line 2: missing field 'answer'")):
        sft.main(replace(args, sft_file=str(bad)))
    assert not (tmp_path / "runs").exists()
    batch = first_batch(args, monkeypatch)
    assert sorted(p["prompt"] for p in batch) == ["Q0", "Q2", "Q4", "Q6"]


def test_filter_correct_reads_an_ifeval_row_of_kept_jsonl(tiny_model_dir, tmp_path, monkeypatch):
    # expert_iter.py's kept.jsonl is a valid --sft-file; an IFEval row's answer is a dict (its
    # instructions).
    row = {
        "prompt": "Say hi.\nYour entire response should be in English, and in all lowercase letters.",
        "response": "hi there",
        "verifier": "ifeval",
        "answer": {"instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]},
    }
    assert verifiers.score(row["response"], row)["reward"] == 1
    sft_file = tmp_path / "kept.jsonl"
    sft_file.write_text(json.dumps(row) + "\n")
    args = sft.Args(
        model=str(tiny_model_dir),
        dataset="synthetic",
        sft_file=str(sft_file),
        filter_correct=True,
        batch_size=1,
        output_dir=str(tmp_path),
    )
    assert [p["prompt"] for p in first_batch(args, monkeypatch)] == [row["prompt"]]


def test_filter_correct_runs_the_tests_of_a_code_row(tiny_model_dir, tmp_path, monkeypatch):
    # A code row (data.sft_row of an MBPP example, as kept.jsonl and eval.py --save-sft-pairs write
    # it) carries its tests: --filter-correct runs them in the sandbox and keeps the program that
    # passes.
    example = {
        "dataset": "mbpp",
        "id": "mbpp/1",
        "answer": "",
        "verifier": "code",
        "tests": "assert add(2, 3) == 5",
    }
    rows = [
        data.sft_row(
            f"Write add ({op}).",
            f"```python\ndef add(a, b):\n    return a {op} b\n```\n[DONE]",
            example,
        )
        for op in ("+", "-")
    ]
    sft_file = tmp_path / "kept.jsonl"
    sft_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = sft.Args(
        model=str(tiny_model_dir),
        dataset="synthetic",
        sft_file=str(sft_file),
        filter_correct=True,
        batch_size=1,
        output_dir=str(tmp_path / "runs"),
    )
    assert [p["prompt"] for p in first_batch(args, monkeypatch)] == ["Write add (+)."]
    # without its tests a program cannot be checked: the error names file, line and field
    del rows[1]["tests"]
    sft_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(
        data.DataError, match=re.escape(f"{sft_file}, line 2: missing field 'tests'")
    ):
        sft.main(args)


# --- whole runs on the tiny model, real vLLM engine on the CPU ---


def run_args(tiny_model_dir, tmp_path, **overrides) -> sft.Args:
    settings = dict(
        model=str(tiny_model_dir),
        dataset="synthetic",
        output_dir=str(tmp_path),
        template="r1_zero",
        n_examples=80,
        batch_size=8,
        microbatch_size=8,
        lr=2e-3,
        warmup_ratio=0.0,
        max_seq_len=256,
        n_eval=4,
        eval_max_tokens=8,
        eval_every=5,
        save_every=100,
        n_log_generations=2,
    )
    settings.update(overrides)
    return sft.Args(**settings)


def read_metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.fixture
def free_engines():
    yield
    gc.collect()  # each run's engine holds a 1 GiB KV cache until collected


@pytest.mark.usefixtures("free_engines")
def test_sft_run_learns_reloads_and_checks(tiny_model_dir, tmp_path):
    run_dir = sft.main(run_args(tiny_model_dir, tmp_path))  # 10 steps of 8 examples
    metrics = read_metrics(run_dir)
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) == 10
    assert losses[-1] < 0.7 * losses[0], losses
    evals = [m for m in metrics if "eval/accuracy" in m]
    # at the start, every eval_every steps, at the end
    assert [m["step"] for m in evals] == [0, 5, 10]
    # float32 engine vs float32 trainer: noise only
    assert all(m["reload/logprob_gap"] < 1e-4 for m in evals)
    assert (run_dir / "args.json").exists() and (run_dir / "generations.jsonl").exists()
    # The checkpoint is an ordinary Hugging Face folder: transformers and vLLM load it as it is.
    checkpoint = sft.checkpoints(run_dir)[-1]
    assert checkpoint.name == "step_000010"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(checkpoint), dtype="float32", enforce_eager=True, seed=0)
    prompt = "Tom has 12 apples. He buys 30 more. How many apples does he have now?"
    vllm_ids = list(
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    )
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    hf_ids = model.generate(input_ids, max_new_tokens=12, do_sample=False)[
        0, input_ids.shape[1] :
    ].tolist()
    # the same tokens, and the same end: at max_tokens, or at the EOS, which both keep
    assert vllm_ids == hf_ids and len(vllm_ids) >= 1


# One step of 4 examples; the check after it, before the final evaluation, must stop the run.
ONE_STEP = dict(n_examples=4, batch_size=4, microbatch_size=4, n_eval=2, eval_max_tokens=4)


@pytest.mark.usefixtures("free_engines")
def test_skipped_reload_trips_the_check(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sft, "load_policy_into_vllm", lambda policy, llm, device: None)
    with pytest.raises(RuntimeError, match="does not follow the trainer") as error:
        sft.main(run_args(tiny_model_dir, tmp_path, **ONE_STEP))
    # the weights read back are the old ones
    assert "weights that differ []" not in str(error.value)


@pytest.mark.usefixtures("free_engines")
def test_stale_prefix_cache_trips_the_check(tiny_model_dir, tmp_path, monkeypatch):
    # Reload the weights but keep the prefix cache: the probe prompts, seen at step 0, reuse old
    # keys and values.
    def reload_without_reset(policy, llm, device):
        weights = [(name, tensor.detach()) for name, tensor in policy.state_dict().items()]
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})

    monkeypatch.setattr(sft, "load_policy_into_vllm", reload_without_reset)
    with pytest.raises(RuntimeError, match="does not follow the trainer") as error:
        sft.main(run_args(tiny_model_dir, tmp_path, **ONE_STEP))
    # the weights are right: the probe caught the stale cache
    assert "weights that differ []" in str(error.value)


@pytest.mark.usefixtures("free_engines")
def test_resume_ends_where_an_uninterrupted_run_ends(tiny_model_dir, tmp_path):
    # 4 steps; keeping 1 checkpoint: the resumed run must still find the newest and delete older
    # ones only after it.
    common = dict(
        n_examples=16,
        batch_size=4,
        microbatch_size=2,
        n_eval=2,
        eval_max_tokens=4,
        eval_every=100,
        save_every=2,
        keep_checkpoints=1,
    )
    straight = sft.main(run_args(tiny_model_dir, tmp_path / "straight", **common))
    # steps 1-3 finish, step 4 dies; the last checkpoint: 2
    with interrupted_at_call(sft, "sft_batch_train_step", 4):
        sft.main(run_args(tiny_model_dir, tmp_path / "stopped", **common))
    (stopped,) = (tmp_path / "stopped").iterdir()
    assert sft.checkpoints(stopped)[-1].name == "step_000002"
    resumed = sft.main(
        run_args(tiny_model_dir, tmp_path / "stopped", resume=str(stopped), **common)
    )
    assert resumed == stopped

    final_a = AutoModelForCausalLM.from_pretrained(sft.checkpoints(straight)[-1]).state_dict()
    final_b = AutoModelForCausalLM.from_pretrained(sft.checkpoints(resumed)[-1]).state_dict()
    assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["step_000004"]
    # bit for bit on a CPU: everything random derives from (seed, step)
    for name, tensor in final_a.items():
        assert torch.equal(tensor, final_b[name]), name
    losses_a = [m["train/loss"] for m in read_metrics(straight) if "train/loss" in m]
    losses_b = {m["step"]: m["train/loss"] for m in read_metrics(resumed) if "train/loss" in m}
    # The records the dead run wrote after its last checkpoint (step 3) were dropped and rewritten:
    # one per step.
    assert [m["step"] for m in read_metrics(resumed) if "train/loss" in m] == [1, 2, 3, 4]
    assert losses_b[4] == losses_a[3]


@pytest.mark.usefixtures("free_engines")
def test_background_evaluation_equals_a_foreground_one_of_the_same_weights(
    tiny_model_dir, tmp_path
):
    # 6 steps, evaluated at 0, 2, 4, 6 while the trainer goes on, each step's weights kept as a
    # checkpoint. (On a CPU the trainer's floats may differ in the 6th digit when the engine runs
    # beside it: compare with the same weights.)
    common = dict(
        n_examples=48,
        batch_size=8,
        microbatch_size=8,
        eval_every=2,
        save_every=2,
        keep_checkpoints=0,
        n_eval=8,
        eval_max_tokens=16,
    )
    run_dir = sft.main(
        run_args(tiny_model_dir, tmp_path / "run", eval_in_background=True, **common)
    )
    rows = read_metrics(run_dir)
    # Logged when collected, as step 4's evaluation starts: after step 3's training, which ran
    # beside it.
    order = [(m["step"], "eval/accuracy" in m) for m in rows]
    assert order.index((2, True)) > order.index((3, False))
    background = {m["step"]: m for m in rows if "eval/accuracy" in m}
    samples = [json.loads(line) for line in open(run_dir / "generations.jsonl")]

    # The same evaluations in the foreground, on a fresh engine, from the base model and each
    # checkpoint.
    args = sft.restore_args(sft.Args(resume=str(run_dir)))
    task = data.load_task(args, train=False)
    task.tokenizer = tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = [
        {**p, "response": p["response"] + tokenizer.eos_token}
        for p in data.sft_pairs(task, None, args.n_examples, args.seed)
    ]
    # as main makes them
    probes = sft.make_probe_prompts(tokenizer, [p["prompt"] + p["response"] for p in pairs[:8]])
    llm = sft.init_vllm(str(tiny_model_dir), "cpu", args.seed, 0.3, 512 + args.eval_max_tokens)
    (tmp_path / "again").mkdir()
    for step, model in [(0, tiny_model_dir)] + [
        (int(c.name[5:]), c) for c in sft.checkpoints(run_dir)
    ]:
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).train()
        # as main's reload_and_evaluate
        gap = sft.reload_and_check(policy, llm, probes, "cpu", 1e-3)
        metrics = {
            **sft.evaluate(llm, policy, tokenizer, task, args, "cpu", tmp_path / "again", step),
            "reload/logprob_gap": gap,
        }
        drop_time = lambda m: {k: v for k, v in m.items() if k not in ("step", "time/eval")}
        # accuracy, entropies, lengths, the gap
        assert drop_time(metrics) == drop_time(background[step]), step
    assert [json.loads(line) for line in open(tmp_path / "again" / "generations.jsonl")] == samples
    assert sorted(background) == [0, 2, 4, 6]
