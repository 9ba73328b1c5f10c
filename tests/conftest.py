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
