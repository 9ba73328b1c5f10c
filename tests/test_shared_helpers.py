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


def shared_blocks() -> list[tuple[str, list[str]]]:
    """(banner, the scripts it names) for every block whose banner says "(same in a, b and c)"."""
    found = {}
    for script in SCRIPTS:
        for title in blocks(script):
            named = re.search(r"\(same in ([^)]*)\)", title)
            if named:
                found[title] = re.findall(r"\w+\.py", named.group(1))
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
    texts = {script: blocks(script).get(title) for script in named}
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
    common = sorted(set(fa) & set(fb) - {"main"})
    assert common  # every pair shares at least the engine and the evaluation
    different = [name for name in common if fa[name] != fb[name]]
    # a variant's rewrites of its parent's functions are its lesson
    different = [name for name in different if name not in rewritten(a) | rewritten(b)]
    assert not different, f"{a} and {b} define different {different}"


def test_a_variant_rewrites_few_functions():
    """A rung adds one idea: it rewrites a handful of its parent's functions, not the script."""
    for variant in VARIANTS:
        assert len(rewritten(variant)) <= 12, (variant, sorted(rewritten(variant)))


NAMED = ["evaluate", "log_generations", "reload_and_check", "resolve_devices", "resume_from"]


@pytest.mark.parametrize("name", NAMED)
def test_named_helpers_are_in_every_script(name):
    assert all(name in functions(script) for script in SCRIPTS)


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
