"""Generation: tokens/s of a vLLM engine started as grpo.py's against transformers' generate, same model, prompts and
sampling.

The reason the project samples with vLLM. Both sides get the synthetic task's prompts (template "question"), group size
8 (vLLM: n=8 with a prefix cache; transformers: num_return_sequences=8), temperature 1, top-p 1, float32, at most
the size's max new tokens, on a random-weight model from tiny_model.py (bench/grpo_step.py's SIZES: the issue's two
rows).

    python -m bench.generate                      # tiny and 25m, each in its own process (one engine each)
    python -m bench.generate --sizes tiny --repeats 1

Prints, per size: generated tokens, seconds and tokens/s of each side (median of --repeats after a warm-up) and the
ratio vLLM / transformers. With --profile, then one more engine call under cProfile and where it went: own seconds
per source file (the model's matmul and attention kernels, vLLM's scheduler, its output processing). cProfile slows
the Python parts several times over, so read its seconds as a ranking, not as the unprofiled call's split. The engine
samples as grpo.py's does: with each sampled token's log-prob (logprobs=0), which transformers' side does not compute.

    python -m bench.generate --sizes 25m --repeats 1 --profile
"""

import collections
import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.grpo_step import SIZES, describe, make_model, run_in_own_process, start_engine


@dataclass
class Args:
    sizes: list[str] = field(default_factory=lambda: list(SIZES))
    """keys of bench.grpo_step.SIZES (the batch: prompts, group size, max new tokens)"""
    repeats: int = 2
    """timed generations per side (median), after one warm-up"""
    work_dir: str | None = None
    """where the models go (None: a temporary folder)"""
    model: str | None = None
    """time this one model folder here, in this process, and print one JSON line (what each size's
    process runs)"""
    batch: tuple[int, int, int, int] = SIZES["tiny"]
    """with --model: the batch to generate, a value of SIZES (prompts, group size, max new tokens,
    microbatch)"""
    profile: bool = False
    """also profile one engine call, and print the functions with the most own time"""


def own_time_by_file(fn, n: int = 12) -> list[tuple[str, float]]:
    """Run fn under cProfile: the seconds spent in each source file's own code (not in what it
    calls), the n largest. Built-in functions (the C++ kernels among them) have no file: each counts
    under its own name."""
    profile = cProfile.Profile()
    profile.runcall(fn)
    seconds = collections.Counter()
    # pstats' table: {(file, line, function): (calls, primitive calls, own seconds, cumulative
    # seconds, callers)}
    for (file, _, function), (_, _, own, *_) in pstats.Stats(profile).stats.items():
        seconds[function if file == "~" else Path(file).name] += own
    return seconds.most_common(n)


def time_model(model: str, batch: tuple, repeats: int, profile: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    import data

    n_prompts, group, max_tokens, _ = batch
    llm = start_engine(model)
    tokenizer = llm.get_tokenizer()
    prompts = [
        data.render_prompt(ex, "question") for ex in data.load("synthetic", "train")[:n_prompts]
    ]
    # grpo.py's sampling: with each sampled token's log-prob (for its importance-sampling
    # correction)
    params = [
        SamplingParams(
            n=group, temperature=1.0, top_p=1.0, max_tokens=max_tokens, logprobs=0, seed=j
        )
        for j in range(n_prompts)
    ]
    torch.manual_seed(1)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    # generate appends to the right: prompts must end at the same column
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)

    def vllm_generate() -> int:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def hf_generate() -> int:
        with torch.no_grad():
            out = policy.generate(
                **encoded,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_tokens,
                num_return_sequences=group,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[:, encoded["input_ids"].shape[1] :]
        # tokens up to and including the first EOS (generate pads the finished rows with it)
        is_eos = new == tokenizer.eos_token_id
        ended = is_eos.any(dim=1)
        return int(torch.where(ended, is_eos.int().argmax(dim=1) + 1, new.shape[1]).sum())

    def timed(fn) -> tuple[float, int]:
        fn()  # warm-up
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            n_tokens = fn()
            runs.append((time.perf_counter() - t0, n_tokens))
        return statistics.median(s for s, _ in runs), statistics.median(n for _, n in runs)

    (vllm_s, vllm_tokens), (hf_s, hf_tokens) = timed(vllm_generate), timed(hf_generate)
    top = own_time_by_file(vllm_generate) if profile else []
    return {
        "vllm_s": vllm_s,
        "vllm_tokens": vllm_tokens,
        "hf_s": hf_s,
        "hf_tokens": hf_tokens,
        "vllm_profile": top,
    }


def main(args: Args) -> list[dict]:
    if args.model:
        print(json.dumps(time_model(args.model, args.batch, args.repeats, args.profile)))
        return []
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="generate_"))
    print(f"generation, median of {args.repeats}; load average {os.getloadavg()[0]:.1f}")
    rows = []
    for size in args.sizes:
        child = [
            "--model",
            make_model(work, size),
            "--batch",
            *map(str, SIZES[size]),
            "--repeats",
            str(args.repeats),
            *(["--profile"] if args.profile else []),
        ]
        r = {"size": size, **run_in_own_process("bench.generate", child)}
        vllm_rate, hf_rate = r["vllm_tokens"] / r["vllm_s"], r["hf_tokens"] / r["hf_s"]
        print(
            f"{describe(size)}\n  vLLM engine   {r['vllm_tokens']:>6.0f} tokens {r['vllm_s']:6.2f} s "
            f"{vllm_rate:7.0f} tokens/s\n  transformers  {r['hf_tokens']:>6.0f} tokens {r['hf_s']:6.2f} s "
            f"{hf_rate:7.0f} tokens/s\n"
            f"  ratio vLLM / transformers (tokens/s): {vllm_rate / hf_rate:.2f}",
            flush=True,
        )
        if r["vllm_profile"]:
            print("  one engine call under cProfile, own seconds by file:")
            print(
                "\n".join(f"    {own:6.2f}  {name}" for name, own in r["vllm_profile"]), flush=True
            )
        rows.append({**r, "vllm_tokens_per_s": vllm_rate, "hf_tokens_per_s": hf_rate})
    return rows


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
