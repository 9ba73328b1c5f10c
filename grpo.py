"""Group Relative Policy Optimization (GRPO) with verifiable rewards: a vLLM engine samples, PyTorch
trains.

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300) is PPO without a value function. Each
step:
  1. sample `rollout_batch_size / group_size` questions and let the engine write `group_size`
  responses to each;
  2. score every response with verifiers.score (1 if its final answer is right, else 0);
  3. advantage of response i in its group: A_i = (r_i - mean(group)) / (std(group) + eps): the group
  is the baseline;
  4. minimise the clipped surrogate -min(ratio_t A_i, clip(ratio_t, 1 - clip_low, 1 + clip_high)
  A_i) over the
     response tokens, ratio_t = p(token) / p_old(token), for one or more optimizer steps on these
     rollouts;
  5. copy the new weights into the engine and *prove* it now samples from them (reload_and_check).

Beyond the textbook, each an Args field (docs/grpo_family.md): GSPO and CISPO losses, three loss
aggregations, clip-higher, a k3 KL, several updates per rollout batch, DAPO's overlong penalty and
dynamic sampling, truncated importance sampling. train/loss sits near 0 while the model learns:
watch rollout/reward_mean.

Simplifications: (1) generation and training take turns; more GPUs: data parallel, a whole model per
rank; (2) groups with no signal are dropped (--dynamic-sampling draws more); (3) the reward is the
verifier's 0 or 1; (4) the KL is in the loss (k3), off by default as in TRL; (5) the engine/trainer
mismatch is corrected per token, capped at 2 as in verl.

Usage:
    python grpo.py --model Qwen/Qwen3-1.7B-Base                    # GSM8K, R1-Zero template, 200 steps, 2 GPUs
    torchrun --nproc-per-node 4 grpo.py --model Qwen/Qwen3-1.7B-Base  # 8 GPUs: 4 ranks of 2 (docs/distributed.md)
    python grpo.py --dataset gsm8k:0.25,math:0.25,mbpp:0.25,ifeval:0.25 --data-dir ../shared/data \\
        --dataset-templates ifeval=question                        # a mixture of tasks: docs/tasks.md
  No GPU: `python ladder.py` runs tiny model -> SFT -> GRPO, printing each stage's command line (~4
  s a GRPO step).
"""

import contextlib
import datetime
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler
from vllm import LLM, SamplingParams

import data
import verifiers


@dataclass
class Args:
    # --- run ---
    # runs/<exp_name>__<seed>__<unix time>
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    seed: int = 1  # seed for the questions drawn, the engine's sampling and the minibatch order
    output_dir: str = "runs"  # where run folders are made
    # a run folder to continue from its last checkpoint, with its own arguments
    resume: str | None = None
    track: bool = False  # also log to Weights & Biases (pip install wandb)
    wandb_project: str = "rlvr-grpo"  # the W&B project, with --track
    # --- model ---
    model: str = "Qwen/Qwen3-1.7B-Base"  # Hugging Face name or folder; also the KL reference
    # device of the trainer; None: this rank's first GPU, else cpu (resolve_devices)
    policy_device: str | None = None
    # device of the vLLM engine; None: this rank's second GPU, else the trainer's
    vllm_device: str | None = None
    # the engine's share of its GPU; None: 0.85 alone, 0.3 shared
    vllm_gpu_memory_utilization: float | None = None
    # recompute activations in the backward pass: less memory, about 30% more time
    gradient_checkpointing: bool = False
    # --- data ---
    # gsm8k | math | mbpp | ifeval | synthetic, or a mixture: gsm8k:0.5,math:0.5
    dataset: str = "gsm8k"
    data_dir: str | None = None  # data root, one folder per dataset (../shared/data); None: the hub
    template: str = "r1_zero"  # r1_zero | question | chat (data.py)
    # e.g. ifeval=question: another template for a dataset
    dataset_templates: list[str] = field(default_factory=list)
    # e.g. mbpp=order.txt: a dataset's questions in a file's order
    curriculum: list[str] = field(default_factory=list)
    # --- generation ---
    n_grpo_steps: int = 200  # GRPO steps: generate a rollout batch, train on it, reload the engine
    rollout_batch_size: int = 256  # responses per step: / group_size questions
    # responses per question; their mean reward is each one's baseline (at least 2)
    group_size: int = 8
    # sampling temperature; the trainer divides its logits by it too, so the ratio starts at 1
    temperature: float = 1.0
    # max new tokens per response; answers cut off here score 0 (watch rollout/truncation_rate)
    max_tokens: int = 1024
    # --- optim ---
    lr: float = 1e-5  # peak learning rate of AdamW (reached after the warmup)
    weight_decay: float = 0.0  # AdamW weight decay
    # GRPO steps over whose optimizer steps the learning rate rises linearly from 0
    warmup_steps: int = 0
    # after the warmup: constant | cosine (to 0 at the last GRPO step)
    lr_schedule: str = "constant"
    # responses per optimizer step (fewer than a rollout batch: off-policy)
    train_batch_size: int = 256
    epochs_per_rollout_batch: int = 1  # passes over each rollout batch; more than 1 is off-policy
    microbatch_size: int = 2  # examples per forward/backward pass (gradients accumulate)
    max_grad_norm: float = 1.0  # clip the gradient's global L2 norm to this
    # --- grpo ---
    # no_baseline | reinforce_with_baseline | grpo_clip | gspo | cispo (LOSS_TYPES)
    loss_type: str = "grpo_clip"
    # sequence_mean | token_mean | constant (grpo_microbatch_train_step)
    loss_aggregation: str = "token_mean"
    normalize_by_std: bool = True  # divide advantages by their group's std (Dr. GRPO: don't)
    advantage_eps: float = 1e-6  # added to the group's std before dividing
    clip_low: float = 0.2  # the ratio is clipped below at 1 - clip_low (grpo_clip)
    # the ratio is clipped above at 1 + clip_high (grpo_clip); DAPO's clip-higher uses 0.28
    clip_high: float = 0.2
    beta: float = 0.0  # weight of the k3 KL to the starting model; 0: no reference loaded
    drop_zero_variance_groups: bool = True  # leave out groups with no gradient (groups_with_signal)
    overlong_buffer: int = 0  # DAPO's soft overlong penalty over the last this many tokens; 0: off
    overlong_penalty: float = 1.0  # the reward's penalty at --max-tokens tokens (overlong_penalty)
    dynamic_sampling: bool = False  # DAPO: draw more questions until enough groups have a signal
    max_draws: int = 4  # with --dynamic-sampling: draws per step, at most
    # leave responses cut off at --max-tokens out of the loss (DAPO's overlong filtering)
    mask_truncated: bool = False
    # truncated IS of the engine's numerics; None: off
    vllm_importance_sampling_cap: float | None = 2.0
    # --- eval ---
    eval_split: str = "val"  # val (or test where there is none) | test
    n_eval: int = 512  # problems evaluated per dataset, greedy, from the start of its eval split
    eval_every: int = 10  # evaluate every this many GRPO steps (and at the start and the end)
    eval_max_tokens: int = 1024  # max new tokens per evaluation response
    n_log_generations: int = 4  # evaluation responses to generations.jsonl
    save_every: int = 50  # checkpoint every this many GRPO steps (and at the end)
    # keep only the newest this many checkpoints (Qwen3-1.7B: ~20.6 GB each); 0 keeps all
    keep_checkpoints: int = 2
    reload_tol: float | None = None  # max probe gap (reload_and_check); None: 1e-3 fp32, 0.5 bf16
    # under torchrun: seconds a rank waits for the others, then names the late and stops
    rank_timeout_s: float = 1800


# --- ALGORITHM, CS336 vocabulary: tokenizing and log-probs (same in sft.py, expert_iter.py, grpo.py, distill.py) ---


def tokenize_prompt_and_output(
    prompt_strs: list[str], output_strs: list[str], tokenizer
) -> dict[str, torch.Tensor]:
    """Tokenize prompts and outputs separately, then collate_token_ids: input_ids, labels,
    response_mask (B, T)."""
    prompt_ids = tokenizer(prompt_strs, add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(output_strs, add_special_tokens=False)["input_ids"]
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    return collate_token_ids(prompt_ids, output_ids, pad_id if pad_id is not None else 0)


def collate_token_ids(
    prompt_ids: list[list[int]], output_ids: list[list[int]], pad_id: int
) -> dict:
    """Concatenate, pad and shift: input_ids, labels, response_mask (1 where the label is an output
    token), each (B, max_len - 1). From lengths, not pad ids: pad == EOS in Qwen3 base models, and
    the EOS must be learned."""
    max_len = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids, strict=True))
    full = torch.full((len(prompt_ids), max_len), pad_id, dtype=torch.long)  # (B, L)
    is_output = torch.zeros((len(prompt_ids), max_len), dtype=torch.bool)  # (B, L)
    for i, (p, o) in enumerate(zip(prompt_ids, output_ids, strict=True)):
        full[i, : len(p) + len(o)] = torch.tensor([*p, *o], dtype=torch.long)
        is_output[i, len(p) : len(p) + len(o)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": is_output[:, 1:]}


def compute_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of each next-token distribution, (B, T, V) logits -> (B, T): logsumexp(z) - sum
    softmax(z) z, which never takes the log of an underflowed probability. In chunks: at once, two
    more (B, T, V) float32 tensors."""
    flat = logits.reshape(-1, logits.shape[-1])  # (B T, V)
    chunks = [
        torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        for z in flat.split(chunk_size)
    ]
    return torch.cat(chunks).reshape(logits.shape[:-1])


def get_response_log_probs(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """log p(labels[t] | input_ids[:t+1]): (B, T) -> {"log_probs": (B, T)}, and "token_entropy" (B,
    T). The logits are divided by `temperature` as the engine's are when it samples (grpo.py needs
    it; SFT uses 1)."""
    logits = model(input_ids).logits.float()  # (B, T, V); float32 even under bf16 autocast
    # at T = 1, no second (B, T, V) copy
    logits = logits / temperature if temperature != 1.0 else logits
    # (B, T)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not return_token_entropy:
        return {"log_probs": log_probs}
    with torch.no_grad():
        return {"log_probs": log_probs, "token_entropy": compute_entropy(logits)}


def masked_normalize(
    tensor: torch.Tensor, mask: torch.Tensor, normalize_constant: float, dim: int | None = None
) -> torch.Tensor:
    """Sum of `tensor` where mask is 1, over `dim` (all dims if None), divided by
    normalize_constant."""
    return (tensor * mask).sum(dim=dim) / normalize_constant


# --- ALGORITHM: GRPO advantages and losses (pure: tests/test_grpo.py checks them by hand), the update, bookkeeping ---


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, dict], dict],
    rollout_responses: list[str],
    repeated_ground_truths: list,
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score each response and centre its reward on its group's: (advantages (B,), raw_rewards (B,),
    metadata). Responses i*G ... i*G + G - 1 form group i; reward_fn(response, ground_truth) returns
    a dict with "reward". A = r - mean(group), divided by std(group) + advantage_eps if
    normalize_by_std (torch's unbiased std, as CS336, TRL and verl). Equal rewards: A = 0."""
    if len(rollout_responses) % group_size != 0:
        raise ValueError(
            f"{len(rollout_responses)} responses do not make whole groups of {group_size}"
        )
    reward_dicts = [
        reward_fn(r, gt) for r, gt in zip(rollout_responses, repeated_ground_truths, strict=True)
    ]
    raw_rewards = torch.tensor([d["reward"] for d in reward_dicts], dtype=torch.float32)  # (B,)
    grouped = raw_rewards.view(-1, group_size)  # (n_groups, G)
    group_std = grouped.std(dim=1, keepdim=True)  # (n_groups, 1), unbiased
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)) / (
        group_std + advantage_eps if normalize_by_std else 1
    )
    metadata = {
        "reward_mean": raw_rewards.mean().item(),
        "reward_max": raw_rewards.max().item(),
        "reward_min": raw_rewards.min().item(),
        "reward_std": raw_rewards.std().item() if len(grouped) > 1 else 0.0,
        "frac_zero_std_groups": (group_std == 0).float().mean().item(),
    }
    metadata |= {
        f"{k}_mean": float(np.mean([d[k] for d in reward_dicts]))
        for k in ("format_reward", "answer_reward")
        if all(k in d for d in reward_dicts)
    }
    return advantages.reshape(-1), raw_rewards, metadata


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor, policy_log_probs: torch.Tensor
) -> torch.Tensor:
    """Per-token REINFORCE loss -A * log p: (B, 1) or (B,) rewards or advantages, (B, T) log-probs
    -> (B, T)."""
    return -raw_rewards_or_advantages.reshape(-1, 1) * policy_log_probs


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float | tuple[float, float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate -min(r A, clip(r, 1 - low, 1 + high) A), r = exp(log p - log
    p_old): advantages (B, 1) or (B,), log-probs (B, T), cliprange a float or (low, high) (DAPO's
    clip-higher: (0.2, 0.28)) -> loss (B, T) and (B, T) metadata: "clipped" where a bound is active
    (no gradient), "clipped_high" (A > 0), "clipped_low", r."""
    low, high = (cliprange, cliprange) if isinstance(cliprange, int | float) else cliprange
    advantages = advantages.reshape(-1, 1)  # (B, 1)
    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - low, 1 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    is_clipped = clipped < unclipped
    return loss, {
        "clipped": is_clipped,
        "clipped_high": is_clipped & (advantages > 0),
        "clipped_low": is_clipped & (advantages < 0),
        "ratio": ratio.detach(),
    }


# loss_type -> its inputs
LOSS_TYPES = {
    "no_baseline": ("raw_rewards",),
    "reinforce_with_baseline": ("advantages",),
    "grpo_clip": ("advantages", "old_log_probs", "cliprange"),
    "gspo": ("advantages", "old_log_probs", "cliprange", "response_mask"),
    "cispo": ("advantages", "old_log_probs", "cliprange"),
}
# grpo_microbatch_train_step's loss_aggregation
LOSS_AGGREGATIONS = ("sequence_mean", "token_mean", "constant")


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | tuple[float, float] | None = None,
    response_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (B, T) and metadata: no_baseline -r log p, reinforce_with_baseline -A log p,
    grpo_clip, and (docs/grpo_family.md) gspo: grpo_clip's surrogate of s_i = exp(mean_t (log p -
    log p_old)), one ratio per response (Zheng et al. 2025; its range is tiny: --clip-low 3e-4
    --clip-high 4e-4), on each of its tokens; cispo: the clipped ratio, detached, weighs -A log p,
    so every token keeps a gradient (MiniMax-M1: --clip-low 1)."""
    given = {
        "raw_rewards": raw_rewards,
        "advantages": advantages,
        "old_log_probs": old_log_probs,
        "cliprange": cliprange,
        "response_mask": response_mask,
    }
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose from {', '.join(LOSS_TYPES)}")
    if missing := [name for name in LOSS_TYPES[loss_type] if given[name] is None]:
        raise ValueError(f"loss_type {loss_type!r} needs {', '.join(missing)}")
    if loss_type in ("no_baseline", "reinforce_with_baseline"):  # -r log p, -A log p
        return compute_naive_policy_gradient_loss(
            given[LOSS_TYPES[loss_type][0]], policy_log_probs
        ), {}
    if loss_type == "gspo":
        mask = response_mask.to(policy_log_probs.dtype)
        log_ratio = ((policy_log_probs - old_log_probs) * mask).sum(-1, keepdim=True) / mask.sum(
            -1, keepdim=True
        )
        # (B, 1)
        loss, metadata = compute_grpo_clip_loss(
            advantages, log_ratio, torch.zeros_like(log_ratio), cliprange
        )
        return loss.expand_as(policy_log_probs), {
            k: v.expand_as(policy_log_probs) for k, v in metadata.items()
        }
    if loss_type == "cispo":
        low, high = (cliprange, cliprange) if isinstance(cliprange, int | float) else cliprange
        ratio = torch.exp(policy_log_probs - old_log_probs).detach()  # (B, T)
        weight = ratio.clamp(1 - low, 1 + high)
        return -weight * advantages.reshape(-1, 1) * policy_log_probs, {
            "clipped": weight != ratio,
            "ratio": ratio,
        }
    return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange)


def overlong_penalty(
    n_tokens: torch.Tensor, max_tokens: int, buffer: int, penalty: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) scaled by `penalty`, added to the
    reward: 0 up to max_tokens - buffer tokens, then linear down to -penalty at max_tokens (buffer
    0: none): (B,) lengths -> (B,)."""
    return -penalty * ((n_tokens - (max_tokens - buffer)) / max(buffer, 1)).clamp(0, 1)


def compute_k3_kl(policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(policy || reference) per token (Schulman 2020): exp(d) - d - 1, d = log
    p_ref - log p, on tokens sampled from the policy: (B, T). Unbiased, >= 0, 0 exactly where the
    two agree."""
    log_ratio = ref_log_probs - policy_log_probs
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | tuple[float, float] | None = None,
    loss_aggregation: str = "sequence_mean",
    n_batch_sequences: int | None = None,
    n_batch_tokens: int | None = None,
    normalize_constant: float | None = None,
    ref_log_probs: torch.Tensor | None = None,
    beta: float = 0.0,
    engine_log_probs: torch.Tensor | None = None,
    is_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This microbatch's share of the batch loss; calls backward(). Returns it (detached) and
    per-token metadata. Log-probs and response_mask (B, T); raw_rewards, advantages (B, 1) or (B,).
    The per-token loss l_it = v_it pg_it + beta k3_it (v_it = min(p_old / p_engine, is_cap),
    detached: the engine sampled in its own numerics, bf16, not from p_old; 1 without is_cap) is
    aggregated as sum_it w_it l_it over the response tokens, with the weights of the WHOLE batch (N
    responses, on every rank together):
        sequence_mean  w_it = 1 / (N |o_i|): mean over each response's tokens, then over responses
        (GRPO, CS336).
                       Every response weighs the same, so a token of a long wrong answer is
                       penalised less.
        token_mean     w_it = 1 / n_batch_tokens: one mean over all tokens (DAPO; TRL's and verl's
        default). constant       w_it = 1 / (N normalize_constant), e.g. --max-tokens (Dr. GRPO):
        the same whatever the lengths.
    So the microbatches' losses and gradients sum to the batch's, however it was split or padded. By
    default N = B * gradient_accumulation_steps, n_batch_tokens = this microbatch's tokens *
    gradient_accumulation_steps."""
    per_token_loss, metadata = compute_policy_gradient_loss(
        policy_log_probs,
        loss_type,
        raw_rewards,
        advantages,
        old_log_probs,
        cliprange,
        response_mask,
    )
    problems = [
        (
            engine_log_probs is not None and old_log_probs is None,
            "engine_log_probs needs old_log_probs (pre-update)",
        ),
        (beta > 0 and ref_log_probs is None, "beta > 0 needs ref_log_probs"),
        (
            loss_aggregation == "constant" and normalize_constant is None,
            "'constant' needs normalize_constant",
        ),
        (
            loss_aggregation not in LOSS_AGGREGATIONS,
            f"unknown loss_aggregation; choose from {LOSS_AGGREGATIONS}",
        ),
    ]
    if bad := [message for is_bad, message in problems if is_bad]:
        raise ValueError(bad[0])
    if engine_log_probs is not None:  # the mismatch, logged whether or not it is corrected
        metadata["engine_gap"] = (old_log_probs - engine_log_probs).abs()
        if is_cap is not None:
            metadata["above_is_cap"] = old_log_probs - engine_log_probs > math.log(is_cap)
            per_token_loss = (
                per_token_loss
                * torch.exp(old_log_probs - engine_log_probs).clamp(max=is_cap).detach()
            )
    if beta > 0:
        kl = compute_k3_kl(policy_log_probs, ref_log_probs)  # (B, T)
        per_token_loss = per_token_loss + beta * kl
        metadata["kl"] = kl.detach()
    mask = response_mask.to(per_token_loss.dtype)
    n_sequences = n_batch_sequences or mask.shape[0] * gradient_accumulation_steps
    n_tokens = n_batch_tokens or mask.sum().item() * gradient_accumulation_steps
    divisor = {
        "sequence_mean": mask.sum(-1, keepdim=True) * n_sequences,
        "token_mean": n_tokens,
        "constant": n_sequences * (normalize_constant or 1),
    }[loss_aggregation]
    loss = (per_token_loss * mask / divisor).sum()
    loss.backward()
    return loss.detach(), metadata


def groups_with_signal(raw_rewards: torch.Tensor, group_size: int, loss_type: str) -> torch.Tensor:
    """(n_groups,) bool: groups whose loss has a gradient: rewards not all equal (A != 0);
    no_baseline: any r != 0."""
    rewards = raw_rewards.view(-1, group_size)  # (n_groups, G)
    return (rewards != 0).any(dim=1) if loss_type == "no_baseline" else rewards.std(dim=1) > 0


def catch_up_scheduler(scheduler, n_steps_done: int, updates_per_step: int) -> None:
    """Step the schedule over the optimizer steps a GRPO step did not take: else a cosine never
    reaches 0."""
    # of a schedule step with no optimizer step: the point
    with warnings.catch_warnings(action="ignore"):
        while scheduler.last_epoch < n_steps_done * updates_per_step:
            scheduler.step()


def microbatches(tensors: dict, rows: list[int], lengths: list[int], size: int, device: str):
    """Yields (rows, their tensors on `device`) in microbatches of `size`, by length: each cut to
    its longest row."""
    rows = sorted(rows, key=lambda i: lengths[i])
    for chunk in (rows[i : i + size] for i in range(0, len(rows), size)):
        width = max(lengths[i] for i in chunk)
        yield chunk, {k: v[torch.tensor(chunk), :width].to(device) for k, v in tensors.items()}


def frozen_log_probs(
    model,
    batch: dict,
    lengths: list[int],
    rows: list[int],
    microbatch_size: int,
    temperature: float,
) -> torch.Tensor:
    """log p of each label in these rows of a padded batch (n, T) under a frozen model; the other
    rows' stay 0."""
    device = next(model.parameters()).device
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    log_probs = torch.zeros(batch["labels"].shape, device=device)  # (n, T)
    for chunk, micro in microbatches(batch, rows, lengths, microbatch_size, str(device)):
        with torch.no_grad(), autocast:
            out = get_response_log_probs(
                model, micro["input_ids"], micro["labels"], False, temperature
            )
        log_probs[chunk, : micro["labels"].shape[1]] = out["log_probs"].float()
    return log_probs


def update_policy(
    policy,
    reference,
    optimizer,
    scheduler,
    batch: dict,
    lengths: list[int],
    args: Args,
    step: int,
    autocast,
    n_bad_in_a_row: int,
) -> tuple[dict, int]:
    """Epochs over a rollout batch (input_ids, labels, response_mask, engine_log_probs (n, T);
    advantages, raw_rewards (n,)), an optimizer step per minibatch, gradients accumulated over
    microbatches (each rank's, summed). Returns the sums (per-token metadata summed over the
    response tokens) and the non-finite updates in a row: 3 stop the run."""
    tensors = {k: batch[k] for k in ("input_ids", "labels", "response_mask", "engine_log_probs")}
    advantages, raw_rewards = (
        batch["advantages"].to(policy.device),
        batch["raw_rewards"].to(policy.device),
    )
    n_minibatches = args.rollout_batch_size // args.train_batch_size
    sums = {"loss": 0.0, "grad_norm": 0.0, "updates": 0, "positions": sum(lengths) + len(lengths)}
    # every rank's
    orders = [
        np.random.default_rng([args.seed, step, epoch]).permutation(len(lengths))
        for epoch in range(args.epochs_per_rollout_batch)
    ]
    plan = [
        part.tolist()
        for order in orders
        for part in np.array_split(order, n_minibatches)
        if len(part)
    ]
    # balanced by length
    mine = lambda minibatch: sorted(minibatch, key=lambda i: lengths[i])[RANK::WORLD_SIZE]
    # Old and reference log-probs: once per rollout batch, before the first optimizer step.  (n, T)
    # each
    my_rows = sorted({i for minibatch in plan for i in mine(minibatch)})
    frozen = lambda model: frozen_log_probs(
        model, tensors, lengths, my_rows, args.microbatch_size, args.temperature
    )
    old_log_probs = (
        frozen(policy) if "old_log_probs" in LOSS_TYPES[args.loss_type] and len(plan) > 1 else None
    )
    ref_log_probs = frozen(reference) if reference is not None else None
    for minibatch in plan:
        n_tokens = int(tensors["response_mask"][minibatch].sum())
        n_micro, update_loss = (
            math.ceil(len(minibatch) / args.microbatch_size),
            torch.zeros((), device=policy.device),
        )
        for rows, micro in microbatches(
            tensors, mine(minibatch), lengths, args.microbatch_size, str(policy.device)
        ):
            with autocast:
                out = get_response_log_probs(
                    policy, micro["input_ids"], micro["labels"], True, args.temperature
                )
            width = micro["labels"].shape[1]
            # One optimizer step per rollout batch: the policy IS the old policy, at no extra
            # forward pass.
            old = (
                out["log_probs"].detach() if old_log_probs is None else old_log_probs[rows, :width]
            )
            loss, metadata = grpo_microbatch_train_step(
                out["log_probs"],
                micro["response_mask"],
                n_micro,
                args.loss_type,
                raw_rewards=raw_rewards[rows],
                advantages=advantages[rows],
                old_log_probs=old,
                cliprange=(args.clip_low, args.clip_high),
                loss_aggregation=args.loss_aggregation,
                n_batch_sequences=len(minibatch),
                n_batch_tokens=n_tokens,
                normalize_constant=args.max_tokens,
                ref_log_probs=None if ref_log_probs is None else ref_log_probs[rows, :width],
                beta=args.beta,
                engine_log_probs=micro["engine_log_probs"],
                is_cap=args.vllm_importance_sampling_cap,
            )
            # on the device: no sync per microbatch
            update_loss, mask = update_loss + loss, micro["response_mask"]
            per_token = {
                "entropy": out["token_entropy"],
                "tokens": torch.ones_like(mask),
                **metadata,
            }
            for key, tensor in per_token.items():
                sums[key] = sums.get(key, 0.0) + (tensor * mask).sum(dtype=torch.float32)
        sum_over_ranks(policy, update_loss)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        # the update's one sync
        update_loss, grad_norm = torch.stack([update_loss, grad_norm]).tolist()
        finite = math.isfinite(update_loss) and math.isfinite(grad_norm)
        n_bad_in_a_row = 0 if finite else n_bad_in_a_row + 1
        if finite:
            optimizer.step()
            scheduler.step()
            sums.update(
                loss=sums["loss"] + update_loss,
                grad_norm=sums["grad_norm"] + grad_norm,
                updates=sums["updates"] + 1,
            )
        elif n_bad_in_a_row >= 3:
            raise RuntimeError(
                f"step {step + 1}: {n_bad_in_a_row} non-finite updates in a row; check rewards and lr"
            )
        else:
            warnings.warn(
                f"step {step + 1}: loss {update_loss} or grad {grad_norm} not finite; skipped",
                stacklevel=2,
            )
        optimizer.zero_grad(set_to_none=True)
    # per-token sums of every rank
    parts = gather([{k: float(v) for k, v in sums.items() if torch.is_tensor(v)}])
    # (a rank with no rows: {})
    sums |= {k: sum(part.get(k, 0.0) for part in parts) for part in parts for k in part}
    return sums, n_bad_in_a_row


def check_args(args: Args) -> None:
    """Raise ValueError for inconsistent arguments before any engine starts or data loads."""
    problems = [
        (
            args.group_size < 2,
            f"group_size {args.group_size}: a group needs at least 2 responses for a baseline",
        ),
        (
            args.rollout_batch_size % args.group_size,
            "rollout_batch_size is not a multiple of group_size",
        ),
        (
            args.rollout_batch_size % args.train_batch_size,
            "rollout_batch_size is not a multiple of train_batch_size",
        ),
        (
            args.loss_type not in LOSS_TYPES,
            f"unknown loss_type; choose from {', '.join(LOSS_TYPES)}",
        ),
        (
            not 0 <= args.overlong_buffer <= args.max_tokens,
            "overlong_buffer must be in [0, max_tokens]",
        ),
        (
            args.dynamic_sampling and not args.drop_zero_variance_groups,
            "dynamic_sampling drops zero-variance groups",
        ),
        (args.max_draws < 1, "max_draws must be at least 1"),
        (
            args.loss_aggregation not in LOSS_AGGREGATIONS,
            f"unknown loss_aggregation; choose from {LOSS_AGGREGATIONS}",
        ),
        (
            args.lr_schedule not in ("constant", "cosine"),
            "unknown lr_schedule; choose from constant, cosine",
        ),
        (
            args.temperature <= 0,
            "temperature must be > 0: GRPO needs several different responses per question",
        ),
    ]
    if bad := [message for is_bad, message in problems if is_bad]:
        raise ValueError(bad[0])


def write_rollouts(
    path: Path, step: int, examples, prompts, completions, rewards, advantages, trained, group_size
):
    """One line per group in rollouts.jsonl: question, responses, rewards, advantages, which were
    trained on."""
    groups = [range(j * group_size, (j + 1) * group_size) for j in range(len(examples))]
    append_jsonl(
        path,
        [
            {
                "step": step,
                "dataset": ex["dataset"],
                "id": ex["id"],
                "answer": ex["answer"],
                "prompt": prompt,
                "responses": [completions[i].text for i in group],
                "rewards": [rewards[i].item() for i in group],
                "trained": [i in trained for i in group],
                "advantages": [advantages[i].item() for i in group],
                "n_tokens": [len(completions[i].token_ids) for i in group],
                "finish_reasons": [completions[i].finish_reason for i in group],
            }
            for ex, prompt, group in zip(examples, prompts, groups, strict=True)
        ],
    )


def step_metrics(
    reward_metadata: dict, completions: list, n_trained: int, sums: dict, extra: dict, args: Args
) -> dict:
    """One GRPO step's metrics: rollout statistics, the update's means (per token for the train
    step's metadata)."""
    lengths = [len(c.token_ids) for c in completions]
    metrics = {
        **{f"rollout/{key}": value for key, value in reward_metadata.items()},
        "rollout/response_length": float(np.mean(lengths)),
        "rollout/response_length_max": max(lengths),
        "rollout/truncation_rate": float(
            np.mean([c.finish_reason == "length" for c in completions])
        ),
        "rollout/n_trained": n_trained,
        "rollout/tokens_per_second": sum(lengths) / extra["time/generate"],
        "train/n_updates": sums["updates"],
        **extra,
    }
    if sums["updates"]:
        # ~0 on-policy while the gradient is not
        metrics["train/loss"] = sums["loss"] / sums["updates"]
        metrics["train/grad_norm"] = sums["grad_norm"] / sums["updates"]
        metrics["train/tokens_per_second"] = (
            sums["positions"] * args.epochs_per_rollout_batch / extra["time/train"]
        )
        token_means = {
            "entropy": "entropy",
            "clipped": "clip_fraction",
            "clipped_low": "clip_fraction_low",
            "clipped_high": "clip_fraction_high",
            "kl": "kl",
            "engine_gap": "engine_logprob_gap",
            "above_is_cap": "frac_above_is_cap",
        }
        metrics.update(
            {
                f"train/{v}": sums[k] / max(sums["tokens"], 1)
                for k, v in token_means.items()
                if k in sums
            }
        )
    return metrics


def main(args: Args) -> Path:
    args = restore_args(args)  # --resume: the stopped run's arguments
    check_args(args)
    n_prompts = args.rollout_batch_size // args.group_size
    # a bad spec stops here, before the engine starts
    task = data.load_task(args, n_questions=n_prompts)
    # --- PLUMBING: ranks, run folder, devices, engine, seeds, policy (the same steps in every script) ---
    # under torchrun: every rank an engine, a trainer, a share of the questions
    init_distributed(args.rank_timeout_s)
    run_dir = make_run_dir(args)
    policy_device, vllm_device, memory_fraction, reload_tol = resolve_devices(args)
    model_path = str(checkpoints(run_dir)[-1]) if checkpoints(run_dir) else args.model
    print(
        f"run folder {run_dir}; trainer on {policy_device}, vLLM on {vllm_device}; starting from {model_path}"
    )
    task.tokenizer = tokenizer = AutoTokenizer.from_pretrained(model_path)
    # The engine's context must hold a prompt and its response, and the 400-token reload probes plus
    # 16 tokens.
    max_model_len = max(task.longest_prompt(), 400) + max(args.max_tokens, args.eval_max_tokens, 16)
    # The engine first: it starts only if gpu_memory_utilization x its GPU is free; the trainer gets
    # the rest.
    llm = init_vllm(model_path, vllm_device, args.seed, memory_fraction, max_model_len)
    policy, autocast = load_policy(
        model_path, policy_device, args.gradient_checkpointing, args.seed
    )
    # the KL's reference: bf16 on a GPU
    dtype = torch.bfloat16 if policy_device.startswith("cuda") else torch.float32
    reference = (
        AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        .to(policy_device)
        .requires_grad_(False)
        if args.beta > 0
        else None
    )  # the starting model, frozen (also after --resume)
    # logprobs=0: each sampled token's log-prob too, after temperature (processed_logprobs), for the
    # mismatch correction
    sampling = dict(
        n=args.group_size,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        include_stop_str_in_output=True,
        logprobs=0,
    )
    probe_prompts = make_probe_prompts(
        tokenizer, [task.prompt(ex) + ex["solution"] for ex in task.train[:8]]
    )

    # --- Optimizer and resume ---
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95)
    )
    updates_per_step = (
        args.rollout_batch_size // args.train_batch_size * args.epochs_per_rollout_batch
    )
    scheduler = get_scheduler(
        "cosine" if args.lr_schedule == "cosine" else "constant_with_warmup",
        optimizer,
        args.warmup_steps * updates_per_step,
        args.n_grpo_steps * updates_per_step,
    )
    start_step = resume_from(run_dir, optimizer, scheduler, "rollouts.jsonl")
    log = make_logger(run_dir, args)
    # the engine follows from step 0 on
    gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
    if start_step == 0:
        log(
            {
                **evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, 0),
                "reload/logprob_gap": gap,
            },
            0,
        )

    # --- ALGORITHM: the GRPO loop ---
    n_bad_in_a_row = 0
    for step in range(start_step, args.n_grpo_steps):
        # when each phase ended: time/<phase> is the time from the previous end
        ends = {"start": time.time()}
        # --- 1. Generate and score group_size responses to each question; --dynamic-sampling (DAPO) draws more ---
        examples, prompts, outputs, scores, t_score = [], [], [], [], 0.0
        for draw in range(args.max_draws if args.dynamic_sampling else 1):
            drawn, seeds = task.questions(
                n_prompts, args.group_size, args.seed + draw * 1_000_003, step
            )
            examples, prompts = examples + drawn, prompts + [task.prompt(ex) for ex in drawn]
            params = [
                SamplingParams(**sampling, stop=task.stop(e), seed=s)
                for e, s in zip(drawn, seeds, strict=True)
            ]
            # each rank its share of the questions; all are gathered below
            with engine_device(vllm_device):
                mine = llm.generate(
                    my_share(prompts[-n_prompts:]), my_share(params), use_tqdm=False
                )
            t0, new = time.time(), [c for output in mine for c in output.outputs]
            verdicts = verifiers.score_batch(
                [c.text for c in new], [e for e in my_share(drawn) for _ in range(args.group_size)]
            )
            penalties = overlong_penalty(
                torch.tensor([len(c.token_ids) for c in new]),
                args.max_tokens,
                args.overlong_buffer,
                args.overlong_penalty,
            ).tolist()
            scores += gather(
                [
                    {**v, "reward": v["reward"] + pen}
                    for v, pen in zip(verdicts, penalties, strict=True)
                ]
            )
            outputs, t_score = outputs + gather(mine), t_score + time.time() - t0
            rewards = torch.tensor([score["reward"] for score in scores])
            if groups_with_signal(rewards, args.group_size, args.loss_type).sum() >= n_prompts:
                break
        # Flattened, group by group: responses j * G ... j * G + G - 1 answer question j.  (B,)
        # lists
        completions = [c for output in outputs for c in output.outputs]
        prompt_ids = [list(output.prompt_token_ids) for output in outputs for _ in output.outputs]
        engine_lps = [
            [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
            for c in completions
        ]
        # minus the draws' scoring: it counts in time/score
        ends["generate"] = time.time() - t_score

        # --- 2. Advantages within each group (scored above: the reward_fn hands back each response's score) ---
        advantages, raw_rewards, reward_metadata = compute_group_normalized_rewards(
            lambda _, score: score,
            [c.text for c in completions],
            scores,
            args.group_size,
            args.advantage_eps,
            args.normalize_by_std,
        )
        has_signal = groups_with_signal(raw_rewards, args.group_size, args.loss_type)  # (n_groups,)
        # DAPO's dynamic sampling: the first n_prompts fill the batch
        has_signal &= has_signal.cumsum(0) <= n_prompts
        rows = [
            i
            for i, c in enumerate(completions)  # the responses trained on
            if (has_signal[i // args.group_size] or not args.drop_zero_variance_groups)
            and not (args.mask_truncated and c.finish_reason == "length")
        ]
        write_rollouts(
            run_dir / "rollouts.jsonl",
            step + 1,
            examples,
            prompts,
            completions,
            raw_rewards,
            advantages,
            set(rows),
            args.group_size,
        )
        ends["score"] = time.time()

        # --- 3. Update: epochs over the kept rollouts, optimizer steps on minibatches, gradient accumulation ---
        sums = {"loss": 0.0, "grad_norm": 0.0, "updates": 0, "positions": 0}
        if rows:
            batch = collate_token_ids(
                [prompt_ids[i] for i in rows], [completions[i].token_ids for i in rows], 0
            )
            # (n, T), laid out like the labels
            batch["engine_log_probs"] = torch.zeros(batch["response_mask"].shape)
            batch["engine_log_probs"][batch["response_mask"]] = torch.tensor(
                [v for i in rows for v in engine_lps[i]]
            )
            # (n,) each
            batch["advantages"], batch["raw_rewards"] = advantages[rows], raw_rewards[rows]
            # unpadded positions
            lengths = [len(prompt_ids[i]) + len(completions[i].token_ids) - 1 for i in rows]
            sums, n_bad_in_a_row = update_policy(
                policy,
                reference,
                optimizer,
                scheduler,
                batch,
                lengths,
                args,
                step,
                autocast,
                n_bad_in_a_row,
            )
        catch_up_scheduler(scheduler, step + 1, updates_per_step)
        ends["train"] = time.time()

        # --- 4. Reload the new weights into the engine, and prove it follows them (unless nothing changed) ---
        gap = (
            reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
            if sums["updates"]
            else None
        )
        ends["reload"] = time.time()

        # --- 5. Log, evaluate, save ---
        step_done = step + 1
        extra = {
            "train/lr": scheduler.get_last_lr()[0],
            "reload/logprob_gap": gap,
            "rollout/n_draws": draw + 1,
            **{f"time/{phase}": ends[phase] - ends[prev] for prev, phase in pairwise(ends)},
        }
        metrics = step_metrics(reward_metadata, completions, len(rows), sums, extra, args)
        metrics.update(
            task.rollout_metrics(examples, raw_rewards.view(-1, args.group_size).tolist())
        )
        if step_done % args.eval_every == 0 or step_done == args.n_grpo_steps:
            metrics.update(
                evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, step_done)
            )
        metrics["time/step"] = time.time() - ends["start"]
        log(metrics, step_done)
        why = "finite update" if rows else "group with a reward signal"
        trained = (
            f"loss {metrics['train/loss']:+.4f} grad {metrics['train/grad_norm']:.3f} | gap {gap:.0e}"
            if sums["updates"]
            else f"nothing trained: no {why}"
        )
        print(
            f"step {step_done:5d}/{args.n_grpo_steps} | reward {metrics['rollout/reward_mean']:.3f} | len "
            f"{metrics['rollout/response_length']:.0f} trunc {metrics['rollout/truncation_rate']:.2f} | zero-std "
            f"{metrics['rollout/frac_zero_std_groups']:.2f} | {trained} | {metrics['time/step']:.1f} s"
        )
        if step_done % args.save_every == 0 or step_done == args.n_grpo_steps:
            save_checkpoint(
                run_dir, step_done, policy, tokenizer, optimizer, scheduler, args.keep_checkpoints
            )
    return run_dir


# --- PLUMBING: the vLLM engine, weight reloads, evaluation (same in sft.py, expert_iter.py, grpo.py, distill.py) ---


def engine_device(device: str):
    """Run engine calls with the engine's GPU current: vLLM uses the ambient CUDA device
    (docs/gpu.md)."""
    return torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()


def init_vllm(
    model: str, device: str, seed: int, gpu_memory_utilization: float, max_model_len: int
) -> LLM:
    """A vLLM engine in this process (reload_weights then takes the trainer's tensors directly) on
    "cpu" or "cuda:N"; processed_logprobs: a sampled token's log-prob after temperature, as it was
    sampled."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    common = dict(
        model=model,
        seed=seed,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
    )
    if device == "cpu":
        # float32: log-probs match the trainer's; eager: no ~40 s compile; a 1 GiB KV cache, not
        # half the RAM. No chunked prefill: vLLM then rewinds seeded generators, which fails on CPU
        # ("CPU Generator does not use offset")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return LLM(**common, dtype="float32", enforce_eager=True, enable_chunked_prefill=False)
    # device_ids places the engine; the memory share is of that whole GPU
    gpu = torch.device(device).index or 0
    return LLM(
        **common, dtype="bfloat16", device_ids=[gpu], gpu_memory_utilization=gpu_memory_utilization
    )


def load_policy_into_vllm(policy, llm: LLM, device: str) -> None:
    """Copy the trainer's weights into the running engine and drop its prefix cache (computed with
    the OLD weights). state_dict(), not named_parameters(): that one leaves out the tied
    lm_head.weight, which would stay stale."""
    with engine_device(device):
        weights = [
            (name, t.detach().to(llm.llm_engine.model_config.dtype))
            for name, t in policy.state_dict().items()
        ]
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")


def make_probe_prompts(tokenizer, texts: list[str], n_tokens: int = 400) -> list[list[int]]:
    """Two fixed prompts for the reload check, long: a prefix cache reuses only full blocks (128
    tokens on CPU)."""
    # surely long enough
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"] * (2 * n_tokens)
    return [ids[:n_tokens], ids[n_tokens : 2 * n_tokens]]


def weights_that_differ(policy, llm: LLM, device: str) -> list[str]:
    """The engine's weights that differ, bit for bit, from the trainer's in the engine's dtype
    (every 64th row; a fused weight stacks the trainer's parts): exact in bf16 too. On CPU, linear
    weights live in oneDNN (empty): skipped."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    state, rows = policy.state_dict(), lambda t: t if t.dim() == 1 else t[::64]
    with engine_device(device):
        (engine,) = llm.apply_model(
            lambda model: {n: rows(p.detach()).cpu() for n, p in model.named_parameters()}
        )
    differ = []
    for name, tensor in engine.items():
        module = name.split(".")[-2]  # model.layers.0.self_attn.qkv_proj.weight -> qkv_proj
        trainer = torch.cat(
            [state[name.replace(module, part)] for part in fused.get(module, (module,))]
        )
        if tensor.numel() and not torch.equal(tensor, rows(trainer).to(tensor.dtype).cpu()):
            differ.append(name)
    return differ


def probe_gap(
    policy, llm: LLM, probe_prompts: list[list[int]], device: str, n_tokens: int = 16
) -> float:
    """The engine continues each probe greedily, the trainer scores the same tokens: the worse
    prompt's median |log-prob gap| (a near-tie in bf16 must not stop a run). Generated: prompt
    log-probs skip the prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, logprobs=0, ignore_eos=True)
    with engine_device(device):
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in probe_prompts], params, use_tqdm=False
        )
    gaps = []
    for prompt, output in zip(probe_prompts, outputs, strict=True):
        ids, logprobs = list(output.outputs[0].token_ids), output.outputs[0].logprobs
        full = torch.tensor([prompt + ids], device=next(policy.parameters()).device)  # (1, L)
        with torch.no_grad():
            trainer = get_response_log_probs(policy, full[:, :-1], full[:, 1:])["log_probs"][
                0, -len(ids) :
            ]
        engine = torch.tensor([lp[t].logprob for lp, t in zip(logprobs, ids, strict=True)])
        gaps.append((engine - trainer.float().cpu()).abs().median().item())
    return max(gaps)


def reload_and_check(
    policy, llm: LLM, probe_prompts: list[list[int]], device: str, tol: float
) -> float:
    """Copy the trainer's weights into the engine and prove it follows them, or raise: the weights
    read back equal the trainer's, and the probe's gap is within tol (~1e-6 in float32); a warning
    above tol / 10. Returns the gap."""
    load_policy_into_vllm(policy, llm, device)
    differ, gap = (
        weights_that_differ(policy, llm, device),
        probe_gap(policy, llm, probe_prompts, device),
    )
    if differ or not gap <= tol:
        raise RuntimeError(
            f"vLLM does not follow the trainer after a weight reload: engine weights that differ "
            f"{differ}, median |log-prob gap| {gap:.3g} (stop above {tol:.3g})"
        )
    if gap > tol / 10:
        warnings.warn(
            f"engine/trainer log-prob gap {gap:.3g} after a reload (stop above {tol:.3g})",
            stacklevel=2,
        )
    return gap


def evaluate(
    llm: LLM, policy, tokenizer, task: data.Task, args, vllm_device: str, run_dir: Path, step: int
):
    """Greedy responses to every eval example, scored: metrics per dataset and in all; a few to
    generations.jsonl."""
    # gathered below
    t0, examples = time.time(), my_share([ex for name in task.names for ex in task.evals[name]])
    # stop strings stay in the output: the verifier reads them
    prompts = [task.prompt(ex) for ex in examples]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=args.eval_max_tokens,
            stop=task.stop(ex),
            include_stop_str_in_output=True,
        )
        for ex in examples
    ]
    with engine_device(vllm_device):
        completions = [output.outputs[0] for output in llm.generate(prompts, params, use_tqdm=True)]
    # code: programs run in a pool
    rewards = verifiers.score_batch([c.text for c in completions], examples)
    records = [
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
        for ex, prompt, c, reward in zip(examples, prompts, completions, rewards, strict=True)
    ]
    records = gather(records)
    sample_metrics, samples = log_generations(policy, tokenizer, records[: args.n_log_generations])
    append_jsonl(run_dir / "generations.jsonl", [{"step": step, **sample} for sample in samples])
    metrics = data.eval_metrics(records)
    print(
        f"step {step:5d} | eval accuracy {metrics['eval/accuracy']:.3f} format {metrics['eval/format_rate']:.3f}"
    )
    return {**metrics, **sample_metrics, "time/eval": time.time() - t0}


def log_generations(policy, tokenizer, records: list[dict]) -> tuple[dict, list[dict]]:
    """The trainer's mean token entropy over each record's response: (metrics, records with
    "mean_token_entropy"). None, not NaN, without records: strict JSON. (data.eval_metrics has the
    lengths, over all the records.)"""
    out = []
    for record in records:
        batch = tokenize_prompt_and_output([record["prompt"]], [record["response"]], tokenizer)
        batch = {k: v.to(policy.device) for k, v in batch.items()}
        with torch.no_grad():
            entropy = get_response_log_probs(policy, batch["input_ids"], batch["labels"], True)[
                "token_entropy"
            ]
        n_tokens = max(batch["response_mask"].sum().item(), 1)
        out.append(
            {
                **record,
                "mean_token_entropy": masked_normalize(
                    entropy, batch["response_mask"], n_tokens
                ).item(),
            }
        )
    return {
        "eval/sample_token_entropy": float(np.mean([r["mean_token_entropy"] for r in out]))
        if out
        else None
    }, out


# --- PLUMBING: run folder, devices, checkpoints, logs, ranks (same in sft.py, expert_iter.py, grpo.py, distill.py) ---

# torchrun's; alone: 0 of 1
RANK, WORLD_SIZE = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
# under torchrun: a gloo group, and how long a rank waits in it for the others (docs/distributed.md)
RANKS = {}
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
}


def restore_args(args):
    """With --resume: the stopped run's arguments. A non-default one that differs is refused, unless
    it may change."""
    if not args.resume:
        return args
    saved, defaults = json.loads((Path(args.resume) / "args.json").read_text()), type(args)()
    given = {k: v for k, v in asdict(args).items() if v != getattr(defaults, k)}
    conflicts = [
        f"--{k.replace('_', '-')} {v!r} (the run has {saved[k]!r})"
        for k, v in given.items()
        if k in saved and saved[k] != v and k not in RESUME_MAY_CHANGE
    ]
    if conflicts:
        raise ValueError(
            f"--resume {args.resume} continues a run with other arguments: {', '.join(conflicts)}"
        )
    return replace(
        args,
        **{k: v for k, v in saved.items() if k in defaults.__dataclass_fields__ and k not in given},
    )


def make_run_dir(args) -> Path:
    """runs/<exp_name>__<seed>__<unix time> (rank 0's time), or the folder being resumed, with
    args.json in it."""
    name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path(args.resume or Path(args.output_dir) / gather([name])[0])
    if RANK == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json").write_text(json.dumps(asdict(args), indent=2))
    return run_dir


def resolve_devices(args) -> tuple[str, str, float, float]:
    """(trainer's device, engine's, the engine's share of its GPU, reload tolerance). The node's
    GPUs are dealt out to its ranks (one process: one rank), k each: with k >= 2 a rank's trainer
    takes its first, its engine the second; with k = 1 they share it; with none, both are on the
    CPU, in float32. "cuda" is "cuda:0", so that they compare."""
    canonical = lambda d: str(
        torch.device(d.type, d.index or 0) if (d := torch.device(d)).type == "cuda" else d
    )
    # torchrun sets LOCAL_*
    k = torch.cuda.device_count() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    first = int(os.environ.get("LOCAL_RANK", 0)) * k
    policy_device = canonical(args.policy_device or (f"cuda:{first}" if k else "cpu"))
    vllm_device = canonical(args.vllm_device or (f"cuda:{first + 1}" if k > 1 else policy_device))
    # None: the defaults; 0 is a value
    memory, tol = args.vllm_gpu_memory_utilization, args.reload_tol
    memory = (0.3 if vllm_device == policy_device else 0.85) if memory is None else memory
    return (
        policy_device,
        vllm_device,
        memory,
        (1e-3 if vllm_device == "cpu" else 0.5) if tol is None else tol,
    )


def load_policy(model_path: str, device: str, gradient_checkpointing: bool, seed: int):
    """Seed, make the trainer's GPU current (the engine set its own), load in float32, train mode:
    (model, autocast)."""
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    # from_pretrained returns eval mode, in which gradient checkpointing is silently off
    policy.train()
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    return policy, torch.autocast("cuda", torch.bfloat16) if device.startswith(
        "cuda"
    ) else contextlib.nullcontext()


def checkpoints(run_dir: Path) -> list[Path]:
    """A run folder's complete checkpoints, oldest first (step_N.tmp, one being written, is not
    one)."""
    return sorted(
        p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp")
    )


def save_checkpoint(
    run_dir: Path, step: int, policy, tokenizer, optimizer, scheduler, keep: int
) -> None:
    """checkpoints/step_N: a Hugging Face model folder and trainer_state.pt (no RNG state: all that
    is random derives from (seed, step)), written as step_N.tmp then renamed: a kill mid-save loses
    nothing. Keeps the newest `keep`."""
    if RANK:  # the ranks' weights are the same
        return
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoints(run_dir)[:-keep] if keep else []:
        shutil.rmtree(old)


def resume_from(run_dir: Path, optimizer, scheduler, *record_files: str) -> int:
    """Restore the newest checkpoint's optimizer and scheduler, return its step (0 without one).
    Records written after it are dropped (by rename: a crash leaves the file whole)."""
    if not checkpoints(run_dir):
        return 0
    state = torch.load(checkpoints(run_dir)[-1] / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    for path in [run_dir / name for name in ("metrics.jsonl", "generations.jsonl", *record_files)]:
        if path.exists() and RANK == 0:
            kept = [
                line
                for line in path.read_text().splitlines(True)
                if json.loads(line)["step"] <= state["step"]
            ]
            path.with_name(path.name + ".tmp").write_text("".join(kept))
            os.replace(path.with_name(path.name + ".tmp"), path)
    print(f"resumed from {checkpoints(run_dir)[-1]} after step {state['step']}")
    return state["step"]


def append_jsonl(path: Path, records: list[dict], allow_nan: bool = True) -> None:
    # rank 0 writes what every rank gathered
    with open(path if RANK == 0 else os.devnull, "a") as f:
        f.writelines(json.dumps(record, allow_nan=allow_nan) + "\n" for record in records)


def make_logger(run_dir: Path, args):
    """log(metrics, step) appends to metrics.jsonl (NaN as null: strict JSON) and W&B (--track):
    rank 0, for all."""
    if args.track and RANK == 0:
        import wandb

        wandb.init(
            project=args.wandb_project, name=run_dir.name, config=asdict(args), resume="allow"
        )

    def log(metrics: dict, step: int) -> None:
        metrics = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in metrics.items()
        }
        # a nested NaN: raise
        append_jsonl(run_dir / "metrics.jsonl", [{"step": step, **metrics}], allow_nan=False)
        if args.track and RANK == 0:
            wandb.log(metrics, step=step)

    return log


def init_distributed(timeout_s: float) -> None:
    """Under torchrun: join the ranks (NCCL on GPUs, else gloo) before the engine starts, else it
    makes a world of its own, and make the gloo group now, while all are here (a collective too).
    Rank 0 prints."""
    if WORLD_SIZE > 1:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
        RANKS.update(group=dist.new_group(backend="gloo", timeout=timeout), timeout=timeout)
        sys.stdout = sys.stdout if RANK == 0 else open(os.devnull, "w")


def my_share(items: list) -> list:
    """This rank's contiguous share of a list every rank holds."""
    return items[RANK * len(items) // WORLD_SIZE : (RANK + 1) * len(items) // WORLD_SIZE]


def gather(items: list) -> list:
    """Every rank's list, concatenated in rank order, after a monitored_barrier (it names a rank
    that does not come)."""
    if not RANKS:
        return items
    dist.monitored_barrier(RANKS["group"], RANKS["timeout"])
    parts = [None] * WORLD_SIZE
    dist.all_gather_object(parts, items, group=RANKS["group"])
    return [item for part in parts for item in part]


def sum_over_ranks(model, *tensors: torch.Tensor) -> None:
    """Sum the gradients and these tensors over the ranks, in place: DDP's all-reduce by hand
    (docs/distributed.md)."""
    if RANKS:
        dist.monitored_barrier(RANKS["group"], RANKS["timeout"])
        for p in model.parameters():
            # a rank with no rows in this minibatch
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        for tensor in [p.grad for p in model.parameters()] + list(tensors):
            dist.all_reduce(tensor)


if __name__ == "__main__":
    main(tyro.cli(Args))
