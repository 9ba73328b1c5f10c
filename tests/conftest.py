"""Shared fixtures: the repo root on sys.path, the local datasets, and a tiny model built once per
session; and interrupted_at_call, for the tests that stop a run and resume it."""

import contextlib
import os
import sys
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


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data: the offline copies of GSM8K, MATH, MBPP and IFEval."""
    assert SHARED_DATA.is_dir(), f"expected the offline datasets at {SHARED_DATA}"
    return SHARED_DATA


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
