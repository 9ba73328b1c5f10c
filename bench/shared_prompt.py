"""The train phase's lever for long prompts: a group's prompt through the model once, not once per response.

grpo.py trains a group's G responses as G rows of prompt + response: the prompt's forward and backward run G times.
ladder_real.py's recipe (8 responses a question, IFEval-style prompts in the chat template) trains more prompt tokens
than response tokens, each 8 times. `--share-prompt` (grpo.py, its variants and distill.py) puts one prompt's
responses in a microbatch (prompt_microbatches) and runs the prompt and every response as one sequence
(shared_prompt_log_probs), each response attending to the prompt and to itself: the prompt runs once, and no padding
runs. The work of a group drops from G (P + max R) tokens to P + sum R.

This times, on one group of random tokens, forward and backward of a loss on the log-probs, grpo.py's plain
get_response_log_probs against shared_prompt_log_probs, and prints both and their largest differences:

    python -m bench.shared_prompt                                      # SmolLM2-135M-Instruct, the recipe's shape
    python -m bench.shared_prompt --model tiny --prompt-len 64 --response-len 40    # no model package needed
    python -m bench.shared_prompt --model qwen3-1.7b --device cuda --prompt-len 200 --response-len 600   # a GPU

On a GPU the model is Qwen3-1.7B's shape with random weights (bench/train_step.py's SHAPES: nothing is downloaded),
float32 weights under bf16 autocast as grpo.py trains it, attention through sdpa: there the shared path's 4D mask
takes sdpa's memory-efficient kernel with a full N x N bias a layer, where the plain path gets flash attention.

The prompt and response lengths default to the recipe's measured ones (bench/real_step.py: ~138 prompt tokens with
the chat template, responses of 112-152 tokens).
"""

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from bench.train_step import SHAPES


@dataclass
class Args:
    model: str = "runs/models/SmolLM2-135M-Instruct"
    """a model folder (ladder_real.py makes this one), "tiny" (tiny_model.py's ladder model), or a
    key of bench.train_step.SHAPES (random weights at that shape)"""
    device: str = "cpu"
    """cpu, or cuda (bf16 autocast, as grpo.py on a GPU)"""
    prompt_len: int = 138
    response_len: int = 112
    group_size: int = 8
    repeats: int = 2
    """timed rounds of each side (the fastest counts), after one warm-up"""
    seed: int = 0


def main(args: Args) -> dict:
    import grpo

    torch.manual_seed(args.seed)
    path = args.model
    if path == "tiny":
        import tempfile

        import tiny_model

        out = Path(tempfile.mkdtemp()) / "tiny"
        path = str(tiny_model.main(tiny_model.Args(out=str(out), n_layers=4)))
    device = torch.device(args.device)
    if path in SHAPES:
        config = Qwen3Config(**SHAPES[path], max_position_embeddings=4096)
        # built on the device: random weights of 1.7B drawn on a CPU take minutes
        with device:
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation="sdpa"
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(device).train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (1, args.prompt_len)).expand(args.group_size, -1)
    responses = torch.randint(1, vocab, (args.group_size, args.response_len))
    full = torch.cat([prompt, responses], dim=1)  # (G, P + R)
    micro = {"input_ids": full[:, :-1], "labels": full[:, 1:]}
    micro["response_mask"] = (torch.arange(full.shape[1] - 1) >= args.prompt_len - 1).expand(
        args.group_size, -1
    )
    micro = {k: v.to(device) for k, v in micro.items()}
    # a loss on the responses' tokens, as grpo.py's
    weights = torch.randn(args.group_size, 1, device=device) * micro["response_mask"]
    sides = {
        "plain": lambda: grpo.get_response_log_probs(model, micro["input_ids"], micro["labels"]),
        "shared": lambda: grpo.shared_prompt_log_probs(model, micro),
    }

    peak = {}

    def step(side: str) -> tuple[float, torch.Tensor, list[torch.Tensor] | None]:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with autocast:
            log_probs = sides[side]()["log_probs"]
        (weights * log_probs).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak[side] = torch.cuda.max_memory_allocated(device) / 2**30
        seconds = time.perf_counter() - start
        return seconds, log_probs.detach()

    result, last = {}, {}
    for name in sides:
        rounds = [step(name) for _ in range(args.repeats + 1)]
        result[name] = {"seconds": min(r[0] for r in rounds[1:]), "peak_gib": peak.get(name)}
        # the last round's gradients, kept on the CPU (a copy on the GPU would count in the
        # other side's peak)
        last[name] = rounds[-1][1], [p.grad.float().cpu() for p in model.parameters()]
    plain_lp, plain_grads = last["plain"]
    shared_lp, shared_grads = last["shared"]
    result["max_log_prob_diff"] = (plain_lp - shared_lp).abs().max().item()
    # each gradient's difference against its own largest entry
    result["max_grad_diff"] = max(
        ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
        for a, b in zip(plain_grads, shared_grads, strict=True)
    )
    tokens = args.group_size * (args.prompt_len + args.response_len)
    print(
        f"{path}: a group of {args.group_size} x ({args.prompt_len} prompt + {args.response_len} "
        f"response) tokens, forward + backward, fastest of {args.repeats}, on "
        + (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"{torch.get_num_threads()} CPU threads"
        )
    )
    for name in ("plain", "shared"):
        seconds = result[name]["seconds"]
        print(
            f"  {name:6s} {seconds:6.3f} s  ({tokens / seconds:5.0f} tokens/s as grpo.py counts them)"
            + (f", peak {peak[name]:.1f} GiB" if name in peak else "")
        )
    print(
        f"  shared / plain {result['shared']['seconds'] / result['plain']['seconds']:.2f}; "
        f"largest log-prob difference {result['max_log_prob_diff']:.1e}, largest gradient "
        f"difference {result['max_grad_diff']:.1e} of the gradient's largest entry"
    )
    return result


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
