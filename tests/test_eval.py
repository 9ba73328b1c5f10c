"""eval.py: pass@k and majority vote by hand, summarize on hand-built records, two end-to-end runs
with a real vLLM engine whose summary is recounted from the per-problem JSONL, argument errors
caught before any engine, the baseline suite end to end, and the MATH k-shot prompt and answer
reading against lm-eval 0.4.13's own code."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
from conftest import plant_right_responses

import data
import eval as eval_script
from eval import SUITE, Args, majority_vote, pass_at_k, summarize

# --- pass@k ---


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # pass@1 = c / n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 4, 1.0),  # n - c < k: every 4 of the 5 samples include a correct one
        (5, 1, 5, 1.0),  # k = n: any correct sample makes pass@n 1
        (5, 0, 5, 0.0),  # k = n, none correct
        (5, 0, 1, 0.0),  # c = 0 is 0 for any k
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_binomial_formula():
    for n in range(1, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    # Large n, where the binomials have hundreds of digits: the product form stays finite and exact
    # enough.
    assert pass_at_k(1000, 3, 100) == pytest.approx(
        1 - math.comb(997, 100) / math.comb(1000, 100), rel=1e-12
    )


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


# --- majority vote ---


def test_majority_vote():
    assert majority_vote(["3", "5", "5"]) == "5"
    assert majority_vote(["3", "5", "5", "3"]) == "3"  # tie: the answer seen first in sample order
    assert majority_vote(["5", "3", "3", "5"]) == "5"
    assert majority_vote([None, "7", None, None]) == "7"  # None never wins, however often it occurs
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


# --- summarize on records built by hand ---


def _reward(extracted, reward):
    return {
        "reward": reward,
        "format_reward": float(extracted is not None),
        "answer_reward": reward,
        "extracted": extracted,
    }


def _record(id, extracted, rewards, **extra):
    return {
        "id": id,
        "prompt": "p",
        "answer": "a",
        "responses": ["r"] * len(rewards),
        "rewards": [_reward(e, r) for e, r in zip(extracted, rewards, strict=True)],
        "n_tokens": [10] * len(rewards),
        "finish_reasons": ["stop"] * len(rewards),
        **extra,
    }


HAND_RECORDS = [
    # c=2. maj@1 "3" (wrong); maj@2: "3" and "5" tie, "3" came first (wrong); maj@4: "5" (right).
    _record("a", ["3", "5", None, "5"], [0.0, 1.0, 0.0, 1.0], level=1, subject="algebra"),
    # c=1. maj@1: None; maj@2 and maj@4: "9" (right): three Nones do not outvote one answer.
    _record("b", [None, "9", None, None], [0.0, 1.0, 0.0, 0.0], level=2, subject="algebra"),
]
HAND_RECORDS[1]["finish_reasons"][0] = "length"
HAND_RECORDS[1]["n_tokens"][0] = 50


def test_summarize_by_hand():
    metrics = summarize(HAND_RECORDS, ks=(1, 2, 4))
    assert metrics["eval/n_problems"] == 2 and metrics["eval/n_samples"] == 8
    assert metrics["eval/accuracy"] == 3 / 8
    assert metrics["eval/format_rate"] == 4 / 8
    assert (
        metrics["eval/n_correct"],
        metrics["eval/n_formatted_wrong"],
        metrics["eval/n_unformatted"],
    ) == (3, 1, 4)
    assert metrics["eval/pass@1"] == pytest.approx(3 / 8)  # (2/4 + 1/4) / 2
    # 1 - C(2,2)/C(4,2), 1 - C(3,2)/C(4,2)
    assert metrics["eval/pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert metrics["eval/pass@4"] == 1.0
    assert (metrics["eval/maj@1"], metrics["eval/maj@2"], metrics["eval/maj@4"]) == (0.0, 0.5, 1.0)
    assert metrics["eval/truncation_rate"] == 1 / 8
    assert metrics["eval/response_length"] == (7 * 10 + 50) / 8
    assert metrics["eval/by_level/1"] == 0.5 and metrics["eval/by_level/2"] == 0.25
    assert metrics["eval/by_subject/algebra"] == 3 / 8
    assert "eval/flexible_accuracy" not in metrics  # only GSM8K reward dicts carry flexible_reward


def test_summarize_gsm8k_strict_and_flexible():
    records = [_record("a", ["18", None], [1.0, 0.0]), _record("b", [None, "4"], [0.0, 0.0])]
    # e.g. "The answer is 18." has no "####" but flexible-extract reads 18
    flexible = [[1.0, 1.0], [1.0, 0.0]]
    for record, flex in zip(records, flexible, strict=True):
        for reward, f in zip(record["rewards"], flex, strict=True):
            reward["flexible_reward"] = f
    metrics = summarize(records)
    assert metrics["eval/strict_accuracy"] == metrics["eval/accuracy"] == 1 / 4
    assert metrics["eval/flexible_accuracy"] == 3 / 4


# --- end to end: a real engine on the tiny model, then recount the summary from samples.jsonl ---


def read_run(run_dir):
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "summary.json").read_text())


def fake_score(response, example):
    """A reward that depends on the response's length, so random text gets a mix of correct / wrong
    / unformatted."""
    bucket = len(response) % 4
    extracted = None if bucket == 0 else str(bucket)
    reward = float(extracted == "1")
    return {
        "reward": reward,
        "format_reward": float(extracted is not None),
        "answer_reward": reward,
        "extracted": extracted,
    }


def test_end_to_end_synthetic_recount(tiny_model_dir, tmp_path, monkeypatch):
    # The tiny model's weights are random, so the real verifier would give all zeros and recount
    # nothing.
    monkeypatch.setattr(eval_script.verifiers, "score", fake_score)
    args = Args(
        model=str(tiny_model_dir),
        dataset="synthetic",
        split="test",
        limit=16,
        template="r1_zero",
        n=4,
        k=(1, 2, 4),
        temperature=1.0,
        max_tokens=12,
        out_dir=str(tmp_path),
    )
    run_dir = eval_script.main(args)
    assert run_dir.parent == tmp_path and "tiny-qwen3__synthetic_test__r1_zero__" in run_dir.name
    records, summary = read_run(run_dir)
    metrics = summary["metrics"]
    assert summary["args"]["model"] == str(tiny_model_dir) and summary["args"]["k"] == [1, 2, 4]

    assert len(records) == metrics["eval/n_problems"] == 16
    assert [r["id"] for r in records] == [f"test/{i}" for i in range(16)]
    rewards = []
    for record in records:
        assert len(record["responses"]) == len(record["rewards"]) == 4
        assert record["prompt"].endswith("Assistant: <think>")
        # aligned
        assert record["rewards"] == [fake_score(text, None) for text in record["responses"]]
        assert all(n_tokens <= 12 for n_tokens in record["n_tokens"])
        rewards += record["rewards"]
    n_correct = sum(r["reward"] == 1.0 for r in rewards)
    assert 0 < n_correct < len(rewards)  # a mix, or the recount below proves little
    assert metrics["eval/accuracy"] == pytest.approx(n_correct / 64)
    assert metrics["eval/format_rate"] == pytest.approx(
        sum(r["extracted"] is not None for r in rewards) / 64
    )
    breakdown = [
        metrics["eval/n_correct"],
        metrics["eval/n_formatted_wrong"],
        metrics["eval/n_unformatted"],
    ]
    assert breakdown == [
        n_correct,
        sum(r["extracted"] is not None and r["reward"] == 0.0 for r in rewards),
        sum(r["extracted"] is None for r in rewards),
    ]
    for k in (1, 2, 4):
        counts = [sum(r["reward"] == 1.0 for r in record["rewards"]) for record in records]
        assert metrics[f"eval/pass@{k}"] == pytest.approx(
            sum(pass_at_k(4, c, k) for c in counts) / 16
        )
        maj = 0
        for record in records:
            votes = [r["extracted"] for r in record["rewards"][:k]]
            winner = majority_vote(votes)
            maj += winner is not None and winner == "1"  # fake_score: "1" is the one right answer
        assert metrics[f"eval/maj@{k}"] == pytest.approx(maj / 16)
    assert metrics["eval/pass@1"] == pytest.approx(n_correct / 64)


def test_end_to_end_gsm8k_kshot(tiny_model_dir, shared_data, tmp_path, monkeypatch):
    # The model's own answers score 0; problems 0 and 2 get their gold solution ("... #### N":
    # strict and flexible), problem 1 "The answer is N." (flexible only), before the real verifier.
    plant_right_responses(monkeypatch, eval_script, every=2)
    planted = eval_script.score_records

    def flexible_only(args, examples, prompts, samples):
        answer = f"The answer is {examples[1]['answer']}."
        samples = [samples[0], [(answer, *samples[1][0][1:])], *samples[2:]]
        return planted(args, examples, prompts, samples)

    monkeypatch.setattr(eval_script, "score_records", flexible_only)
    args = Args(
        model=str(tiny_model_dir),
        dataset="gsm8k",
        split="test",
        data_dir=str(shared_data),
        limit=4,
        template="gsm8k_kshot",
        n_shot=2,
        max_tokens=32,
        out_dir=str(tmp_path),
    )
    run_dir = eval_script.main(args)
    assert "__gsm8k_test__gsm8k_kshot2__" in run_dir.name
    records, summary = read_run(run_dir)
    metrics = summary["metrics"]
    assert len(records) == 4 and all(len(record["responses"]) == 1 for record in records)
    for record in records:
        assert record["prompt"].count("Question:") == 3  # two shots and the question
        assert "Question:" not in record["responses"][0]  # generation stops there, as in lm-eval
    rewards = [record["rewards"][0] for record in records]
    # by hand: strict 2 of 4 (problems 0 and 2), flexible 3 of 4 (and problem 1)
    assert [r["reward"] for r in rewards] == [1.0, 0.0, 1.0, 0.0]
    assert [r["flexible_reward"] for r in rewards] == [1.0, 1.0, 1.0, 0.0]
    assert metrics["eval/strict_accuracy"] == metrics["eval/accuracy"] == 2 / 4
    assert metrics["eval/flexible_accuracy"] == 3 / 4


# --- argument errors: raised before any data is read or engine started ---


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model": "./no/such/checkpoint"}, r"'./no/such/checkpoint'.*config.json"),
        ({"model": "/no/such/checkpoint"}, r"'/no/such/checkpoint'.*config.json"),
        ({"dataset": "squad"}, r"unknown dataset 'squad'"),
        ({"dataset": "gsm8k", "split": "validation"}, r"no split 'validation'"),
        ({"dataset": "math500", "split": "train"}, r"no split 'train'"),
        ({"template": "alpaca"}, r"unknown template 'alpaca'"),
        ({"n": 2, "k": (1, 4), "temperature": 1.0}, r"k=4 must be between 1 and n=2"),
        ({"n": 4, "k": (1,)}, r"n=4 greedy samples"),
        (
            {"dataset": "math500", "template": "hendrycks_math_kshot"},
            r"hendrycks_math_kshot.*math500/test",
        ),
        (
            {"dataset": "math", "split": "train", "template": "hendrycks_math_kshot"},
            r"not math/train",
        ),
    ],
)
def test_errors_before_the_engine_starts(overrides, message, monkeypatch):
    def no_engine(args):
        raise AssertionError("the engine must not start")

    def no_data(*args, **kwargs):
        raise AssertionError("no data must be loaded")

    monkeypatch.setattr(eval_script, "start_engine", no_engine)
    monkeypatch.setattr(eval_script.data, "load", no_data)
    with pytest.raises(ValueError, match=message):
        eval_script.main(Args(**overrides))


def test_existing_folder_without_config_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(
        eval_script, "start_engine", lambda args: pytest.fail("the engine must not start")
    )
    (tmp_path / "step_100").mkdir()
    monkeypatch.chdir(tmp_path)
    # no "./", but the folder exists here
    with pytest.raises(ValueError, match=r"'step_100'.*config.json"):
        eval_script.main(Args(model="step_100"))


# --- the baseline suite: one engine, every benchmark in its own folder, one table ---


@pytest.fixture(scope="module")
def tiny_long_model_dir(tmp_path_factory) -> Path:
    """The tiny model with 4096 positions: its vocabulary is small, so GSM8K's 8-shot prompt is
    ~2,900 of its tokens."""
    import tiny_model

    out = tmp_path_factory.mktemp("tiny") / "tiny-qwen3-4k"
    return tiny_model.main(tiny_model.Args(out=str(out), max_position_embeddings=4096))


def recount_suite_row(references: dict, rewards: list[dict]) -> dict:
    """Each reference metric of a suite row, counted from its samples' reward dicts (one sample per
    problem), as lm-eval defines it."""
    recounted = {}
    for key in references:
        if key in ("eval/accuracy", "eval/strict_accuracy", "eval/pass@1"):
            values = [r["reward"] for r in rewards]
        elif key == "eval/flexible_accuracy":
            values = [r["flexible_reward"] for r in rewards]
        elif key == "eval/prompt_level_strict_acc":
            values = [all(r["strict"]) for r in rewards]
        else:
            assert key == "eval/inst_level_strict_acc", key
            values = [verdict for r in rewards for verdict in r["strict"]]
        recounted[key] = sum(values) / len(values)
    return recounted


def test_suite_one_engine_one_table(
    tiny_long_model_dir, shared_data, tmp_path, monkeypatch, capsys
):
    plant_right_responses(monkeypatch, eval_script, every=2)
    starts, start_engine = [], eval_script.start_engine
    monkeypatch.setattr(
        eval_script, "start_engine", lambda args: starts.append(args) or start_engine(args)
    )
    args = Args(
        suite=True,
        model=str(tiny_long_model_dir),
        data_dir=str(shared_data),
        limit=2,
        max_tokens=16,
        out_dir=str(tmp_path),
    )
    suite_dir = eval_script.main(args)
    assert (
        len(starts) == 1
        and suite_dir.parent == tmp_path
        and "tiny-qwen3-4k__suite__" in suite_dir.name
    )
    table = capsys.readouterr().out.split("Qwen3-1.7B-Base (lm-eval)\n")[1]
    n_lines = 0
    for name, dataset, template, n_shot, _, references in SUITE:
        records, summary = read_run(suite_dir / name)
        row = summary["args"]
        assert (row["dataset"], row["split"], row["template"], row["n_shot"]) == (
            dataset,
            "test",
            template,
            n_shot,
        )
        # --limit, cap
        assert len(records) == 2 and all(n <= 16 for record in records for n in record["n_tokens"])
        # recounted from the samples: problem 0 got its gold (IFEval has none), problem 1 is the
        # model's own
        rewards = [record["rewards"][0] for record in records]
        if dataset != "ifeval":
            assert [r["reward"] for r in rewards] == [1.0, 0.0], name
        else:
            # no gold to plant: the random text follows some instructions and not others, so the
            # instruction-level recount counts a mix
            verdicts = [verdict for r in rewards for verdict in r["strict"]]
            print(f"ifeval: {sum(verdicts)} of {len(verdicts)} instructions followed (strict)")
            assert 0 < sum(verdicts) < len(verdicts), verdicts
        recounted = recount_suite_row(references, rewards)
        for key in references:
            assert summary["metrics"][key] == pytest.approx(recounted[key]), (name, key)
        # our number (from summary.json) next to the reference
        for key, reference in references.items():
            ours = 100 * summary["metrics"][key]
            assert re.search(
                rf"^{name} +{key} +{ours:.2f} +{reference:.2f}$", table, flags=re.MULTILINE
            ), (name, key)
            n_lines += 1
    assert n_lines == 11  # GSM8K 3 x 2, MATH, IFEval 2, MBPP, HumanEval
    math_prompt = read_run(suite_dir / "math_4shot")[0][0]["prompt"]
    assert math_prompt.count("Problem: ") == 5 and math_prompt.endswith("\nAnswer:")
    assert json.loads((suite_dir / "suite.json").read_text())["table"][6][:2] == [
        "math_4shot",
        "eval/accuracy",
    ]


# --- GSM8K and MATH k-shot prompts against lm-eval 0.4.13's own task objects, built offline on our local rows ---


def lm_eval_tasks() -> Path:
    """lm-eval's task folder; the differential tests skip, with the reason, where it is not
    installed (`make test` installs it: requirements-test.txt)."""
    lm_eval = pytest.importorskip("lm_eval", reason="pip install -r requirements-test.txt")
    return Path(lm_eval.__file__).parent / "tasks"


def lm_eval_module(name):
    path = lm_eval_tasks() / "hendrycks_math" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lm_eval_task(yaml_path: Path, rows):
    """lm-eval's own task object, reading rows(split) instead of downloading the hub copy."""
    import datasets
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(yaml_path)
    del config["dataset_path"], config["dataset_name"]
    config["custom_dataset"] = lambda **kwargs: datasets.DatasetDict(
        {split: datasets.Dataset.from_list(rows(split)) for split in ("train", "test")}
    )
    task = ConfigurableTask(config=config)
    task.set_fewshot_seed(1234)  # as lm_eval.simple_evaluate does (its default fewshot_random_seed)
    return task


@pytest.mark.parametrize("k", [0, 4, 8])
def test_gsm8k_prompt_is_lm_evals(k, shared_data):
    """Every test question, with lm-eval's draws of shots (openai/gsm8k on the hub has the official
    files' order)."""

    def rows(split):
        return [
            json.loads(line)
            for line in (shared_data / "gsm8k" / f"{split}.jsonl").read_text().splitlines()
        ]

    task = lm_eval_task(lm_eval_tasks() / "gsm8k" / "gsm8k.yaml", rows)
    shots = data.gsm8k_lm_eval_fewshot(k, shared_data)
    tests = data.load("gsm8k", "test", shared_data)
    for doc, example in zip(task.test_docs(), tests, strict=True):
        ours = data.render_prompt(example, "gsm8k_kshot", fewshot=shots[example["id"]])
        assert ours == task.fewshot_context(doc, k), example["id"]
    assert len({tuple(s["id"] for s in shot) for shot in shots.values()}) == (
        1 if k == 0 else len(tests)
    )


def lm_eval_math_task(subject: str, yaml_name: str, data_dir: Path):
    """lm-eval's hendrycks_math task for one subject, on ../shared/data/math in the hub's row order
    (file names sorted as strings, as EleutherAI/hendrycks_math's loader did)."""

    def rows(split):
        lines = (data_dir / "math" / f"{split}.jsonl").read_text().splitlines()
        mine = [row for row in map(json.loads, lines) if row["unique_id"].split("/")[1] == subject]
        return sorted(mine, key=lambda row: row["unique_id"].rsplit("/", 1)[1])

    return lm_eval_task(lm_eval_tasks() / "hendrycks_math" / yaml_name, rows)


@pytest.fixture(scope="module")
def math_shots_and_tests(shared_data):
    return data.math_fewshot(4, shared_data), {
        ex["id"]: ex for ex in data.load("math", "test", shared_data)
    }


# lm-eval 0.4.13 builds every prompt of four subjects, and stops in three at the first problem with
# a shot whose answer is "[-9, 9]"-like: its doc_to_target reads it as a Python list, and
# build_qa_turn asserts a string.
@pytest.mark.parametrize(
    ("subject", "yaml_name", "n_built"),
    [
        ("algebra", "hendrycks_math_algebra.yaml", 29),
        ("counting_and_probability", "hendrycks_math_counting_and_prob.yaml", 474),
        ("geometry", "hendrycks_math_geometry.yaml", 479),
        ("intermediate_algebra", "hendrycks_math_intermediate_algebra.yaml", 89),
        # 6 prompts with an empty-answer shot
        ("number_theory", "hendrycks_math_num_theory.yaml", 540),
        ("prealgebra", "hendrycks_math_prealgebra.yaml", 871),
        ("precalculus", "hendrycks_math_precalc.yaml", 121),
    ],
)
def test_math_prompt_is_lm_evals(subject, yaml_name, n_built, math_shots_and_tests, shared_data):
    shots, tests = math_shots_and_tests
    task = lm_eval_math_task(subject, yaml_name, shared_data)
    docs = list(task.test_docs())
    for i, doc in enumerate(docs[:n_built]):
        ours = data.render_prompt(
            tests[doc["unique_id"]], "hendrycks_math_kshot", fewshot=shots[doc["unique_id"]]
        )
        assert ours == task.fewshot_context(doc, 4), (subject, i)
    if n_built < len(docs):
        with pytest.raises(AssertionError, match=r"Answer is not a string! : \[-?\d+, -?\d+\]"):
            task.fewshot_context(docs[n_built], 4)


def test_math_shot_answers_are_lm_evals(shared_data):
    utils = lm_eval_module("utils")
    for ex in data.load("math", "train", shared_data):
        theirs = utils.remove_boxed(utils.last_boxed_only_string(ex["solution"]))
        assert data._lm_eval_math_answer(ex["solution"]) == theirs, ex["id"]


# (response, gold, ours, lm-eval's): the answer is read as lm-eval reads it; the comparison is our
# MATH verifier's.
MATH_READS = [
    (" $\\frac{1}{2}$", "\\frac{1}{2}", 1, 1),
    (" 5\n\n", "5", 1, 1),  # no "$": the whole response
    (" $5$ apples", "5", 1, 1),
    (" $0.5$", "\\frac{1}{2}", 1, 1),
    (" $\\dfrac{1}{2}$", "\\frac12", 1, 1),
    (" 3", "5", 0, 0),
    (" $\\boxed{5}$", "5", 1, 0),  # ours unwraps \boxed; lm-eval compares "\boxed{5}" with "5"
    (" 5.", "5", 1, 0),  # ours drops a final "."
    (" $\\frac{2}{4}$", "\\frac{1}{2}", 1, 0),  # ours compares numbers, lm-eval strings
    (" $10,080$", "10080", 1, 0),
    (" $\\{1,2\\}$", "\\{2,1\\}", 1, 0),  # ours: sets in any order
    # ours takes the \text{} at the end for a unit
    (" $x = \\text{Evelyn}$", "\\text{Evelyn}", 0, 1),
]


@pytest.mark.parametrize(("response", "gold", "ours", "theirs"), MATH_READS)
def test_math_answer_reading_vs_lm_eval(response, gold, ours, theirs):
    example = {"verifier": "math", "answer": gold, "solution": f"\\boxed{{{gold}}}"}
    assert eval_script.hendrycks_math_score(response, example)["reward"] == ours
    assert lm_eval_module("utils").process_results(example, [response])["exact_match"] == theirs


def test_math_every_gold_in_dollars_scores_as_in_lm_eval(shared_data):
    """Every test gold as lm-eval's shots write answers (" $gold$"), and the next problem's gold:
    same verdicts."""
    utils = lm_eval_module("utils")
    tests = data.load("math", "test", shared_data)
    for i, example in enumerate(tests):
        for response in (f" ${example['answer']}$", f" ${tests[(i + 1) % len(tests)]['answer']}$"):
            ours = eval_script.hendrycks_math_score(response, example)["reward"]
            assert ours == utils.process_results(example, [response])["exact_match"], (
                example["id"],
                response,
            )
