"""Tests for verifiers.py: tables of answers that must score 1, hacks that must score 0, and the
datasets' own solutions scored against their own golds (the datasets are read with json directly,
not through data.py).

Counts on the local copies (asserted below): GSM8K test 1319/1319 solutions score 1 against their
"#### N"; MATH-500 500/500 solutions score 1 against the last \\boxed{} of the solution and 500/500
against the dataset's own `answer` field (which equals that last \\boxed{} on every row). Misses
found and fixed or documented: none.
"""

import json
import threading
import time

import pytest
from conftest import data_root

import verifiers


def gsm8k(response, gold="18"):
    return verifiers.score(
        response, {"id": "t", "prompt": "q", "answer": gold, "verifier": "gsm8k"}
    )


def math(response, gold):
    return verifiers.score(response, {"id": "t", "prompt": "q", "answer": gold, "verifier": "math"})


def synthetic(response, gold="29"):
    return verifiers.score(
        response, {"id": "t", "prompt": "q", "answer": gold, "verifier": "synthetic"}
    )


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- GSM8K: (response, gold, reward, format_reward) ---

GSM8K_CASES = [
    (" 16 - 3 - 4 = 9 eggs, 9 * 2 = 18 </think> <answer> 18 </answer>", "18", 1, 1),
    ("She makes 9 * 2 = $18.\n#### 18", "18", 1, 1),
    ("#### 18\n\nQuestion: a hallucinated next question", "18", 1, 1),
    ("####18", "18", 1, 1),
    ("#### 18.", "18", 1, 1),
    ("<answer>$18</answer>", "18", 1, 1),
    (r"<answer>\$18</answer>", "18", 1, 1),
    ("<answer>$18$</answer>", "18", 1, 1),
    (r"<answer>\boxed{18}</answer>", "18", 1, 1),
    (r"#### \boxed{18}", "18", 1, 1),
    ("<answer>18%</answer>", "18", 1, 1),  # percent sign dropped, not divided by 100 (documented)
    (r"<answer>18\%</answer>", "18", 1, 1),
    ("<answer>18.00</answer>", "18", 1, 1),
    ("<answer>1.50</answer>", "1.5", 1, 1),
    ("<answer>.5</answer>", "0.5", 1, 1),
    ("<answer>1,800</answer>", "1800", 1, 1),
    ("<answer>$1,234,567.50</answer>", "1234567.5", 1, 1),
    ("<answer>\u22123.5</answer>", "-3.5", 1, 1),  # unicode minus
    ("<answer>-0</answer>", "0", 1, 1),
    ("<answer>+7</answer>", "7", 1, 1),
    ("<answer>19</answer>", "18", 0, 1),
    ("<answer>-18</answer>", "18", 0, 1),  # sign matters (open-instruct PR #1530)
    ("<answer>0.30000001</answer>", "0.3", 0, 1),  # exact comparison, no float tolerance
    ("<answer>18 dollars</answer>", "18", 0, 0),
    # lm-eval's strict-match would read 18 here; we want one answer, nothing else
    ("#### 18 dollars", "18", 0, 0),
    ("<answer>1,80</answer>", "180", 0, 0),  # bad thousands grouping
    ("<answer>1e3</answer>", "1000", 0, 0),
    ("<answer>1_000</answer>", "1000", 0, 0),
    # Arabic-Indic digits: Fraction() would accept them
    ("<answer>\u0661\u0668</answer>", "18", 0, 0),
    # GSM8K answers are decimals; fractions are not parsed
    (r"<answer>\frac{36}{2}</answer>", "18", 0, 0),
]


@pytest.mark.parametrize(("response", "gold", "reward", "format_reward"), GSM8K_CASES)
def test_gsm8k_table(response, gold, reward, format_reward):
    result = gsm8k(response, gold)
    assert (result["reward"], result["format_reward"]) == (reward, format_reward)
    assert result["answer_reward"] == result["reward"] <= result["format_reward"]


def test_gsm8k_flexible_is_lm_eval_flexible_extract():
    # The question echoed with no answer marker: strict finds nothing even though the gold's number
    # is there.
    echo = "Janet's ducks lay 16 eggs. She makes 9 * 2 = $18 every day at the farmers' market"
    result = gsm8k(echo)
    assert (result["reward"], result["format_reward"], result["extracted"]) == (0, 0, None)
    assert (result["flexible_reward"], result["flexible_extracted"]) == (1, "18")
    # flexible takes the LAST number-like token, after lm-eval's cleaning of "," "$" and a trailing
    # "."
    assert gsm8k("first 18, then $1,234.")["flexible_extracted"] == "1234"
    assert gsm8k("no numbers here")["flexible_extracted"] is None


def test_extracted_is_canonical_for_majority_vote():
    forms = [
        "<answer>18</answer>",
        "<answer>18.0</answer>",
        "<answer>$18</answer>",
        "#### 18.",
        "#### 1,8.00",
    ]
    assert {gsm8k(r)["extracted"] for r in forms[:4]} == {"18"}
    assert gsm8k(forms[4])["extracted"] is None
    assert gsm8k("<answer>-3.50</answer>", "-3.5")["extracted"] == "-3.5"
    assert {
        math(r, "1/2")["extracted"]
        for r in [r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{1/2}"]
    } == {"0.5"}
    assert math(r"\boxed{\dfrac{1}{3}}", "1/3")["extracted"] == "1/3"


# --- MATH: (response, gold, reward) ---

MATH_CASES = [
    (r"so $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1),
    (r"\boxed{.5}", "0.5", 1),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}", 1),
    (r"\boxed{\tfrac{1}{2}}", r"\frac12", 1),
    (r"\fbox{42}", "42", 1),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1),
    (
        r" ... </think> <answer> \left( 3, \frac{\pi}{2} \right) </answer>",
        r"\left( 3, \frac{\pi}{2} \right)",
        1,
    ),
    (r"<answer>(3,\frac{\pi}{2})</answer>", r"\left( 3, \frac{\pi}{2} \right)", 1),
    (r"<answer> $\frac{1}{2}$ </answer>", r"\frac{1}{2}", 1),
    ("The solution is $\\boxed{18}$.\n#### 18", "18", 1),  # data.py's chat format for MATH
    ("#### Step 1: add\n2 + 3 = 5\n#### Step 2: answer\n$\\boxed{5}$", "5", 1),  # markdown headings
    (r"#### \frac{1}{2}", "0.5", 1),
    # an empty box falls through (2 MATH train rows do this)
    ("there are $\\boxed{}$ primes.\n#### 0", "0", 1),
    (r"\boxed{10\text{ cm}}", "10", 1),
    (r"\boxed{864 \mbox{ inches}^2}", "864", 1),
    (r"\boxed{90^\circ}", "90", 1),
    (r"\boxed{90^{\circ}}", r"90^\circ", 1),
    (r"\boxed{5}", "x=5", 1),
    (r"\boxed{x = 5}", "5", 1),
    (r"\boxed{2x + 3}", "y = 2x + 3", 1),
    (r"\boxed{[-2, 7]}", r"x \in [-2,7]", 1),
    (r"\boxed{(3, 4]}", "(3,4]", 1),
    (r"\boxed{-2, 1}", "1,-2", 1),  # "find all solutions": any order
    (r"\boxed{\{-2, 1\}}", r"\{1,-2\}", 1),
    (r"\boxed{(6, 31, -1)}", "(6,31,-1)", 1),
    (
        r"\boxed{\begin{pmatrix} -\frac13 \\ \frac23 \end{pmatrix}}",
        r"\begin{pmatrix} -1/3 \\ 2/3 \end{pmatrix}",
        1,
    ),
    (r"\boxed{10080}", r"10,\!080", 1),
    (r"\boxed{\$18.90}", "18.9", 1),
    (r"\boxed{\text{(C)}}", "C", 1),
    (r"\boxed{\textbf{(C)}}", r"\text{(C)}", 1),
    (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", 1),
    (r"\boxed{275/2}", r"137 \frac{1}{2}", 1),  # mixed number
    ("\\boxed{\u22125}", "-5", 1),
    (r"\boxed{4210_{5}}", "4210_5", 1),
    (r"\boxed{(3, 4)}", "(3,4]", 0),  # brackets matter for intervals
    (r"\boxed{(1, -2)}", "1,-2", 0),  # an ordered pair is not the list of solutions
    (r"\boxed{0.333333}", r"\frac{1}{3}", 0),  # exact: no float tolerance
    (r"\boxed{0.3333333333333333}", r"\frac{1}{3}", 0),
    (r"\boxed{x}", "x=5", 0),
    (r"\boxed{\frac{1}{0}}", "1", 0),
    # Deliberately not handled (symbolic equivalence needs sympy; see the module docstring):
    (r"\boxed{\frac{1}{\sqrt{3}}}", r"\frac{\sqrt{3}}{3}", 0),
    (r"\boxed{\sqrt{117}}", r"3\sqrt{13}", 0),
]


@pytest.mark.parametrize(("response", "gold", "reward"), MATH_CASES)
def test_math_table(response, gold, reward):
    result = math(response, gold)
    assert result["reward"] == reward
    assert result["format_reward"] == 1
    assert result["answer_reward"] == result["reward"]


def test_equal_extracted_means_equal_reward():
    # eval.py's maj@k relies on this: the reward of the winning `extracted` is the reward of any
    # sample carrying it.
    for cases, scorer in [(GSM8K_CASES, gsm8k), (MATH_CASES, math)]:
        for gold in {case[1] for case in cases}:
            reward_of = {}
            for case in cases:
                result = scorer(case[0], gold)
                if result["extracted"] is not None:
                    assert (
                        reward_of.setdefault(result["extracted"], result["reward"])
                        == result["reward"]
                    )


def test_synthetic():
    assert synthetic("<answer>29</answer>")["reward"] == 1
    assert synthetic("23 + 15 = 38. 38 - 9 = 29.\n#### 29")["reward"] == 1
    assert synthetic("<answer> \u22127 </answer>", "-7")["reward"] == 1
    for not_an_integer in [
        "<answer>29.0</answer>",
        "<answer>$29</answer>",
        "<answer>2,9</answer>",
        "29",
    ]:
        assert synthetic(not_an_integer)["format_reward"] == 0, not_an_integer
    assert synthetic("<answer>30</answer>") == {
        "reward": 0,
        "format_reward": 1,
        "answer_reward": 0,
        "extracted": "30",
    }


# --- Red team: hacks a policy will find. Each must score 0 (response, verifier, gold) ---

SPAM_TAGS = "".join(f"<answer>{i}</answer>" for i in range(1, 101))
SPAM_HASHES = " ".join(f"#### {i}" for i in range(1, 101))
RED_TEAM = [
    ("", "gsm8k", "18"),
    ("", "math", "18"),
    ("", "synthetic", "18"),
    ("   \n ", "gsm8k", "18"),
    # Several answers: only the LAST marker counts, so an early right answer is overridden.
    ("<answer>18</answer> wait, no: <answer>19</answer>", "gsm8k", "18"),
    ("#### 18\n#### 19", "gsm8k", "18"),
    (r"\boxed{18} or maybe \boxed{19}", "math", "18"),
    (r"<answer>\boxed{18}\boxed{19}</answer>", "gsm8k", "18"),
    # a tag takes precedence over "####": 18 is scored
    ("<answer>18</answer>\n#### 19", "synthetic", "19"),
    ("\\boxed{18}\n#### 19", "math", "19"),  # for MATH a \boxed{} takes precedence over "####"
    # Spam: one scored answer (the last: 100), so listing 1..100 earns what "100" alone earns.
    (SPAM_TAGS, "gsm8k", "42"),
    (SPAM_HASHES, "gsm8k", "42"),
    (SPAM_TAGS, "synthetic", "42"),
    (SPAM_TAGS.replace("answer>", r"answer>\boxed{").replace(r"</\boxed{", "}</"), "math", "42"),
    # Hedging inside one marker: the content must be ONE answer.
    ("<answer>17, 18, 19</answer>", "gsm8k", "18"),
    ("<answer>18 or 19</answer>", "gsm8k", "18"),
    ("<answer>18 19</answer>", "gsm8k", "18"),
    ("<answer>18\n19</answer>", "gsm8k", "18"),
    ("<answer>[18, 19]</answer>", "gsm8k", "18"),
    ("<answer>18, 19</answer>", "synthetic", "18"),
    (r"\boxed{18, 19}", "math", "18"),
    (r"\boxed{18 \text{ or } 19}", "math", "18"),
    (r"\boxed{18\text{ or 19}}", "math", "18"),  # a \text{} with digits is not a unit
    (r"\boxed{18 \pm 1}", "math", "18"),
    # The gold's number in an echo of the question, with no marker (flexible would match; strict
    # must not).
    ("She sells 9 eggs at $2: 9 * 2 = 18", "gsm8k", "18"),
    ("Janet's ducks lay 16 eggs per day. 18", "synthetic", "18"),
    (r"The answer is $\frac{1}{2}$.", "math", r"\frac{1}{2}"),
    # Broken markers.
    # unclosed: keep "</answer>" in the output (include_stop_str_in_output)
    ("<answer> 18", "gsm8k", "18"),
    ("<answer></answer>", "gsm8k", "18"),
    (r"\boxed{}", "math", "18"),
    (r"\boxed{18", "math", "18"),
    (r"<answer>\boxed{</answer>", "math", "18"),
    ("####", "gsm8k", "18"),
    # longer than MAX_ANSWER_CHARS: not one answer
    ("<answer>" + "1" * 10_000 + "</answer>", "gsm8k", "18"),
]


@pytest.mark.parametrize(("response", "verifier", "gold"), RED_TEAM)
def test_red_team_scores_zero(response, verifier, gold):
    result = verifiers.score(response, {"answer": gold, "verifier": verifier})
    assert result["reward"] == 0 and result["answer_reward"] == 0


def test_only_the_last_answer_counts():
    assert gsm8k("<answer>19</answer> let me check again <answer>18</answer>")["reward"] == 1
    strict_keys = ("reward", "format_reward", "answer_reward", "extracted")
    spam, single = gsm8k(SPAM_TAGS, "100"), gsm8k("<answer>100</answer>", "100")
    assert [spam[k] for k in strict_keys] == [single[k] for k in strict_keys] == [1, 1, 1, "100"]
    assert gsm8k(SPAM_HASHES, "100")["extracted"] == "100"
    assert math(r"\boxed{19} no, \boxed{18}", "18")["reward"] == 1


@pytest.mark.parametrize("gold", ["", "   "])
@pytest.mark.parametrize("verifier", ["gsm8k", "math", "synthetic"])
def test_empty_gold_raises(verifier, gold):
    with pytest.raises(ValueError):
        verifiers.score("<answer></answer>", {"answer": gold, "verifier": verifier})


@pytest.mark.parametrize(
    ("verifier", "gold"), [("gsm8k", "eighteen"), ("gsm8k", "$"), ("synthetic", "1.5")]
)
def test_unparsable_gold_raises(verifier, gold):
    with pytest.raises(ValueError):
        verifiers.score("<answer>18</answer>", {"answer": gold, "verifier": verifier})


def test_unknown_verifier_lists_valid_ones():
    with pytest.raises(ValueError, match="gsm8k.*math.*synthetic"):
        verifiers.score("18", {"answer": "18", "verifier": "mbpp"})


def test_returned_keys():
    assert set(math(r"\boxed{1}", "1")) == {"reward", "format_reward", "answer_reward", "extracted"}
    assert set(gsm8k("#### 18")) == {"reward", "format_reward", "answer_reward", "extracted"} | {
        "flexible_reward",
        "flexible_extracted",
    }


def test_safe_off_the_main_thread():
    # No signals (unlike math_verify's timeout), so a trainer or eval may score from worker threads.
    results = []
    thread = threading.Thread(
        target=lambda: results.append(math(r"\boxed{9^{9^{9^{9}}}}", "1")["reward"])
    )
    thread.start()
    thread.join(timeout=5)
    assert results == [0.0]


# --- Megabyte responses: a guard against catastrophic regexes and quadratic scans ---

MB = 1_000_000
ADVERSARIAL = {
    "digits": "1" * MB,
    "spaced_digits": "1 " * (MB // 2),
    "unclosed_tags": "<answer>" * (MB // 8),
    "closing_tags": "</answer>" * (MB // 9),
    "tag_spam": "<answer>1</answer>" * (MB // 17),
    "huge_tag": "<answer>" + "1" * MB + "</answer>",
    "unbalanced_boxed": r"\boxed{" * (MB // 7),
    "boxed_then_braces": r"\boxed{" + "{" * MB,
    "boxed_spam": r"\boxed{1}" * (MB // 9),
    "commas_dots": ",." * (MB // 2),
    "hashes": "####" * (MB // 4),
    "hash_then_commas": "#### " + "1," * (MB // 2),
    "dollars_minus": "$-" * (MB // 2),
    "parens_in_tag": "<answer>" + "(" * MB + "</answer>",
    "newlines": "\n" * MB,
}


@pytest.mark.parametrize("kind", ADVERSARIAL)
@pytest.mark.parametrize(
    ("verifier", "gold"), [("gsm8k", "18"), ("math", r"\frac{1}{2}"), ("synthetic", "18")]
)
def test_megabyte_response_is_fast(kind, verifier, gold):
    start = time.perf_counter()
    result = verifiers.score(ADVERSARIAL[kind], {"answer": gold, "verifier": verifier})
    assert time.perf_counter() - start < 1.0
    assert result["reward"] == 0


# --- The datasets' own solutions must score 1 against their own golds ---


def test_every_gsm8k_test_solution_scores_one():
    rows = read_jsonl(data_root() / "gsm8k" / "test.jsonl")
    misses = []
    for row in rows:
        gold = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        if gsm8k(row["answer"], gold)["reward"] != 1:
            misses.append(row["answer"][-60:])
    assert (len(rows), misses) == (1319, [])


def test_every_math500_solution_scores_one():
    rows = read_jsonl(data_root() / "math" / "math500.jsonl")
    against_boxed = sum(
        math(row["solution"], verifiers.last_boxed_in_response(row["solution"]))["reward"]
        for row in rows
    )
    # The dataset's own `answer` field equals the last \boxed{} of the solution on all 500 rows: no
    # misses.
    against_answer_field = [
        row["unique_id"] for row in rows if math(row["solution"], row["answer"])["reward"] != 1
    ]
    assert (len(rows), against_boxed, against_answer_field) == (500, 500, [])
