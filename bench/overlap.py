"""Would generating step k+1 while training on step k pay here? Measure it before writing the variant that does it.

One-step-off-policy GRPO (verl's one_step_off_policy recipe, TRL's and PipelineRL's async modes) lets the engine sample
the next batch while the trainer updates on the last one. It changes the algorithm (each batch comes from the weights
of one update ago) and it pays only where the two phases do not share the hardware: two GPUs, or phases that leave
CPU cores idle. On one batch of the issue's settings (bench/grpo_step.py's SIZES) this prints

    generate   an engine started as grpo.py's samples the batch, as grpo.py's step 1 does
    train      an update on it as grpo.py's (bench/train_step.py's microbatch_backward), one AdamW step
    both       the two at once: the engine samples in a second thread while this one trains

and both / (generate + train): 1.0 means overlapping gains nothing; max(generate, train) / (generate + train) is the
most it could gain (the slower phase hides the other).

    python -m bench.overlap                             # both sizes, on the CPU
    python -m bench.overlap --sizes tiny --repeats 1
    python -m bench.overlap --vllm-device cuda:0 --policy-device cuda:1     # two GPUs (not run yet)

Each size runs in its own process (one engine each): where engines share a machine, wrap it in `flock /tmp/vllm.lock`.
"""

import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.grpo_step import SIZES, describe, make_model, run_in_own_process, start_engine


@dataclass
class Args:
    sizes: list[str] = field(default_factory=lambda: list(SIZES))
    """keys of bench.grpo_step.SIZES"""
    repeats: int = 2
    """timed rounds (median), after one warm-up round"""
    vllm_device: str = "cpu"
    policy_device: str = "cpu"
    work_dir: str | None = None
    """where the models go (None: a temporary folder)"""
    model: str | None = None
    """time this one model folder here, in this process, and print one JSON line (what each size's
    process runs)"""
    batch: tuple[int, int, int, int] = SIZES["tiny"]
    """with --model: the batch, a value of SIZES (prompts, group size, max new tokens,
    microbatch)"""


def time_model(
    model: str, batch: tuple, repeats: int, vllm_device: str, policy_device: str
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    import data
    from bench.train_step import microbatch_backward

    n_prompts, group, max_tokens, micro = batch
    llm = start_engine(model, vllm_device)  # the engine first, while the GPU is empty (as grpo.py)
    torch.manual_seed(1)
    policy = (
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(policy_device).train()
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    prompts = [
        data.render_prompt(ex, "question") for ex in data.load("synthetic", "train")[:n_prompts]
    ]
    params = [
        SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=j)
        for j in range(n_prompts)
    ]
    # vLLM samples on the ambient CUDA device: make the engine's current while it generates (grpo.py
    # does the same)
    on_engine = (
        torch.cuda.device(vllm_device)
        if vllm_device.startswith("cuda")
        else contextlib.nullcontext()
    )

    def generate() -> list[tuple[list[int], list[int]]]:
        llm.reset_prefix_cache()  # every round samples the prompts afresh, as after a reload
        with on_engine:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(list(o.prompt_token_ids), list(c.token_ids)) for o in outputs for c in o.outputs]

    # The batch every round trains on, in microbatches of rows sorted by length (little padding, as
    # grpo.py's)
    pairs = sorted(generate(), key=lambda pair: len(pair[0]) + len(pair[1]))
    pad_id = llm.get_tokenizer().pad_token_id
    batches = []
    for i in range(0, len(pairs), micro):
        rows = pairs[i : i + micro]
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), width), pad_id)  # (b, L)
        is_response = torch.zeros((len(rows), width), dtype=torch.bool)  # (b, L)
        for j, (p, r) in enumerate(rows):
            ids[j, : len(p) + len(r)] = torch.tensor(p + r)
            is_response[j, len(p) : len(p) + len(r)] = True
        # (b,) half up, half down
        advantages = torch.tensor([1.0, -1.0]).repeat(len(rows))[: len(rows)]
        batches.append([t.to(policy_device) for t in (ids, is_response[:, 1:], advantages)])
    n_tokens = sum(int(mask.sum()) for _, mask, _ in batches)

    def train() -> None:
        for ids, response_mask, advantages in batches:
            microbatch_backward(policy, ids, response_mask, advantages, n_tokens)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if policy_device.startswith("cuda"):
            torch.cuda.synchronize(policy_device)

    def both() -> None:
        sampler = threading.Thread(target=generate)
        sampler.start()
        train()
        sampler.join()

    def seconds(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    # [0]: warm-up
    rounds = [(seconds(generate), seconds(train), seconds(both)) for _ in range(repeats + 1)][1:]
    generate_s, train_s, both_s = (
        statistics.median(column) for column in zip(*rounds, strict=True)
    )
    return {"generate_s": generate_s, "train_s": train_s, "both_s": both_s, "responses": len(pairs)}


def main(args: Args) -> list[dict]:
    if args.model:
        print(
            json.dumps(
                time_model(
                    args.model, args.batch, args.repeats, args.vllm_device, args.policy_device
                )
            )
        )
        return []
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="overlap_"))
    print(
        f"generate and train, apart and at once; median of {args.repeats}; load average {os.getloadavg()[0]:.1f}"
    )
    rows = []
    for size in args.sizes:
        child = [
            "--model",
            make_model(work, size),
            "--batch",
            *map(str, SIZES[size]),
            "--repeats",
            str(args.repeats),
            "--vllm-device",
            args.vllm_device,
            "--policy-device",
            args.policy_device,
        ]
        r = {"size": size, **run_in_own_process("bench.overlap", child)}
        apart = r["generate_s"] + r["train_s"]
        r["ratio"], r["best_ratio"] = (
            r["both_s"] / apart,
            max(r["generate_s"], r["train_s"]) / apart,
        )
        print(
            f"{describe(size)}\n  generate {r['generate_s']:.2f} s + train {r['train_s']:.2f} s = {apart:.2f} s "
            f"apart; {r['both_s']:.2f} s at once\n  at once / apart: {r['ratio']:.2f} "
            f"(1.00: no gain; {r['best_ratio']:.2f}: the slower phase hides the other)",
            flush=True,
        )
        rows.append(r)
    return rows


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
