"""The helpers the algorithm scripts share are copies, not imports (a script imports only data.py
and verifiers.py): a reader who learned one copy recognises the others. These tests keep the copies
identical: every banner-delimited block that says "(same in ...)" is the same text in each script it
names, in the same order, and every function defined in two scripts (at the top level, or inside
main) is the same source."""

import ast
import re
from itertools import combinations
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [
    "sft.py",
    "expert_iter.py",
    "grpo.py",
    "grpo_family.py",
    "distill.py",
    "grpo_tools.py",
    "grpo_async.py",
]
# A variant is a copy of its parent plus one idea: it carries each of the parent's shared blocks as
# they are, and may rewrite a function of its parent (the rewrite is its lesson: `diff grpo.py
# grpo_family.py`); every other function two scripts define is the same copy.
VARIANTS = {"grpo_tools.py": "grpo.py", "grpo_family.py": "grpo.py", "grpo_async.py": "grpo.py"}
# The functions of its parent that each variant rewrites, by name: its lesson. Any other copy that
# drifts fails, and so does a rewrite that is no longer one (a stale name here).
REWRITES = {
    "grpo_tools.py": set(),
    "grpo_family.py": {"check_args", "collate_rollouts", "grpo_update"},
    "grpo_async.py": {"check_args", "grpo_update"},
}
# The blocks of its parent a variant replaces whole, by words of their banner: grpo_tools.py
# evaluates through the tool loop (evaluate_with_tools), so neither grpo.py's evaluation nor the
# masked sum of its logged entropies is in it.
REPLACED = {"grpo_tools.py": ["evaluation through the engine (", "a masked sum"]}
# A banner at any indentation: the steps inside main that every script shares are checked too.
BANNER = re.compile(r"^\s*# --- .*---$")


def blocks(script: str) -> dict[str, str]:
    """Banner line -> the text from it up to the next banner (or `def main`, or the command line
    at the end), for every banner of one script."""
    out, title = {}, None
    for line in (ROOT / script).read_text().splitlines(keepends=True):
        if BANNER.match(line):
            title = line.strip()
            out[title] = ""
        elif line.startswith(("def main(", 'if __name__ == "__main__":')):
            title = None
        if title:
            out[title] += line
    return out


def block_body(script: str, title: str) -> str | None:
    """The block of `script` whose banner is `title` but for what its parentheses say (a copy's
    banner names the other file), without its banner line; None if it has none."""
    topic = title.split(" (")[0]
    for other, text in blocks(script).items():
        if other.split(" (")[0] == topic and ("(same in" in other or "holds the same" in other):
            return text.split("\n", 1)[1]
    return None


def shared_blocks() -> list[tuple[str, list[str]]]:
    """(banner, the scripts it names) for every block whose banner says "(same in a, b and c)"."""
    found = {}
    for script in SCRIPTS:
        for title in blocks(script):
            named = re.search(r"\(same in ([^)]*)\)", title)
            if named:
                found[title] = re.findall(r"\w+\.py", named.group(1))
            # a block copied from a file that is not a training script (eval.py's tool loop)
            copied = re.search(r"\((\w+\.py) holds the same copy\)", title)
            if copied:
                found[title] = [script, copied.group(1)]
    return sorted(found.items())


def functions(script: str) -> dict[str, str]:
    """Source of every top-level function, and of every function defined inside main (as
    main.<name>)."""
    source = (ROOT / script).read_text()
    tree = ast.parse(source)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = ast.get_source_segment(source, node)
            if node.name == "main":
                for inner in node.body:
                    if isinstance(inner, ast.FunctionDef):
                        out[f"main.{inner.name}"] = ast.get_source_segment(source, inner)
    out.pop("main", None)
    return out


def test_there_are_shared_blocks():
    # vocabulary, SFT loss, engine and evaluation, run folder
    assert len(shared_blocks()) >= 4, shared_blocks()


@pytest.mark.parametrize(("title", "named"), shared_blocks())
def test_shared_block_is_identical_in_every_script_it_names(title, named):
    texts = {script: block_body(script, title) for script in named}
    missing = [script for script, text in texts.items() if text is None]
    assert not missing, f"{title} is missing from {missing}"
    first = texts[named[0]]
    for script in named[1:]:
        assert texts[script] == first, f"{title}: {script} differs from {named[0]}"


@pytest.mark.parametrize(("variant", "parent"), VARIANTS.items())
def test_a_variant_carries_its_parents_shared_blocks(variant, parent):
    """Each block the parent shares with every other training script (the vocabulary, the
    learning rate, the engine, the run folder) is in the variant, character for character."""
    theirs = blocks(variant)
    for title, named in shared_blocks():
        if any(word in title for word in REPLACED.get(variant, [])):
            assert title not in theirs, f"{variant} carries {title}, which it says it replaces"
            continue
        if parent in named and len(named) >= 4:
            assert theirs.get(title) == blocks(parent)[title], f"{variant}: {title}"


@pytest.mark.parametrize(("a", "b"), list(combinations(SCRIPTS, 2)))
def test_shared_blocks_come_in_the_same_order(a, b):
    shared = set(blocks(a)) & set(blocks(b))
    order = lambda script: [title for title in blocks(script) if title in shared]
    assert order(a) == order(b)


def rewritten(script: str) -> set[str]:
    """The functions a variant rewrites: those its parent defines otherwise (none elsewhere)."""
    if script not in VARIANTS:
        return set()
    mine, parents = functions(script), functions(VARIANTS[script])
    return {name for name in mine if name in parents and mine[name] != parents[name]}


@pytest.mark.parametrize(("a", "b"), list(combinations(SCRIPTS, 2)))
def test_every_function_two_scripts_define_is_an_identical_copy(a, b):
    fa, fb = functions(a), functions(b)
    # check_args is each script's own (its Args are), in one shape
    common = sorted(set(fa) & set(fb) - {"main", "check_args"})
    assert common  # every pair shares at least the engine and the evaluation
    different = [name for name in common if fa[name] != fb[name]]
    # a variant's rewrites of its parent's functions are its lesson
    different = [name for name in different if name not in rewritten(a) | rewritten(b)]
    assert not different, f"{a} and {b} define different {different}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_variant_rewrites_only_the_functions_it_names(variant):
    """A rung adds one idea: it rewrites the few functions of its parent listed in REWRITES, and
    every other function it shares with its parent is the parent's copy."""
    assert rewritten(variant) == REWRITES[variant]


NAMED = ["evaluate", "log_generations", "reload_and_check", "resolve_devices", "resume_from"]
# grpo_tools.py evaluates through the tool loop (evaluate_with_tools), and logs no entropies
EVALUATES_OTHERWISE = {"grpo_tools.py": {"evaluate", "log_generations"}}


@pytest.mark.parametrize("name", NAMED)
def test_named_helpers_are_in_every_script(name):
    for script in SCRIPTS:
        if name not in EVALUATES_OTHERWISE.get(script, set()):
            assert name in functions(script), (script, name)


@pytest.mark.parametrize("script", [*SCRIPTS, "eval.py"])
def test_scripts_import_no_other_script(script):
    tree = ast.parse((ROOT / script).read_text())
    imported = {
        a.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for a in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    project = {p.stem for p in ROOT.glob("*.py")}
    assert imported & project <= {"data", "verifiers"}, imported & project
