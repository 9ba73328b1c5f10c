"""Weight reload into the vLLM engine: seconds and bytes/s, against a plain copy of the same bytes on the same device.

grpo.py copies the trainer's weights into its in-process engine after every step (load_policy_into_vllm: vLLM's
reload_weights, then a reset of the prefix cache) and proves the engine follows them (check_vllm_follows_policy: read
back weight slices, generate on two 400-token probes and score them with the trainer). This times both, with
grpo.py's own functions, on random-weight models from tiny_model.py, and the physical limit in-process: copy_ of
every tensor into a preallocated one of the same shape and dtype.

    python bench/reload.py                        # tiny, 25m and 300m (each in its own process: one engine each)
    python bench/reload.py --sizes tiny --repeats 3

Prints, per size: parameters, MB sent, reload seconds and MB/s, the plain copy's, their ratio, and the check's seconds.
"""

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from grpo_step import MODELS, make_model, run_in_own_process  # noqa: E402


@dataclass
class Args:
    sizes: list[str] = field(default_factory=lambda: list(MODELS))
    """keys of grpo_step.MODELS"""
    repeats: int = 5
    """timed reloads per size (median), after one warm-up"""
    work_dir: str | None = None
    """where the models go (None: a temporary folder)"""
    model: str | None = None
    """time this one model folder here, in this process, and print one JSON line (what each size's process runs)"""


def time_model(model: str, repeats: int) -> dict:
    """Median seconds of grpo.py's reload, of its check, and of a plain copy of the same tensors."""
    import torch

    sys.path.insert(0, str(ROOT))
    import grpo

    llm = grpo.init_vllm(model, "cpu", 1, 0.3, 512)
    policy, _ = grpo.seed_and_load_policy(model, "cpu", False, 1)
    weights = grpo.policy_weights(policy, torch.float32)
    n_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    copies = [torch.empty_like(t) for _, t in weights]

    def median_seconds(fn) -> float:
        fn()  # warm-up
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds)

    def plain_copy():
        for dst, (_, src) in zip(copies, weights, strict=True):
            dst.copy_(src)

    probes = grpo.make_probe_prompts(llm.get_tokenizer(), ["1 + 2 = 3. " * 50])
    return {
        "n_params": sum(p.numel() for p in policy.parameters()), "bytes": n_bytes,
        "reload_s": median_seconds(lambda: grpo.load_policy_into_vllm(policy, llm, "cpu")),
        "copy_s": median_seconds(plain_copy),
        "check_s": median_seconds(lambda: grpo.check_vllm_follows_policy(policy, llm, probes, "cpu", 1e-3)),
    }  # fmt: skip


def main(args: Args) -> list[dict]:
    if args.model:
        print(json.dumps(time_model(args.model, args.repeats)))
        return []
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="reload_"))
    print(f"reload into the vLLM engine (CPU, float32), median of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.1f}\n{'size':>6} {'params':>8} {'MB':>7} {'reload s':>9} {'MB/s':>7} "
          f"{'copy s':>7} {'MB/s':>7} {'reload/copy':>11} {'check s':>8}")  # fmt: skip
    rows = []
    for size in args.sizes:
        child = ["--model", make_model(work, size), "--repeats", str(args.repeats)]
        r = {"size": size, **run_in_own_process(__file__, child)}
        mb = r["bytes"] / 1e6
        print(f"{size:>6} {r['n_params'] / 1e6:>7.1f}M {mb:>7.1f} {r['reload_s']:>9.3f} {mb / r['reload_s']:>7.0f} "
              f"{r['copy_s']:>7.3f} {mb / r['copy_s']:>7.0f} {r['reload_s'] / r['copy_s']:>11.1f} "
              f"{r['check_s']:>8.3f}", flush=True)  # fmt: skip
        rows.append(r)
    return rows


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
