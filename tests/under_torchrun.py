"""A script as tests launch it with torchrun: `torchrun ... tests/under_torchrun.py grpo --its
--args`. The letter-share reward (a random model's groups carry a signal), 256 synthetic train
problems; and, when FAIL is "die" or "hang", rank FAIL_RANK kills or stops itself at its FAIL_AT-th
reward call, as a rank would that crashed or hung (printing the time it stopped)."""

import importlib
import os
import signal
import sys
import time
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import verifiers  # noqa: E402

calls = []


def letter_reward(response, example):
    calls.append(1)
    failing = os.environ.get("FAIL") and int(os.environ["FAIL_RANK"]) == int(os.environ["RANK"])
    if failing and len(calls) == int(os.environ["FAIL_AT"]):
        # stderr: the scripts send a rank other than 0's stdout to /dev/null
        print(f"rank {os.environ['RANK']} stops at {time.time():.3f}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL if os.environ["FAIL"] == "die" else signal.SIGSTOP)
    reward = sum(c.isalpha() for c in response) / max(len(response), 1)
    return {"reward": reward, "format_reward": 0.0, "answer_reward": reward}


if __name__ == "__main__":
    script = importlib.import_module(sys.argv[1])
    verifiers.score = letter_reward
    load = data.load
    data.load = lambda name, split, data_dir=None: load(name, split, data_dir)[:256]
    script.main(tyro.cli(script.Args, args=sys.argv[2:]))
