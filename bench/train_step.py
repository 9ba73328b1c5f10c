"""The trainer side of a GRPO step, alone: tokens/s, model FLOPs utilisation and peak memory.

Builds a model of Qwen3-1.7B-Base's shape from its config with random weights (nothing is downloaded) and trains it
on random token ids as grpo.py's update does, in this file's own copy of it (microbatch_backward): float32 weights,
bf16 autocast on a GPU, log-probs of the labels and the token entropy, the clipped surrogate with a token-mean loss,
backward; gradient clipping and one AdamW step per batch. For each microbatch size it prints

    tokens/s   trained tokens (prompt + response) per second over the timed steps
    MFU        6 (LoRA: 4) x parameters x tokens/s over the device's bf16 dense peak (--peak-tflops; H100 SXM: 989);
               on a CPU, over a MEASURED float32 peak: the best of a few 2048 x 2048 matmuls (cpu_matmul_tflops)
    peak GiB   torch.cuda.max_memory_allocated (GPU), or the process's peak RSS (CPU), over the timed steps
    resident   what was allocated before them: the weights, and after the warm-up step AdamW's state
    added GiB  that peak less what was resident before them (the weights, AdamW's state): what a step's
               microbatches add, the logits above all (--log-probs full keeps a (B, T, V) float32 copy)

    python -m bench.train_step                                  # GPU: Qwen3-1.7B shape, microbatch 1, 2, 4, 8
    python -m bench.train_step --gradient-checkpointing
    python -m bench.train_step --lora-rank 32                   # grpo.py's LoRA: a frozen bf16 base on a GPU
    python -m bench.train_step --shape tiny --seq-len 128       # no GPU: a small shape on the CPU
    python -m bench.train_step --shape 25m --seq-len 160 --microbatch-sizes 32   # the issue's 25M row's microbatch
    python -m bench.train_step --shape smollm2 --seq-len 256 --microbatch-sizes 8 --cpu-bf16   # ladder_real's model
    python -m bench.train_step --shape tiny --microbatch-sizes 1 --accumulation 1 --steps 1 --log-probs full

It needs torch and transformers only, so it runs on a GPU machine where vLLM is not installed: with --lora-rank it
reads grpo.py's LoRALinear and add_lora from grpo.py's source (importing grpo.py would import vLLM).
"""

import ast
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tyro
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, Qwen3Config

SHAPES = {  # Qwen3-1.7B-Base's config.json (1.72e9 parameters, tied embeddings); "tiny" for a CPU
    "qwen3-1.7b": dict(
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    # the two CPU sizes, as tiny_model.py builds them (its BPE vocabulary has 477 tokens)
    "ladder": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        vocab_size=477,
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M-Instruct's (ladder_real.py's model, a Llama: no q/k norm, which adds ~nothing)
    "smollm2": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "25m": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=477,
        tie_word_embeddings=True,
    ),
}


@dataclass
class Args:
    shape: str = "qwen3-1.7b"
    """a key of SHAPES"""
    microbatch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    seq_len: int = 1024
    """prompt + response tokens per sequence (half of it the response)"""
    gradient_checkpointing: bool = False
    steps: int = 3
    """timed optimizer steps per microbatch size, after one warm-up step"""
    accumulation: int = 4
    """microbatches per optimizer step"""
    log_probs: str = "chunked"
    """chunked (grpo.py's get_response_log_probs) | full (a (B, T, V) log_softmax kept for the backward)"""
    chunk_size: int = 256
    """positions per chunk of the output layer, with --log-probs chunked"""
    peak_tflops: float | None = None
    """the device's bf16 dense peak, for MFU (default: 989 on an H100 or H200; on a CPU,
    cpu_matmul_tflops)"""
    lora_rank: int = 0
    """rank of grpo.py's LoRA adapters on all seven linear layers, the base frozen (bf16 on a GPU,
    as grpo.py's load_policy); 0: full fine-tuning"""
    cpu_bf16: bool = False
    """on a CPU, bf16 autocast (grpo.py's --cpu-bf16) and MFU over the measured bf16 matmul peak"""


LORA_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def grpo_lora() -> dict:
    """grpo.py's LoRALinear and add_lora, compiled from its source: the code that trains, not a
    copy of it."""
    path = Path(__file__).resolve().parents[1] / "grpo.py"
    tree = ast.parse(path.read_text())
    wanted = [n for n in tree.body if getattr(n, "name", "") in ("LoRALinear", "add_lora")]
    namespace = {"torch": torch, "math": math}
    exec(compile(ast.Module(wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def cpu_matmul_tflops(n: int = 2048, repeats: int = 5, dtype=torch.float32) -> float:
    """The CPU's float32 (or bf16) peak as torch reaches it: 2 n^3 FLOPs per n x n matmul, the
    fastest of `repeats`. A measured limit, not the datasheet's (2 cores of AVX2 FMA at ~2.7 GHz:
    ~0.17 TFLOP/s)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return proc_status_gib("VmHWM")


def current_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    return proc_status_gib("VmRSS")


def reset_peak(device: torch.device) -> None:
    """Start the peak over: CUDA's allocator statistics, or on Linux the process's peak RSS
    (VmHWM; writing 5 to clear_refs resets it). Elsewhere the CPU peak is the process's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif Path("/proc/self/clear_refs").exists():
        Path("/proc/self/clear_refs").write_text("5")


def proc_status_gib(key: str) -> float:
    """VmHWM (peak RSS) or VmRSS from /proc/self/status, in GiB; off Linux, ru_maxrss."""
    status = Path("/proc/self/status")
    if not status.exists():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    for line in status.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20  # kB
    raise KeyError(key)


def microbatch_backward(
    model,
    ids: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    n_batch_tokens: int,
    log_probs_mode: str = "chunked",
    chunk_size: int = 256,
    cpu_bf16: bool = False,
) -> torch.Tensor:
    """One microbatch of grpo.py's update, this file's copy: ids (B, T + 1), response_mask (B, T)
    over the labels ids[:, 1:], advantages (B,). Log-probs, the clipped surrogate at ratio 1 (one
    optimizer step per batch: the old policy is this one) summed over the response tokens / the
    batch's, backward; returns the summed token entropy (grpo.py logs its mean), on the device.

    log_probs_mode "chunked" is grpo.py's get_response_log_probs: the output layer on chunk_size
    positions at a time, each under checkpoint, so that autograd keeps no (B, T, V) tensor; "full"
    is the plain computation it replaces: the (B, T, V) float32 log_softmax kept for the backward."""
    device_type = ids.device.type
    labels = ids[:, 1:]  # (B, T)
    bf16 = device_type == "cuda" or cpu_bf16
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        if log_probs_mode == "full":
            logits = model(ids[:, :-1]).logits.float()  # (B, T, V); float32 under autocast too
            log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
            with torch.no_grad():
                entropy = chunk_entropy(logits.flatten(0, 1))  # (B T,)
        else:
            hidden = model.base_model(ids[:, :-1], use_cache=False).last_hidden_state.flatten(0, 1)
            head = model.get_output_embeddings()
            parts = [
                checkpoint(chunk_log_probs, h, y, head, use_reentrant=False)
                for h, y in zip(
                    hidden.split(chunk_size), labels.flatten().split(chunk_size), strict=True
                )
            ]
            log_probs = torch.cat([p[0] for p in parts]).view_as(labels)  # (B, T)
            entropy = torch.cat([p[1] for p in parts])  # (B T,)
    ratio, a = torch.exp(log_probs - log_probs.detach()), advantages[:, None]  # (B, T), (B, 1)
    per_token = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)  # (B, T); cliprange 0.2
    ((per_token * response_mask).sum() / n_batch_tokens).backward()
    return (entropy.view_as(log_probs) * response_mask).sum()


def chunk_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) -> (N,), in chunks of 1024 positions, as grpo.py: at once, two more (N, V) tensors."""
    parts = [
        torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1) for z in logits.split(1024)
    ]
    return torch.cat(parts)


def chunk_log_probs(
    hidden: torch.Tensor, labels: torch.Tensor, head
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: hidden states (n, H), labels (n,) -> log-probs (n,), entropy (n,) without a gradient."""
    logits = head(hidden).float()  # (n, V)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = chunk_entropy(logits)
    return log_probs, entropy


def train_steps(
    model, optimizer, args: Args, microbatch_size: int, n_steps: int, device: torch.device
) -> int:
    """n_steps optimizer steps of args.accumulation microbatches; returns the number of tokens
    trained on."""
    response_mask = torch.zeros(microbatch_size, args.seq_len, dtype=torch.bool, device=device)
    response_mask[:, args.seq_len // 2 :] = True
    n_batch_tokens = int(response_mask.sum()) * args.accumulation
    for _ in range(n_steps):
        for _ in range(args.accumulation):
            ids = torch.randint(
                0, model.config.vocab_size, (microbatch_size, args.seq_len + 1), device=device
            )
            advantages = torch.randn(microbatch_size, device=device)
            microbatch_backward(
                model,
                ids,
                response_mask,
                advantages,
                n_batch_tokens,
                args.log_probs,
                args.chunk_size,
                args.cpu_bf16,
            )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return n_steps * args.accumulation * microbatch_size * args.seq_len


def main(args: Args) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = args.peak_tflops or (989.0 if any(g in name for g in ("H100", "H200")) else None)
    if peak is None and device.type == "cpu":
        dtype = torch.bfloat16 if args.cpu_bf16 else torch.float32
        peak = cpu_matmul_tflops(dtype=dtype)
        name = f"CPU ({torch.get_num_threads()} threads; measured {dtype} matmul peak {peak:.3f} TFLOP/s)"
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[args.shape], max_position_embeddings=max(4096, args.seq_len))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    # a step's FLOPs: forward 2N, backward 4N (the activations' gradients 2N, the weights' 2N)
    flops_per_token = 6 * n_params
    if args.lora_rank:
        if device.type == "cuda":
            model.to(torch.bfloat16)
        grpo_lora()["add_lora"](model, args.lora_rank, 32.0, LORA_LAYERS)
        # the frozen weights get no gradient: the backward's 2N for them is not done
        flops_per_token = 4 * n_params
    model.to(device)
    model.train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    trained = [p for p in model.parameters() if p.requires_grad]
    n_trained = sum(p.numel() for p in trained)
    optimizer = torch.optim.AdamW(trained, lr=1e-6)
    print(
        f"{name}, torch {torch.__version__}: {args.shape} ({n_params / 1e9:.3f}e9 parameters, "
        f"{n_trained / 1e6:.1f}e6 trained), sequences of {args.seq_len} tokens, {args.accumulation} "
        f"microbatches a step, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, "
        f"log-probs {args.log_probs}, LoRA rank {args.lora_rank or 'none'}, "
        f"autocast {'bf16' if device.type == 'cuda' or args.cpu_bf16 else 'off'}"
    )
    print(
        f"{'microbatch':>10} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'resident':>9} {'added GiB':>9}"
    )
    rows = []
    for microbatch_size in args.microbatch_sizes:
        try:
            # warm-up: kernels, AdamW state
            train_steps(model, optimizer, args, microbatch_size, 1, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            # the weights and AdamW's state are resident now: the steps' peak above them is
            # what their microbatches add
            reset_peak(device)
            resident = current_gib(device)
            start = time.perf_counter()
            tokens = train_steps(model, optimizer, args, microbatch_size, args.steps, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            tokens_per_s = tokens / (time.perf_counter() - start)
        except torch.OutOfMemoryError:
            print(f"{microbatch_size:>10} {'out of memory':>27}")
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            break
        mfu = flops_per_token * tokens_per_s / (peak * 1e12) if peak else None
        rows.append(
            dict(
                microbatch_size=microbatch_size,
                tokens_per_s=tokens_per_s,
                mfu=mfu,
                peak_gib=peak_gib(device),
                resident_gib=resident,
                added_gib=peak_gib(device) - resident,
            )
        )
        mfu_text = f"{mfu:.1%}" if mfu is not None else "-"
        print(
            f"{microbatch_size:>10} {tokens_per_s:>10.0f} {mfu_text:>6} {rows[-1]['peak_gib']:>9.2f}"
            f" {resident:>9.2f} {rows[-1]['added_gib']:>9.2f}",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
