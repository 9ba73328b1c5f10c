"""Group Relative Policy Optimization (GRPO) with verifiable rewards; a vLLM engine samples, and reloads the trainer's
weights after every step.

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300) is PPO without a value function. Each step:
  1. sample `rollout_batch_size / group_size` questions and let the engine write `group_size` responses to each;
  2. score every response with verifiers.score (1 if its final answer is right, else 0);
  3. advantage of response i in its group: A_i = (r_i - mean(group)) / (std(group) + eps): the group is the baseline;
  4. minimise the clipped surrogate -min(ratio_t A_i, clip(ratio_t, 1 - clip_low, 1 + clip_high) A_i) over the
     response tokens, ratio_t = p(token) / p_old(token), for one or more optimizer steps on these rollouts;
  5. copy the new weights into the engine and *prove* it now samples from them (check_vllm_follows_policy).

Beyond the textbook, each behind an Args field: the loss aggregation (below), asymmetric "clip-higher" clipping
(DAPO, Yu et al. 2025, arXiv:2503.14476), a k3 KL penalty to a frozen reference model (off by default: no reference
model is loaded), several optimizer steps and epochs per rollout batch, dropping groups whose rewards are all equal
(they carry no signal), and masking responses cut off at max_tokens.

Loss aggregation: how per-token losses l_it become one number. The weight each token gets, in a batch of two
responses of 4 and 7 tokens (N = 2 responses, 11 tokens):
    sequence_mean  mean over each response's tokens, then over responses (GRPO paper, CS336's masked_mean):
                   w = 1 / (N |o_i|): 1/8 per token of the short response, 1/14 of the long one. Every response
                   weighs the same, so a token of a long wrong answer is penalised less than one of a short one.
    token_mean     one mean over all response tokens of the batch (DAPO; TRL's and verl's default): w = 1/11 each.
    constant       sum over tokens / (N L) with a fixed L, here --max-tokens (Dr. GRPO, Liu et al. 2025,
                   arXiv:2503.20783): with L = 8, w = 1/16 each, whatever the lengths in this batch.
The weights are those of the whole optimizer batch, however it is split into microbatches: the batch's response and
token counts are passed to every microbatch (grpo_microbatch_train_step).

Why the loss is ~0 while the model learns (the question TRL users ask most: trl#2703, open-r1#239). With one
optimizer step per rollout batch, the ratio is exactly 1 at the update, so the loss *value* is -sum_it w_it A_i: a
weighted mean of advantages, which are centred on 0 within each group (exactly 0 with sequence_mean and no groups
dropped or masked). Its *gradient* is -sum_it w_it A_i grad log p_it, the policy gradient, which is not 0. Watch
rollout/reward_mean (is it rising?) and train/grad_norm (is anything being learned?), not train/loss.

Sampling and the ratio. The engine samples from softmax(logits / T); the trainer divides its logits by the same T
(get_response_log_probs(..., temperature)), so it differentiates the distribution that was sampled, and its
log-probs equal the engine's (tested): without it the ratio to the sampling policy starts far from 1 (trl#4159).
top_p stays 1.0: nucleus sampling draws from a truncated, renormalised distribution the trainer does not compute,
which biases the ratio and the gradient (trl#6789). The trainer scores the engine's own token ids, never a
re-tokenization of the response text: BPE is not one-to-one, and re-tokenized text is not what was sampled. Old
log-probs (the p_old of the ratio) come from the trainer, once per rollout batch, before its first optimizer step; with
a single optimizer step per rollout batch they are the trainer's current log-probs, detached, and no extra forward
pass is spent on them.

Reproducible: the questions, the engine's seeds (one per request) and the minibatch order derive from (seed, step),
so --resume replays what an interrupted run would have done. On a CPU (float32) a resumed run ends bit for bit where
an uninterrupted one does (tested); on a GPU, bf16 kernels are not batch-invariant: expect the same statistics.

Deliberate simplifications:
1. One trainer process, no data or model parallelism; generation and training take turns (no asynchronous rollouts),
   and every step is sampled from the current weights.
2. Zero-variance groups are dropped, not replaced: DAPO's dynamic sampling keeps generating until the batch is full
   of informative groups; here the batch just gets smaller (logged as rollout/frac_zero_std_groups).
3. The reward is the verifier's: 1 for a right answer, else 0; no format bonus, no length penalty or overlong shaping.
4. The KL penalty is in the loss (k3, per token), never in the reward, and is off by default (beta = 0), as in TRL.
5. No correction for the engine's numerics differing from the trainer's (truncated importance sampling): the ratio
   uses the trainer's log-probs on both sides. In float32 on a CPU the two agree to ~1e-6; in bf16 at scale they
   do not, which is where verl and TRL add that correction.
6. No value function, no GAE, no reward model: those are PPO's; the group mean is the baseline.

Usage:
    python grpo.py --model Qwen/Qwen3-1.7B-Base                    # GSM8K, R1-Zero template, 200 steps, 2 GPUs
    python grpo.py --model runs/sft__1__1763700000/checkpoints/step_000200 --loss-aggregation sequence_mean
    python grpo.py --resume runs/grpo__1__1763800000              # continue a stopped run where it stopped
  No GPU: a tiny model, SFT'd on the synthetic task, then GRPO (~4 s a step). ladder.py runs the whole chain, with
  SFT on a flawed teacher's traces that GRPO then corrects (the README has its numbers); by hand, on gold traces:
    python tiny_model.py --out runs/tiny-qwen3
    python sft.py --model runs/tiny-qwen3 --dataset synthetic --batch-size 32 --microbatch-size 32 --lr 2e-3 \\
        --n-examples 9600 --eval-every 100 --n-eval 64 --eval-max-tokens 64 --max-seq-len 256
    python grpo.py --model runs/sft__1__*/checkpoints/step_000300 --dataset synthetic --n-grpo-steps 40 \\
        --rollout-batch-size 64 --train-batch-size 64 --microbatch-size 16 --lr 1e-4 --max-tokens 64 \\
        --eval-every 10 --n-eval 64 --eval-max-tokens 64
"""

import contextlib
import json
import math
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import tyro
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

import data
import verifiers


@dataclass
class Args:
    # --- run ---
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment; the run folder is runs/<exp_name>__<seed>__<unix time>"""
    seed: int = 1
    """seed for the questions drawn, the engine's sampling and the minibatch order"""
    output_dir: str = "runs"
    """where run folders are made"""
    resume: str | None = None
    """a run folder to continue from its last checkpoint (the other arguments should match the original run's)"""
    track: bool = False
    """also log to Weights & Biases (pip install wandb)"""
    wandb_project: str = "rlvr-grpo"
    """the W&B project, with --track"""

    # --- model ---
    model: str = "Qwen/Qwen3-1.7B-Base"
    """Hugging Face model name or local model folder to start from (an SFT checkpoint learns faster); also the
    frozen reference model of the KL penalty"""
    policy_device: str | None = None
    """device of the trainer; None: cuda:0 if there is a GPU, else cpu"""
    vllm_device: str | None = None
    """device of the vLLM engine; None: cuda:1 with two GPUs, else the policy's device"""
    vllm_gpu_memory_utilization: float | None = None
    """fraction of the engine GPU's memory vLLM may take; None: 0.85 alone on its GPU, 0.3 beside the trainer"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, about 30% more time"""

    # --- data ---
    dataset: str = "gsm8k"
    """gsm8k | math | synthetic: questions are drawn from its train split, evaluation uses --eval-split"""
    data_dir: str | None = None
    """folder of the local JSONL copies (e.g. ../shared/data/gsm8k); None: the Hugging Face hub"""
    template: str = "r1_zero"
    """prompt template from data.py (r1_zero | question | chat); use the one the starting checkpoint was trained on"""

    # --- generation ---
    n_grpo_steps: int = 200
    """GRPO steps; each one generates a rollout batch, trains on it and reloads the engine"""
    rollout_batch_size: int = 256
    """responses generated per step: rollout_batch_size / group_size questions, group_size responses to each"""
    group_size: int = 8
    """responses per question; their mean reward is the baseline of each one's advantage (at least 2)"""
    temperature: float = 1.0
    """sampling temperature; the trainer divides its logits by it too, so the ratio starts at 1"""
    top_p: float = 1.0
    """nucleus sampling; keep 1.0: the trainer's log-probs are of the untruncated distribution (trl#6789)"""
    max_tokens: int = 1024
    """max new tokens per response; answers cut off here score 0 (watch rollout/truncation_rate)"""

    # --- optim ---
    lr: float = 1e-5
    """peak learning rate of AdamW (reached after the warmup)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 0
    """the learning rate rises linearly from 0 over the optimizer steps of the first warmup_steps GRPO steps"""
    lr_schedule: str = "constant"
    """after the warmup: constant | cosine (decays to 0 at the last GRPO step; a tiny model needs it, see README)"""
    train_batch_size: int = 256
    """responses per optimizer step: rollout_batch_size / train_batch_size optimizer steps per epoch over a rollout
    batch (fewer responses each when groups are dropped); 1 step is on-policy, more are off-policy and need clipping"""
    epochs_per_rollout_batch: int = 1
    """passes over each rollout batch; more than 1 is off-policy"""
    microbatch_size: int = 2
    """responses per forward/backward pass; the gradients of a train batch's microbatches are accumulated"""
    max_grad_norm: float = 1.0
    """clip the gradient's global L2 norm to this"""

    # --- grpo ---
    loss_type: str = "grpo_clip"
    """no_baseline (-r log p) | reinforce_with_baseline (-A log p) | grpo_clip (clipped ratio; = the second when
    on-policy)"""
    loss_aggregation: str = "token_mean"
    """sequence_mean (GRPO) | token_mean (DAPO) | constant (Dr. GRPO, divides by --max-tokens): see the docstring"""
    normalize_by_std: bool = True
    """divide advantages by their group's std (unbiased, as torch.std); Dr. GRPO argues against it"""
    advantage_eps: float = 1e-6
    """added to the group's std before dividing"""
    clip_low: float = 0.2
    """the ratio is clipped below at 1 - clip_low (grpo_clip)"""
    clip_high: float = 0.2
    """the ratio is clipped above at 1 + clip_high (grpo_clip); DAPO's clip-higher uses 0.28"""
    beta: float = 0.0
    """weight of the k3 KL penalty to the frozen starting model, per token; 0: no reference model is loaded"""
    drop_zero_variance_groups: bool = True
    """leave out groups whose rewards are all equal (their advantages are 0; they would only dilute the batch)"""
    mask_truncated: bool = False
    """leave responses cut off at --max-tokens out of the loss (DAPO's overlong filtering)"""

    # --- eval ---
    eval_split: str = "val"
    """split of --dataset to evaluate on (MATH has no val: use test)"""
    n_eval: int = 512
    """problems evaluated, greedy, from the start of the eval split"""
    eval_every: int = 10
    """evaluate every this many GRPO steps (and at the start and the end)"""
    eval_max_tokens: int = 1024
    """max new tokens per evaluation response"""
    n_log_generations: int = 4
    """evaluation responses written to generations.jsonl (with entropy and length) at each evaluation"""
    save_every: int = 50
    """checkpoint every this many GRPO steps (and at the end)"""
    reload_tol: float | None = None
    """largest mean |log-prob gap| between engine and trainer allowed after a reload; None: 1e-3 in float32 (CPU),
    0.05 in bfloat16 (GPU; bf16 kernels differ between the two, not yet measured on a GPU)"""


# --- Tokenizing and log-probs (the same in sft.py, expert_iter.py and grpo.py) ---


def tokenize_prompt_and_output(prompt_strs: list[str], output_strs: list[str], tokenizer) -> dict[str, torch.Tensor]:
    """Tokenize prompts and outputs separately, concatenate, pad, and shift for next-token prediction.

    Returns input_ids, labels and response_mask, each (B, max_len - 1), where max_len is the longest
    prompt + output. labels[i, t] = full[i, t + 1]; response_mask is 1 exactly where the label is an output token.
    The mask is built from lengths, never by comparing ids with the pad id: when pad == EOS (Qwen3 base models),
    an id comparison would hide the EOS the model must learn to emit.
    """
    prompt_ids = tokenizer(prompt_strs, add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(output_strs, add_special_tokens=False)["input_ids"]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = pad_id if pad_id is not None else 0
    max_len = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids, strict=True))
    full = torch.full((len(prompt_ids), max_len), pad_id, dtype=torch.long)  # (B, L)
    is_output = torch.zeros((len(prompt_ids), max_len), dtype=torch.bool)  # (B, L)
    for i, (p, o) in enumerate(zip(prompt_ids, output_ids, strict=True)):
        full[i, : len(p) + len(o)] = torch.tensor(p + o, dtype=torch.long)
        is_output[i, len(p) : len(p) + len(o)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": is_output[:, 1:]}


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: (B, T, V) logits -> (B, T).

    H = -sum p log p = logsumexp(z) - sum softmax(z) z, which never takes the log of an underflowed probability.
    """
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def get_response_log_probs(
    model, input_ids: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool = False, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """log p(labels[t] | input_ids[:t+1]) for every position: (B, T) ids -> {"log_probs": (B, T)}.

    `temperature` divides the logits first, exactly as the sampling engine does, so log-probs of sampled tokens
    match the distribution they were drawn from (grpo.py needs this; SFT uses 1). With return_token_entropy,
    also "token_entropy" (B, T) of that distribution.
    """
    logits = model(input_ids).logits.float() / temperature  # (B, T, V); float32 even under bf16 autocast
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    out = {"log_probs": log_probs}
    if return_token_entropy:
        with torch.no_grad():
            out["token_entropy"] = compute_entropy(logits)
    return out


def masked_normalize(
    tensor: torch.Tensor, mask: torch.Tensor, normalize_constant: float, dim: int | None = None
) -> torch.Tensor:
    """Sum of `tensor` where mask is 1, over `dim` (all dims if None), divided by normalize_constant."""
    masked = tensor * mask
    total = masked.sum() if dim is None else masked.sum(dim=dim)
    return total / normalize_constant


# --- GRPO: advantages and losses (pure functions; tests/test_grpo.py checks them by hand) ---


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, dict], dict],
    rollout_responses: list[str],
    repeated_ground_truths: list,
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score each response and centre its reward on its group's mean: (advantages (B,), raw_rewards (B,), metadata).

    Responses i*G ... i*G + G - 1 form group i (B = n_groups * G). reward_fn(response, ground_truth) returns a dict
    with "reward" (here verifiers.score, and the ground truths are the examples). A = r - mean(group), divided by
    std(group) + advantage_eps when normalize_by_std. The std is torch.std's unbiased one (divides by G - 1), as in
    CS336, TRL and verl; the population std would divide by G and make every |A| smaller by sqrt((G - 1) / G).
    A group whose rewards are all equal gets A = 0 for every response (0 / (0 + eps)).
    Metadata (floats, for logging): reward mean / std / max / min over the batch, format_reward and answer_reward
    means (when reward_fn returns them), and frac_zero_std_groups, the share of groups with all rewards equal.
    """
    if len(rollout_responses) % group_size != 0:
        raise ValueError(f"{len(rollout_responses)} responses do not make whole groups of {group_size}")
    reward_dicts = [reward_fn(r, gt) for r, gt in zip(rollout_responses, repeated_ground_truths, strict=True)]
    raw_rewards = torch.tensor([d["reward"] for d in reward_dicts], dtype=torch.float32)  # (B,)
    grouped = raw_rewards.view(-1, group_size)  # (n_groups, G)
    group_std = grouped.std(dim=1, keepdim=True)  # (n_groups, 1), unbiased
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std:
        advantages = advantages / (group_std + advantage_eps)
    metadata = {
        "reward_mean": raw_rewards.mean().item(),
        "reward_std": raw_rewards.std().item() if len(raw_rewards) > 1 else 0.0,
        "reward_max": raw_rewards.max().item(),
        "reward_min": raw_rewards.min().item(),
        "frac_zero_std_groups": (group_std == 0).float().mean().item(),
    }
    for key in ("format_reward", "answer_reward"):
        if all(key in d for d in reward_dicts):
            metadata[f"{key}_mean"] = float(np.mean([d[key] for d in reward_dicts]))
    return advantages.reshape(-1), raw_rewards, metadata


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor, policy_log_probs: torch.Tensor
) -> torch.Tensor:
    """Per-token REINFORCE loss -A * log p: (B, 1) or (B,) rewards or advantages, (B, T) log-probs -> (B, T)."""
    return -raw_rewards_or_advantages.reshape(-1, 1) * policy_log_probs


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float | tuple[float, float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate loss -min(r A, clip(r, 1 - low, 1 + high) A), r = exp(log p - log p_old).

    advantages (B, 1) or (B,); log-probs (B, T); cliprange a float (symmetric, as in CS336 and PPO) or (low, high)
    (DAPO's clip-higher, e.g. (0.2, 0.28)). Returns the loss (B, T) and per-token metadata, each (B, T):
    "clipped" where the bound is active (the clipped term is the smaller, so the token's gradient is 0), split into
    "clipped_high" (A > 0, r > 1 + high) and "clipped_low" (A < 0, r < 1 - low); and "ratio" r, detached.
    """
    low, high = (cliprange, cliprange) if isinstance(cliprange, int | float) else cliprange
    advantages = advantages.reshape(-1, 1)  # (B, 1)
    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - low, 1 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    is_clipped = clipped < unclipped
    metadata = {
        "clipped": is_clipped,
        "clipped_high": is_clipped & (advantages > 0),
        "clipped_low": is_clipped & (advantages < 0),
        "ratio": ratio.detach(),
    }
    return loss, metadata


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (B, T) of one loss_type, and its metadata.

    no_baseline: -r log p (needs raw_rewards); reinforce_with_baseline: -A log p (needs advantages); grpo_clip: the
    clipped surrogate (needs advantages, old_log_probs and cliprange).
    """
    if loss_type == "no_baseline":
        if raw_rewards is None:
            raise ValueError("loss_type 'no_baseline' needs raw_rewards")
        return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}
    if loss_type == "reinforce_with_baseline":
        if advantages is None:
            raise ValueError("loss_type 'reinforce_with_baseline' needs advantages")
        return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}
    if loss_type == "grpo_clip":
        if advantages is None or old_log_probs is None or cliprange is None:
            raise ValueError("loss_type 'grpo_clip' needs advantages, old_log_probs and cliprange")
        return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange)
    raise ValueError(f"unknown loss_type {loss_type!r}; choose from no_baseline, reinforce_with_baseline, grpo_clip")


def compute_k3_kl(policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) (Schulman 2020, "Approximating KL divergence"): (B, T).

    k3 = exp(d) - d - 1 with d = log p_ref - log p, on tokens sampled from the policy. Unbiased, >= 0 everywhere
    (e^d >= 1 + d), 0 exactly where the two models agree; its gradient pulls log p toward log p_ref.
    """
    log_ratio = ref_log_probs - policy_log_probs
    return torch.exp(log_ratio) - log_ratio - 1


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `tensor` over the elements where mask is 1, along `dim` (all elements if None)."""
    masked = tensor * mask
    if dim is None:
        return masked.sum() / mask.sum()
    return masked.sum(dim=dim) / mask.sum(dim=dim)


LOSS_AGGREGATIONS = ("sequence_mean", "token_mean", "constant")


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This microbatch's share of the batch loss; calls backward(). Returns it (detached) and per-token metadata.

    policy_log_probs, response_mask, old_log_probs, ref_log_probs: (B, T); raw_rewards, advantages: (B, 1) or (B,).
    The per-token loss l_it (policy gradient, plus beta * k3 KL when beta > 0) is aggregated as sum_it w_it l_it over
    the unmasked tokens, with the weights of the WHOLE batch (module docstring):
        sequence_mean  w_it = 1 / (n_batch_sequences |o_i|)
        token_mean     w_it = 1 / n_batch_tokens
        constant       w_it = 1 / (n_batch_sequences normalize_constant)
    so the microbatches' losses (and gradients) sum to the batch's, however the batch was split or padded. By
    default n_batch_sequences = B * gradient_accumulation_steps and n_batch_tokens = (this microbatch's tokens) *
    gradient_accumulation_steps: exact when all microbatches are alike, and then sequence_mean is CS336's
    masked_mean(loss, mask, dim=-1).mean() / gradient_accumulation_steps. Every response must have >= 1 token.
    """
    per_token_loss, metadata = compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs, cliprange
    )
    if beta > 0:
        if ref_log_probs is None:
            raise ValueError("beta > 0 needs ref_log_probs")
        kl = compute_k3_kl(policy_log_probs, ref_log_probs)  # (B, T)
        per_token_loss = per_token_loss + beta * kl
        metadata["kl"] = kl.detach()
    mask = response_mask.to(per_token_loss.dtype)
    if n_batch_sequences is None:
        n_batch_sequences = mask.shape[0] * gradient_accumulation_steps
    if n_batch_tokens is None:
        n_batch_tokens = mask.sum().item() * gradient_accumulation_steps
    if loss_aggregation == "sequence_mean":
        loss = masked_mean(per_token_loss, mask, dim=-1).sum() / n_batch_sequences
    elif loss_aggregation == "token_mean":
        loss = masked_normalize(per_token_loss, mask, n_batch_tokens)
    elif loss_aggregation == "constant":
        if normalize_constant is None:
            raise ValueError("loss_aggregation 'constant' needs normalize_constant (e.g. max_tokens)")
        loss = masked_normalize(per_token_loss, mask, n_batch_sequences * normalize_constant)
    else:
        raise ValueError(f"unknown loss_aggregation {loss_aggregation!r}; choose from {list(LOSS_AGGREGATIONS)}")
    loss.backward()
    return loss.detach(), metadata


# --- The vLLM engine and weight reloads (the same in sft.py, expert_iter.py and grpo.py) ---


def engine_device(device: str):
    """Run engine calls with the engine's GPU as the current CUDA device (vLLM uses the ambient device)."""
    return torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()


def init_vllm(model: str, device: str, seed: int, gpu_memory_utilization: float, max_model_len: int) -> LLM:
    """Start a vLLM engine inside this process, on `device` ("cpu" or "cuda:N").

    In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, read when the engine starts) so that reload_weights receives
    the trainer's tensors directly, with no serialization. Prefix caching stays on: the n samples of one prompt
    share its KV cache, and load_policy_into_vllm resets that cache after every reload. Note that vLLM reseeds
    Python's, NumPy's and torch's RNGs when it starts: seed the trainer afterwards.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    common = dict(model=model, seed=seed, max_model_len=max_model_len, enable_prefix_caching=True)
    if device == "cpu":
        # float32 makes the engine's tokens and log-probs match the trainer's; eager mode skips a ~40 s compile.
        # The CPU engine claims half the machine's memory for its KV cache unless told otherwise (GiB).
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # No chunked prefill: after a partly prefilled prompt vLLM rewinds the request's seeded torch.Generator, which
        # a CPU generator cannot do ("CPU Generator does not use offset"): seeded sampling crashed on CPU whenever the
        # prompts of one generate call overflowed a scheduler step (4096 tokens).
        return LLM(**common, dtype="float32", enforce_eager=True, enable_chunked_prefill=False)
    # vLLM 0.32 places an engine on a chosen GPU with device_ids (there is no device= argument any more);
    # gpu_memory_utilization is a fraction of that GPU's total memory, weights and KV cache together.
    gpu = torch.device(device).index or 0
    return LLM(**common, dtype="bfloat16", device_ids=[gpu], gpu_memory_utilization=gpu_memory_utilization)


def load_policy_into_vllm(policy, llm: LLM, device: str) -> None:
    """Copy the trainer's current weights into the running engine, in place, and drop its stale prefix cache.

    reload_weights (vLLM 0.32) takes Hugging Face parameter names and runs the model's own loaders (fusing q/k/v
    and gate/up); tensors may sit on another GPU, the copy moves them. Send state_dict(), not named_parameters():
    the latter drops the tied lm_head.weight alias, and the engine then kept part of its old weights (measured on
    the tiny model: a probe log-prob gap of 1.25 instead of 1e-6). Without reset_prefix_cache the engine would
    reuse keys and values computed with the OLD weights for any prompt it has seen before.
    """
    dtype = llm.llm_engine.model_config.dtype
    weights = [(name, tensor.detach().to(dtype)) for name, tensor in policy.state_dict().items()]
    with engine_device(device):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")


def make_probe_prompts(tokenizer, texts: list[str], min_tokens: int = 400) -> list[list[int]]:
    """Two fixed token sequences for the reload check, each >= min_tokens long.

    Long on purpose: a prefix cache reuses only full blocks (128 tokens on CPU, 16 on GPU), so only a prompt of
    several blocks that the engine has already seen can reveal keys and values left over from old weights.
    """
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    while len(ids) < 2 * min_tokens:
        ids = ids + ids
    return [ids[:min_tokens], ids[min_tokens : 2 * min_tokens]]


def check_vllm_follows_policy(policy, llm: LLM, probe_prompts: list[list[int]], device: str, tol: float) -> float:
    """Prove the engine samples from the trainer's current weights; raise if it does not. Returns the gap.

    The engine greedily continues each probe prompt for a few tokens and reports each token's log-prob; the
    trainer scores the same tokens. The gap is the mean |difference|. Stale weights, a stale prefix cache, or a
    reload that silently did nothing all show up as a gap far above the numerical noise of the two
    implementations (about 1e-5 in float32).
    """
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    with engine_device(device):
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in probe_prompts], params, use_tqdm=False)
    gaps = []
    policy_device = next(policy.parameters()).device
    for prompt, output in zip(probe_prompts, outputs, strict=True):
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        engine_log_probs = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, token_ids, strict=True)])
        full = torch.tensor([prompt + token_ids], device=policy_device)  # (1, L)
        with torch.no_grad():
            log_probs = get_response_log_probs(policy, full[:, :-1], full[:, 1:])["log_probs"]  # (1, L - 1)
        policy_log_probs = log_probs[0, -len(token_ids) :].float().cpu()
        gaps.append((engine_log_probs - policy_log_probs).abs().mean().item())
    gap = max(gaps)
    if not gap <= tol:
        raise RuntimeError(
            f"vLLM does not follow the trainer after a weight reload: mean |log-prob gap| {gap:.3g} > {tol:.3g} on "
            "the probe prompts. The engine is sampling from other weights than the ones being trained."
        )
    return gap


# --- Evaluation ---


def evaluate(llm: LLM, examples: list[dict], prompts: list[str], args: Args, device: str) -> tuple[dict, list[dict]]:
    """Greedy responses from the engine, scored by verifiers.score: metrics and one record per problem."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.eval_max_tokens,
        stop=data.stop_strings(args.template) or None,
        include_stop_str_in_output=True,
    )
    with engine_device(device):
        outputs = llm.generate(prompts, params, use_tqdm=True)
    records = []
    for example, prompt, output in zip(examples, prompts, outputs, strict=True):
        completion = output.outputs[0]
        reward = verifiers.score(completion.text, example)
        records.append(
            {"id": example["id"], "prompt": prompt, "response": completion.text, "answer": example["answer"],
             "reward": reward, "n_tokens": len(completion.token_ids), "truncated": completion.finish_reason == "length"}
        )  # fmt: skip
    metrics = {
        "eval/accuracy": float(np.mean([r["reward"]["reward"] for r in records])),
        "eval/format_rate": float(np.mean([r["reward"]["format_reward"] for r in records])),
        "eval/response_length": float(np.mean([r["n_tokens"] for r in records])),
        "eval/truncation_rate": float(np.mean([r["truncated"] for r in records])),
    }
    return metrics, records


def log_generations(policy, tokenizer, records: list[dict], policy_device: str) -> tuple[dict, list[dict]]:
    """For a few evaluation records: the trainer's mean token entropy over each response, and length statistics.

    Returns metrics (response length overall, for correct and for incorrect responses; mean entropy) and the
    records with "mean_token_entropy" added, to be written to generations.jsonl.
    """
    out = []
    for record in records:
        batch = tokenize_prompt_and_output([record["prompt"]], [record["response"]], tokenizer)
        batch = {k: v.to(policy_device) for k, v in batch.items()}
        with torch.no_grad():
            entropy = get_response_log_probs(policy, batch["input_ids"], batch["labels"], True)["token_entropy"]
        mask = batch["response_mask"]
        mean_entropy = masked_normalize(entropy, mask, max(mask.sum().item(), 1)).item()
        out.append({**record, "mean_token_entropy": mean_entropy})
    lengths = {"correct": [], "incorrect": []}
    for record in out:
        lengths["correct" if record["reward"]["reward"] == 1 else "incorrect"].append(record["n_tokens"])
    mean_or_none = lambda xs: float(np.mean(xs)) if xs else None  # None, not NaN: metrics.jsonl stays strict JSON
    metrics = {
        "eval/sample_token_entropy": mean_or_none([r["mean_token_entropy"] for r in out]),
        "eval/sample_length": mean_or_none([r["n_tokens"] for r in out]),
        "eval/sample_length_correct": mean_or_none(lengths["correct"]),
        "eval/sample_length_incorrect": mean_or_none(lengths["incorrect"]),
    }
    return metrics, out


# --- Rollouts: questions per step, and the engine's token ids as training tensors ---


def step_questions_and_seeds(n_questions: int, n_prompts: int, group_size: int, seed: int, step: int):
    """The questions of GRPO step `step` (indices into the train split) and the engine's sampling seed for each.

    Derived from (seed, step) alone, so a resumed run draws and samples exactly what an uninterrupted run would.
    vLLM gives the n samples of a request the seeds s, s + 1, ..., s + n - 1: requests are spaced group_size apart,
    or two questions would share a random stream.
    """
    rng = np.random.default_rng([seed, step])
    indices = rng.choice(n_questions, size=n_prompts, replace=False).tolist()
    first_seed = int(rng.integers(2**30))
    return indices, [first_seed + j * group_size for j in range(n_prompts)]


def collate_token_ids(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> dict:
    """tokenize_prompt_and_output for token ids: input_ids, labels and response_mask, each (B, max_len - 1).

    The trainer must score exactly the tokens the engine sampled (the EOS too, when the model stopped by itself),
    so it takes the engine's ids: re-tokenizing the response text can give other ids (BPE is not one-to-one; on the
    tiny model every truncated random response re-tokenized differently).
    """
    max_len = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True))
    full = torch.full((len(prompt_ids), max_len), pad_id, dtype=torch.long)  # (B, L)
    is_response = torch.zeros((len(prompt_ids), max_len), dtype=torch.bool)  # (B, L)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        full[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        is_response[i, len(p) : len(p) + len(r)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": is_response[:, 1:]}


def microbatches(rows: list[int], lengths: list[int], size: int) -> list[list[int]]:
    """Split rows into microbatches of `size`, sorted by length so each pads little. The order changes no gradient:
    the loss weights are the whole batch's."""
    rows = sorted(rows, key=lambda i: lengths[i])
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def take_rows(tensors: dict, rows: list[int], lengths: list[int], device: str) -> dict:
    """These rows of (B, T) tensors, cut to their longest sequence (the padding is on the right), on `device`."""
    width = max(lengths[i] for i in rows)
    index = torch.tensor(rows)
    return {k: v[index, :width].to(device) for k, v in tensors.items()}


def frozen_log_probs(model, batch: dict, lengths: list[int], microbatch_size: int, temperature: float) -> torch.Tensor:
    """log p of every label of a padded batch (n, T) under `model`, without gradient, microbatch by microbatch: the
    old policy's (before the first optimizer step on a rollout batch) or the frozen reference model's."""
    device = next(model.parameters()).device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    log_probs = torch.zeros(batch["labels"].shape, device=device)  # (n, T)
    for rows in microbatches(list(range(len(lengths))), lengths, microbatch_size):
        micro = take_rows(batch, rows, lengths, str(device))
        with torch.no_grad(), autocast:
            out = get_response_log_probs(model, micro["input_ids"], micro["labels"], False, temperature)
        log_probs[rows, : micro["labels"].shape[1]] = out["log_probs"].float()
    return log_probs


def drop_records_after(path: Path, step: int) -> None:
    """Remove a JSONL file's records of steps after `step`: a resumed run rewrites them, as an uninterrupted run did.
    The file is replaced by rename, so a crash here leaves the old file whole."""
    if path.exists():
        kept = [line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["step"] <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


def check_args(args: Args) -> None:
    """Raise ValueError for inconsistent arguments before any engine starts or data loads."""
    if args.group_size < 2:
        raise ValueError(f"group_size {args.group_size}: a group needs at least 2 responses for a baseline")
    if args.rollout_batch_size % args.group_size:
        raise ValueError(f"rollout_batch_size {args.rollout_batch_size} is not a multiple of group_size")
    if args.rollout_batch_size % args.train_batch_size:
        raise ValueError(f"rollout_batch_size {args.rollout_batch_size} is not a multiple of train_batch_size")
    if args.loss_type not in ("no_baseline", "reinforce_with_baseline", "grpo_clip"):
        raise ValueError(f"unknown loss_type {args.loss_type!r}")
    if args.loss_aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_aggregation {args.loss_aggregation!r}; choose from {list(LOSS_AGGREGATIONS)}")
    if args.lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown lr_schedule {args.lr_schedule!r}; choose from constant, cosine")
    if args.temperature <= 0:
        raise ValueError("temperature must be > 0: GRPO needs several different responses per question")


# --- Run folder, checkpoints, logging (the same in sft.py, expert_iter.py and grpo.py) ---


def save_checkpoint(run_dir: Path, step: int, policy, tokenizer, optimizer, scheduler) -> Path:
    """Write checkpoints/step_N: a plain Hugging Face model folder (transformers and vLLM load it as it is) plus
    trainer_state.pt (optimizer, scheduler, RNG states, step) for --resume. Written to a temporary folder, then
    renamed: a run killed mid-save leaves the previous checkpoint intact, never a half-written one."""
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng}
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder (unfinished .tmp folders are ignored), or None."""
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    return done[-1] if done else None


def restore_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def make_logger(run_dir: Path, args: Args):
    """log(metrics, step) appends a line to metrics.jsonl and, with --track, sends it to W&B."""
    metrics_file = open(run_dir / "metrics.jsonl", "a")
    tracker = None
    if args.track:
        import wandb

        tracker = wandb.init(project=args.wandb_project, name=run_dir.name, config=asdict(args), resume="allow")

    def log(metrics: dict, step: int) -> None:
        metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        metrics_file.flush()
        if tracker is not None:
            tracker.log(metrics, step=step)

    return log


def main(args: Args) -> Path:
    check_args(args)
    # --- Run folder and devices ---
    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path(args.resume) if args.resume else Path(args.output_dir) / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "args.json").write_text(json.dumps(asdict(args), indent=2))
    policy_device = args.policy_device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    vllm_device = args.vllm_device or ("cuda:1" if torch.cuda.device_count() > 1 else policy_device)
    # Two GPUs: trainer on one, engine on the other, no memory shared. One GPU: the engine gets a bounded share and
    # the trainer the rest. No GPU: both on the CPU, in float32.
    memory_fraction = args.vllm_gpu_memory_utilization
    if memory_fraction is None:
        memory_fraction = 0.3 if vllm_device == policy_device else 0.85
    checkpoint = latest_checkpoint(run_dir) if args.resume else None
    model_path = str(checkpoint) if checkpoint else args.model
    print(f"run folder {run_dir}; trainer on {policy_device}, vLLM on {vllm_device}; starting from {model_path}")

    # --- Data (no RNG involved), then the engine (it reseeds every RNG when it starts), then seeds and models ---
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_examples = data.load(args.dataset, "train", args.data_dir)
    train_prompts = [data.render_prompt(ex, args.template, tokenizer) for ex in train_examples]
    eval_examples = data.load(args.dataset, args.eval_split, args.data_dir)[: args.n_eval]
    eval_prompts = [data.render_prompt(ex, args.template, tokenizer) for ex in eval_examples]
    n_prompts = args.rollout_batch_size // args.group_size
    if n_prompts > len(train_examples):
        raise ValueError(f"{n_prompts} questions per step, but the train split has {len(train_examples)}")
    longest_prompt = max(len(ids) for ids in tokenizer(train_prompts + eval_prompts)["input_ids"])
    # The engine's context must hold a prompt and its response, and the 400-token reload probes plus 8 tokens.
    max_model_len = max(longest_prompt, 400) + max(args.max_tokens, args.eval_max_tokens, 8)
    llm = init_vllm(model_path, vllm_device, args.seed, memory_fraction, max_model_len)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(policy_device)
    policy.train()  # from_pretrained returns eval mode, in which gradient checkpointing is silently off
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    on_gpu = policy_device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext()
    reference = None
    if args.beta > 0:  # the frozen starting model, also after --resume
        reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(policy_device)
        reference.requires_grad_(False)
    reload_tol = args.reload_tol
    if reload_tol is None:  # an explicit 0 stays 0 (exact agreement), it does not mean "the default"
        reload_tol = 1e-3 if vllm_device == "cpu" else 5e-2
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop = data.stop_strings(args.template)
    probe_texts = [prompt + ex["solution"] for prompt, ex in zip(train_prompts[:8], train_examples[:8], strict=True)]
    probe_prompts = make_probe_prompts(tokenizer, probe_texts)

    n_minibatches = args.rollout_batch_size // args.train_batch_size
    updates_per_step = n_minibatches * args.epochs_per_rollout_batch
    # With one optimizer step per rollout batch the policy IS the old policy at the update: its own log-probs,
    # detached, are the old log-probs (ratio exactly 1), and the extra forward pass is skipped.
    needs_old_log_probs = args.loss_type == "grpo_clip" and updates_per_step > 1
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    if args.lr_schedule == "cosine":
        scheduler = get_cosine_schedule_with_warmup(
            optimizer, args.warmup_steps * updates_per_step, args.n_grpo_steps * updates_per_step
        )
    else:
        scheduler = get_constant_schedule_with_warmup(optimizer, args.warmup_steps * updates_per_step)
    start_step = 0
    if checkpoint:
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"])
        start_step = state["step"]
        for name in ("metrics.jsonl", "rollouts.jsonl", "generations.jsonl"):
            drop_records_after(run_dir / name, start_step)
        print(f"resumed from {checkpoint} at step {start_step} of {args.n_grpo_steps}")
    log = make_logger(run_dir, args)
    # The engine loaded the same weights from disk; prove it computes what the trainer does before sampling from it.
    check_vllm_follows_policy(policy, llm, probe_prompts, vllm_device, reload_tol)

    def evaluate_policy(step: int) -> dict:
        """Greedy evaluation by the engine (which follows the policy: checked after every reload)."""
        t0 = time.time()
        metrics, records = evaluate(llm, eval_examples, eval_prompts, args, vllm_device)
        sample_metrics, samples = log_generations(policy, tokenizer, records[: args.n_log_generations], policy_device)
        with open(run_dir / "generations.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, **s}) + "\n" for s in samples)
        return {**metrics, **sample_metrics, "time/eval": time.time() - t0}

    if start_step == 0:
        metrics = evaluate_policy(0)
        log(metrics, 0)
        print(f"step {0:5d} | eval accuracy {metrics['eval/accuracy']:.3f} format {metrics['eval/format_rate']:.3f}")

    n_bad_updates_in_a_row = 0
    for step in range(start_step, args.n_grpo_steps):
        t_step = time.time()
        # --- 1. Generate: group_size responses to each of the step's questions ---
        indices, seeds = step_questions_and_seeds(len(train_examples), n_prompts, args.group_size, args.seed, step)
        examples = [train_examples[i] for i in indices]
        params = [
            SamplingParams(n=args.group_size, temperature=args.temperature, top_p=args.top_p,
                           max_tokens=args.max_tokens, stop=stop or None, include_stop_str_in_output=True, seed=seed)
            for seed in seeds
        ]  # fmt: skip
        with engine_device(vllm_device):
            outputs = llm.generate([train_prompts[i] for i in indices], params, use_tqdm=False)
        # Flattened, group by group: responses j * G ... j * G + G - 1 answer question j.  (B,) lists, B = n_prompts G
        completions = [c for output in outputs for c in output.outputs]
        prompt_ids = [list(output.prompt_token_ids) for output in outputs for _ in output.outputs]
        response_ids = [list(c.token_ids) for c in completions]
        truncated = [c.finish_reason == "length" for c in completions]
        n_generated = sum(len(ids) for ids in response_ids)
        t_generate = time.time() - t_step

        # --- 2. Score, and advantages within each group ---
        t0 = time.time()
        advantages, raw_rewards, reward_metadata = compute_group_normalized_rewards(
            verifiers.score,
            [c.text for c in completions],
            [ex for ex in examples for _ in range(args.group_size)],
            args.group_size,
            args.advantage_eps,
            args.normalize_by_std,
        )
        has_signal = raw_rewards.view(-1, args.group_size).std(dim=1) > 0  # (n_prompts,)
        rows = [
            i for i in range(len(completions))
            if (has_signal[i // args.group_size] or not args.drop_zero_variance_groups)
            and not (args.mask_truncated and truncated[i])
        ]  # fmt: skip
        trained = set(rows)
        t_score = time.time() - t0
        with open(run_dir / "rollouts.jsonl", "a") as f:
            for j, ex in enumerate(examples):
                group = range(j * args.group_size, (j + 1) * args.group_size)
                record = {"step": step + 1, "id": ex["id"], "answer": ex["answer"], "prompt": train_prompts[indices[j]],
                          "responses": [completions[i].text for i in group],
                          "rewards": [raw_rewards[i].item() for i in group],
                          "advantages": [advantages[i].item() for i in group],
                          "n_tokens": [len(response_ids[i]) for i in group],
                          "finish_reasons": [completions[i].finish_reason for i in group],
                          "trained": [i in trained for i in group]}  # fmt: skip
                f.write(json.dumps(record) + "\n")

        # --- 3. Update: epochs over the kept rollouts, optimizer steps on minibatches, gradient accumulation ---
        t0 = time.time()
        train_sums = {"loss": 0.0, "grad_norm": 0.0, "clipped": 0.0, "clipped_low": 0.0, "clipped_high": 0.0,
                      "kl": 0.0, "entropy": 0.0, "tokens": 0, "updates": 0}  # fmt: skip
        if rows:
            batch = collate_token_ids([prompt_ids[i] for i in rows], [response_ids[i] for i in rows], pad_id)  # (n, T)
            lengths = [len(prompt_ids[i]) + len(response_ids[i]) - 1 for i in rows]  # positions per row, unpadded
            batch_advantages, batch_rewards = advantages[rows].to(policy_device), raw_rewards[rows].to(policy_device)
            # Old and reference log-probs: once per rollout batch, before the first optimizer step.  (n, T) each
            old_log_probs = ref_log_probs = None
            if needs_old_log_probs:
                old_log_probs = frozen_log_probs(policy, batch, lengths, args.microbatch_size, args.temperature)
            if reference is not None:
                ref_log_probs = frozen_log_probs(reference, batch, lengths, args.microbatch_size, args.temperature)
            for epoch in range(args.epochs_per_rollout_batch):
                order = np.random.default_rng([args.seed, step, epoch]).permutation(len(rows))
                for minibatch in np.array_split(order, n_minibatches):
                    if len(minibatch) == 0:
                        continue
                    minibatch = minibatch.tolist()
                    n_tokens = int(batch["response_mask"][minibatch].sum())
                    micro_list = microbatches(minibatch, lengths, args.microbatch_size)
                    update_loss = 0.0
                    for micro_rows in micro_list:
                        micro = take_rows(batch, micro_rows, lengths, policy_device)
                        with autocast:
                            out = get_response_log_probs(
                                policy, micro["input_ids"], micro["labels"], True, args.temperature
                            )
                        width = micro["labels"].shape[1]
                        # On-policy the old log-probs are the current ones, detached: ratio 1, same gradient.
                        old = old_log_probs[micro_rows, :width] if needs_old_log_probs else out["log_probs"].detach()
                        loss, metadata = grpo_microbatch_train_step(
                            out["log_probs"],
                            micro["response_mask"],
                            len(micro_list),
                            args.loss_type,
                            raw_rewards=batch_rewards[micro_rows],
                            advantages=batch_advantages[micro_rows],
                            old_log_probs=old,
                            cliprange=(args.clip_low, args.clip_high),
                            loss_aggregation=args.loss_aggregation,
                            n_batch_sequences=len(minibatch),
                            n_batch_tokens=n_tokens,
                            normalize_constant=args.max_tokens,
                            ref_log_probs=ref_log_probs[micro_rows, :width] if reference is not None else None,
                            beta=args.beta,
                        )
                        update_loss += loss.item()
                        mask = micro["response_mask"]
                        train_sums["entropy"] += (out["token_entropy"] * mask).sum().item()
                        for key in ("clipped", "clipped_low", "clipped_high", "kl"):
                            if key in metadata:
                                train_sums[key] += (metadata[key] * mask).sum().item()
                        train_sums["tokens"] += mask.sum().item()
                    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm).item()
                    if math.isfinite(update_loss) and math.isfinite(grad_norm):
                        optimizer.step()
                        scheduler.step()
                        n_bad_updates_in_a_row = 0
                        train_sums["loss"] += update_loss
                        train_sums["grad_norm"] += grad_norm
                        train_sums["updates"] += 1
                    else:
                        n_bad_updates_in_a_row += 1
                        warnings.warn(
                            f"step {step + 1}: loss {update_loss} or gradient norm {grad_norm} is not finite; "
                            "update skipped",
                            stacklevel=1,
                        )
                        if n_bad_updates_in_a_row >= 3:
                            raise RuntimeError(
                                f"{n_bad_updates_in_a_row} non-finite updates in a row (step {step + 1}): stopping. "
                                "Check the rewards and the learning rate."
                            )
                    optimizer.zero_grad(set_to_none=True)
        t_train = time.time() - t0

        # --- 4. Reload the new weights into the engine, and prove it follows them ---
        t0 = time.time()
        load_policy_into_vllm(policy, llm, vllm_device)
        gap = check_vllm_follows_policy(policy, llm, probe_prompts, vllm_device, reload_tol)
        t_reload = time.time() - t0

        # --- 5. Log, evaluate, save ---
        step_done = step + 1
        lengths_all = [len(ids) for ids in response_ids]
        metrics = {
            **{f"rollout/{key}": value for key, value in reward_metadata.items()},
            "rollout/response_length": float(np.mean(lengths_all)),
            "rollout/response_length_max": max(lengths_all),
            "rollout/truncation_rate": float(np.mean(truncated)),
            "rollout/n_trained": len(rows),
            "rollout/tokens_per_second": n_generated / t_generate,
            "train/lr": scheduler.get_last_lr()[0],
            "train/n_updates": train_sums["updates"],
            "reload/logprob_gap": gap,
            "time/generate": t_generate,
            "time/score": t_score,
            "time/train": t_train,
            "time/reload": t_reload,
        }
        if train_sums["updates"]:
            n_tokens = max(train_sums["tokens"], 1)
            metrics.update({
                "train/loss": train_sums["loss"] / train_sums["updates"],  # ~0 on-policy: see the module docstring
                "train/grad_norm": train_sums["grad_norm"] / train_sums["updates"],
                "train/entropy": train_sums["entropy"] / n_tokens,
                "train/tokens_per_second": (sum(lengths) + len(rows)) * args.epochs_per_rollout_batch / t_train,
            })  # fmt: skip
            if args.loss_type == "grpo_clip":
                metrics["train/clip_fraction"] = train_sums["clipped"] / n_tokens
                metrics["train/clip_fraction_low"] = train_sums["clipped_low"] / n_tokens
                metrics["train/clip_fraction_high"] = train_sums["clipped_high"] / n_tokens
            if args.beta > 0:
                metrics["train/kl"] = train_sums["kl"] / n_tokens
        if step_done % args.eval_every == 0 or step_done == args.n_grpo_steps:
            metrics.update(evaluate_policy(step_done))
        metrics["time/step"] = time.time() - t_step
        log(metrics, step_done)
        line = (f"step {step_done:5d}/{args.n_grpo_steps} | reward {reward_metadata['reward_mean']:.3f} "
                f"format {reward_metadata.get('format_reward_mean', float('nan')):.3f} | "
                f"len {metrics['rollout/response_length']:.0f} trunc {metrics['rollout/truncation_rate']:.2f} | "
                f"zero-std groups {reward_metadata['frac_zero_std_groups']:.2f} | ")  # fmt: skip
        if train_sums["updates"]:
            line += f"loss {metrics['train/loss']:+.4f} grad {metrics['train/grad_norm']:.3f} | "
        else:
            line += "no update | "
        if "eval/accuracy" in metrics:
            line += f"eval {metrics['eval/accuracy']:.3f} | "
        print(line + f"gap {gap:.0e} | gen {t_generate:.1f}s train {t_train:.1f}s step {metrics['time/step']:.1f}s")
        if step_done % args.save_every == 0 or step_done == args.n_grpo_steps:
            save_checkpoint(run_dir, step_done, policy, tokenizer, optimizer, scheduler)
    return run_dir


if __name__ == "__main__":
    main(tyro.cli(Args))
