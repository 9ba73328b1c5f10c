"""grpo.py as tests/test_distributed.py launches it with torchrun: the letter-share reward (a random model's groups
carry a signal), 256 synthetic train problems; and, when FAIL is "die" or "hang", rank FAIL_RANK kills or stops
itself at its FAIL_AT-th reward call, as a rank would that crashed or hung there."""

import os
import signal
import sys
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402

calls = []


def letter_reward(response, example):
    calls.append(1)
    if os.environ.get("FAIL") and grpo.RANK == int(os.environ["FAIL_RANK"]) and len(calls) == int(os.environ["FAIL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL if os.environ["FAIL"] == "die" else signal.SIGSTOP)
    reward = sum(c.isalpha() for c in response) / max(len(response), 1)
    return {"reward": reward, "format_reward": 0.0, "answer_reward": reward}


if __name__ == "__main__":
    grpo.verifiers.score = letter_reward
    load = grpo.data.load
    grpo.data.load = lambda name, split, data_dir=None: load(name, split, data_dir)[:256]
    grpo.main(tyro.cli(grpo.Args))
