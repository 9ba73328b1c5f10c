"""Datasets and prompt templates: everything between a benchmark file and the strings a model sees.

1. `load(dataset, split, data_dir=None)` returns a list of plain dicts, one per problem:
     gsm8k           train 6961 / val 512 / test 1319 (val is held out of the official train split)
     math            train 7500 / test 5000 (Hendrycks et al. 2021, the full MATH)
     math500         test 500 (the MATH-500 subset of "Let's Verify Step by Step")
     synthetic       train 20000 / val 256 / test 512 (word problems a tiny model learns on a CPU)
     mbpp            train 374 / val 90 / test 500 / prompt 10 (Python tasks, 3 asserts each)
     mbpp_sanitized  train 120 / val 43 / test 257 / prompt 7 (427 of them, hand-verified)
     humaneval       test 164 (a function's signature and docstring; the body is the answer)
     ifeval          train 8000 / test 541 (instruction following)
   (MBPP's splits are by task_id.) Every example has `id`, `prompt` (the raw question, not
   templated), `answer` (the normalized gold answer), `solution` (the worked solution as in the
   source) and `verifier` ("gsm8k" | "math" | "synthetic" | "code" | "ifeval": which reward
   function grades it). Code examples add `tests` (the code that checks a program); HumanEval adds
   `code_prompt` and `completion_stop`. MATH and MATH-500 add `level` (int 1-5, or None) and
   `subject`; MATH-500 adds `answer_given`. An IFEval example's `answer` holds its instructions.
2. Gold answers: `parse_gsm8k_answer` (the "#### N" line) and `last_boxed_in_solution`.
3. The synthetic task: `make_synthetic(n, seed, ...)`, and `flawed_teacher`: its solutions by a
   teacher who errs.
4. Prompt templates: `render_prompt` (what the model is given), `render_response` (the SFT
   target), `stop_strings` (where generation stops) and `gsm8k_fewshot` (the k-shot exemplars).
5. Mixtures: `parse_mixture("gsm8k:0.5,math:0.5")`, `read_order` (a curriculum file of ids),
   `dataset_templates`, `eval_split`, `load_mixture` and `mixture_questions_and_seeds` (the
   questions of a training step, drawn by weight from (seed, step) alone).
6. What a training script calls: `load_task(args)`, a `Task` (its prompts, stop strings, the
   questions of a step, per-dataset metrics, and with --judge-model its judge), `eval_metrics`,
   and for SFT `sft_pairs` and `batch_order`.
7. A judge as a reward: `JUDGE_RUBRICS` (a rubric per verifier), `judge_rubric` and `make_judge`
   (the verifiers.Judge of a script's --judge-* flags).

data_dir=None reads the Hugging Face hub; data_dir="../shared/data" (the data root, one folder per
dataset: see `dataset_dir`) reads the local JSONL copies. Both run the same checks: a bad row
raises DataError naming where it is (file and line, or hub row) and which field. Nothing is
dropped silently.
"""

import json
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import verifiers

SPLITS = {
    "gsm8k": ("train", "val", "test"),
    "math": ("train", "test"),
    "math500": ("test",),
    "synthetic": ("train", "val", "test"),
    "mbpp": ("train", "val", "test", "prompt"),
    "mbpp_sanitized": ("train", "val", "test", "prompt"),
    "humaneval": ("test",),
    "ifeval": ("train", "test"),
}


class DataError(ValueError):
    """A row that cannot become an example; the message says where it is and which field."""


# datasets read from another dataset's folder
FOLDERS = {"math500": "math", "mbpp_sanitized": "mbpp"}


def dataset_dir(dataset: str, data_dir: str | Path | None) -> Path | None:
    """The folder of `dataset` under the data root: ../shared/data/gsm8k, .../math for math500."""
    if data_dir is None or dataset == "synthetic":
        return None
    folder = Path(data_dir) / FOLDERS.get(dataset, dataset)
    if not folder.is_dir():
        raise DataError(
            f"{folder}: no such folder; --data-dir is the data root, with one folder per dataset "
            f"(gsm8k/, math/, mbpp/, humaneval/, ifeval/)"
        )
    return folder


def load(dataset: str, split: str, data_dir: str | Path | None = None) -> list[dict]:
    """Examples of one split, in the source's row order. data_dir=None reads the hub."""
    if dataset not in SPLITS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {list(SPLITS)}")
    if split not in SPLITS[dataset]:
        raise ValueError(
            f"dataset {dataset!r} has no split {split!r}; choose from {list(SPLITS[dataset])}"
        )
    loader = {
        "gsm8k": _load_gsm8k,
        "math": _load_math,
        "math500": _load_math500,
        "synthetic": _load_synthetic,
        "mbpp": _load_mbpp,
        "humaneval": _load_humaneval,
        "mbpp_sanitized": lambda split, data_dir: _load_mbpp(split, data_dir, sanitized=True),
        "ifeval": _load_ifeval,
    }
    examples = loader[dataset](split, dataset_dir(dataset, data_dir))
    ids = [ex["id"] for ex in examples]
    if len(set(ids)) != len(ids):
        raise DataError(f"{dataset}/{split}: duplicate ids")
    return examples


# --- reading rows: (where, row) pairs, `where` says where the row came from for error messages ---


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            where = f"{path}, line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            rows.append((where, row))
    return rows


def _read_hub(name: str, config: str | None, split: str) -> list[tuple[str, dict]]:
    import datasets  # imported here: it is slow to import, and runs on local files never need it

    rows = datasets.load_dataset(name, config, split=split)
    where = f"hub dataset {name} ({config or 'default'}) split {split}, row"
    return [(f"{where} {i}", dict(row)) for i, row in enumerate(rows)]


def _field(row: dict, key: str, where: str, kind: type = str):
    if key not in row:
        raise DataError(f"{where}: missing field '{key}'")
    if not isinstance(row[key], kind):
        raise DataError(
            f"{where}: field '{key}' should be {kind.__name__}, got {type(row[key]).__name__}"
        )
    return row[key]


# --- GSM8K (Cobbe et al. 2021): solutions end with a line "#### <number>" ---

GSM8K_N_VAL = 512  # held out of the official train split: train 6961 / val 512, test untouched
GSM8K_VAL_SEED = 0


def normalize_number(text: str) -> str | None:
    """Canonical form of a plain decimal number, else None: "1,234.50" -> "1234.5", "-0" -> "0"."""
    match = re.fullmatch(r"([-+]?)(\d+)(?:\.(\d+))?", text.strip().replace(",", ""))
    if match is None:
        return None
    sign, whole, frac = match.groups()
    frac = (frac or "").rstrip("0")
    number = str(int(whole)) + (f".{frac}" if frac else "")
    return "-" + number if sign == "-" and number != "0" else number


def parse_gsm8k_answer(solution: str) -> str | None:
    """The normalized number on the last "#### N" line of a GSM8K solution, or None."""
    lines = re.findall(r"^####(.*)$", solution, flags=re.MULTILINE)
    return normalize_number(lines[-1]) if lines else None


def _gsm8k_example(where: str, row: dict, id: str) -> dict:
    question = _field(row, "question", where)
    solution = _field(row, "answer", where)
    answer = parse_gsm8k_answer(solution)
    if answer is None:
        raise DataError(
            f"{where}: field 'answer' has no line '#### <number>' with a parsable number"
        )
    return {
        "id": id,
        "prompt": question,
        "answer": answer,
        "solution": solution,
        "verifier": "gsm8k",
    }


def _load_gsm8k_official(split: str, data_dir: str | Path | None) -> list[dict]:
    """An official split ("train" 7473 or "test" 1319); ids are "<split>/<row in the file>"."""
    if data_dir is None:
        rows = _read_hub("openai/gsm8k", "main", split)
    else:
        rows = _read_jsonl(Path(data_dir) / f"{split}.jsonl")
    return [_gsm8k_example(where, row, f"{split}/{i}") for i, (where, row) in enumerate(rows)]


def _load_gsm8k(split: str, data_dir: str | Path | None) -> list[dict]:
    if split == "test":
        return _load_gsm8k_official("test", data_dir)
    official = _load_gsm8k_official("train", data_dir)
    # random.Random(seed).sample is reproducible across processes and Python versions, so the val
    # split is fixed; the ids keep the official row index, so a val example can be traced back to
    # the train file.
    val_rows = set(random.Random(GSM8K_VAL_SEED).sample(range(len(official)), GSM8K_N_VAL))
    return [ex for i, ex in enumerate(official) if (i in val_rows) == (split == "val")]


def gsm8k_fewshot(k: int = 5, data_dir: str | Path | None = None) -> list[dict]:
    """The first k rows of the *official* GSM8K train file (some in our val split): gsm8k_kshot."""
    return _load_gsm8k_official("train", dataset_dir("gsm8k", data_dir))[:k]


LM_EVAL_FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed


def lm_eval_fewshot(pool: list[dict], questions: list[dict], k: int) -> dict[str, list[dict]]:
    """lm-eval's default few-shot sampler, replayed: random.Random(1234), then rnd.sample(pool, k)
    for each question in turn, so every question has its own shots. Both lists in the row order of
    the hub copy lm-eval reads."""
    rng = random.Random(LM_EVAL_FEWSHOT_SEED)
    return {ex["id"]: rng.sample(pool, k) for ex in questions}


def gsm8k_lm_eval_fewshot(k: int = 5, data_dir: str | Path | None = None) -> dict[str, list[dict]]:
    """The k shots lm-eval's `gsm8k` puts before each test question, by id, from the train file."""
    root = dataset_dir("gsm8k", data_dir)
    pool = _load_gsm8k_official("train", root)
    questions = _load_gsm8k_official("test", root)
    return lm_eval_fewshot(pool, questions, k)


# --- MATH (Hendrycks et al. 2021) and MATH-500: the gold answer is the last \boxed{...} of the solution ---

# Hub copy of the full MATH: EleutherAI/hendrycks_math, one config per subject, fields
# problem/level/type/solution, train 7500 / test 5000, MIT. Chosen because it is the original
# release as parquet (no loading script) and is what lm-evaluation-harness's hendrycks_math tasks
# read. It has no unique_id, so hub ids are "<split>/<subject>/row<i>".
MATH_HUB = "EleutherAI/hendrycks_math"
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
# one split, test; fields problem/solution/answer/subject/level/unique_id
MATH500_HUB = "HuggingFaceH4/MATH-500"

# Two MATH train solutions end in an empty "\boxed{}", a defect of the original release. Both are
# multiple-choice problems whose solutions argue for choice (A), 0. Keyed by the problem's start so
# the fix also applies on the hub.
# The two: train/number_theory/7115.json and 7117.json.
_MATH_GOLD_FIXES = {
    "For any integer $n>1$, the number of prime numbers greater than $n!+1$": "0",
    "You are given a sequence of $58$ terms; each term has the form $P+n$": "0",
}


def last_boxed_in_solution(text: str) -> str | None:
    """The gold of a MATH solution: the content of its last \\boxed{...} or \\fbox{...}, braces
    balanced; None if absent or unbalanced.

    Read as the original MATH grader reads a solution, more leniently than
    verifiers.last_boxed_in_response reads a model's response: escaped braces (\\{ \\}) are not
    counted, and the brace-less "\\boxed 9" of two train solutions gives the text up to the next
    space or "$".
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + len("\\boxed" if text.startswith("\\boxed", start) else "\\fbox")
    rest = text[i:].lstrip()
    if not rest.startswith("{"):
        bare = re.match(r"\s+([^\s$]+)", text[i:])
        return bare.group(1) if bare else None
    depth = 0
    j = 0
    while j < len(rest):
        if rest[j] == "\\":
            j += 2  # skip an escaped character such as \{ or \}
            continue
        depth += {"{": 1, "}": -1}.get(rest[j], 0)
        if depth == 0:
            return rest[1:j]
        j += 1
    return None


def _math_level(row: dict, where: str) -> int | None:
    level = _field(row, "level", where, kind=object)  # "Level 3" in MATH, 3 in MATH-500
    if isinstance(level, int) and 1 <= level <= 5:
        return level
    if isinstance(level, str) and re.fullmatch(r"Level [1-5]", level):
        return int(level[-1])
    if level == "Level ?":  # two train rows of the original release
        return None
    raise DataError(
        f"{where}: field 'level' is {level!r}, expected 1..5, 'Level 1'..'Level 5' or 'Level ?'"
    )


def _math_example(where: str, row: dict, id: str, subject_field: str) -> dict:
    problem = _field(row, "problem", where)
    solution = _field(row, "solution", where)
    answer = last_boxed_in_solution(solution)
    if answer == "":
        answer = next(
            (gold for start, gold in _MATH_GOLD_FIXES.items() if problem.startswith(start)), ""
        )
    if not answer:
        raise DataError(
            f"{where}: field 'solution' has no non-empty \\boxed{{...}} with balanced braces"
        )
    return {
        "id": id,
        "prompt": problem,
        "answer": answer,
        "solution": solution,
        "verifier": "math",
        "level": _math_level(row, where),
        "subject": _field(row, subject_field, where),
    }


def _load_math(split: str, data_dir: str | Path | None) -> list[dict]:
    # local rows carry unique_id "<split>/<subject>/<n>.json", as MATH-500 does
    if data_dir is not None:
        rows = _read_jsonl(Path(data_dir) / f"{split}.jsonl")
        return [
            _math_example(where, row, _field(row, "unique_id", where), "type")
            for where, row in rows
        ]
    examples = []
    for subject in MATH_SUBJECTS:
        for i, (where, row) in enumerate(_read_hub(MATH_HUB, subject, split)):
            examples.append(_math_example(where, row, f"{split}/{subject}/row{i}", "type"))
    return examples


def _load_math500(split: str, data_dir: str | Path | None) -> list[dict]:
    if data_dir is None:
        rows = _read_hub(MATH500_HUB, None, split)
    else:
        rows = _read_jsonl(Path(data_dir) / "math500.jsonl")
    examples = []
    for where, row in rows:
        example = _math_example(where, row, _field(row, "unique_id", where), "subject")
        # equals `answer` on all 500 rows of the local copy
        example["answer_given"] = _field(row, "answer", where)
        examples.append(example)
    return examples


def _hub_order(examples: list[dict]) -> list[dict]:
    """MATH examples of one subject in EleutherAI/hendrycks_math's row order, which lm-eval reads:
    its loader sorted the original files by name as strings (1.json, 10.json, 1001.json, 2.json).
    Hub ids "row<i>" are in that order."""
    names = [ex["id"].rsplit("/", 1)[-1] for ex in examples]
    keys = [int(name[3:]) if name.startswith("row") else name for name in names]
    return [ex for _, ex in sorted(zip(keys, examples, strict=True), key=lambda pair: pair[0])]


def math_fewshot(k: int = 4, data_dir: str | Path | None = None) -> dict[str, list[dict]]:
    """The k shots lm-eval's `hendrycks_math` puts before each MATH test problem, by id
    ("hendrycks_math_kshot"): each subject is a task of its own there, with its own sampler drawing
    from that subject's train problems."""
    root = dataset_dir("math", data_dir)
    train = _load_math("train", root)
    test = _load_math("test", root)
    shots = {}
    for subject in sorted({ex["subject"] for ex in test}):
        pool = [ex for ex in train if ex["subject"] == subject]
        questions = [ex for ex in test if ex["subject"] == subject]
        shots.update(lm_eval_fewshot(_hub_order(pool), _hub_order(questions), k))
    return shots


# --- Synthetic: GSM8K-shaped +/- word problems, small enough for a ~1M-parameter model to learn on a CPU ---

SYNTHETIC_SEED = 0
# cut in this order from one stream of distinct problems
SYNTHETIC_SIZES = {"test": 512, "val": 256, "train": 20000}
_NAMES = [
    ("Tom", "he"),
    ("Anna", "she"),
    ("Ben", "he"),
    ("Maria", "she"),
    ("Sam", "he"),
    ("Lily", "she"),
]
_OBJECTS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells"]
_MORE = ["buys {} more", "finds {} more", "gets {} more"]
_LESS = ["gives away {}", "loses {}", "sells {}"]


def make_synthetic(
    n: int, seed: int = SYNTHETIC_SEED, max_operand: int = 9, max_steps: int = 4
) -> list[dict]:
    """n word problems with distinct arithmetic, deterministic in the arguments (ids "<seed>/<i>").

    A problem starts from a count in 1..max_operand and applies 1..max_steps steps, each adding
    1..max_operand or removing 1..min(current count, max_operand), so every intermediate result and
    the answer are integers >= 0:
      prompt    "Tom has 4 marbles. He sells 3 and gets 9 more and gets 6 more and buys 7 more.
                How many marbles does he have now?"
      solution  "4 - 3 = 1. 1 + 9 = 10. 10 + 6 = 16. 16 + 7 = 23."
      answer    "23"
    The defaults (one-digit operands, up to 4 steps) make a multi-step task that the ladder's
    4-layer, 0.85M-parameter model learns from the gold solutions to 78.5 / 32.6 / 82.6% greedy
    test accuracy (seeds 1 / 2 / 3) in one SFT epoch (625 steps, ~3.5 minutes on 2 cores;
    docs/ladder.md). With two-digit operands (max_operand=99, max_steps=2) it needed 1250 steps to
    reach ~20%: its errors were carries. Problems are distinct in their numbers and operations (not
    only in wording), so a split cut from this list never asks a computation that another split
    asks. Only `random.Random(seed)` is used: the same output everywhere.
    """
    rng = random.Random(seed)
    examples = []
    # (start, steps) of every problem made: a repeat is drawn again
    seen = set()
    while len(examples) < n:
        name, pronoun = rng.choice(_NAMES)
        things = rng.choice(_OBJECTS)
        total = start = rng.randint(1, max_operand)
        steps = []
        phrases = []
        equations = []
        for _ in range(rng.randint(1, max_steps)):
            add = total == 0 or rng.random() < 0.5
            x = rng.randint(1, max_operand if add else min(total, max_operand))
            phrases.append(rng.choice(_MORE if add else _LESS).format(x))
            result = total + x if add else total - x
            equations.append(f"{total} {'+' if add else '-'} {x} = {result}.")
            total = result
            steps.append((add, x))
        key = (start, tuple(steps))
        if key in seen:
            continue
        seen.add(key)
        prompt = (
            f"{name} has {start} {things}. {pronoun.capitalize()} {' and '.join(phrases)}. "
            f"How many {things} does {pronoun} have now?"
        )
        examples.append(
            {
                "id": f"{seed}/{len(examples)}",
                "prompt": prompt,
                "answer": str(total),
                "solution": " ".join(equations),
                "verifier": "synthetic",
            }
        )
    return examples


def carries(total: int, x: int) -> bool:
    """Whether the addition total + x carries: a count >= 0 whose units digit overflows (17 + 5)."""
    return total >= 0 and total % 10 + x >= 10


def flawed_teacher(example: dict, forget_carry: float, rng: random.Random) -> dict:
    """The synthetic problem as worked by a teacher who forgets to carry: on an addition whose units
    digits overflow (17 + 5), it writes the sum without the carry (12) with probability
    forget_carry, and goes on from its own total.

    The copy's `solution` and `answer` are the teacher's, wrong whenever it forgot; `gold_answer`
    keeps the right one:
      gold     "4 - 3 = 1. 1 + 9 = 10. 10 + 6 = 16. 16 + 7 = 23."   answer "23"
      teacher  "4 - 3 = 1. 1 + 9 = 0. 0 + 6 = 6. 6 + 7 = 3."         answer "3"   (forget_carry=1)
    Traces like these stand in for a weaker model's: SFT learns the flaw along with the arithmetic,
    and only a verifier (which knows the gold answers) can teach a model to do better than its
    teacher.
    """
    equations = re.findall(r"(\d+) ([+-]) (\d+) = \d+\.", example["solution"])
    if not equations:
        raise ValueError(
            f"{example['id']}: solution {example['solution']!r} is not a synthetic one"
        )
    total = int(equations[0][0])
    steps = []
    for _, op, x in equations:
        x = int(x)
        if op == "-":
            result = total - x
        elif carries(total, x) and rng.random() < forget_carry:
            result = total + x - 10
        else:
            result = total + x
        steps.append(f"{total} {op} {x} = {result}.")
        total = result
    return dict(example, solution=" ".join(steps), answer=str(total), gold_answer=example["answer"])


def calculator_teacher(
    example: dict, forget_carry: float, call_rate: float, rng: random.Random
) -> dict:
    """flawed_teacher, but on each addition it calls the calculator (TOOL_PROTOCOLS) with
    probability call_rate instead of adding in its head; the calculator's sums are right:
      teacher  "4 - 3 = 1. 1 + 9 = <<1 + 9>>10. 10 + 6 = 16. 16 + 7 = 13."   answer "13"
    `tool_spans` lists the [start, end) of each tool output in `solution` ("10" above): SFT on
    these traces must not train on them (the tool wrote them, as in grpo_tools.py's mask)."""
    equations = re.findall(r"(\d+) ([+-]) (\d+) = \d+\.", example["solution"])
    if not equations:
        raise ValueError(
            f"{example['id']}: solution {example['solution']!r} is not a synthetic one"
        )
    total = int(equations[0][0])
    solution = ""
    tool_spans = []
    for _, op, x in equations:
        x = int(x)
        if solution:
            solution += " "
        if op == "+" and rng.random() < call_rate:
            solution += f"{total} + {x} = <<{total} + {x}>>"
            tool_spans.append([len(solution), len(solution) + len(str(total + x))])
            total = total + x
        elif op == "-":
            solution += f"{total} - {x} = "
            total = total - x
        elif carries(total, x) and rng.random() < forget_carry:
            solution += f"{total} + {x} = "
            total = total + x - 10
        else:
            solution += f"{total} + {x} = "
            total = total + x
        solution += f"{total}."
    return dict(
        example,
        solution=solution,
        answer=str(total),
        gold_answer=example["answer"],
        tool_spans=tool_spans,
    )


def _load_synthetic(split: str, data_dir: str | Path | None) -> list[dict]:
    problems = make_synthetic(sum(SYNTHETIC_SIZES.values()))
    names = list(SYNTHETIC_SIZES)
    start = sum(SYNTHETIC_SIZES[name] for name in names[: names.index(split)])
    chunk = problems[start : start + SYNTHETIC_SIZES[split]]
    return [dict(ex, id=f"{split}/{i}") for i, ex in enumerate(chunk)]


# --- Code: MBPP (Austin et al. 2021) and HumanEval (Chen et al. 2021); verifier "code" runs the tests ---

# MBPP's own split by task_id (its README; the hub's google-research-datasets/mbpp has the same).
MBPP_SPLIT_IDS = {
    "prompt": range(1, 11),
    "test": range(11, 511),
    "val": range(511, 601),
    "train": range(601, 975),
}
MBPP_FEWSHOT_IDS = (2, 3, 4)  # lm-eval's 3 shots, from the prompt split
# lm-eval's `humaneval` stops: a completion ends where the next top-level statement would start.
HUMANEVAL_STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


def _mbpp_example(where: str, row: dict, text_field: str) -> dict:
    task_id = _field(row, "task_id", where, int)
    code = _field(row, "code", where)
    tests = _field(row, "test_list", where, list)
    if len(tests) < 3 or not all(isinstance(t, str) and t.startswith("assert") for t in tests):
        raise DataError(f"{where}: field 'test_list' should hold at least 3 assert statements")
    # the full MBPP has test_setup_code, the sanitized one test_imports
    setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or [])
    text = _field(row, text_field, where)
    return {
        "id": f"mbpp/{task_id}",
        "prompt": f"{text}\nYour code should pass these tests:\n" + "\n".join(tests[:3]),
        "answer": code,
        "solution": code,
        "verifier": "code",
        "text": text,
        "test_list": tests,
        "tests": "\n".join([setup, *tests]).strip(),
    }


def _load_mbpp(split: str, data_dir: str | Path | None, sanitized: bool = False) -> list[dict]:
    text_field = "prompt" if sanitized else "text"
    if data_dir is None:
        hub_split = {"val": "validation"}.get(split, split)
        rows = _read_hub(
            "google-research-datasets/mbpp", "sanitized" if sanitized else "full", hub_split
        )
    elif sanitized:
        path = Path(data_dir) / "sanitized-mbpp.json"
        rows = [
            (f"{path}, item {i}", row)
            for i, row in enumerate(json.loads(path.read_text(encoding="utf-8")))
        ]
    else:
        rows = _read_jsonl(Path(data_dir) / "mbpp.jsonl")
    examples = [_mbpp_example(where, row, text_field) for where, row in rows]
    return [ex for ex in examples if int(ex["id"].split("/")[1]) in MBPP_SPLIT_IDS[split]]


def mbpp_fewshot(data_dir: str | Path | None = None) -> list[dict]:
    """MBPP tasks 2, 3 and 4, the exemplars of lm-eval's 3-shot `mbpp` ("mbpp_kshot")."""
    examples = _load_mbpp("prompt", dataset_dir("mbpp", data_dir))
    return [ex for ex in examples if int(ex["id"].split("/")[1]) in MBPP_FEWSHOT_IDS]


def _load_humaneval(split: str, data_dir: str | Path | None) -> list[dict]:
    if data_dir is None:
        rows = _read_hub("openai/openai_humaneval", None, split)
    else:
        rows = _read_jsonl(Path(data_dir) / "HumanEval.jsonl")
    examples = []
    for where, row in rows:
        prompt = _field(row, "prompt", where)
        entry_point = _field(row, "entry_point", where)
        solution = _field(row, "canonical_solution", where)
        test = _field(row, "test", where)
        if "def check(" not in test:
            raise DataError(f"{where}: field 'test' defines no check(candidate)")
        examples.append(
            {
                "id": _field(row, "task_id", where),
                "prompt": prompt,
                "answer": solution,
                "solution": solution,
                "verifier": "code",
                "code_prompt": prompt,
                "completion_stop": HUMANEVAL_STOP,
                "tests": f"{test}\ncheck({entry_point})",
            }
        )
    return examples


# --- IFEval (Zhou et al. 2023): prompts with verifiable instructions; `answer` holds the instructions ---
# test: the 541 prompts (google/IFEval on the hub, ../shared/data/ifeval/input_data.jsonl here),
#   ids "<key>".
# train: never those prompts. GSM8K and MATH train questions with 1-3 instructions attached,
#   kwargs sampled, deterministic in IFEVAL_TRAIN_SEED (the recipe of public RLVR
#   instruction-following sets such as Tulu 3's).
# answer = {"instruction_id_list": [...], "kwargs": [...]}: what verifiers.ifeval_reward checks.

IFEVAL_TRAIN_SIZE = 8000
IFEVAL_TRAIN_SEED = 0
# 14,336 of the 14,973 questions; leaves out MATH's long figure (asy) problems
IFEVAL_MAX_QUESTION_CHARS = 500
_IFEVAL_WORDS = [
    "answer",
    "number",
    "result",
    "step",
    "reason",
    "method",
    "total",
    "problem",
    "value",
    "simple",
    "careful",
    "check",
    "idea",
    "solution",
    "clear",
]
_IFEVAL_LANGUAGES = {
    "de": "German",
    "fr": "French",
    "es": "Spanish",
    "it": "Italian",
    "pt": "Portuguese",
    "ru": "Russian",
    "hi": "Hindi",
    "sw": "Swahili",
    "ja": "Japanese",
    "ko": "Korean",
}
_REL = ("less than", "at least")

# id -> (sampler of kwargs from rng and the question, description in IFEval's wording)
_IFEVAL_INSTRUCTIONS = {
    "keywords:existence": (
        lambda rng, q: {"keywords": rng.sample(_IFEVAL_WORDS, 2)},
        lambda kw: f"Include keywords {kw['keywords']} in the response.",
    ),
    "keywords:frequency": (
        lambda rng, q: {
            "keyword": rng.choice(_IFEVAL_WORDS),
            "frequency": rng.randint(1, 3),
            "relation": rng.choice(_REL),
        },
        lambda kw: (
            f"In your response, the word {kw['keyword']} should appear {kw['relation']} {kw['frequency']} "
            "times."
        ),
    ),
    "keywords:forbidden_words": (
        lambda rng, q: {"forbidden_words": rng.sample(_IFEVAL_WORDS, 2)},
        lambda kw: f"Do not include keywords {kw['forbidden_words']} in the response.",
    ),
    "keywords:letter_frequency": (
        lambda rng, q: {
            "letter": rng.choice("abcdefghijklmnopqrstuvwxyz"),
            "let_frequency": rng.randint(1, 10),
            "let_relation": rng.choice(_REL),
        },
        lambda kw: (
            f"In your response, the letter {kw['letter']} should appear {kw['let_relation']} "
            f"{kw['let_frequency']} times."
        ),
    ),
    "language:response_language": (
        lambda rng, q: {"language": rng.choice(sorted(_IFEVAL_LANGUAGES))},
        lambda kw: (
            f"Your ENTIRE response should be in {_IFEVAL_LANGUAGES[kw['language']]} language, no other "
            "language is allowed."
        ),
    ),
    "length_constraints:number_sentences": (
        lambda rng, q: {"num_sentences": rng.randint(2, 20), "relation": rng.choice(_REL)},
        lambda kw: (
            f"Your response should contain {kw['relation']} {kw['num_sentences']} sentences."
        ),
    ),
    "length_constraints:number_paragraphs": (
        lambda rng, q: {"num_paragraphs": rng.randint(2, 5)},
        lambda kw: (
            f"There should be {kw['num_paragraphs']} paragraphs. Paragraphs are separated with the markdown "
            "divider: ***"
        ),
    ),
    "length_constraints:number_words": (
        lambda rng, q: {
            "num_words": rng.choice([50, 100, 150, 200, 300]),
            "relation": rng.choice(_REL),
        },
        lambda kw: f"Answer with {kw['relation']} {kw['num_words']} words.",
    ),
    "length_constraints:nth_paragraph_first_word": (
        lambda rng, q: (
            lambda n: {
                "num_paragraphs": n,
                "nth_paragraph": rng.randint(1, n),
                "first_word": rng.choice(_IFEVAL_WORDS),
            }
        )(rng.randint(2, 4)),
        lambda kw: (
            f"There should be {kw['num_paragraphs']} paragraphs. Paragraphs and only paragraphs are separated "
            "with each other by two new lines as if it was '\\n\\n' in python. "
            f"Paragraph {kw['nth_paragraph']} must start with word {kw['first_word']}."
        ),
    ),
    "detectable_content:number_placeholders": (
        lambda rng, q: {"num_placeholders": rng.randint(1, 4)},
        lambda kw: (
            f"The response must contain at least {kw['num_placeholders']} placeholders represented by square "
            "brackets, such as [address]."
        ),
    ),
    "detectable_content:postscript": (
        lambda rng, q: {"postscript_marker": rng.choice(["P.S.", "P.P.S"])},
        lambda kw: (
            f"At the end of your response, please explicitly add a postscript starting with "
            f"{kw['postscript_marker']}"
        ),
    ),
    "detectable_format:number_bullet_lists": (
        lambda rng, q: {"num_bullets": rng.randint(1, 5)},
        lambda kw: (
            f"Your answer must contain exactly {kw['num_bullets']} bullet points. Use the markdown bullet "
            "points such as:\n* This is point 1. \n* This is point 2"
        ),
    ),
    "detectable_format:constrained_response": (
        lambda rng, q: {},
        lambda kw: (
            "Answer with one of the following options: ('My answer is yes.', 'My answer is no.', "
            "'My answer is maybe.')"
        ),
    ),
    "detectable_format:number_highlighted_sections": (
        lambda rng, q: {"num_highlights": rng.randint(1, 4)},
        lambda kw: (
            f"Highlight at least {kw['num_highlights']} sections in your answer with markdown, i.e. "
            "*highlighted section*."
        ),
    ),
    "detectable_format:multiple_sections": (
        lambda rng, q: {
            "section_spliter": rng.choice(["Section", "SECTION"]),
            "num_sections": rng.randint(2, 4),
        },
        lambda kw: (
            f"Your response must have {kw['num_sections']} sections. Mark the beginning of each section with "
            f"{kw['section_spliter']} X, such as:\n{kw['section_spliter']} 1\n[content of section 1]\n"
            f"{kw['section_spliter']} 2\n[content of section 2]"
        ),
    ),
    "detectable_format:json_format": (
        lambda rng, q: {},
        lambda kw: (
            "Entire output should be wrapped in JSON format. You can use markdown ticks such as ```."
        ),
    ),
    "detectable_format:title": (
        lambda rng, q: {},
        lambda kw: (
            "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>."
        ),
    ),
    "combination:two_responses": (
        lambda rng, q: {},
        lambda kw: (
            "Give two different responses. Responses and only responses should be separated by 6 asterisk "
            "symbols: ******."
        ),
    ),
    "combination:repeat_prompt": (
        lambda rng, q: {"prompt_to_repeat": q},
        lambda kw: (
            "First repeat the request word for word without change, then give your answer (1. do not say any "
            "words or characters before repeating the request; 2. the request you need to repeat does not "
            "include this sentence)"
        ),
    ),
    "startend:end_checker": (
        lambda rng, q: {
            "end_phrase": rng.choice(
                ["Any other questions?", "Is there anything else I can help with?"]
            )
        },
        lambda kw: (
            f"Finish your response with this exact phrase {kw['end_phrase']}. No other words should follow "
            "this phrase."
        ),
    ),
    "startend:quotation": (
        lambda rng, q: {},
        lambda kw: "Wrap your entire response with double quotation marks.",
    ),
    "change_case:capital_word_frequency": (
        lambda rng, q: {
            "capital_frequency": rng.randint(1, 10),
            "capital_relation": rng.choice(_REL),
        },
        lambda kw: (
            f"In your response, words with all capital letters should appear {kw['capital_relation']} "
            f"{kw['capital_frequency']} times."
        ),
    ),
    "change_case:english_capital": (
        lambda rng, q: {},
        lambda kw: "Your entire response should be in English, and in all capital letters.",
    ),
    "change_case:english_lowercase": (
        lambda rng, q: {},
        lambda kw: (
            "Your entire response should be in English, and in all lowercase letters. No capital letters are "
            "allowed."
        ),
    ),
    "punctuation:no_comma": (
        lambda rng, q: {},
        lambda kw: "In your entire response, refrain from the use of any commas.",
    ),
}

# Instructions that no response can follow together (after IFEval's INSTRUCTION_CONFLICTS): these
# four combine only with the listed ones, and the pairs below never meet. A type never meets itself.
_IFEVAL_ONLY_WITH = {
    "detectable_format:constrained_response": set(),
    "detectable_format:json_format": {"keywords:existence", "keywords:forbidden_words"},
    "combination:two_responses": {
        "keywords:existence",
        "keywords:forbidden_words",
        "language:response_language",
        "detectable_format:title",
        "punctuation:no_comma",
    },
    "combination:repeat_prompt": {
        "keywords:existence",
        "detectable_format:title",
        "punctuation:no_comma",
    },
}
_LANG = "language:response_language"
_IFEVAL_CONFLICTS = {
    frozenset(pair)
    for pair in [
        (_LANG, "detectable_format:multiple_sections"),
        (_LANG, "keywords:existence"),
        (_LANG, "keywords:frequency"),
        (_LANG, "keywords:forbidden_words"),
        (_LANG, "startend:end_checker"),
        (_LANG, "change_case:english_capital"),
        (_LANG, "change_case:english_lowercase"),
        (_LANG, "change_case:capital_word_frequency"),
        ("length_constraints:number_paragraphs", "length_constraints:nth_paragraph_first_word"),
        ("length_constraints:number_paragraphs", "length_constraints:number_sentences"),
        ("detectable_format:multiple_sections", "detectable_format:number_highlighted_sections"),
        ("detectable_format:multiple_sections", "change_case:english_lowercase"),
        ("change_case:capital_word_frequency", "change_case:english_lowercase"),
        ("change_case:capital_word_frequency", "change_case:english_capital"),
        ("change_case:english_capital", "change_case:english_lowercase"),
        ("startend:quotation", "detectable_format:title"),
    ]
}


def ifeval_compatible(a: str, b: str) -> bool:
    """Whether one response can follow instructions a and b together (the tables above)."""
    if a == b or frozenset((a, b)) in _IFEVAL_CONFLICTS:
        return False
    return b in _IFEVAL_ONLY_WITH.get(a, {b}) and a in _IFEVAL_ONLY_WITH.get(b, {a})


def _ifeval_example(id: str, prompt: str, instruction_ids: list[str], kwargs: list[dict]) -> dict:
    answer = {"instruction_id_list": instruction_ids, "kwargs": kwargs}
    return {"id": id, "prompt": prompt, "answer": answer, "solution": "", "verifier": "ifeval"}


def make_ifeval_train(questions: list[str], n: int, seed: int = IFEVAL_TRAIN_SEED) -> list[dict]:
    """n prompts, each a question (drawn without replacement) and 1-3 compatible instructions
    with sampled kwargs. Deterministic in (questions, n, seed): only random.Random(seed) is used.
    ids "<seed>/<i>"."""
    rng = random.Random(seed)
    examples = []
    for i, question in enumerate(rng.sample(questions, n)):
        chosen = []
        # IFEval's own prompts: 1.5 instructions on average
        for _ in range(rng.choice([1, 1, 2, 2, 3])):
            options = [
                t for t in _IFEVAL_INSTRUCTIONS if all(ifeval_compatible(t, c) for c in chosen)
            ]
            if options:
                chosen.append(rng.choice(options))
        kwargs = [_IFEVAL_INSTRUCTIONS[t][0](rng, question) for t in chosen]
        descriptions = " ".join(
            _IFEVAL_INSTRUCTIONS[t][1](kw) for t, kw in zip(chosen, kwargs, strict=True)
        )
        examples.append(
            _ifeval_example(f"{seed}/{i}", f"{question}\n{descriptions}", chosen, kwargs)
        )
    return examples


def _load_ifeval(split: str, data_dir: str | Path | None) -> list[dict]:
    """data_dir: ../shared/data/ifeval; the train split reads GSM8K and MATH from its siblings."""
    if split == "train":
        gsm8k_dir = None
        math_dir = None
        if data_dir is not None:
            gsm8k_dir = Path(data_dir).parent / "gsm8k"
            math_dir = Path(data_dir).parent / "math"
        examples = _load_gsm8k_official("train", gsm8k_dir) + _load_math("train", math_dir)
        questions = [
            ex["prompt"] for ex in examples if len(ex["prompt"]) <= IFEVAL_MAX_QUESTION_CHARS
        ]
        return make_ifeval_train(questions, IFEVAL_TRAIN_SIZE)
    if data_dir is None:
        rows = _read_hub("google/IFEval", None, "train")
    else:
        rows = _read_jsonl(Path(data_dir) / "input_data.jsonl")
    examples = []
    for where, row in rows:
        ids = _field(row, "instruction_id_list", where, list)
        kwargs = _field(row, "kwargs", where, list)
        unknown = [i for i in ids if i not in _IFEVAL_INSTRUCTIONS]
        if unknown or len(ids) != len(kwargs):
            raise DataError(
                f"{where}: unknown instruction ids {unknown} or {len(ids)} ids for {len(kwargs)} kwargs"
            )
        # the hub fills unused keys with None
        kwargs = [{k: v for k, v in kw.items() if v is not None} for kw in kwargs]
        id = str(_field(row, "key", where, int))
        prompt = _field(row, "prompt", where)
        examples.append(_ifeval_example(id, prompt, ids, kwargs))
    return examples


# --- Prompt templates ---

# R1-Zero template (DeepSeek-R1 paper, Table 1), verbatim as in CS336 assignment 5's
# cs336_alignment/prompts/r1_zero.prompt. The prompt ends inside "<think>": the model writes the
# reasoning, closes it, then answers in <answer> tags, which is where the verifier looks.
R1_ZERO_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> "
    "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {question}\n"
    "Assistant: <think>"
)

# Appended to the question for "chat". It asks for GSM8K's "####" on every dataset, so that the
# question, chat and k-shot formats share one answer format (the SFT targets below end that way).
CHAT_INSTRUCTION = (
    'Solve the problem step by step. Write the final answer on the last line as "#### <answer>".'
)

# r1_zero, question and chat are the training templates; gsm8k_kshot, mbpp_kshot, humaneval and
# hendrycks_math_kshot reproduce lm-evaluation-harness's tasks, prompt for prompt (docs/eval.md,
# "The templates that copy lm-eval's tasks": which version and setting each one copies).
TEMPLATES = (
    "r1_zero",
    "question",
    "chat",
    "gsm8k_kshot",
    "mbpp_kshot",
    "humaneval",
    "hendrycks_math_kshot",
)
# r1_zero and chat ask a code question for a fenced block; the verifier reads the block
CODE_INSTRUCTION = "Write the solution as one Python function in a ```python code block."
MBPP_PROMPT = (
    "You are an expert Python programmer, and here is your task: {text} Your code should pass these tests:\n\n"
    "{tests}\n[BEGIN]\n"
)


def _mbpp_text(example: dict) -> str:
    return MBPP_PROMPT.format(text=example["text"], tests="\n".join(example["test_list"][:3]))


def _lm_eval_math_answer(solution: str) -> str:
    """A MATH shot's answer as lm-eval's hendrycks_math reads it (utils.process_docs): our gold,
    except that "\\boxed 17" without braces runs to the next "$" ("{17}." on one train row), and an
    empty \\boxed{} stays empty."""
    if "\\boxed " in solution:
        return solution.split("\\boxed ")[-1].split("$")[0]
    return last_boxed_in_solution(solution) or ""


def _reasoning(example: dict) -> str:
    """The worked solution without its "####" line and GSM8K's <<48/2=24>> calculator notes."""
    if example["verifier"] != "gsm8k":
        return example["solution"].strip()
    text = re.sub(r"<<[^>]*>>", "", example["solution"])
    return "\n".join(line for line in text.splitlines() if not line.startswith("####")).strip()


def _hash_target(example: dict) -> str:
    """The solution in GSM8K form, ending "#### ANSWER" (GSM8K solutions already do, verbatim)."""
    if example["verifier"] == "gsm8k":
        return example["solution"]
    return f"{example['solution']}\n#### {example['answer']}"


def render_prompt(
    example: dict,
    template: str,
    tokenizer=None,
    fewshot: list[dict] | None = None,
    tools: bool = False,
) -> str:
    """The text the model is given. "chat" needs the tokenizer; "gsm8k_kshot" needs
    fewshot=gsm8k_fewshot(k). tools=True: the question says how to call its tool (tool_protocol),
    where it has one."""
    protocol = tool_protocol(example, template) if tools else None
    if protocol:
        example = dict(example, prompt=f"{example['prompt']}\n{protocol['instruction']}")
    question = example["prompt"]
    code = example["verifier"] == "code"
    if template in ("mbpp_kshot", "humaneval") and not (
        code and (template == "humaneval") == ("code_prompt" in example)
    ):
        raise ValueError(
            f"template {template!r} is for {template.split('_')[0]} examples, not {example['id']!r}"
        )
    if template == "mbpp_kshot":
        if fewshot is None:
            raise ValueError(
                "template 'mbpp_kshot' needs fewshot=mbpp_fewshot() (0-shot: fewshot=[])"
            )
        shots = [f"{_mbpp_text(shot)}{shot['solution']}\n[DONE]" for shot in fewshot]
        return "\n\n".join([*shots, _mbpp_text(example)])
    if template == "humaneval":
        return question
    if template == "hendrycks_math_kshot":
        if fewshot is None or example["verifier"] != "math":
            raise ValueError(
                "template 'hendrycks_math_kshot' is for MATH and needs fewshot=math_fewshot(k)[id]"
            )
        shots = []
        for shot in fewshot:
            answer = _lm_eval_math_answer(shot["solution"])
            # lm-eval 0.4.13 leaves out the delimiters after an empty answer (two train rows)
            delimited = f" {answer}\n\n" if answer else ""
            shots.append(f"Problem: {shot['prompt']}\nAnswer:" + delimited)
        return "".join([*shots, f"Problem: {question}\nAnswer:"])
    if code and template in ("r1_zero", "chat"):
        question = f"{question}\n{CODE_INSTRUCTION}"
    if template == "r1_zero":
        return R1_ZERO_PROMPT.format(question=question)
    if template == "question":
        return question
    if template == "chat":
        if tokenizer is None:
            raise ValueError("template 'chat' needs the tokenizer (its chat template)")
        messages = [{"role": "user", "content": chat_message(example)}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if template == "gsm8k_kshot":
        if fewshot is None:
            raise ValueError(
                "template 'gsm8k_kshot' needs fewshot=gsm8k_fewshot(k) (k=0: fewshot=[])"
            )
        shots = [f"Question: {shot['prompt']}\nAnswer: {_hash_target(shot)}" for shot in fewshot]
        return "\n\n".join([*shots, f"Question: {question}\nAnswer:"])
    raise ValueError(f"unknown template {template!r}; choose from {list(TEMPLATES)}")


def chat_message(example: dict) -> str:
    """The user's message of the "chat" template. The "####" line is for answer-checked tasks: code
    has its own instruction, and an IFEval prompt is the task."""
    if example["verifier"] == "code":
        return f"{example['prompt']}\n{CODE_INSTRUCTION}"
    if example["verifier"] == "ifeval":
        return example["prompt"]
    return f"{example['prompt']}\n{CHAT_INSTRUCTION}"


def render_response(example: dict, template: str) -> str:
    """The SFT target that follows render_prompt(example, template); the trainer appends EOS.

    r1_zero: " <reasoning> </think> <answer> ANSWER </answer>". The others: the solution ending
    "#### ANSWER", after a " " for gsm8k_kshot (lm-eval's target delimiter) and a "\\n" for question
    (the prompt is the bare question).
    """
    # no worked reasoning: the program is the solution
    if example["verifier"] == "code" and template in TEMPLATES:
        block = f"```python\n{example['solution']}\n```"
        targets = {
            "r1_zero": f" </think> <answer>\n{block}\n</answer>",
            "question": f"\n{block}",
            "chat": block,
            "mbpp_kshot": f"{example['solution']}\n[DONE]",
            "humaneval": example["solution"],
        }
        return targets[template]
    if template == "r1_zero":
        return f" {_reasoning(example)} </think> <answer> {example['answer']} </answer>"
    prefix = {"question": "\n", "chat": "", "gsm8k_kshot": " "}
    if template not in prefix:
        raise ValueError(f"unknown template {template!r}; choose from {list(TEMPLATES)}")
    return prefix[template] + _hash_target(example)


def stop_strings(template: str) -> list[str]:
    """Strings that end generation besides EOS: chat stops at the end of its turn, which is not EOS
    in base models.

    For r1_zero, give vLLM include_stop_str_in_output=True so the response keeps "</answer>" for the
    verifier.
    """
    stops = {
        "r1_zero": ["</answer>"],
        "question": [],
        "chat": ["<|im_end|>"],
        "gsm8k_kshot": ["Question:", "</s>", "<|im_end|>"],
        "mbpp_kshot": ["[DONE]"],
        "humaneval": HUMANEVAL_STOP,
        "hendrycks_math_kshot": ["Problem:"],
    }
    if template not in stops:
        raise ValueError(f"unknown template {template!r}; choose from {list(TEMPLATES)}")
    return stops[template]


# --- Tools during generation: one Python tool, called in a form the template declares ---

# A response calls the tool by writing `open`, a call, then `stop` (where the engine stops); the
# sandbox runs `program` with the call in it, and its output, inside `output`, is appended to the
# response (grpo_tools.py). GSM8K and MATH: a fenced python block answered by a fenced output
# block. The synthetic task: GSM8K's calculator notes, short enough for the tiny tokenizer:
#   "16 + 7 = <<16 + 7>>23. 23 - 5 = 18."   (the tool wrote "23")
TOOL_PROTOCOLS = {
    "python": {
        "open": "```python\n",
        # the closing fence: "```python" opens, "\n```\n" closes
        "stop": "\n```\n",
        "program": "{}",
        "output": "```output\n{}\n```\n",
        "instruction": (
            "You may run Python: write a ```python block that prints, and its output will follow "
            "in a ```output block."
        ),
    },
    "calculator": {
        "open": "<<",
        "stop": ">>",
        "program": "print({})",
        "output": "{}",
        "instruction": "Calculator: <<16 + 7>>23",
    },
}


def tool_protocol(example: dict, template: str) -> dict | None:
    """The tool protocol of an example under a template (TOOL_PROTOCOLS), or None: code tasks
    already write python blocks, and IFEval and the k-shot templates have no tool."""
    if example["verifier"] == "synthetic" and template in ("question", "r1_zero", "chat"):
        return TOOL_PROTOCOLS["calculator"]
    if example["verifier"] in ("gsm8k", "math") and template in ("r1_zero", "chat"):
        return TOOL_PROTOCOLS["python"]
    return None


def tool_program(text: str, protocol: dict) -> str | None:
    """The program of the call that ends `text` (a turn that stopped at protocol["stop"]): the
    text after the last protocol["open"], in protocol["program"]; None if the turn opened none."""
    start = text.rfind(protocol["open"])
    if start < 0 or not text.endswith(protocol["stop"]):
        return None
    call = text[start + len(protocol["open"]) : len(text) - len(protocol["stop"])]
    return protocol["program"].format(call)


# --- Mixtures: several datasets with weights, and optionally a fixed order per dataset (a curriculum) ---


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """ "gsm8k:0.25,math:0.75" -> [("gsm8k", 0.25), ("math", 0.75)]; a plain "gsm8k" has weight 1.
    Weights are relative (normalized when drawing). A bad spec raises ValueError naming the part."""
    mixture = []
    for part in spec.split(","):
        name, colon, weight_text = part.strip().partition(":")
        name = name.strip()
        if not name or (colon and not weight_text.strip()):
            raise ValueError(
                f"mixture {spec!r}: malformed part {part!r}; write name or name:weight"
            )
        if name not in SPLITS:
            raise ValueError(
                f"mixture {spec!r}: unknown dataset {name!r}; choose from {list(SPLITS)}"
            )
        if name in dict(mixture):
            raise ValueError(f"mixture {spec!r}: dataset {name!r} given twice")
        try:
            weight = float(weight_text) if colon else 1.0
        except ValueError:
            raise ValueError(
                f"mixture {spec!r}: weight {weight_text!r} of {name!r} is not a number"
            ) from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(
                f"mixture {spec!r}: weight of {name!r} must be finite and >= 0, got {weight_text!r}"
            )
        mixture.append((name, weight))
    if sum(w for _, w in mixture) <= 0:
        raise ValueError(f"mixture {spec!r}: the weights sum to zero")
    return mixture


def read_order(path: str | Path, examples: list[dict]) -> list[int]:
    """A curriculum file (one example id a line, blank lines skipped) -> indices into `examples`, in
    file order."""
    index = {ex["id"]: i for i, ex in enumerate(examples)}
    order = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        id = line.strip()
        if not id:
            continue
        if id not in index:
            raise DataError(f"{path}:{line_no}: id {id!r} is not in the dataset")
        order.append(index[id])
    if not order:
        raise DataError(f"{path}: no ids")
    return order


def parse_per_dataset(pairs: list[str], names: list[str], flag: str) -> dict[str, str]:
    """["mbpp=order.txt", ...] -> {"mbpp": "order.txt"}: a flag's value for some datasets of the
    mixture `names` (--curriculum, --dataset-templates). A malformed pair or a dataset not in the
    mixture raises ValueError."""
    values = {}
    for pair in pairs:
        name, equals, value = (part.strip() for part in pair.partition("="))
        if not (name and equals and value):
            raise ValueError(f"{flag} {pair!r}: write dataset=value")
        if name not in names or name in values:
            raise ValueError(
                f"{flag} {pair!r}: {name!r} is not in the mixture {names}, or is given twice"
            )
        values[name] = value
    return values


def dataset_templates(names: list[str], template: str, overrides: list[str]) -> dict[str, str]:
    """Each dataset's prompt template: `template`, or its own from --dataset-templates
    ("ifeval=question"). IFEval under r1_zero is refused: its verifier checks the whole response,
    and an R1-Zero response is reasoning in tags that stops at "</answer>", so "end with this
    phrase" or "answer in JSON" could never be followed."""
    templates = {name: template for name in names} | parse_per_dataset(
        overrides, names, "--dataset-templates"
    )
    for name, name_template in templates.items():
        if name_template not in TEMPLATES:
            raise ValueError(
                f"template {name_template!r} of {name!r}: unknown; choose from {list(TEMPLATES)}"
            )
        if name == "ifeval" and name_template == "r1_zero":
            raise ValueError(
                "ifeval is scored on the whole response, not on <answer>: give it its own template, "
                "--dataset-templates ifeval=question (or --template question)"
            )
    return templates


def eval_split(dataset: str, split: str) -> str:
    """The split `dataset` is evaluated on: `split`, or test where that is "val" and there is none
    (MATH, IFEval)."""
    return "test" if split == "val" and "val" not in SPLITS[dataset] else split


def load_mixture(
    names: list[str], split: str, data_dir, order_files: dict[str, str] | None = None
) -> tuple:
    """The examples of `split` of every dataset, one dataset after another, each tagged "dataset":
    its name; the size of each dataset; and each one's curriculum (read_order of order_files[name])
    or None."""
    sets = [[{**ex, "dataset": name} for ex in load(name, split, data_dir)] for name in names]
    files = order_files or {}
    orders = [
        read_order(files[name], s) if name in files else None
        for name, s in zip(names, sets, strict=True)
    ]
    return [ex for s in sets for ex in s], [len(s) for s in sets], orders


def _step_datasets(weights: list[float], n_prompts: int, seed: int, step: int) -> tuple:
    """Step `step`'s random stream, and the dataset of each of its questions (n_prompts,): the
    stream's first draw."""
    rng = np.random.default_rng([seed, step])
    return rng, rng.choice(len(weights), size=n_prompts, p=np.array(weights) / sum(weights))


# (weights, n_prompts, seed) -> per-dataset counts before step 0, 1, ...
_DRAWN: dict[tuple, list[np.ndarray]] = {}


def _drawn_before(weights: list[float], n_prompts: int, seed: int, step: int) -> np.ndarray:
    """How many questions each dataset gave in steps 0 .. step - 1: the dataset draws replayed, once
    per process (a resumed run replays them too; 10,000 steps of 32 questions took 0.6 s on 2 loaded
    CPU cores)."""
    history = _DRAWN.setdefault(
        (tuple(weights), n_prompts, seed), [np.zeros(len(weights), dtype=int)]
    )
    while len(history) <= step:
        datasets = _step_datasets(weights, n_prompts, seed, len(history) - 1)[1]
        history.append(history[-1] + np.bincount(datasets, minlength=len(weights)))
    return history[step]


def mixture_questions_and_seeds(
    sizes: list[int],
    weights: list[float],
    n_prompts: int,
    group_size: int,
    seed: int,
    step: int,
    orders: list[list[int] | None] | None = None,
) -> tuple[list[tuple[int, int]], list[int]]:
    """The questions of step `step` as (dataset, index) pairs, and the engine's sampling seed for
    each question. Each question's dataset is drawn in proportion to `weights`, then distinct
    questions of each dataset at random, or, where `orders[d]` is given, the next ones of that order
    (wrapping around): the k-th question ever drawn from dataset d is orders[d][k], across steps.
    Derived from (seed, step) alone, so a resumed run continues exactly. One dataset without an
    order makes no dataset draw: it draws exactly as the scripts did before mixtures
    (tests/test_mixture.py keeps that draw)."""
    orders = orders or [None] * len(sizes)
    if len(sizes) == 1:
        rng = np.random.default_rng([seed, step])
        datasets = np.zeros(n_prompts, dtype=int)
        drawn_before = np.array([step * n_prompts])
    else:
        rng, datasets = _step_datasets(weights, n_prompts, seed, step)
        drawn_before = None
        if any(o is not None for o in orders):
            drawn_before = _drawn_before(weights, n_prompts, seed, step)
    picks = [None] * n_prompts
    for d, (size, order) in enumerate(zip(sizes, orders, strict=True)):
        slots = np.flatnonzero(datasets == d)  # the questions of this step that come from dataset d
        if order is None:
            # distinct questions within a step; a curriculum wraps around instead
            if len(slots) > size:
                raise ValueError(
                    f"step {step} drew {len(slots)} questions of dataset {d + 1} of the mixture, which "
                    f"has {size}: ask fewer questions per step, or give it less weight"
                )
            indices = rng.choice(size, size=len(slots), replace=False).tolist()
        else:
            indices = [order[(drawn_before[d] + k) % len(order)] for k in range(len(slots))]
        for slot, i in zip(slots, indices, strict=True):
            picks[slot] = (d, i)
    first_seed = int(rng.integers(2**30))
    return picks, [first_seed + j * group_size for j in range(n_prompts)]


# --- Tasks: what a training script needs of its datasets, from one call ---


@dataclass
class Task:
    """The datasets of a run, made by load_task. `train`: every dataset's train examples, one
    dataset after another, each tagged with its "dataset" (`sizes` says where each begins); `evals`:
    each dataset's evaluation examples."""

    names: list[str]
    weights: list[float]
    templates: dict[str, str]
    train: list[dict]
    sizes: list[int]
    orders: list[list[int] | None]
    evals: dict[str, list[dict]]
    data_dir: str | None = None
    tokenizer: object = None
    tools: bool = False
    judge: verifiers.Judge | None = None
    """--judge-model's verifiers.Judge: score_batch(..., judge=task.judge) grades the train examples
    it marked"""

    def prompt(self, example: dict) -> str:
        template = self.templates[example["dataset"]]
        return render_prompt(example, template, self.tokenizer, tools=self.tools)

    def tool(self, example: dict) -> dict | None:
        """The example's tool protocol if the task has tools, else None."""
        if not self.tools:
            return None
        return tool_protocol(example, self.templates[example["dataset"]])

    def response(self, example: dict) -> str:
        return render_response(example, self.templates[example["dataset"]])

    def stop(self, example: dict) -> list[str] | None:
        return stop_strings(self.templates[example["dataset"]]) or None

    def longest_prompt(self) -> int:
        """The longest prompt of the train and eval examples, in tokens: the engine's context must
        hold it."""
        examples = self.train + [ex for evals in self.evals.values() for ex in evals]
        return max(
            len(ids) for ids in self.tokenizer([self.prompt(ex) for ex in examples])["input_ids"]
        )

    def questions(
        self, n_questions: int, group_size: int, seed: int, step: int
    ) -> tuple[list[dict], list[int]]:
        """The questions of step `step` and the engine's sampling seed for each
        (mixture_questions_and_seeds)."""
        picks, seeds = mixture_questions_and_seeds(
            self.sizes, self.weights, n_questions, group_size, seed, step, self.orders
        )
        starts = np.cumsum([0, *self.sizes]).tolist()  # where each dataset's examples begin
        return [self.train[starts[d] + i] for d, i in picks], seeds

    def rollout_metrics(self, examples: list[dict], rewards: list[list[float]]) -> dict:
        """rollout/<dataset>/count (questions drawn) and /reward_mean (NaN when none was drawn),
        from Q examples and their Q lists of G rewards."""
        metrics = {}
        for name in self.names:
            drawn = [
                group for ex, group in zip(examples, rewards, strict=True) if ex["dataset"] == name
            ]
            metrics[f"rollout/{name}/count"] = len(drawn)
            # a judge's failure (NaN) is no reward: the mean of the rewards there are
            values = np.array(drawn, dtype=float)
            if np.isnan(values).any():
                values = values[~np.isnan(values)]
            mean = float(np.mean(values)) if values.size else math.nan
            metrics[f"rollout/{name}/reward_mean"] = mean
        return metrics


def load_task(args, tokenizer=None, n_questions: int = 0, train: bool = True) -> Task:
    """The task of a script's Args: its mixture --dataset ("gsm8k" or "gsm8k:0.5,math:0.5"),
    --template and --dataset-templates, --curriculum (if the script has it), the train examples
    (unless train=False), and the first --n-eval examples of each dataset's --eval-split, from
    --data-dir. Every bad spec raises here, before a script starts its engine. n_questions:
    questions per step, checked against each dataset's train split."""
    mixture = parse_mixture(args.dataset)
    names = [name for name, _ in mixture]
    weights = [weight for _, weight in mixture]
    templates = dataset_templates(names, args.template, args.dataset_templates)
    order_files = parse_per_dataset(getattr(args, "curriculum", []), names, "--curriculum")
    examples, sizes, orders = [], [], []
    if train:
        examples, sizes, orders = load_mixture(names, "train", args.data_dir, order_files)
    # grpo.py's --ifeval-partial-credit: the training prompts' reward; evaluation stays strict
    share = getattr(args, "ifeval_partial_credit", 0.0)
    if share:
        for ex in examples:
            if ex["verifier"] == "ifeval":
                ex["answer"] = {**ex["answer"], "partial_credit": share}
    # a step draws n w / sum(w) on average
    for name, size, weight in zip(names, sizes, weights, strict=False):
        if n_questions * weight / sum(weights) > size:
            raise ValueError(
                f"{n_questions} questions per step, {weight / sum(weights):.0%} from {name}, but its "
                f"train split has {size}"
            )
    evals = {}
    for name in names:
        split = eval_split(name, args.eval_split)
        eval_examples = load(name, split, args.data_dir)[: args.n_eval]
        evals[name] = [{**ex, "dataset": name} for ex in eval_examples]
    # grpo_tools.py's --max-tool-calls, eval.py's --tools
    tools = getattr(args, "max_tool_calls", 0) > 0 or getattr(args, "tools", False)
    # --judge-model: the train examples are graded by the judge (blended with the rule below
    # --judge-weight 1); evaluation keeps the rule, the number a run is compared by
    judge = make_judge(args)
    if judge is not None:
        rubric_file = read_rubric_file(getattr(args, "judge_rubric", None))
        weight = getattr(args, "judge_weight", 1.0)
        for ex in examples:
            ex["judge"] = {"rubric": judge_rubric(ex, rubric_file), "weight": weight}
    return Task(
        names,
        weights,
        templates,
        examples,
        sizes,
        orders,
        evals,
        args.data_dir,
        tokenizer,
        tools,
        judge,
    )


# --- A judge as a reward (verifiers.Judge): rubrics, and the judge of a script's --judge-* flags ---

# A rubric per verifier: what the judge is asked to check. "{answer}" is replaced by the example's
# gold answer where it is text (a reference-guided judge: it need not solve the problem itself).
JUDGE_RUBRICS = {
    "gsm8k": (
        "The response solves the problem and its final answer equals the reference answer, "
        "{answer}. A wrong, missing or hedged final answer scores 0."
    ),
    "math": (
        "The response solves the problem and its final answer is mathematically equal to the "
        "reference answer, {answer}. A wrong, missing or hedged final answer scores 0."
    ),
    "synthetic": (
        "The response solves the word problem and its final answer equals the reference answer, "
        "{answer}. A wrong or missing final answer scores 0."
    ),
    "code": (
        "The response is one correct and complete Python function that does what the task asks "
        "and would pass its tests. Code that is wrong, incomplete or missing scores 0."
    ),
    "ifeval": (
        "The response does what the task asks and follows every instruction in it exactly "
        "(length, format, sections, words to use or avoid, case, punctuation, language). Score 1 "
        "only if every instruction is followed, 0 if none is, the share followed otherwise."
    ),
}


def judge_rubric(example: dict, rubric_file: str | None = None) -> str:
    """The rubric an example is judged by: its own "rubric" field, else --judge-rubric's file,
    else the default of its verifier (JUDGE_RUBRICS); "{answer}" filled with a text gold."""
    rubric = example.get("rubric") or rubric_file or JUDGE_RUBRICS[example["verifier"]]
    if isinstance(example.get("answer"), str):
        rubric = rubric.replace("{answer}", example["answer"])
    return rubric


def read_rubric_file(path: str | None) -> str | None:
    """--judge-rubric: a text file that holds one rubric for every example (None: none)."""
    if path is None:
        return None
    if not Path(path).is_file() or not Path(path).read_text(encoding="utf-8").strip():
        raise ValueError(f"--judge-rubric {path!r} is not a file with a rubric in it")
    return Path(path).read_text(encoding="utf-8").strip()


def make_judge(args) -> verifiers.Judge | None:
    """The judge of args' --judge-* flags (None without --judge-model), its server checked: it
    answers, takes the key and serves the model. A bad flag raises ValueError naming it, before
    any engine starts. The key is read from the variable --judge-api-key-env names, never from a
    file."""
    model = getattr(args, "judge_model", None)
    base_url = getattr(args, "judge_base_url", None)
    if model is None and base_url is None:
        return None
    if model is None or base_url is None:
        raise ValueError("--judge-model and --judge-base-url go together: give both or neither")
    weight = getattr(args, "judge_weight", 1.0)
    if not 0 < weight <= 1:
        raise ValueError(f"--judge-weight must be in (0, 1] (1: the judge alone), got {weight}")
    concurrency = getattr(args, "judge_concurrency", 8)
    timeout_s = getattr(args, "judge_timeout_s", 60.0)
    if concurrency < 1 or timeout_s <= 0:
        raise ValueError(
            f"need --judge-concurrency >= 1 and --judge-timeout-s > 0, got {concurrency}, {timeout_s}"
        )
    price = list(getattr(args, "judge_price_per_mtok", []))
    if len(price) not in (0, 2) or any(p < 0 for p in price):
        raise ValueError(
            f"--judge-price-per-mtok takes two prices, in and out, in $ per million tokens: {price}"
        )
    read_rubric_file(getattr(args, "judge_rubric", None))
    structured = getattr(args, "judge_structured", "choice")
    if structured not in verifiers.STRUCTURED:
        raise ValueError(f"--judge-structured {structured!r}: one of {list(verifiers.STRUCTURED)}")
    key_env = getattr(args, "judge_api_key_env", "JUDGE_API_KEY")
    # unset: no key is sent (a local vllm serve needs none); a server that wants one says so below
    key = os.environ.get(key_env) if key_env else None
    judge = verifiers.Judge(
        base_url,
        model,
        api_key=key,
        concurrency=concurrency,
        timeout_s=timeout_s,
        price_per_mtok=price,
        max_tokens=getattr(args, "judge_max_tokens", 32),
        structured=structured,
    )
    try:
        judge.check_server()
    except ValueError as error:
        raise ValueError(
            f"{error} (--judge-base-url, --judge-model; the key: ${key_env})"
        ) from None
    return judge


def eval_metrics(records: list[dict]) -> dict:
    """Greedy evaluation's means over records {"dataset", "reward": reward dict, "n_tokens",
    "truncated"}: over all of them, and eval/<dataset>/accuracy for each dataset (a mixture's totals
    weigh each dataset by its n_eval)."""
    # None for no rows, not NaN: metrics.jsonl is strict JSON
    mean = lambda key, rows: float(np.mean([r[key] for r in rows])) if rows else None
    correct = [r for r in records if r["reward"]["reward"] == 1]
    incorrect = [r for r in records if r["reward"]["reward"] != 1]
    metrics = {
        "eval/accuracy": float(np.mean([r["reward"]["reward"] for r in records])),
        "eval/format_rate": float(np.mean([r["reward"]["format_reward"] for r in records])),
        "eval/response_length": mean("n_tokens", records),
        "eval/response_length_correct": mean("n_tokens", correct),
        "eval/response_length_incorrect": mean("n_tokens", incorrect),
        "eval/truncation_rate": mean("truncated", records),
    }
    for d in dict.fromkeys(r["dataset"] for r in records):
        rewards = [r["reward"]["reward"] for r in records if r["dataset"] == d]
        metrics[f"eval/{d}/accuracy"] = float(np.mean(rewards))
    return metrics


# --- SFT pairs: (prompt, response) from a JSONL file or from the datasets' worked solutions ---


# what verifiers.score reads
VERIFIER_FIELDS = ("answer", "verifier", "tests", "code_prompt", "completion_stop")


def sft_row(prompt: str, response: str, example: dict) -> dict:
    """One --sft-file row: the pair, and what verifiers.score needs to check it again (sft.py
    --filter-correct)."""
    keys = ("dataset", "id", *VERIFIER_FIELDS)
    return {
        "prompt": prompt,
        "response": response,
        **{key: example[key] for key in keys if key in example},
    }


def read_sft_file(path: str, fields: tuple[str, ...] = ("prompt", "response")) -> list[dict]:
    """Rows of {"prompt", "response"} (optionally "answer", "verifier"); a bad row names its file,
    line and field."""
    rows = []
    for where, row in _read_jsonl(Path(path)):
        # an answer may be a dict (IFEval's instructions): only prompt and response are text
        for key in fields:
            _field(row, key, where, str if key in ("prompt", "response") else object)
        if "verifier" in fields and row["verifier"] == "code":
            _field(row, "tests", where)  # a program is checked by running its tests
        if "tool_spans" in row:
            _check_tool_spans(row, where)
        rows.append(row)
    return rows


def _check_tool_spans(row: dict, where: str) -> None:
    """tool_spans: [start, end) character spans of the response, in order, not overlapping."""
    end_before = 0
    for span in _field(row, "tool_spans", where, list):
        ok = isinstance(span, list) and len(span) == 2 and all(type(c) is int for c in span)
        if not ok or not end_before <= span[0] <= span[1] <= len(row["response"]):
            raise DataError(
                f"{where}: field 'tool_spans' should list [start, end] character spans of the"
                f" response, in order, within its {len(row['response'])} characters; got {span!r}"
            )
        end_before = span[1]


def sft_pairs(
    task: Task, sft_file: str | None, n_examples: int | None, seed: int, keep=None
) -> list[dict]:
    """The SFT pairs {"prompt", "response", "example"}: sft_file's rows, or each dataset's worked
    solutions in its template. keep(pair) -> bool filters them first (e.g. the verifier accepts the
    response); then mix_pairs."""
    if sft_file:
        # keep() scores the response again: it needs the gold and the verifier
        fields = ("prompt", "response", "answer", "verifier") if keep else ("prompt", "response")
        rows = read_sft_file(sft_file, fields)
        pairs = []
        for r in rows:
            pair = {"prompt": r["prompt"], "response": r["response"], "example": r}
            # a tool's output in the response (ladder.py's calculator traces): out of the loss
            pairs.append({**pair, "tool_spans": r.get("tool_spans", [])})
        pair_sets = [pairs]
        weights = [1.0]
    else:
        if "ifeval" in task.names:
            raise ValueError(
                "ifeval has no worked solutions to fine-tune on: leave it out, or give --sft-file"
            )
        pair_sets = []
        for name in task.names:
            examples = [{**ex, "dataset": name} for ex in load(name, "train", task.data_dir)]
            pairs = []
            for ex in examples:
                pair = {"prompt": task.prompt(ex), "response": task.response(ex), "example": ex}
                pairs.append(pair)
            pair_sets.append(pairs)
        weights = task.weights
    if keep:
        pair_sets = [[p for p in pairs if keep(p)] for pairs in pair_sets]
    return mix_pairs(pair_sets, weights, n_examples, seed)


def mix_pairs(
    pair_sets: list[list[dict]], weights: list[float], n_examples: int | None, seed: int
) -> list[dict]:
    """One dataset: its first n_examples pairs (all if None). A mixture: dataset d gives
    floor(n w_d / sum(w)) pairs, a random subset drawn from (seed, d), where n is n_examples, or
    else the largest n for which no dataset runs out (each pair then used at most once an epoch).
    The datasets' pairs are concatenated, one dataset after another: batch_order shuffles them, so
    each batch holds the weights' shares on average."""
    if len(pair_sets) == 1:
        return pair_sets[0][:n_examples]
    shares = [weight / sum(weights) for weight in weights]
    pairs_and_shares = list(zip(pair_sets, shares, strict=True))
    n = n_examples or int(min(len(pairs) / share for pairs, share in pairs_and_shares if share))
    mixed = []
    for d, (pairs, share) in enumerate(pairs_and_shares):
        if int(n * share) > len(pairs):
            raise ValueError(
                f"{n} examples: dataset {d + 1} of the mixture has {len(pairs)}, its weight asks for "
                f"{int(n * share)}; lower --n-examples"
            )
        permutation = np.random.default_rng([seed, d]).permutation(len(pairs))
        mixed += [pairs[i] for i in permutation[: int(n * share)]]
    return mixed


def batch_order(n_pairs: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The pairs of SFT step `step`: a fresh permutation per epoch from (seed, epoch), so a resumed
    run sees exactly the batches an uninterrupted one would (an epoch's last partial batch is left
    out)."""
    epoch, k = divmod(step, n_pairs // batch_size)
    permutation = np.random.default_rng([seed, epoch]).permutation(n_pairs)
    return permutation[k * batch_size : (k + 1) * batch_size].tolist()
