"""Does FSDP2 (torch.distributed.fsdp.fully_shard) train on CPU with gloo? The first step toward a
model that does not fit one GPU (docs/distributed.md). Under torchrun, every rank shards a tiny
Qwen3 model (each decoder layer, then the whole), trains on its half of a batch in two microbatches
(gradient sync on the last only), one AdamW step, and compares the gathered full weights with an
unsharded copy trained on the whole batch in this process.

    python tiny_model.py --out /tmp/tiny && torchrun --nproc-per-node 2 -m bench.fsdp2_cpu --model /tmp/tiny

Prints the largest weight difference after the step against how far the weights moved.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import tyro
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM


@dataclass
class Args:
    model: str
    """a tiny model folder (tiny_model.py)"""
    lr: float = 1e-3
    """AdamW's learning rate"""


def summed_nll(model, ids: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Backward of these rows' summed next-token NLL over the GLOBAL token count; returns the
    loss."""
    log_probs = torch.log_softmax(model(ids).logits.float()[:, :-1], dim=-1)
    loss = -log_probs.gather(-1, ids[:, 1:, None]).sum() / n_tokens
    loss.backward()
    return loss.detach()


def main(args: Args) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # (B, T), every rank
    ids = torch.randint(3, 300, (4 * world, 12), generator=torch.Generator().manual_seed(0))
    n_tokens = ids[:, 1:].numel()
    start = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).state_dict()

    # one process, whole batch
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    summed_nll(reference, ids, n_tokens)
    optimizer.step()

    sharded = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=args.lr)
    mine = ids[rank * 4 : (rank + 1) * 4]
    sharded.set_requires_gradient_sync(False)  # accumulate the first microbatch locally
    summed_nll(sharded, mine[:2], n_tokens)
    sharded.set_requires_gradient_sync(True)  # reduce-scatter after the last
    summed_nll(sharded, mine[2:], n_tokens)
    # FSDP averages over the ranks; each rank's loss is over the global count, so the sum is wanted.
    # (NCCL: set_gradient_divide_factor(1.0); gloo refuses the PREMUL_SUM that needs.)
    for p in sharded.parameters():
        p.grad.mul_(world)
    optimizer.step()

    full = get_model_state_dict(
        sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        want = reference.state_dict()
        moved = max((want[k] - start[k]).abs().max().item() for k in want)
        differ = max((full[k] - want[k]).abs().max().item() for k in want)
        print(
            f"FSDP2 on gloo, {world} ranks: weights moved {moved:.3g}, differ from one process by {differ:.3g}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(tyro.cli(Args))
