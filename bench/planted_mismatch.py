"""grpo_family.py with a planted engine/trainer mismatch: the family's corrections where they differ.

On a CPU the engine and the trainer agree to float rounding (train/engine_logprob_gap ~1e-7), so no importance weight
is ever capped or masked and every correction trains as plain GRPO does. A bf16 engine's log-probs are off by a few 1e-2
per token (docs/training.md). This runs grpo_family.py as it is, except that the engine's log-prob of a random share
of the sampled tokens (PLANT_SHARE, default 0.1) is moved by PLANT_OFFSET nats (default 1.0), up or down at random: as
if the engine had sampled from a distribution that the trainer disagrees with on those tokens. Their weight p_old /
p_engine is e or 1/e: token truncation caps e at 2, IcePop's band [0.5, 5] masks 1/e, a sequence's weight (the product)
moves by e^(ups - downs), and DeepSeek-V3.2's mask sees a response's mean log(p_engine / p) move by (ups - downs) / its
length. The same tokens for every variant (a generator seeded by the run's seed and step).

    PLANT_SHARE=0.1 python -m bench.planted_mismatch --model ... --is-mode icepop   # any grpo_family.py flags
    SCRIPT="-m bench.planted_mismatch" SFT=... bash bench/grpo_family.sh              # the family table's rows
"""

import os

import torch
import tyro

import grpo_family


def plant(
    engine_log_probs: torch.Tensor, mask: torch.Tensor, share: float, offset: float, seed: int
):
    """engine_log_probs (n, T) with offset added to (or taken from, at random) a share of the
    tokens under mask, drawn by a generator seeded with seed. Returns the new tensor."""
    generator = torch.Generator().manual_seed(seed)
    chosen = (torch.rand(mask.shape, generator=generator) < share) & mask  # (n, T)
    sign = torch.where(torch.rand(mask.shape, generator=generator) < 0.5, -1.0, 1.0)  # (n, T)
    return engine_log_probs + offset * sign * chosen


def main() -> None:
    share = float(os.environ.get("PLANT_SHARE", "0.1"))
    offset = float(os.environ.get("PLANT_OFFSET", "1.0"))
    args = tyro.cli(grpo_family.Args)
    collate = grpo_family.collate_rollouts
    calls = []

    def planted(*a):
        batch, lengths = collate(*a)
        # one call a step (a resumed run restarts the count: the same steps get other tokens)
        seed = args.seed * 1_000_003 + len(calls)
        calls.append(seed)
        mask = batch["response_mask"]
        batch["engine_log_probs"] = plant(batch["engine_log_probs"], mask, share, offset, seed)
        return batch, lengths

    grpo_family.collate_rollouts = planted
    print(f"planted: {share:.0%} of the response tokens' engine log-probs moved by {offset} nats")
    grpo_family.main(args)


if __name__ == "__main__":
    main()
