"""Weight reload into the vLLM engine: seconds and bytes/s, against a plain copy of the same bytes on the same device.

grpo.py copies the trainer's weights into its in-process engine after every step: vLLM's in-place reload_weights with
the trainer's state_dict(), then a reset of the prefix cache. This file times its own copy of those two calls on
random-weight models from tiny_model.py, and the physical limit in-process: copy_ of every tensor into a preallocated
one of the same shape and dtype. The check grpo.py runs after each reload (weights read back, two probes generated and
scored) is in its time/reload: bench/grpo_step.py prints it.

    python -m bench.reload                        # tiny, 25m and 300m (each in its own process: one engine each)
    python -m bench.reload --sizes tiny --repeats 3

Prints, per size: parameters, MB sent, reload seconds and MB/s, the plain copy's, and their ratio.
"""

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.grpo_step import MODELS, make_model, run_in_own_process, start_engine


@dataclass
class Args:
    sizes: list[str] = field(default_factory=lambda: list(MODELS))
    """keys of bench.grpo_step.MODELS"""
    repeats: int = 5
    """timed reloads per size (median), after one warm-up"""
    work_dir: str | None = None
    """where the models go (None: a temporary folder)"""
    model: str | None = None
    """time this one model folder here, in this process, and print one JSON line (what each size's
    process runs)"""


def time_model(model: str, repeats: int) -> dict:
    """Median seconds of the reload grpo.py does after every step, and of a plain copy of the same
    tensors."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = start_engine(model, "cpu", 512)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    # state_dict(), not named_parameters(): the tied lm_head.weight too, as grpo.py sends it (else
    # it would stay stale)
    weights = [(name, t.detach()) for name, t in policy.state_dict().items()]
    copies = [torch.empty_like(t) for _, t in weights]

    def reload():
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        llm.reset_prefix_cache()  # its entries were computed with the old weights

    def plain_copy():
        for dst, (_, src) in zip(copies, weights, strict=True):
            dst.copy_(src)

    def median_seconds(fn) -> float:
        fn()  # warm-up
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds)

    return {
        "n_params": sum(p.numel() for p in policy.parameters()),
        "bytes": sum(t.numel() * t.element_size() for _, t in weights),
        "reload_s": median_seconds(reload),
        "copy_s": median_seconds(plain_copy),
    }


def main(args: Args) -> list[dict]:
    if args.model:
        print(json.dumps(time_model(args.model, args.repeats)))
        return []
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="reload_"))
    print(
        f"reload into the vLLM engine (CPU, float32), median of {args.repeats}; load average "
        f"{os.getloadavg()[0]:.1f}\n{'size':>6} {'params':>8} {'MB':>7} {'reload s':>9} {'MB/s':>7} "
        f"{'copy s':>7} {'MB/s':>7} {'reload/copy':>11}"
    )
    rows = []
    for size in args.sizes:
        child = ["--model", make_model(work, size), "--repeats", str(args.repeats)]
        r = {"size": size, **run_in_own_process("bench.reload", child)}
        mb = r["bytes"] / 1e6
        print(
            f"{size:>6} {r['n_params'] / 1e6:>7.1f}M {mb:>7.1f} {r['reload_s']:>9.3f} {mb / r['reload_s']:>7.0f} "
            f"{r['copy_s']:>7.3f} {mb / r['copy_s']:>7.0f} {r['reload_s'] / r['copy_s']:>11.1f}",
            flush=True,
        )
        rows.append(r)
    return rows


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
