"""Tests for the IFEval reward (verifiers.py), its data (data.py) and parity with
lm-evaluation-harness.

1. A table per instruction type: responses that pass and that fail, strict and loose.
2. Determinism: the same response scored 100 times gets one reward (langdetect is seeded).
3. Differential test: our verdicts equal lm-eval 0.4.13's (lm_eval/tasks/ifeval, loaded by path) on
the 541
   prompts with rule-made responses each. Exceptions, where the reference cannot run offline or
   deterministically:
     - number_sentences: the reference counts with nltk's punkt model, which it downloads at run
     time (no network
       here). Its count_sentences is replaced by ours (verifiers.ifeval_sentences), so the test
       compares the rest.
     - capital_word_frequency: the reference's nltk.word_tokenize needs punkt too. It runs with
       preserve_line=True (Treebank rules without the punkt sentence split), which our tokenizer
       must match.
     - language, english_capital, english_lowercase: langdetect is random unless seeded; both sides
     run seeded.
"""

import importlib.util
import json
import logging
import math
import random
import sys
import types
from pathlib import Path

import pytest
from conftest import data_root
from transformers import AutoModelForCausalLM

import data
import verifiers


def ifeval(response, instruction_id, **kwargs):
    """(strict, loose) verdicts of one instruction."""
    result = verifiers.score(
        response,
        {
            "verifier": "ifeval",
            "answer": {"instruction_id_list": [instruction_id], "kwargs": [kwargs]},
        },
    )
    return result["strict"][0], result["loose"][0]


HERE = "Sure, here is my answer:\n"  # a chatty first line: fails strict, the loose check removes it
ENGLISH = (
    "the quick brown fox jumps over the lazy dog and then it runs far away into the green forest"
)
# (instruction id, kwargs, response, strict verdict, loose verdict)
CASES = [
    ("keywords:existence", {"keywords": ["fox", "dog"]}, "A fox met a dog.", True, True),
    ("keywords:existence", {"keywords": ["fox", "cat"]}, "A fox met a dog.", False, False),
    ("keywords:existence", {"keywords": ["fox"]}, "A *f*ox.", False, True),
    (
        "keywords:frequency",
        {"keyword": "tea", "frequency": 2, "relation": "at least"},
        "tea, Tea",
        True,
        True,
    ),
    (
        "keywords:frequency",
        {"keyword": "tea", "frequency": 2, "relation": "at least"},
        "tea",
        False,
        False,
    ),
    (
        "keywords:frequency",
        {"keyword": "tea", "frequency": 2, "relation": "less than"},
        "tea tea",
        False,
        False,
    ),
    (
        "keywords:frequency",
        {"keyword": "tea", "frequency": 2, "relation": "less than"},
        "tea\nok\ntea",
        False,
        True,
    ),
    ("keywords:forbidden_words", {"forbidden_words": ["rock"]}, "rocks are hard", True, True),
    ("keywords:forbidden_words", {"forbidden_words": ["rock"]}, "A Rock.", False, False),
    ("keywords:forbidden_words", {"forbidden_words": ["rock"]}, "rock on:\nno stones", False, True),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 2, "let_relation": "at least"},
        "Zz",
        True,
        True,
    ),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 2, "let_relation": "less than"},
        "zz",
        False,
        False,
    ),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 2, "let_relation": "less than"},
        "zz\nok",
        False,
        True,
    ),
    (
        "language:response_language",
        {"language": "de"},
        "Das ist ein kleines Haus und wir wohnen gern hier.",
        True,
        True,
    ),
    ("language:response_language", {"language": "de"}, ENGLISH, False, False),
    # undetectable counts as followed
    ("language:response_language", {"language": "de"}, "12345 !!!", True, True),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": "less than"},
        "One. Two!",
        True,
        True,
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 2, "relation": "less than"},
        "A. B? C.",
        False,
        False,
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": "less than"},
        "Hi. Yo.\nA. B.",
        False,
        True,
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": "at least"},
        'He said "no." Yes. Ok.',
        True,
        True,
    ),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "One.\n***\nTwo.", True, True),
    (
        "length_constraints:number_paragraphs",
        {"num_paragraphs": 2},
        "One.\n***\n***\nTwo.",
        False,
        False,
    ),
    (
        "length_constraints:number_paragraphs",
        {"num_paragraphs": 2},
        "One.\n***\nTwo.\n***\nThree",
        False,
        True,
    ),
    (
        "length_constraints:number_words",
        {"num_words": 3, "relation": "less than"},
        "two words",
        True,
        True,
    ),
    (
        "length_constraints:number_words",
        {"num_words": 3, "relation": "at least"},
        "two words",
        False,
        False,
    ),
    (
        "length_constraints:number_words",
        {"num_words": 3, "relation": "less than"},
        "a b c\nd e",
        False,
        True,
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\n'Then, more.",
        True,
        True,
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\nNow more.",
        False,
        False,
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\n**Then** more.",
        False,
        True,
    ),
    (
        "detectable_content:number_placeholders",
        {"num_placeholders": 2},
        "[name] at [address]",
        True,
        True,
    ),
    (
        "detectable_content:number_placeholders",
        {"num_placeholders": 2},
        "[name] at address",
        False,
        False,
    ),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\n\nP.S. bye", True, True),
    (
        "detectable_content:postscript",
        {"postscript_marker": "P.P.S"},
        "Hi.\n\nP.S. bye",
        False,
        False,
    ),
    (
        "detectable_content:postscript",
        {"postscript_marker": "P.S."},
        "Hi.\n\nP*.S. bye",
        False,
        True,
    ),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n- b", True, True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a", False, False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "- Sure:\n* a\n* b", False, True),
    ("detectable_format:constrained_response", {}, "My answer is no.", True, True),
    ("detectable_format:constrained_response", {}, "My answer is nope.", False, False),
    ("detectable_format:constrained_response", {}, "My answer is **yes**.", False, True),
    (
        "detectable_format:number_highlighted_sections",
        {"num_highlights": 2},
        "*a* and **b**",
        True,
        True,
    ),
    (
        "detectable_format:number_highlighted_sections",
        {"num_highlights": 2},
        "*a* and * *",
        False,
        False,
    ),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nA\nSection 2\nB",
        True,
        True,
    ),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nA\nSECTION 2\nB",
        False,
        False,
    ),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', True, True),
    ("detectable_format:json_format", {}, '{"a": 1,}', False, False),
    ("detectable_format:json_format", {}, HERE + '{"a": 1}', False, True),
    ("detectable_format:title", {}, "<<My Title>>\nText", True, True),
    ("detectable_format:title", {}, "<< >>\n<My Title>", False, False),
    ("combination:two_responses", {}, "Yes.\n******\nNo.", True, True),
    ("combination:two_responses", {}, "Yes.\n******\nYes.", False, False),
    ("combination:two_responses", {}, "Yes.\n******\n\n******\nNo.", False, False),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, "say hi. Hi!", True, True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, "Hi! Say hi.", False, False),
    (
        "combination:repeat_prompt",
        {"prompt_to_repeat": "Say hi."},
        HERE + "Say hi. Hi!",
        False,
        True,
    ),
    (
        "startend:end_checker",
        {"end_phrase": "Any questions?"},
        'Done. "Any questions?"',
        True,
        True,
    ),
    ("startend:end_checker", {"end_phrase": "Any questions?"}, "Any questions? Bye.", False, False),
    (
        "startend:end_checker",
        {"end_phrase": "Any questions?"},
        "Done. Any questions?\nCheers",
        False,
        True,
    ),
    ("startend:quotation", {}, '"All of it."', True, True),
    ("startend:quotation", {}, '"', False, False),
    ("startend:quotation", {}, HERE + '"All of it."', False, True),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "at least"},
        "I'M SO happy",
        True,
        True,
    ),  # I, M, SO: Treebank splits "I'M" into I and 'M
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "less than"},
        "DON'T go",
        False,
        False,
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "less than"},
        "NOTE THIS\nok ABC",
        False,
        True,
    ),
    ("change_case:english_capital", {}, ENGLISH.upper(), True, True),
    ("change_case:english_capital", {}, ENGLISH.upper() + " x", False, False),
    ("change_case:english_capital", {}, "Sure\n" + ENGLISH.upper(), False, True),
    (
        "change_case:english_capital",
        {},
        "DAS IST EIN KLEINES HAUS UND WIR WOHNEN GERN HIER",
        False,
        False,
    ),
    ("change_case:english_lowercase", {}, ENGLISH, True, True),
    ("change_case:english_lowercase", {}, "The " + ENGLISH, False, False),
    ("change_case:english_lowercase", {}, "Sure!\n" + ENGLISH, False, True),
    ("punctuation:no_comma", {}, "No commas here.", True, True),
    ("punctuation:no_comma", {}, "One, two.", False, False),
    ("punctuation:no_comma", {}, "Sure, here:\nNo commas here.", False, True),
]


@pytest.mark.parametrize(("instruction_id", "kwargs", "response", "strict", "loose"), CASES)
def test_instruction_table(instruction_id, kwargs, response, strict, loose):
    assert ifeval(response, instruction_id, **kwargs) == (strict, loose)


def test_every_type_passes_and_fails_strict_and_loose():
    types_in_data = {
        i
        for line in open(data_root() / "ifeval/input_data.jsonl")
        for i in json.loads(line)["instruction_id_list"]
    }
    assert set(verifiers.IFEVAL_CHECKERS) == types_in_data and len(types_in_data) == 25
    for instruction_id in types_in_data:
        verdicts = {(strict, loose) for i, _, _, strict, loose in CASES if i == instruction_id}
        assert {True, False} <= {s for s, _ in verdicts} and {True, False} <= {
            lo for _, lo in verdicts
        }, instruction_id


def test_prompt_reward_all_or_fraction_and_empty_response():
    gold = {
        "instruction_id_list": ["punctuation:no_comma", "startend:quotation"],
        "kwargs": [{}, {}],
    }
    example = {"verifier": "ifeval", "answer": gold}
    assert verifiers.score('"no commas"', example)["reward"] == 1.0
    assert verifiers.score("no commas", example)["reward"] == 0.0
    assert (
        verifiers.score("no commas", {**example, "answer": {**gold, "partial_credit": True}})[
            "reward"
        ]
        == 0.5
    )
    # follows "no commas" vacuously, but an empty response follows nothing
    empty = verifiers.score("  ", example)
    assert empty["strict"] == empty["loose"] == [False, False] and empty["format_reward"] == 0.0


def test_same_response_same_reward_100_times():
    """langdetect unseeded answered "NO WAY" with Polish or Slovenian at random; seeded it is one
    answer."""
    gold = {
        "instruction_id_list": ["language:response_language", "change_case:english_capital"],
        "kwargs": [{"language": "pl"}, {}],
    }
    rewards, languages = set(), set()
    for _ in range(100):
        verifiers.ifeval_language.cache_clear()  # a fresh detection each time, not the cached one
        rewards.add(json.dumps(verifiers.score("NO WAY", {"verifier": "ifeval", "answer": gold})))
        verifiers.ifeval_language.cache_clear()
        languages.add(verifiers.ifeval_language("NO WAY"))
    assert len(rewards) == 1 and len(languages) == 1


# --- Differential test against lm-evaluation-harness (test-only dependency: requirements-test.txt) ---


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """lm-eval's ifeval utils module (process_results), loaded by path: lm_eval's package init
    imports torch & co.

    Offline and deterministic as in the module docstring: an empty punkt_tab folder stops its
    import-time nltk.download, count_sentences is ours, word_tokenize skips punkt, langdetect is
    seeded.
    """
    spec = importlib.util.find_spec("lm_eval")
    if spec is None:
        pytest.skip("lm-eval not installed: pip install -r requirements-test.txt")
    import nltk

    folder = Path(spec.origin).parent / "tasks" / "ifeval"
    nltk_data = tmp_path_factory.mktemp("nltk_data")
    (nltk_data / "tokenizers" / "punkt_tab").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nltk.data, "path", [str(nltk_data)])
        # empty parents: no package init runs
        for name in ("lm_eval", "lm_eval.tasks", "lm_eval.tasks.ifeval"):
            mp.setitem(sys.modules, name, types.ModuleType(name))
        for name in ("instructions_util", "instructions", "instructions_registry", "utils"):
            module_spec = importlib.util.spec_from_file_location(
                f"lm_eval.tasks.ifeval.{name}", folder / f"{name}.py"
            )
            module = importlib.util.module_from_spec(module_spec)
            mp.setitem(sys.modules, module_spec.name, module)
            setattr(sys.modules["lm_eval.tasks.ifeval"], name, module)
            module_spec.loader.exec_module(module)
        util = sys.modules["lm_eval.tasks.ifeval.instructions_util"]
        reference_utils = sys.modules["lm_eval.tasks.ifeval.utils"]
    util.count_sentences = verifiers.ifeval_sentences
    # "Unable to detect language"
    logging.getLogger("lm_eval.tasks.ifeval.instructions").setLevel(logging.CRITICAL)
    word_tokenize = nltk.word_tokenize
    nltk.word_tokenize = lambda text: word_tokenize(text, preserve_line=True)
    yield reference_utils
    nltk.word_tokenize = word_tokenize


def reference_is_random(kwargs):
    """IFEval prompt 1122 asks for at least 4 '#': the reference replaces a letter outside a-z by
    random.choice (unseeded) of all letters, so its verdict is random; ours counts '#'. Left out of
    the comparison."""
    return "letter" in kwargs and not ("a" <= kwargs["letter"].lower() <= "z")


def both(reference, response, example):
    """(ours, reference's): each a tuple of strict and loose per-instruction verdict lists."""
    ours = verifiers.score(response, example)
    doc = {"key": 0, "prompt": example["prompt"], **example["answer"]}
    theirs = reference.process_results(doc, [response])
    keep = [not reference_is_random(kw) for kw in example["answer"]["kwargs"]]
    ours = tuple(
        [v for v, k in zip(ours[key], keep, strict=True) if k] for key in ("strict", "loose")
    )
    theirs = tuple(
        [v for v, k in zip(theirs[key], keep, strict=True) if k]
        for key in ("inst_level_strict_acc", "inst_level_loose_acc")
    )
    return ours, theirs


def test_capital_words_as_nltk_treebank(reference):
    import nltk

    for text in [
        "CANNOT",
        "O'NEIL",
        "A+B",
        "ROCK'N'ROLL",
        "I'M",
        "DON'T.",
        "U.S.A.",
        "A--B",
        "A..B",
        "GONNA",
        "A*B",
        "JOHN'S",
        "'TIS",
        "HELLO_WORLD",
        "**BOLD**",
        "A/B",
        "RE: X'",
        "'QUOTE'",
        "E-MAIL.",
        "HELLO...WORLD",
        "A;B A,1 WE'LL THEY'RE YOU'VE I'D",
        "THIS IS, I THINK, FINE (OK?) 1ST [A] {B} <C> #D $E %F &G @H",
    ]:
        expected = sum(
            word.isupper() for word in nltk.tokenize.word_tokenize(text, preserve_line=True)
        )
        assert verifiers.ifeval_capital_words(text) == expected, text


def test_table_matches_reference(reference):
    for instruction_id, kwargs, response, _, _ in CASES:
        example = {
            "prompt": "",
            "verifier": "ifeval",
            "answer": {"instruction_id_list": [instruction_id], "kwargs": [kwargs]},
        }
        ours, theirs = both(reference, response, example)
        assert ours == theirs, (instruction_id, kwargs, response)


WORDS = [
    "the",
    "answer",
    "is",
    "simple",
    "so",
    "we",
    "add",
    "two",
    "numbers",
    "and",
    "check",
    "total",
    "value",
    "care",
]
FOREIGN = {
    "de": "Das ist ein kleines Haus und wir wohnen sehr gern hier mit unseren Kindern.",
    "fr": "Nous avons vérifié le résultat deux fois et la réponse est toujours la même.",
    "es": "La respuesta es muy sencilla porque sumamos los dos números con mucho cuidado.",
    "hi": "उत्तर बहुत सरल है क्योंकि हमने दोनों संख्याओं को ध्यान से जोड़ा है।",
    "ru": "Ответ очень простой, потому что мы внимательно сложили два числа.",
}


def sentences(rng, n):
    return " ".join(
        " ".join(rng.choices(WORDS, k=rng.randint(3, 9))).capitalize() + "." for _ in range(n)
    )


def apply(instruction_id, kw, text, follow, rng):
    """text changed to follow (follow=True) or to break one instruction, the way a model would."""
    name, k = instruction_id.split(":")[1], lambda n: n if follow else n + rng.choice([-1, 1])
    if "relation" in str(kw):  # a "less than N" instruction is followed by N-1 and broken by N
        relation = next(v for key, v in kw.items() if key.endswith("relation"))
        k = lambda n: (
            (n if follow else n - 1) if relation == "at least" else (n - 1 if follow else n)
        )
    ops = {
        "existence": lambda: text + " " + " ".join(kw["keywords"][: None if follow else -1]) + ".",
        "frequency": lambda: text + (" " + kw["keyword"]) * max(k(kw["frequency"]), 0),
        "forbidden_words": lambda: (
            text + (" " + kw["forbidden_words"][0].upper() if not follow else "")
        ),
        "letter_frequency": lambda: (
            text.replace(kw["letter"], "") + " " + kw["letter"] * k(kw["let_frequency"])
        ),
        "response_language": lambda: FOREIGN.get(kw["language"], text) if follow else text,
        "number_sentences": lambda: sentences(rng, max(k(kw["num_sentences"]), 1)),
        "number_paragraphs": lambda: "\n***\n".join(
            sentences(rng, 2) for _ in range(max(k(kw["num_paragraphs"]), 1))
        ),
        "number_words": lambda: " ".join(rng.choices(WORDS, k=max(k(kw["num_words"]), 1))),
        "nth_paragraph_first_word": lambda: "\n\n".join(
            (kw["first_word"].title() if i + 1 == kw["nth_paragraph"] and follow else "Then")
            + " "
            + sentences(rng, 2)
            for i in range(kw["num_paragraphs"])
        ),
        "number_placeholders": lambda: text + " [name]" * max(k(kw["num_placeholders"]), 0),
        "postscript": lambda: (
            text + ("\n\n" + kw["postscript_marker"] + " thanks" if follow else "\n\nPS thanks")
        ),
        "number_bullet_lists": lambda: (
            text + "".join(f"\n* point {i}" for i in range(max(k(kw["num_bullets"]), 0)))
        ),
        "constrained_response": lambda: "My answer is yes." if follow else "Yes, my answer is yes",
        "number_highlighted_sections": lambda: text + " *part*" * max(k(kw["num_highlights"]), 0),
        "multiple_sections": lambda: "\n".join(
            f"{kw['section_spliter']} {i + 1}\n{text}" for i in range(max(k(kw["num_sections"]), 0))
        ),
        "json_format": lambda: (
            f"```json\n{json.dumps({'answer': text})}\n```" if follow else "{answer: " + text + "}"
        ),
        "title": lambda: ("<<A title>>\n" if follow else "<A title>\n") + text,
        "two_responses": lambda: text + "\n******\n" + (sentences(rng, 2) if follow else text),
        "repeat_prompt": lambda: (kw["prompt_to_repeat"] + "\n" if follow else "") + text,
        "end_checker": lambda: text + " " + kw["end_phrase"] + ("" if follow else " Bye."),
        "quotation": lambda: f'"{text}"' if follow else f'"{text}',
        "capital_word_frequency": lambda: text + " NOTE" * max(k(kw["capital_frequency"]), 0),
        "english_capital": lambda: text.upper() if follow else text,
        "english_lowercase": lambda: text.lower() if follow else text.title(),
        "no_comma": lambda: text.replace(",", "") if follow else text + ", yes",
    }
    return ops[name]()


MUTATIONS = [
    lambda t: "Sure, here is my answer:\n" + t,
    lambda t: t + "\nI hope this helps!",
    lambda t: "**Answer**\n" + t + "\n**End**",
    lambda t: t.replace("*", ""),
    lambda t: t.upper(),
    lambda t: t.lower(),
    lambda t: f'"{t}"',
    lambda t: t[: len(t) // 2],
    lambda t: t.replace(". ", ", ", 1),
    lambda t: t.replace(" ", "\n\n", 2),
    lambda t: "I'M DONE. DON'T WORRY, U.S.A. CANNOT O'NEIL A-B A+B ROCK'N'ROLL.\n" + t,
    lambda t: 'Dr. Smith e.g. said hi... "Yes!" (Really?) 3.5 is it. Ok\n' + t,
]


def rule_made_responses(example, rng):
    """Responses to one prompt: following all its instructions, breaking each one, and common
    mutations."""
    ids, kwargs = example["answer"]["instruction_id_list"], example["answer"]["kwargs"]

    def compose(broken):
        text = sentences(rng, rng.randint(1, 6))
        for i, (instruction_id, kw) in enumerate(zip(ids, kwargs, strict=True)):
            text = apply(instruction_id, kw, text, i != broken, rng)
        return text

    follow = compose(None)
    return [
        follow,
        *(compose(i) for i in range(len(ids))),
        *(m(follow) for m in MUTATIONS),
        "",
        "  \n ",
    ]


def test_541_prompts_match_reference(reference):
    """Our strict and loose verdicts equal lm-eval's on every instruction of every response (~20 per
    prompt)."""
    rng = random.Random(0)
    n_responses, n_strict_followed, n_instructions, mismatches = 0, 0, 0, []
    for example in data.load("ifeval", "test", data_root()):
        for response in rule_made_responses(example, rng):
            ours, theirs = both(reference, response, example)
            n_responses += 1
            n_instructions += len(ours[0])
            n_strict_followed += sum(ours[0])
            if ours != theirs:
                mismatches.append((example["id"], example["answer"], response, ours, theirs))
    assert not mismatches, f"{len(mismatches)} of {n_responses} differ; first: {mismatches[:3]}"
    # both verdicts well represented
    assert n_responses > 541 * 15 and 0.3 < n_strict_followed / n_instructions < 0.8


# --- data.py: the test split and the offline training set ---


def test_test_split_is_the_541_prompts():
    examples = data.load("ifeval", "test", data_root())
    rows = [json.loads(line) for line in open(data_root() / "ifeval/input_data.jsonl")]
    assert len(examples) == 541 and [ex["id"] for ex in examples] == [
        str(row["key"]) for row in rows
    ]
    for ex, row in zip(examples, rows, strict=True):
        assert ex["prompt"] == row["prompt"] and ex["verifier"] == "ifeval"
        assert ex["answer"] == {
            "instruction_id_list": row["instruction_id_list"],
            "kwargs": row["kwargs"],
        }


def test_train_set_deterministic_compatible_and_disjoint_from_test():
    train = data.load("ifeval", "train", data_root())
    assert (
        train == data.load("ifeval", "train", data_root()) and len(train) == data.IFEVAL_TRAIN_SIZE
    )
    test_prompts = {ex["prompt"] for ex in data.load("ifeval", "test", data_root())}
    assert not test_prompts & {ex["prompt"] for ex in train}
    counts = {n: 0 for n in (1, 2, 3)}
    for ex in train:
        ids = ex["answer"]["instruction_id_list"]
        counts[len(ids)] += 1
        assert all(data.ifeval_compatible(a, b) for i, a in enumerate(ids) for b in ids[i + 1 :]), (
            ids
        )
        verifiers.score("x", ex)  # every sampled kwargs dict is one the checkers accept
    assert min(counts.values()) > 1000  # one, two and three instructions all common
    assert set(verifiers.IFEVAL_CHECKERS) == {
        i for ex in train for i in ex["answer"]["instruction_id_list"]
    }
    assert not data.ifeval_compatible(
        "change_case:english_capital", "change_case:english_lowercase"
    )
    assert not data.ifeval_compatible("detectable_format:json_format", "startend:quotation")
    assert data.ifeval_compatible("detectable_format:json_format", "keywords:existence")


def test_train_prompt_is_question_then_instructions():
    questions = ["What is 2 + 3?", "Name a prime.", "What is 7 * 6?"]
    a, b = (
        data.make_ifeval_train(questions, 3, seed=1),
        data.make_ifeval_train(questions, 3, seed=2),
    )
    assert a == data.make_ifeval_train(questions, 3, seed=1) and a != b
    for ex in a:
        assert ex["prompt"].split("\n")[0] in questions and ex["id"].startswith("1/")


# --- end to end on the tiny model, with a real vLLM engine: eval.py, grpo.py and expert_iter.py ---


def test_eval_prints_four_metrics_and_per_type_table(tiny_model_dir, tmp_path, capsys):
    import eval as eval_script

    args = eval_script.Args(
        model=str(tiny_model_dir),
        dataset="ifeval",
        split="test",
        data_dir=str(data_root()),
        limit=12,
        template="question",
        max_tokens=16,
        out_dir=str(tmp_path),
    )
    run_dir = eval_script.main(args)
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in open(run_dir / "samples.jsonl")]
    metrics = json.loads((run_dir / "summary.json").read_text())["metrics"]
    strict = [r["rewards"][0]["strict"] for r in records]
    loose = [r["rewards"][0]["loose"] for r in records]
    # a mix of followed and not, at both levels, or the recounts below prove little
    counts = [(sum(map(all, v)), sum(map(sum, v)), sum(map(len, v))) for v in (strict, loose)]
    print(f"strict, loose: (prompts followed, instructions followed, instructions) {counts}")
    for prompts_followed, followed, n_instructions in counts:
        assert 0 < prompts_followed < 12 and 0 < followed < n_instructions
    assert metrics["eval/prompt_level_strict_acc"] == pytest.approx(sum(map(all, strict)) / 12)
    assert metrics["eval/inst_level_loose_acc"] == pytest.approx(
        sum(map(sum, loose)) / sum(map(len, loose))
    )
    assert metrics["eval/prompt_level_loose_acc"] == pytest.approx(sum(map(all, loose)) / 12)
    assert metrics["eval/inst_level_strict_acc"] == pytest.approx(
        sum(map(sum, strict)) / sum(map(len, strict))
    )
    for name in (
        "prompt_level_strict_acc",
        "inst_level_strict_acc",
        "prompt_level_loose_acc",
        "inst_level_loose_acc",
    ):
        assert f"eval/{name}" in printed
    for instruction_id in {i for r in records for i in r["answer"]["instruction_id_list"]}:
        assert (
            f"eval/by_type/{instruction_id}/strict" in printed
            and f"eval/by_type/{instruction_id}/loose" in printed
        )


@pytest.fixture
def small_ifeval_train(monkeypatch):
    """The first 64 ifeval train prompts, not 8,000: the scripts tokenize every train prompt to size
    the engine."""
    load = data.load
    monkeypatch.setattr(
        data, "load", lambda name, split, data_dir=None: load(name, split, data_dir)[:64]
    )


def test_grpo_and_expert_iter_run_on_ifeval(tiny_model_dir, tmp_path, small_ifeval_train):
    """Both trainers take --dataset ifeval with no script change: data.load gives prompts,
    verifiers.score rewards."""
    import expert_iter
    import grpo

    common = dict(
        model=str(tiny_model_dir),
        dataset="ifeval",
        data_dir=str(data_root()),
        template="question",
        eval_split="test",
        n_eval=2,
        eval_max_tokens=4,
        n_log_generations=1,
        group_size=4,
        max_tokens=12,
    )
    run_dir = grpo.main(
        grpo.Args(
            **common,
            output_dir=str(tmp_path / "grpo"),
            n_grpo_steps=2,
            rollout_batch_size=16,
            train_batch_size=16,
            microbatch_size=16,
            lr=1e-2,
            eval_every=1000,
        )
    )
    rollouts = [json.loads(line) for line in open(run_dir / "rollouts.jsonl")]
    assert len(rollouts) == 2 * 4 and all(
        group["answer"]["instruction_id_list"] for group in rollouts
    )
    rewards = [r for group in rollouts for r in group["rewards"]]
    # random text follows "no commas" & co. now and then
    assert set(rewards) <= {0.0, 1.0} and sum(rewards) > 0
    ei_args = expert_iter.Args(
        **common,
        output_dir=str(tmp_path / "ei"),
        n_ei_steps=1,
        n_questions=8,
        temperature=1.0,
        batch_size=8,
        microbatch_size=4,
        max_seq_len=512,
        lr=1e-3,
        warmup_steps=0,
    )
    run_dir = expert_iter.main(ei_args)
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    kept = [json.loads(line) for line in open(run_dir / "kept.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1]
    step = metrics[1]
    # 8 questions x 4 responses: each distinct accepted response once per question (measured: 6
    # of 32), each one that the IFEval verifier, scoring it again, accepts
    assert 0 < step["rollout/n_kept"] == len(kept) <= 32
    assert all(verifiers.score(row["response"], row)["reward"] == 1.0 for row in kept)
    # batches of 8: that many optimizer steps, and the engine follows the trained weights
    assert step["train/n_updates"] == math.ceil(len(kept) / 8)
    assert step["reload/logprob_gap"] < 1e-4
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    final = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    assert max((final[k] - start[k]).abs().max().item() for k in start) > 1e-4
