"""Tests for data.py on the local copies of the datasets (conftest.data_root: ../shared/data).

MATH-500: the dataset's own `answer` field equals the last \\boxed{} of its `solution` on all 500
rows after removing spaces (exceptions found: none), so `answer` and `answer_given` agree
everywhere.
"""

import json
import random
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import data_root

import data


def load(dataset, split):
    # the synthetic task is generated, not read: it runs without a data root
    return data.load(dataset, split, None if dataset == "synthetic" else data_root())


def pairwise_disjoint(sets):
    sets = list(sets)
    return all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :])


# --- sizes and splits ---


@pytest.mark.parametrize(
    "dataset, split, n",
    [
        ("gsm8k", "train", 6961),
        ("gsm8k", "val", 512),
        ("gsm8k", "test", 1319),
        ("math", "train", 7500),
        ("math", "test", 5000),
        ("math500", "test", 500),
        ("synthetic", "train", 20000),
        ("synthetic", "val", 256),
        ("synthetic", "test", 512),
    ],
)
def test_split_sizes_and_fields(dataset, split, n):
    examples = load(dataset, split)
    assert len(examples) == n
    assert len({ex["id"] for ex in examples}) == n
    for ex in examples:
        assert {"id", "prompt", "answer", "solution", "verifier"} <= ex.keys()
        assert all(
            isinstance(ex[key], str) and ex[key] for key in ("id", "prompt", "answer", "solution")
        )
        assert ex["verifier"] == {"math500": "math"}.get(dataset, dataset)


def test_gsm8k_val_is_held_out_of_official_train():
    train, val, test = load("gsm8k", "train"), load("gsm8k", "val"), load("gsm8k", "test")
    for key in ("id", "prompt"):
        assert pairwise_disjoint([{ex[key] for ex in split} for split in (train, val, test)])
    official = [
        json.loads(line)["question"]
        for line in (data_root() / "gsm8k" / "train.jsonl").read_text("utf-8").splitlines()
    ]
    # train + val is the official train split, and each keeps the official row order
    assert sorted(int(ex["id"].split("/")[1]) for ex in train + val) == list(range(len(official)))
    for split in (train, val):
        rows = [int(ex["id"].split("/")[1]) for ex in split]
        assert rows == sorted(rows)
        assert all(ex["prompt"] == official[row] for ex, row in zip(split, rows, strict=True))
    # fixed, not re-drawn
    assert [ex["id"] for ex in val] == [ex["id"] for ex in load("gsm8k", "val")]


def test_gsm8k_gold_answers():
    examples = load("gsm8k", "train") + load("gsm8k", "val") + load("gsm8k", "test")
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", ex["answer"]) for ex in examples)
    by_id = {ex["id"]: ex for ex in examples}
    assert by_id["test/0"]["answer"] == "18"  # Janet's ducks
    commas = [ex for ex in examples if re.search(r"#### \d{1,3}(,\d{3})+$", ex["solution"])]
    assert len(commas) > 30  # e.g. "#### 1,200"
    assert all(ex["answer"] == ex["solution"].split("#### ")[-1].replace(",", "") for ex in commas)


@pytest.mark.parametrize(
    "solution, gold",
    [
        ("a\n#### 18", "18"),
        ("#### 1,234", "1234"),
        ("#### -3", "-3"),
        ("#### 1234.50", "1234.5"),
        ("#### +7", "7"),
        ("#### 3.0", "3"),
        ("#### 007", "7"),
        ("#### 1\nmore\n#### 2", "2"),
        ("#### $5", None),
        ("#### five", None),
        ("no answer line", None),
    ],
)
def test_parse_gsm8k_answer(solution, gold):
    assert data.parse_gsm8k_answer(solution) == gold


# --- MATH ---


@pytest.mark.parametrize(
    "text, content",
    [
        (r"so $x = \boxed{5}$.", "5"),
        (r"$\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{1} then \fbox{x^{2}}", "x^{2}"),
        (r"is $\boxed 9$.", "9"),
        (r"= \boxed {17}.$$", "17"),
        (r"$\boxed{\{1, 2\}}$", r"\{1, 2\}"),
        (r"$\boxed{\left\{ x \right.}$", r"\left\{ x \right."),
        (r"$\boxed{}$", ""),
        (r"\boxed{\frac{1}{2}", None),
        ("no box here", None),
    ],
)
def test_last_boxed_in_solution(text, content):
    assert data.last_boxed_in_solution(text) == content


def test_math_gold_level_subject():
    train, test = load("math", "train"), load("math", "test")
    by_id = {ex["id"]: ex for ex in train + test}
    # empty \boxed{} in the source, fixed by hand
    assert by_id["train/number_theory/7115.json"]["answer"] == "0"
    assert by_id["train/algebra/24014.json"]["answer"] == "2"  # brace-less "\boxed 2"
    no_level = sorted(ex["id"] for ex in train if ex["level"] is None)
    # "Level ?" in the source
    assert no_level == ["train/geometry/377.json", "train/geometry/471.json"]
    assert all(ex["level"] in (1, 2, 3, 4, 5) for ex in train + test if ex["level"] is not None)
    assert sum(ex["subject"] == "Counting & Probability" for ex in test) == 474
    assert not {ex["prompt"] for ex in train} & {ex["prompt"] for ex in test}


def test_math500_answer_field_agrees_with_boxed():
    examples = load("math500", "test")
    exceptions = [
        ex["id"]
        for ex in examples
        if ex["answer"].replace(" ", "") != ex["answer_given"].replace(" ", "")
    ]
    # none, as the module docstring says
    assert exceptions == []
    assert all(ex["level"] in (1, 2, 3, 4, 5) and ex["subject"] for ex in examples)
    test_by_id = {ex["id"]: ex for ex in load("math", "test")}
    # a subset of MATH test
    assert all(test_by_id[ex["id"]]["prompt"] == ex["prompt"] for ex in examples)


# --- bad input: the error names the file, the 1-based line and the field ---

GOOD_GSM8K = {"question": "What is 1+1?", "answer": "1+1 = <<1+1=2>>2\n#### 2"}
GOOD_MATH = {
    "problem": "p",
    "level": "Level 1",
    "type": "Algebra",
    "solution": r"$\boxed{2}$",
    "unique_id": "test/a/1.json",
}


def test_data_dir_is_the_data_root():
    with pytest.raises(data.DataError, match=r"gsm8k: no such folder; --data-dir is the data root"):
        data.load("gsm8k", "test", data_root() / "gsm8k")  # the old meaning: a dataset's own folder


def mkdir(path):
    path.mkdir()
    return path


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "bad_line, field",
    [
        ('{"question": "What is 1+1?", "answer": ', None),
        (json.dumps({"question": "What is 1+1?"}), "'answer'"),
        (json.dumps({"answer": "#### 2"}), "'question'"),
        (json.dumps({"question": "q", "answer": "it is 2\n#### two"}), "'answer'"),
        (json.dumps({"question": "q", "answer": "it is 2"}), "'answer'"),
        (json.dumps({"question": 7, "answer": "#### 2"}), "'question'"),
    ],
)
def test_bad_gsm8k_row(tmp_path, bad_line, field):
    rows = [json.dumps(GOOD_GSM8K), json.dumps(GOOD_GSM8K), bad_line]
    path = write_jsonl(mkdir(tmp_path / "gsm8k") / "test.jsonl", rows)
    with pytest.raises(data.DataError) as error:
        data.load("gsm8k", "test", tmp_path)
    assert f"{path}, line 3" in str(error.value)
    assert field is None or field in str(error.value)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"solution": r"so $\boxed{\frac{1}{2}$"}, "'solution'"),
        ({"solution": "no box"}, "'solution'"),
        ({"level": "Level 9"}, "'level'"),
        ({"unique_id": None}, "'unique_id'"),
    ],
)
def test_bad_math_row(tmp_path, change, field):
    bad = {key: value for key, value in {**GOOD_MATH, **change}.items() if value is not None}
    path = write_jsonl(
        mkdir(tmp_path / "math") / "test.jsonl", [json.dumps(GOOD_MATH), json.dumps(bad)]
    )
    with pytest.raises(data.DataError) as error:
        data.load("math", "test", tmp_path)
    assert f"{path}, line 2" in str(error.value) and field in str(error.value)


def test_unknown_dataset_or_split():
    with pytest.raises(ValueError, match="gsm8k"):
        data.load("gsm9k", "train")
    with pytest.raises(ValueError, match="'train', 'test'"):
        data.load("math", "val")


def test_hub_branch_with_a_fake_datasets_module(monkeypatch):
    """The hub path cannot download here; check which hub datasets it asks for and how it names
    rows."""
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        if name == "openai/gsm8k":
            return [GOOD_GSM8K, {"question": "q", "answer": "no gold"}]
        return [{key: GOOD_MATH[key] for key in ("problem", "level", "type", "solution")}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(
        data.DataError, match=r"hub dataset openai/gsm8k \(main\) split test, row 1: field 'answer'"
    ):
        data.load("gsm8k", "test")
    examples = data.load("math", "test")
    assert calls[1:] == [
        ("EleutherAI/hendrycks_math", subject, "test") for subject in data.MATH_SUBJECTS
    ]
    assert [ex["id"] for ex in examples] == [
        f"test/{subject}/row0" for subject in data.MATH_SUBJECTS
    ]


# --- synthetic ---


def test_synthetic_is_deterministic_across_processes():
    """A fresh process with another hash seed makes the same problems: nothing depends on hash() or
    set order."""
    code = "import data, json; print(json.dumps(data.make_synthetic(300)))"
    repo = Path(data.__file__).parent
    env = {"PYTHONHASHSEED": "123"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(run.stdout) == data.make_synthetic(300)
    assert load("synthetic", "test") == load("synthetic", "test")
    assert data.make_synthetic(50, seed=1) != data.make_synthetic(50, seed=0)


def recompute(question):
    """The answer of a synthetic question, from its words alone."""
    start = int(re.match(r"\w+ has (\d+) ", question).group(1))
    steps = re.findall(r"(buys|finds|gets|gives away|loses|sells) (\d+)", question)
    return start + sum(
        int(x) if verb in ("buys", "finds", "gets") else -int(x) for verb, x in steps
    )


def test_synthetic_answers_and_disjoint_splits():
    splits = {split: load("synthetic", split) for split in ("train", "val", "test")}
    for examples in splits.values():
        for ex in examples:
            assert ex["answer"] == str(recompute(ex["prompt"])) and int(ex["answer"]) >= 0
            assert ex["solution"].endswith(f"= {ex['answer']}.")
            assert all(int(n) <= 99 for n in re.findall(r"\d+", ex["prompt"]))
    texts = {split: {ex["prompt"] for ex in examples} for split, examples in splits.items()}
    assert len(texts["train"]) == 20000
    assert pairwise_disjoint(texts.values())
    # stronger: no computation (numbers and operations, whatever the wording) is shared between
    # splits
    sums = {split: {ex["solution"] for ex in examples} for split, examples in splits.items()}
    assert pairwise_disjoint(sums.values())


def test_flawed_teacher_forgets_carries_and_goes_on_from_its_own_total():
    gold = {
        "id": "g",
        "prompt": "q",
        "answer": "23",
        "solution": "4 - 3 = 1. 1 + 9 = 10. 10 + 6 = 16. 16 + 7 = 23.",
        "verifier": "synthetic",
    }
    rng = random.Random(0)
    # 1 + 9 and 6 + 7 carry; 0 + 6 does not
    always = data.flawed_teacher(gold, forget_carry=1.0, rng=rng)
    assert always["solution"] == "4 - 3 = 1. 1 + 9 = 0. 0 + 6 = 6. 6 + 7 = 3."
    assert (always["answer"], always["gold_answer"], always["prompt"]) == ("3", "23", "q")
    assert data.flawed_teacher(gold, forget_carry=0.0, rng=rng)["solution"] == gold["solution"]
    with pytest.raises(ValueError, match="'g'|g: solution"):
        data.flawed_teacher(dict(gold, solution="23 apples"), forget_carry=0.5, rng=rng)


def test_flawed_teacher_forgets_at_its_rate():
    """Over the train split, the teacher forgets a carry at about the rate asked, and never errs
    elsewhere."""
    forgot = carries = 0
    for ex in load("synthetic", "train")[:4000]:
        teacher = data.flawed_teacher(ex, forget_carry=0.7, rng=random.Random(ex["id"]))
        for step in teacher["solution"].split(". "):
            a, op, x, result = re.fullmatch(r"(-?\d+) ([+-]) (\d+) = (-?\d+)\.?", step).groups()
            a, x, result = int(a), int(x), int(result)
            if op == "+" and a >= 0 and a % 10 + x >= 10:
                carries += 1
                forgot += result == a + x - 10
                assert result in (a + x, a + x - 10)
            else:
                assert result == (a + x if op == "+" else a - x)
    assert carries > 2000 and abs(forgot / carries - 0.7) < 0.03


# --- prompt templates ---

TOY = {
    "id": "t",
    "prompt": "What is 2+3?",
    "answer": "5",
    "solution": "2+3 = <<2+3=5>>5 apples.\n#### 5",
    "verifier": "gsm8k",
}
SYNTH = {
    "id": "s",
    "prompt": "Tom has 23 apples.",
    "answer": "29",
    "solution": "23 + 15 = 38. 38 - 9 = 29.",
    "verifier": "synthetic",
}


def test_r1_zero():
    assert data.render_prompt(TOY, "r1_zero") == (
        "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The "
        "Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
        "The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> "
        "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
        "User: What is 2+3?\nAssistant: <think>"
    )
    assert data.render_response(TOY, "r1_zero") == " 2+3 = 5 apples. </think> <answer> 5 </answer>"
    assert (
        data.render_response(SYNTH, "r1_zero")
        == " 23 + 15 = 38. 38 - 9 = 29. </think> <answer> 29 </answer>"
    )
    assert data.stop_strings("r1_zero") == ["</answer>"]


def test_question_and_chat():
    assert data.render_prompt(TOY, "question") == "What is 2+3?"
    assert data.render_response(TOY, "question") == "\n2+3 = <<2+3=5>>5 apples.\n#### 5"
    assert data.render_response(SYNTH, "question") == "\n23 + 15 = 38. 38 - 9 = 29.\n#### 29"

    class ChatTokenizer:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return (
                "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages) + "<|assistant|>"
            )

    assert data.render_prompt(TOY, "chat", tokenizer=ChatTokenizer()) == (
        "<|user|>What is 2+3?\n"
        'Solve the problem step by step. Write the final answer on the last line as "#### <answer>".'
        "<|end|><|assistant|>"
    )
    # no "####" line added
    ifeval = {"prompt": "Write a haiku. End it with the word 'done'.", "verifier": "ifeval"}
    rendered = data.render_prompt(ifeval, "chat", tokenizer=ChatTokenizer())
    assert rendered == f"<|user|>{ifeval['prompt']}<|end|><|assistant|>"
    assert data.render_response(SYNTH, "chat") == "23 + 15 = 38. 38 - 9 = 29.\n#### 29"
    assert data.stop_strings("question") == []
    assert data.stop_strings("chat") == ["<|im_end|>"]
    with pytest.raises(ValueError, match="tokenizer"):
        data.render_prompt(TOY, "chat")


def test_gsm8k_kshot():
    shot = dict(TOY, prompt="What is 1+1?", solution="1+1 = <<1+1=2>>2\n#### 2")
    assert data.render_prompt(TOY, "gsm8k_kshot", fewshot=[shot, shot]) == (
        "Question: What is 1+1?\nAnswer: 1+1 = <<1+1=2>>2\n#### 2\n\n"
        "Question: What is 1+1?\nAnswer: 1+1 = <<1+1=2>>2\n#### 2\n\n"
        "Question: What is 2+3?\nAnswer:"
    )
    assert data.render_prompt(TOY, "gsm8k_kshot", fewshot=[]) == "Question: What is 2+3?\nAnswer:"
    assert data.render_response(TOY, "gsm8k_kshot") == " 2+3 = <<2+3=5>>5 apples.\n#### 5"
    assert data.stop_strings("gsm8k_kshot") == ["Question:", "</s>", "<|im_end|>"]

    shots = data.gsm8k_fewshot(5, data_root())
    first = json.loads((data_root() / "gsm8k" / "train.jsonl").read_text("utf-8").splitlines()[0])
    prompt = data.render_prompt(load("gsm8k", "test")[0], "gsm8k_kshot", fewshot=shots)
    assert prompt.startswith(
        f"Question: {first['question']}\nAnswer: {first['answer']}\n\nQuestion: "
    )
    assert prompt.count("Question: ") == 6 and prompt.endswith("\nAnswer:")
    assert [ex["id"] for ex in shots] == [f"train/{i}" for i in range(5)]


def test_unknown_template():
    for function in (
        lambda t: data.render_prompt(TOY, t),
        lambda t: data.render_response(TOY, t),
        data.stop_strings,
    ):
        with pytest.raises(ValueError, match="r1_zero"):
            function("alpaca")
