"""Would generating step k+1 while training on step k pay here? Measure it before writing the variant that does it.

One-step-off-policy GRPO (verl's one_step_off_policy recipe, TRL's and PipelineRL's async modes) lets the engine sample
the next batch while the trainer updates on the last one. It changes the algorithm (each batch comes from the weights
of one update ago) and it pays only where the two phases do not share the hardware: two GPUs, or phases that leave
CPU cores idle. On one batch of the issue's settings (grpo_step.SIZES) this prints

    generate   the engine samples the batch, as grpo.py's step 1 does
    train      grpo.py's update on it (get_response_log_probs, grpo_microbatch_train_step), one AdamW step
    both       the two at once: the engine samples in a second thread while this one trains

and both / (generate + train): 1.0 means overlapping gains nothing; max(generate, train) / (generate + train) is the
most it could gain (the slower phase hides the other).

    python bench/overlap.py                             # both sizes, on the CPU
    python bench/overlap.py --sizes tiny --repeats 1
    python bench/overlap.py --vllm-device cuda:0 --policy-device cuda:1     # two GPUs (not run yet)

Each size runs in its own process (one engine each): where engines share a machine, wrap it in `flock /tmp/vllm.lock`.
"""

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from grpo_step import SIZES, describe, make_model, run_in_own_process  # noqa: E402


@dataclass
class Args:
    sizes: list[str] = field(default_factory=lambda: list(SIZES))
    """keys of grpo_step.SIZES"""
    repeats: int = 2
    """timed rounds (median), after one warm-up round"""
    vllm_device: str = "cpu"
    policy_device: str = "cpu"
    work_dir: str | None = None
    """where the models go (None: a temporary folder)"""
    model: str | None = None
    """time this one model folder here, in this process, and print one JSON line (what each size's process runs)"""
    size: str = "tiny"
    """with --model: the key of grpo_step.SIZES whose batch to use"""


def time_model(model: str, size: str, repeats: int, vllm_device: str, policy_device: str) -> dict:
    import torch
    from vllm import SamplingParams

    sys.path.insert(0, str(ROOT))
    import data
    import grpo

    n_prompts, group, max_tokens, micro = SIZES[size][1]
    llm = grpo.init_vllm(model, vllm_device, 1, 0.3, 1024)
    policy, autocast = grpo.seed_and_load_policy(model, policy_device, False, 1)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    prompts = [data.render_prompt(ex, "question") for ex in data.load("synthetic", "train")[:n_prompts]]
    params = [
        SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=j) for j in range(n_prompts)
    ]

    def generate() -> tuple[list[list[int]], list[list[int]]]:
        llm.reset_prefix_cache()  # every round samples the prompts afresh, as after a reload
        with grpo.engine_device(vllm_device):
            outputs = llm.generate(prompts, params, use_tqdm=False)
        return ([list(o.prompt_token_ids) for o in outputs for _ in o.outputs],
                [list(c.token_ids) for o in outputs for c in o.outputs])  # fmt: skip

    prompt_ids, response_ids = generate()  # the batch every round trains on
    batch = grpo.collate_token_ids(prompt_ids, response_ids, llm.get_tokenizer().pad_token_id)
    lengths = [len(p) + len(r) - 1 for p, r in zip(prompt_ids, response_ids, strict=True)]
    advantages = torch.tensor([1.0, -1.0]).repeat(len(lengths) // 2).to(policy_device)  # (B,) half up, half down
    n_tokens = int(batch["response_mask"].sum())

    def train() -> None:
        micro_list = grpo.microbatches(list(range(len(lengths))), lengths, micro)
        for rows in micro_list:
            part = grpo.take_rows(batch, rows, lengths, policy_device)
            with autocast:
                out = grpo.get_response_log_probs(policy, part["input_ids"], part["labels"], True)
            grpo.grpo_microbatch_train_step(
                out["log_probs"], part["response_mask"], len(micro_list), "grpo_clip", advantages=advantages[rows],
                old_log_probs=out["log_probs"].detach(), cliprange=0.2, loss_aggregation="token_mean",
                n_batch_sequences=len(lengths), n_batch_tokens=n_tokens,
            )  # fmt: skip
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

    rounds = [(seconds(generate), seconds(train), seconds(both)) for _ in range(repeats + 1)][1:]  # [0]: warm-up
    generate_s, train_s, both_s = (statistics.median(column) for column in zip(*rounds, strict=True))
    return {"generate_s": generate_s, "train_s": train_s, "both_s": both_s, "responses": len(lengths)}


def main(args: Args) -> list[dict]:
    if args.model:
        print(json.dumps(time_model(args.model, args.size, args.repeats, args.vllm_device, args.policy_device)))
        return []
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="overlap_"))
    print(f"generate and train, apart and at once; median of {args.repeats}; load average {os.getloadavg()[0]:.1f}")
    rows = []
    for size in args.sizes:
        child = ["--model", make_model(work, size), "--size", size, "--repeats", str(args.repeats),
                 "--vllm-device", args.vllm_device, "--policy-device", args.policy_device]  # fmt: skip
        r = {"size": size, **run_in_own_process(__file__, child)}
        apart = r["generate_s"] + r["train_s"]
        r["ratio"], r["best_ratio"] = r["both_s"] / apart, max(r["generate_s"], r["train_s"]) / apart
        print(f"{describe(size)}\n  generate {r['generate_s']:.2f} s + train {r['train_s']:.2f} s = {apart:.2f} s "
              f"apart; {r['both_s']:.2f} s at once\n  at once / apart: {r['ratio']:.2f} "
              f"(1.00: no gain; {r['best_ratio']:.2f}: the slower phase hides the other)", flush=True)  # fmt: skip
        rows.append(r)
    return rows


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
