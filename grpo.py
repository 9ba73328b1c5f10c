"""Group Relative Policy Optimization (GRPO) with verifiable rewards; a vLLM engine samples, and reloads the trainer's
weights after every step.

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300) is PPO without a value function. Each step:
  1. sample `rollout_batch_size / group_size` questions and let the engine write `group_size` responses to each;
  2. score every response with verifiers.score (1 if its final answer is right, else 0);
  3. advantage of response i in its group: A_i = (r_i - mean(group)) / (std(group) + eps): the group is the baseline;
  4. minimise the clipped surrogate -min(ratio_t A_i, clip(ratio_t, 1 - clip_low, 1 + clip_high) A_i) over the
     response tokens, ratio_t = p(token) / p_old(token), for one or more optimizer steps on these rollouts;
  5. copy the new weights into the engine and *prove* it now samples from them (check_vllm_follows_policy).

Beyond the textbook, each behind an Args field: three loss aggregations (the table in grpo_microbatch_train_step),
DAPO's asymmetric "clip-higher", a k3 KL penalty to a frozen reference model (off by default), several optimizer
steps and epochs per rollout batch, dropping groups whose rewards are all equal, masking responses cut off at
max_tokens, and a truncated importance-sampling correction for the engine's numerics differing from the trainer's.
train/loss sits near 0 while the model learns: watch rollout/reward_mean and train/grad_norm. README's "Background
and citations" says why, and has the papers and the TRL issues behind these choices.

Reproducible: the questions, the engine's seeds (one per request) and the minibatch order derive from (seed, step),
so --resume replays what an interrupted run would have done: bit for bit on a CPU in float32 (tested); on a GPU,
bf16 kernels are not batch-invariant: expect the same statistics.

Deliberate simplifications:
1. One trainer process, no data or model parallelism; generation and training take turns (no asynchronous rollouts).
2. Zero-variance groups are dropped, not replaced (DAPO's dynamic sampling regenerates until the batch is full):
   the batch just gets smaller (logged as rollout/frac_zero_std_groups).
3. The reward is the verifier's: 1 for a right answer, else 0; no format bonus, no length penalty or overlong shaping.
4. The KL penalty is in the loss (k3, per token), never in the reward, and is off by default (beta = 0), as in TRL.
5. The engine/trainer mismatch is corrected per token (truncated at 2, verl's choice), not by masking whole
   sequences (TRL's default) or by recomputing the rollouts' log-probs in the engine's numerics.
6. No value function, no GAE, no reward model: those are PPO's; the group mean is the baseline.

Usage:
    python grpo.py --model Qwen/Qwen3-1.7B-Base                    # GSM8K, R1-Zero template, 200 steps, 2 GPUs
    python grpo.py --model runs/sft__1__1763700000/checkpoints/step_000200 --loss-aggregation sequence_mean
    python grpo.py --resume runs/grpo__1__1763800000              # continue a stopped run where it stopped
    python grpo.py --dataset gsm8k:0.25,math:0.25,mbpp:0.25,ifeval:0.25 --data-dir ../shared/data \
        --dataset-templates ifeval=question                        # a mixture of tasks: README "Mixtures"
  No GPU: a tiny model, SFT'd on the synthetic task, then GRPO (~4 s a step); ladder.py runs the whole chain:
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
from dataclasses import asdict, dataclass, field, replace
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
    """gsm8k | math | mbpp | ifeval | synthetic, or a mixture with weights, gsm8k:0.25,math:0.25,mbpp:0.25,ifeval:0.25:
    each question's dataset is drawn by weight; questions come from the train splits, evaluation from --eval-split"""
    data_dir: str | None = None
    """data root with one folder per dataset (e.g. ../shared/data: gsm8k/, math/, ...); None: the Hugging Face hub"""
    template: str = "r1_zero"
    """prompt template from data.py (r1_zero | question | chat); use the one the starting checkpoint was trained on"""
    dataset_templates: list[str] = field(default_factory=list)
    """a template for some datasets of the mixture instead of --template, e.g. ifeval=question"""
    curriculum: list[str] = field(default_factory=list)
    """order files (one example id a line) for some datasets, e.g. mbpp=order.txt: their questions come in that order"""

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
    """sequence_mean (GRPO) | token_mean (DAPO) | constant (Dr. GRPO): see grpo_microbatch_train_step"""
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
    """leave out groups with no gradient, which would only dilute the batch: rewards all equal (advantages 0), or,
    with no_baseline, all 0 (an all-correct group's -r log p is not 0: it is kept)"""
    mask_truncated: bool = False
    """leave responses cut off at --max-tokens out of the loss (DAPO's overlong filtering)"""
    vllm_importance_sampling_cap: float | None = 2.0
    """correct for the engine sampling from other numerics than the trainer's: each token's policy-gradient loss
    times min(p_old / p_engine, cap), detached (truncated importance sampling, verl's token level); None: off"""

    # --- eval ---
    eval_split: str = "val"
    """split each dataset is evaluated on; val falls back to test where a dataset has none (MATH, IFEval)"""
    n_eval: int = 512
    """problems evaluated per dataset, greedy, from the start of its eval split"""
    eval_every: int = 10
    """evaluate every this many GRPO steps (and at the start and the end)"""
    eval_max_tokens: int = 1024
    """max new tokens per evaluation response"""
    n_log_generations: int = 4
    """evaluation responses written to generations.jsonl (with entropy and length) at each evaluation"""
    save_every: int = 50
    """checkpoint every this many GRPO steps (and at the end)"""
    keep_checkpoints: int = 2
    """keep only the newest this many checkpoints (Qwen3-1.7B: ~20.6 GB each); 0 keeps all"""
    reload_tol: float | None = None
    """largest mean |log-prob gap| between engine and trainer allowed after a reload; None: 1e-3 in float32 (CPU),
    in bfloat16 4 x the gap measured at the start (at least 0.05); README: Your first GPU run"""


# --- ALGORITHM, CS336 vocabulary: tokenizing and log-probs (same in sft.py, expert_iter.py and grpo.py) ---


def tokenize_prompt_and_output(prompt_strs: list[str], output_strs: list[str], tokenizer) -> dict[str, torch.Tensor]:
    """Tokenize prompts and outputs separately, concatenate, pad, and shift for next-token prediction: input_ids,
    labels and response_mask, each (B, max_len - 1); response_mask is 1 exactly where the label is an output token.
    Built from lengths, never by comparing ids with the pad id: when pad == EOS (Qwen3 base models), that would hide
    the EOS the model must learn to emit."""
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


def compute_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: (B, T, V) logits -> (B, T).
    H = -sum p log p = logsumexp(z) - sum softmax(z) z, which never takes the log of an underflowed probability.
    chunk_size positions at a time: softmax(z) and softmax(z) z of all B T positions at once would be two more
    (B, T, V) float32 tensors at the peak (1.2 GiB each for 2 x 1,024 positions of Qwen3's 151,936 tokens)."""
    flat = logits.reshape(-1, logits.shape[-1])  # (B T, V)
    chunks = [torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1) for z in flat.split(chunk_size)]
    return torch.cat(chunks).reshape(logits.shape[:-1])


def get_response_log_probs(
    model, input_ids: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool = False, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """log p(labels[t] | input_ids[:t+1]) for every position: (B, T) ids -> {"log_probs": (B, T)}, and with
    return_token_entropy "token_entropy" (B, T). The logits are divided by `temperature` first, as the engine does
    when it samples, so the log-probs are of the distribution sampled from (grpo.py needs this; SFT uses 1)."""
    logits = model(input_ids).logits.float()  # (B, T, V); float32 even under bf16 autocast
    if temperature != 1.0:  # not at T = 1: another (B, T, V) float32 copy, for nothing
        logits = logits / temperature
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


# --- ALGORITHM: GRPO advantages and losses (pure functions; tests/test_grpo.py checks them by hand) ---


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, dict], dict], rollout_responses: list[str], repeated_ground_truths: list,
    group_size: int, advantage_eps: float, normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:  # fmt: skip
    """Score each response and centre its reward on its group's mean: (advantages (B,), raw_rewards (B,), metadata).
    Responses i*G ... i*G + G - 1 form group i (B = n_groups * G). reward_fn(response, ground_truth) returns a dict
    with "reward" (here verifiers.score, and the ground truths are the examples). A = r - mean(group), divided by
    std(group) + advantage_eps when normalize_by_std. The std is torch.std's unbiased one (divides by G - 1), as in
    CS336, TRL and verl; the population std would divide by G and make every |A| smaller by sqrt((G - 1) / G).
    A group whose rewards are all equal gets A = 0 for every response (0 / (0 + eps)).
    Metadata (floats, for logging): reward mean / std / max / min over the batch, format_reward and answer_reward
    means (when reward_fn returns them), and frac_zero_std_groups, the share of groups with all rewards equal."""
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
    advantages: torch.Tensor, policy_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
    cliprange: float | tuple[float, float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """Per-token clipped surrogate loss -min(r A, clip(r, 1 - low, 1 + high) A), r = exp(log p - log p_old).
    advantages (B, 1) or (B,); log-probs (B, T); cliprange a float (symmetric, as in CS336 and PPO) or (low, high)
    (DAPO's clip-higher, e.g. (0.2, 0.28)). Returns the loss (B, T) and per-token metadata, each (B, T):
    "clipped" where the bound is active (the clipped term is the smaller, so the token's gradient is 0), split into
    "clipped_high" (A > 0, r > 1 + high) and "clipped_low" (A < 0, r < 1 - low); and "ratio" r, detached."""
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
    policy_log_probs: torch.Tensor, loss_type: str, raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None, old_log_probs: torch.Tensor | None = None,
    cliprange: float | tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """Per-token loss (B, T) of one loss_type, and its metadata.
    no_baseline: -r log p (needs raw_rewards); reinforce_with_baseline: -A log p (needs advantages); grpo_clip: the
    clipped surrogate (needs advantages, old_log_probs and cliprange)."""
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
    (e^d >= 1 + d), 0 exactly where the two models agree; its gradient pulls log p toward log p_ref."""
    log_ratio = ref_log_probs - policy_log_probs
    return torch.exp(log_ratio) - log_ratio - 1


def compute_truncated_is_weights(
    old_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, cap: float
) -> torch.Tensor:  # fmt: skip
    """Per-token truncated importance weights for the engine/trainer mismatch: (B, T) log-probs each -> (B, T).
        w_t = min(p_old(o_t) / p_engine(o_t), cap) = min(exp(log p_old(o_t) - log p_engine(o_t)), cap), detached.
    The engine sampled o_t from p_engine (bf16 kernels), not from the trainer's p_old, which the loss assumes; w_t
    reweights each token to p_old, and the cap bounds the variance a token the engine rarely samples would bring
    (verl's token-level truncation, threshold 2). Detached: it scales each token's gradient, it has none of its own."""
    return torch.exp(old_log_probs - engine_log_probs).clamp(max=cap).detach()


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `tensor` over the elements where mask is 1, along `dim` (all elements if None)."""
    masked = tensor * mask
    if dim is None:
        return masked.sum() / mask.sum()
    return masked.sum(dim=dim) / mask.sum(dim=dim)


LOSS_AGGREGATIONS = ("sequence_mean", "token_mean", "constant")


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor, response_mask: torch.Tensor, gradient_accumulation_steps: int, loss_type: str,
    raw_rewards: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None, cliprange: float | tuple[float, float] | None = None,
    loss_aggregation: str = "sequence_mean", n_batch_sequences: int | None = None, n_batch_tokens: int | None = None,
    normalize_constant: float | None = None, ref_log_probs: torch.Tensor | None = None, beta: float = 0.0,
    engine_log_probs: torch.Tensor | None = None, is_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """This microbatch's share of the batch loss; calls backward(). Returns it (detached) and per-token metadata.
    policy_log_probs, response_mask, old_log_probs, ref_log_probs, engine_log_probs: (B, T); raw_rewards,
    advantages: (B, 1) or (B,). The per-token loss is l_it = v_it pg_it + beta k3_it: the policy-gradient loss, times
    the truncated importance weight v_it = min(exp(log p_old - log p_engine), is_cap) when is_cap is given (else 1;
    compute_truncated_is_weights), plus the k3 KL when beta > 0. It is aggregated as sum_it w_it l_it over
    the response tokens, with the weights of the WHOLE batch (N responses, tokens counted over all of them):
        sequence_mean  w_it = 1 / (N |o_i|): mean over each response's tokens, then over responses (GRPO paper,
                       CS336). Every response weighs the same, so a token of a long wrong answer is penalised less.
        token_mean     w_it = 1 / n_batch_tokens: one mean over all tokens (DAPO; TRL's and verl's default).
        constant       w_it = 1 / (N normalize_constant), e.g. --max-tokens (Dr. GRPO): the same whatever the lengths.
    So the microbatches' losses (and gradients) sum to the batch's, however it was split or padded. By default
    N = B * gradient_accumulation_steps and n_batch_tokens = (this microbatch's tokens) * gradient_accumulation_steps:
    exact when all microbatches are alike, and then sequence_mean is CS336's masked_mean(loss, mask, dim=-1).mean()
    / gradient_accumulation_steps. Every response must have >= 1 token."""
    per_token_loss, metadata = compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs, cliprange
    )
    if engine_log_probs is not None:  # the mismatch, logged whether or not it is corrected
        if old_log_probs is None:
            raise ValueError("engine_log_probs needs old_log_probs (the trainer's, before this update)")
        metadata["engine_gap"] = (old_log_probs - engine_log_probs).abs()
        if is_cap is not None:
            metadata["above_is_cap"] = old_log_probs - engine_log_probs > math.log(is_cap)
            per_token_loss = per_token_loss * compute_truncated_is_weights(old_log_probs, engine_log_probs, is_cap)
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


def groups_with_signal(raw_rewards: torch.Tensor, group_size: int, loss_type: str) -> torch.Tensor:
    """(n_groups,) bool: the groups whose loss has a gradient, from the flat (B,) rewards. With an advantage
    (reinforce_with_baseline, grpo_clip) a group of equal rewards has A = 0 on every token. no_baseline's -r log p is 0
    only where r = 0: an all-correct group still pushes its responses up, and leaving it out would bias REINFORCE."""
    rewards = raw_rewards.view(-1, group_size)  # (n_groups, G)
    if loss_type == "no_baseline":
        return (rewards != 0).any(dim=1)
    return rewards.std(dim=1) > 0


def make_scheduler(optimizer, lr_schedule: str, warmup_steps: int, n_grpo_steps: int, updates_per_step: int):
    """Linear warmup over the optimizer steps of the first warmup_steps GRPO steps, then constant or a cosine that
    reaches 0 after the last GRPO step. Counted in optimizer steps (updates_per_step per GRPO step), so the warmup
    rises within a step too; catch_up_scheduler keeps it on the GRPO step when updates are skipped."""
    warmup, total = warmup_steps * updates_per_step, n_grpo_steps * updates_per_step
    if lr_schedule == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup, total)
    return get_constant_schedule_with_warmup(optimizer, warmup)


def catch_up_scheduler(scheduler, n_steps_done: int, updates_per_step: int) -> None:
    """Step the schedule over the optimizer steps a GRPO step did not take (no group with signal, a non-finite
    update), so it stands at n_steps_done GRPO steps: otherwise a cosine never reaches 0."""
    while scheduler.last_epoch < n_steps_done * updates_per_step:
        scheduler.step()


# --- ALGORITHM: the questions of a step (same in expert_iter.py and grpo.py) ---


def step_questions_and_seeds(sizes: list[int], weights: list[float], orders: list, n_prompts: int, group_size: int,
                             seed: int, step: int) -> tuple[list[int], list[int]]:  # fmt: skip
    """The questions of step `step` (indices into the train examples of all datasets, one dataset after another) and
    the engine's sampling seed for each: data.mixture_questions_and_seeds, each question's dataset drawn by weight.
    Derived from (seed, step) alone, so a resumed run draws and samples exactly what an uninterrupted run would.
    vLLM gives the n samples of a request the seeds s, s + 1, ..., s + n - 1: requests are spaced group_size apart,
    or two questions would share a random stream."""
    picks, seeds = data.mixture_questions_and_seeds(sizes, weights, n_prompts, group_size, seed, step, orders)
    starts = np.cumsum([0, *sizes]).tolist()  # where each dataset's examples begin
    return [starts[d] + i for d, i in picks], seeds


def rollout_metrics_by_dataset(names: list[str], examples: list[dict], rewards: list[list[float]]) -> dict:
    """Per task: rollout/<dataset>/count (questions drawn this step) and rollout/<dataset>/reward_mean (over their
    responses; NaN, logged as null, when none was drawn). examples: Q questions, rewards: Q lists of G."""
    metrics = {}
    for name in names:
        drawn = [group for ex, group in zip(examples, rewards, strict=True) if ex["dataset"] == name]
        metrics[f"rollout/{name}/count"] = len(drawn)
        metrics[f"rollout/{name}/reward_mean"] = float(np.mean(drawn)) if drawn else math.nan
    return metrics


# --- ALGORITHM: rollouts as training tensors ---


def collate_token_ids(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> dict:
    """tokenize_prompt_and_output for token ids: input_ids, labels and response_mask, each (B, max_len - 1).
    The trainer must score exactly the tokens the engine sampled (the EOS too, when the model stopped by itself),
    so it takes the engine's ids: re-tokenizing the response text can give other ids (BPE is not one-to-one; on the
    tiny model every truncated random response re-tokenized differently)."""
    max_len = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True))
    full = torch.full((len(prompt_ids), max_len), pad_id, dtype=torch.long)  # (B, L)
    is_response = torch.zeros((len(prompt_ids), max_len), dtype=torch.bool)  # (B, L)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        full[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        is_response[i, len(p) : len(p) + len(r)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": is_response[:, 1:]}


def response_values(response_mask: torch.Tensor, values: list[list[float]]) -> torch.Tensor:
    """Per-response-token values (one list per row, in token order) laid out like the labels: (B, T), 0 elsewhere."""
    out = torch.zeros(response_mask.shape)  # (B, T)
    out[response_mask] = torch.tensor([v for row in values for v in row])  # row-major: each row's tokens in order
    return out


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


# --- PLUMBING: GRPO's bookkeeping (arguments, rollouts.jsonl, metrics) ---


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


def write_rollouts(path: Path, step: int, examples, prompts, completions, rewards, advantages, trained, group_size):
    """One line per group in rollouts.jsonl: the question, its responses, their rewards and advantages, and which of
    them were trained on (trained: a set of indices into the flat (B,) completions)."""
    records = []
    for j, (ex, prompt) in enumerate(zip(examples, prompts, strict=True)):
        group = range(j * group_size, (j + 1) * group_size)
        records.append({"step": step, "dataset": ex["dataset"], "id": ex["id"], "answer": ex["answer"],
                        "prompt": prompt,
                        "responses": [completions[i].text for i in group],
                        "rewards": [rewards[i].item() for i in group],
                        "advantages": [advantages[i].item() for i in group],
                        "n_tokens": [len(completions[i].token_ids) for i in group],
                        "finish_reasons": [completions[i].finish_reason for i in group],
                        "trained": [i in trained for i in group]})  # fmt: skip
    append_jsonl(path, records)


def add_masked_sums(sums: dict, mask: torch.Tensor, **per_token: torch.Tensor) -> None:
    """sums[key] += the sum of each (B, T) tensor over the response tokens; sums["tokens"] += their count. The sums
    stay on the tensors' device (a .item() would wait for the GPU): step_metrics reads them once per step."""
    for key, tensor in {**per_token, "tokens": torch.ones_like(mask)}.items():
        sums[key] = sums.get(key, 0.0) + (tensor * mask).sum(dtype=torch.float32)


def skip_non_finite_update(loss: float, grad_norm: float, step: int, n_in_a_row: int) -> int:
    """Warn that an update was skipped (its loss or gradient is not finite); stop the run at the third in a row."""
    warnings.warn(f"step {step}: loss {loss} or gradient norm {grad_norm} is not finite; update skipped", stacklevel=2)
    if n_in_a_row >= 3:
        raise RuntimeError(f"{n_in_a_row} non-finite updates in a row (step {step}): stopping. Check the rewards and "
                           "the learning rate.")  # fmt: skip
    return n_in_a_row


def step_metrics(reward_metadata: dict, completions: list, n_trained: int, sums: dict, extra: dict, args: Args) -> dict:
    """The metrics of one GRPO step: rollout statistics, and the means of the update's sums (add_masked_sums)."""
    on_device = [key for key, value in sums.items() if torch.is_tensor(value)]
    if on_device:  # one host sync for all of them
        sums = {**sums, **dict(zip(on_device, torch.stack([sums[k] for k in on_device]).tolist(), strict=True))}
    lengths = [len(c.token_ids) for c in completions]
    metrics = {
        **{f"rollout/{key}": value for key, value in reward_metadata.items()},
        "rollout/response_length": float(np.mean(lengths)),
        "rollout/response_length_max": max(lengths),
        "rollout/truncation_rate": float(np.mean([c.finish_reason == "length" for c in completions])),
        "rollout/n_trained": n_trained,
        "rollout/tokens_per_second": sum(lengths) / extra["time/generate"],
        "train/n_updates": sums["updates"],
        **extra,
    }
    if sums["updates"]:
        n_tokens = max(sums["tokens"], 1)
        metrics["train/loss"] = sums["loss"] / sums["updates"]  # ~0 on-policy while the gradient is not (README)
        metrics["train/grad_norm"] = sums["grad_norm"] / sums["updates"]
        metrics["train/entropy"] = sums["entropy"] / n_tokens
        metrics["train/tokens_per_second"] = sums["positions"] * args.epochs_per_rollout_batch / extra["time/train"]
        if args.loss_type == "grpo_clip":
            for key in ("clipped", "clipped_low", "clipped_high"):
                metrics[f"train/clip_fraction{key[len('clipped') :]}"] = sums[key] / n_tokens
        if args.beta > 0:
            metrics["train/kl"] = sums["kl"] / n_tokens
        # the engine/trainer mismatch on the sampled tokens, and how many the cap truncates
        metrics["train/engine_logprob_gap"] = sums["engine_gap"] / n_tokens
        if args.vllm_importance_sampling_cap is not None:
            metrics["train/frac_above_is_cap"] = sums["above_is_cap"] / n_tokens
    return metrics


# --- PLUMBING: the vLLM engine and its weight reloads (same in sft.py, expert_iter.py and grpo.py) ---


def engine_device(device: str):
    """Run engine calls with the engine's GPU as the current CUDA device (vLLM uses the ambient device)."""
    return torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()


def init_vllm(model: str, device: str, seed: int, gpu_memory_utilization: float, max_model_len: int) -> LLM:
    """Start a vLLM engine inside this process (reload_weights then gets the trainer's tensors directly), on `device`
    ("cpu" or "cuda:N"). It reseeds every RNG: seed after. Prefix caching: a prompt's n samples share its KV cache."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    common = dict(model=model, seed=seed, max_model_len=max_model_len, enable_prefix_caching=True)
    # Sampled tokens' log-probs after temperature/top-p (vLLM's Sampler.sample), the distribution sampled from, not
    # the raw logits' (the default). Per-request seeds keep vLLM 0.32 on its native sampler, which supports this mode.
    common["logprobs_mode"] = "processed_logprobs"
    if device == "cpu":
        # float32: log-probs match the trainer's; eager: no ~40 s compile; a 1 GiB KV cache, not half the RAM. No
        # chunked prefill: vLLM then rewinds seeded generators, which fails on CPU ("CPU Generator does not use offset")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return LLM(**common, dtype="float32", enforce_eager=True, enable_chunked_prefill=False)
    # vLLM 0.32 places an engine with device_ids; gpu_memory_utilization is a fraction of that GPU's whole memory.
    gpu = torch.device(device).index or 0
    return LLM(**common, dtype="bfloat16", device_ids=[gpu], gpu_memory_utilization=gpu_memory_utilization)


def policy_weights(policy, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs a reload sends, cast to the engine's dtype. state_dict(), not named_parameters(): the
    latter drops the tied lm_head.weight, and the engine would keep part of its old weights."""
    return [(name, tensor.detach().to(dtype)) for name, tensor in policy.state_dict().items()]


def load_policy_into_vllm(policy, llm: LLM, device: str) -> None:
    """Copy the trainer's weights into the running engine, in place (vLLM 0.32's reload_weights runs the model's own
    loaders), and drop its prefix cache, or it would reuse keys and values computed with the OLD weights."""
    with engine_device(device):
        weights = policy_weights(policy, llm.llm_engine.model_config.dtype)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})  # vLLM Worker.reload_weights
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")


def make_probe_prompts(tokenizer, texts: list[str], min_tokens: int = 400) -> list[list[int]]:
    """Two fixed token sequences for the reload check, each min_tokens long. Long on purpose: a prefix cache reuses
    only full blocks (128 tokens on CPU, 16 on GPU), so only a prompt of several blocks can reveal stale entries."""
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    while len(ids) < 2 * min_tokens:
        ids = ids + ids
    return [ids[:min_tokens], ids[min_tokens : 2 * min_tokens]]


# vLLM fuses these projections into one weight, the parts stacked along rows (Qwen3's packed_modules_mapping).
FUSED = [("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj"))]


def weights_that_differ(policy, llm: LLM, device: str) -> list[str]:
    """Read small slices of the engine's weights back (3 rows of the embedding and of each part of the fused
    projections, whole norm weights; layers 0 and last) and compare them with the trainer's tensors cast to the
    engine's dtype, bit for bit: the names that differ. Exact in bf16 too, where a log-prob probe drowns in noise."""
    state, dtype, last = policy.state_dict(), llm.llm_engine.model_config.dtype, policy.config.num_hidden_layers - 1
    parts = {name: [name] for name in ("model.embed_tokens.weight", "model.norm.weight")}  # engine name -> trainer's
    for prefix in sorted({f"model.layers.{i}." for i in (0, last)}):
        parts[prefix + "input_layernorm.weight"] = [prefix + "input_layernorm.weight"]
        for module, fused, names in FUSED:
            parts[f"{prefix}{module}.{fused}.weight"] = [f"{prefix}{module}.{n}.weight" for n in names]
    expected, rows = {}, {}
    for name, names in parts.items():
        offset, rows[name], pieces = 0, [], []
        for tensor in (state[n] for n in names):
            if tensor.dim() == 1:  # a norm weight: all of it
                rows[name], pieces = slice(None), [tensor]
                break
            picked = [0, len(tensor) // 2, len(tensor) - 1]
            rows[name] += [offset + r for r in picked]  # the part's rows inside the fused weight
            pieces.append(tensor[picked])
            offset += len(tensor)
        expected[name] = torch.cat(pieces).to(dtype).cpu()

    def read(model):  # runs inside the engine's worker: vLLM's LLM.apply_model
        params = dict(model.named_parameters())
        # On CPU, vLLM's dispatch_cpu_unquantized_gemm(remove_weight=True) packs linear weights into oneDNN and leaves
        # empty parameters: those are skipped; embeddings and norms stay readable.
        return {n: params[n].detach()[r].cpu() for n, r in rows.items() if n in params and params[n].numel()}

    with engine_device(device):
        (engine,) = llm.apply_model(read)
    if not {"model.embed_tokens.weight", "model.norm.weight"} <= set(engine):
        raise RuntimeError(f"could not read the engine's embedding and final norm back; read {sorted(engine)}")
    return [name for name, tensor in engine.items() if not torch.equal(tensor, expected[name])]


def probe_gap(policy, llm: LLM, probe_prompts: list[list[int]], device: str) -> float:
    """The engine continues each probe prompt greedily, the trainer scores the same tokens: the worse of the two mean
    |log-prob differences|. Generated, not teacher-forced: vLLM skips the prefix cache for prompt log-probs
    (SamplingParams.skip_reading_prefix_cache), and stale cache entries are one thing this must catch."""
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    with engine_device(device):
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in probe_prompts], params, use_tqdm=False)
    gaps, policy_device = [], next(policy.parameters()).device
    for prompt, output in zip(probe_prompts, outputs, strict=True):
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        engine_log_probs = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, token_ids, strict=True)])
        full = torch.tensor([prompt + token_ids], device=policy_device)  # (1, L)
        with torch.no_grad():
            log_probs = get_response_log_probs(policy, full[:, :-1], full[:, 1:])["log_probs"]  # (1, L - 1)
        gaps.append((engine_log_probs - log_probs[0, -len(token_ids) :].float().cpu()).abs().mean().item())
    return max(gaps)


def check_vllm_follows_policy(policy, llm: LLM, probe_prompts: list[list[int]], device: str, tol: float) -> float:
    """Prove the engine samples from the trainer's current weights, or raise: the read-back weight slices must equal
    the trainer's exactly (a skipped or partial reload), and the probe's log-prob gap must stay within tol (stale
    prefix cache, a wrong dtype or kernel; in float32 the honest gap is ~1e-6). Returns the gap."""
    differ, gap = weights_that_differ(policy, llm, device), probe_gap(policy, llm, probe_prompts, device)
    if differ or not gap <= tol:
        raise RuntimeError(f"vLLM does not follow the trainer after a weight reload: engine weights that differ "
                           f"{differ}, mean |log-prob gap| {gap:.3g} (stop above {tol:.3g})")  # fmt: skip
    return gap


def check_reload_at_start(
    policy, llm: LLM, probe_prompts: list[list[int]], device: str, tol: float | None
) -> tuple[float, float]:
    """Once, before training. The probe gap now, with the same weights on both sides, is the engine's own noise: the
    baseline. Then zero the engine's weights and reload: a tensor the reload misses stays zero and the check trips.
    Returns the tolerance for every later check (tol, or with tol None (bf16) max(4 x baseline, 0.05)) and the gap
    after the reload: the engine now follows the policy, and step 0 needs no other reload."""
    baseline = probe_gap(policy, llm, probe_prompts, device)
    tol = max(4 * baseline, 0.05) if tol is None else tol
    with engine_device(device):
        llm.collective_rpc("reset_weights")  # vLLM Worker.reset_weights: zero_weights(model), every named parameter
        weights = policy_weights(policy, llm.llm_engine.model_config.dtype)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        llm.reset_prefix_cache()  # the baseline probe cached keys and values that would hide a missed tensor
    gap = check_vllm_follows_policy(policy, llm, probe_prompts, device, tol)
    print(f"reload check: baseline gap {baseline:.2g}, after zeroing and reloading {gap:.2g}; stops above {tol:.2g}")
    return tol, gap


def reload_and_check(policy, llm: LLM, probe_prompts: list[list[int]], device: str, tol: float) -> float:
    """Copy the trainer's weights into the engine and prove it follows them; returns the probe's log-prob gap."""
    load_policy_into_vllm(policy, llm, device)
    return check_vllm_follows_policy(policy, llm, probe_prompts, device, tol)


# --- PLUMBING: evaluation (same in sft.py, expert_iter.py and grpo.py) ---


def evaluate(llm: LLM, examples: list[dict], prompts: list[str], template: str, max_tokens: int, device: str):
    """Greedy responses from the engine, scored by verifiers.score_batch: (metrics, one record per problem)."""
    stop = data.stop_strings(template) or None  # kept in the output (include_stop_str...): the verifier needs it
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop, include_stop_str_in_output=True)
    with engine_device(device):
        outputs = llm.generate(prompts, params, use_tqdm=True)
    completions = [output.outputs[0] for output in outputs]
    rewards = verifiers.score_batch([c.text for c in completions], examples)  # code: programs run in a pool
    records = []
    for example, prompt, completion, reward in zip(examples, prompts, completions, rewards, strict=True):
        records.append(
            {"id": example["id"], "prompt": prompt, "response": completion.text, "answer": example["answer"],
             "reward": reward, "n_tokens": len(completion.token_ids), "truncated": completion.finish_reason == "length"}
        )  # fmt: skip
    return eval_metrics(records), records


def eval_metrics(records: list[dict]) -> dict:
    """The evaluation's means over evaluate's records (of one dataset, or of all the datasets of a mixture)."""
    return {
        "eval/accuracy": float(np.mean([r["reward"]["reward"] for r in records])),
        "eval/format_rate": float(np.mean([r["reward"]["format_reward"] for r in records])),
        "eval/response_length": float(np.mean([r["n_tokens"] for r in records])),
        "eval/truncation_rate": float(np.mean([r["truncated"] for r in records])),
    }


def log_generations(policy, tokenizer, records: list[dict], policy_device: str) -> tuple[dict, list[dict]]:
    """For a few evaluation records: the trainer's mean token entropy over each response, and length statistics.
    Returns metrics and the records with "mean_token_entropy" added, for generations.jsonl."""
    out = []
    for record in records:
        batch = tokenize_prompt_and_output([record["prompt"]], [record["response"]], tokenizer)
        batch = {k: v.to(policy_device) for k, v in batch.items()}
        with torch.no_grad():
            entropy = get_response_log_probs(policy, batch["input_ids"], batch["labels"], True)["token_entropy"]
        mask = batch["response_mask"]
        mean_entropy = masked_normalize(entropy, mask, max(mask.sum().item(), 1)).item()
        out.append({**record, "mean_token_entropy": mean_entropy})
    length = lambda correct: mean_or_none([r["n_tokens"] for r in out if (r["reward"]["reward"] == 1) == correct])
    mean_or_none = lambda xs: float(np.mean(xs)) if xs else None  # None, not NaN: metrics.jsonl stays strict JSON
    metrics = {
        "eval/sample_token_entropy": mean_or_none([r["mean_token_entropy"] for r in out]),
        "eval/sample_length": mean_or_none([r["n_tokens"] for r in out]),
        "eval/sample_length_correct": length(True),
        "eval/sample_length_incorrect": length(False),
    }
    return metrics, out


# --- PLUMBING: run folder, devices, policy, checkpoints, logging (same in sft.py, expert_iter.py and grpo.py) ---


# Arguments a resumed run may change: where it runs and what it logs, not what it computes.
RESUME_MAY_CHANGE = {"resume", "output_dir", "track", "wandb_project", "policy_device", "vllm_device",
                     "vllm_gpu_memory_utilization", "gradient_checkpointing", "keep_checkpoints",
                     "reload_tol"}  # fmt: skip


def restore_args(args):
    """With --resume: the stopped run's arguments from its args.json. An argument given a non-default value that
    differs from the run's is refused (ValueError naming it), unless RESUME_MAY_CHANGE lists it."""
    if not args.resume:
        return args
    saved, defaults = json.loads((Path(args.resume) / "args.json").read_text()), type(args)()
    given = {k: v for k, v in asdict(args).items() if v != getattr(defaults, k)}
    conflicts = [f"--{k.replace('_', '-')} {v!r} (the run has {saved[k]!r})" for k, v in given.items()
                 if k in saved and saved[k] != v and k not in RESUME_MAY_CHANGE]  # fmt: skip
    if conflicts:
        raise ValueError(f"--resume {args.resume} continues a run with other arguments: {', '.join(conflicts)}")
    kept = {k: v for k, v in saved.items() if k in defaults.__dataclass_fields__ and k not in given}
    return replace(args, **kept)


def make_run_dir(output_dir: str, exp_name: str, seed: int, resume: str | None, config: dict) -> Path:
    """runs/<exp_name>__<seed>__<unix time>, or the folder being resumed; args.json is written into it."""
    run_dir = Path(resume) if resume else Path(output_dir) / f"{exp_name}__{seed}__{int(time.time())}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "args.json").write_text(json.dumps(config, indent=2))
    return run_dir


def resolve_devices(policy_device, vllm_device, memory_fraction, reload_tol) -> tuple[str, str, float, float | None]:
    """The defaults. Two GPUs: trainer on one, engine on the other. One GPU: the engine gets a bounded share. No GPU:
    both on the CPU in float32, with a fixed reload tolerance; in bf16 None: check_reload_at_start calibrates it.
    Devices compare as torch.devices with "cuda" read as "cuda:0": as strings, "cuda" != "cuda:0"."""
    canonical = lambda d: str(torch.device(d.type, d.index or 0) if (d := torch.device(d)).type == "cuda" else d)
    policy_device = canonical(policy_device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    vllm_device = canonical(vllm_device or ("cuda:1" if torch.cuda.device_count() > 1 else policy_device))
    memory_fraction = (0.3 if vllm_device == policy_device else 0.85) if memory_fraction is None else memory_fraction
    reload_tol = (1e-3 if vllm_device == "cpu" else None) if reload_tol is None else reload_tol
    return policy_device, vllm_device, memory_fraction, reload_tol


def seed_and_load_policy(model_path: str, device: str, gradient_checkpointing: bool, seed: int):
    """Seed Python, NumPy and torch (after the engine started: it reseeds them), then load the trainer's model in
    float32 and train mode. Returns it and the context to run it in: bfloat16 autocast on a GPU."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    policy.train()  # from_pretrained returns eval mode, in which gradient checkpointing is silently off
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext()
    return policy, autocast


def save_checkpoint(run_dir: Path, step: int, policy, tokenizer, optimizer, scheduler, keep: int) -> Path:
    """checkpoints/step_N: a plain Hugging Face model folder plus trainer_state.pt (optimizer, scheduler, RNGs, step)
    for --resume, written to a temporary folder then renamed: a run killed mid-save leaves the last one intact. Then
    the older ones beyond the newest `keep` (0: none) are deleted; the first one written prints its size."""
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
    done = complete_checkpoints(run_dir)
    if len(done) == 1:
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 1e9
        print(f"checkpoint {final}: {size:.3g} GB; up to {keep or 'all'} are kept (--keep-checkpoints)")
    for old in done[:-keep] if keep else []:  # only after the new one is complete; the newest always stays
        shutil.rmtree(old)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """A run folder's complete checkpoints, oldest first (unfinished .tmp folders are left out)."""
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def resume_from(checkpoint: Path | None, optimizer, scheduler, run_dir: Path, *record_files: str) -> int:
    """Restore a checkpoint's optimizer, scheduler and RNG states and return its step (0 without one). The records the
    stopped run wrote after it are dropped (by rename: a crash leaves the file whole), to be rewritten."""
    if checkpoint is None:
        return 0
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    for gpu, cuda_state in enumerate(cuda_rng_states_to_restore(rng.get("cuda", []), torch.cuda.device_count())):
        torch.cuda.set_rng_state(cuda_state, gpu)
    names = ("metrics.jsonl", "generations.jsonl", *record_files)
    for path in [run_dir / name for name in names if (run_dir / name).exists()]:
        kept = [
            line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["step"] <= state["step"]
        ]
        path.with_name(path.name + ".tmp").write_text("".join(kept))
        os.replace(path.with_name(path.name + ".tmp"), path)
    print(f"resumed from {checkpoint} after step {state['step']}")
    return state["step"]


def cuda_rng_states_to_restore(saved: list, n_gpus: int) -> list:
    """The saved per-GPU RNG states for the GPUs this machine has (set_rng_state_all fails when the count changed)."""
    if len(saved) != n_gpus:
        warnings.warn(f"the checkpoint has RNG states of {len(saved)} GPUs, this machine {n_gpus}: restoring "
                      f"{min(len(saved), n_gpus)}; sampling on the others will not replay", stacklevel=2)  # fmt: skip
    return saved[:n_gpus]


def append_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def make_logger(run_dir: Path, track: bool, wandb_project: str, config: dict):
    """log(metrics, step) appends a line to metrics.jsonl and, with track, sends it to W&B. A NaN (the mean of
    nothing, a diverged reward) is written as null: metrics.jsonl stays strict JSON."""
    metrics_file = open(run_dir / "metrics.jsonl", "a")
    tracker = None
    if track:
        import wandb

        tracker = wandb.init(project=wandb_project, name=run_dir.name, config=config, resume="allow")

    def log(metrics: dict, step: int) -> None:
        metrics = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        metrics_file.write(json.dumps({"step": step, **metrics}, allow_nan=False) + "\n")
        metrics_file.flush()
        if tracker is not None:
            tracker.log(metrics, step=step)

    return log


def main(args: Args) -> Path:
    args = restore_args(args)  # --resume: the stopped run's arguments
    check_args(args)
    mixture = data.parse_mixture(args.dataset)  # a bad spec stops here, before the engine starts
    names, weights = [name for name, _ in mixture], [weight for _, weight in mixture]
    templates = data.dataset_templates(names, args.template, args.dataset_templates)
    order_files = data.parse_per_dataset(args.curriculum, names, "--curriculum")
    # --- PLUMBING: run folder, devices, engine, seeds, policy (the same steps in every script) ---
    run_dir = make_run_dir(args.output_dir, args.exp_name, args.seed, args.resume, asdict(args))
    policy_device, vllm_device, memory_fraction, reload_tol = resolve_devices(
        args.policy_device, args.vllm_device, args.vllm_gpu_memory_utilization, args.reload_tol
    )
    checkpoint = latest_checkpoint(run_dir) if args.resume else None
    model_path = str(checkpoint) if checkpoint else args.model
    print(f"run folder {run_dir}; trainer on {policy_device}, vLLM on {vllm_device}; starting from {model_path}")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # All datasets' train examples, one dataset after another; each names its dataset (ex["dataset"]).
    train_examples, sizes, orders = data.load_mixture(names, "train", args.data_dir, order_files)
    train_prompts = [data.render_prompt(ex, templates[ex["dataset"]], tokenizer) for ex in train_examples]
    eval_examples = {name: data.load(name, data.eval_split(name, args.eval_split), args.data_dir)[: args.n_eval]
                     for name in names}  # fmt: skip
    eval_prompts = {name: [data.render_prompt(ex, templates[name], tokenizer) for ex in examples]
                    for name, examples in eval_examples.items()}  # fmt: skip
    n_prompts = args.rollout_batch_size // args.group_size
    for name, size, weight in zip(names, sizes, weights, strict=True):  # a step draws n_prompts w / sum(w), on average
        if n_prompts * weight / sum(weights) > size:
            raise ValueError(f"{n_prompts} questions per step, {weight / sum(weights):.0%} from {name}, but its train "
                             f"split has {size}")  # fmt: skip
    all_prompts = train_prompts + [prompt for prompts in eval_prompts.values() for prompt in prompts]
    longest_prompt = max(len(ids) for ids in tokenizer(all_prompts)["input_ids"])
    # The engine's context must hold a prompt and its response, and the 400-token reload probes plus 8 tokens.
    max_model_len = max(longest_prompt, 400) + max(args.max_tokens, args.eval_max_tokens, 8)
    # The engine first, while the GPU is empty: vLLM's request_memory refuses to start unless gpu_memory_utilization
    # x the GPU's memory is free, then keeps it; the trainer (which allocates as it goes) gets the rest.
    llm = init_vllm(model_path, vllm_device, args.seed, memory_fraction, max_model_len)
    policy, autocast = seed_and_load_policy(model_path, policy_device, args.gradient_checkpointing, args.seed)
    reference = None
    if args.beta > 0:  # the KL penalty's reference: the frozen starting model, also after --resume
        ref_dtype = torch.bfloat16 if policy_device.startswith("cuda") else torch.float32  # frozen: bf16 saves 3.2 GiB
        reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=ref_dtype).to(policy_device)
        reference.requires_grad_(False)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # logprobs=0: the engine also returns each sampled token's log-prob (free), for the mismatch correction
    sampling = dict(n=args.group_size, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                    include_stop_str_in_output=True, logprobs=0)  # fmt: skip
    stops = {name: data.stop_strings(template) or None for name, template in templates.items()}  # each template's
    probe_prompts = make_probe_prompts(tokenizer, [train_prompts[i] + train_examples[i]["solution"] for i in range(8)])

    # --- Optimizer and resume ---
    n_minibatches = args.rollout_batch_size // args.train_batch_size
    updates_per_step = n_minibatches * args.epochs_per_rollout_batch
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    scheduler = make_scheduler(optimizer, args.lr_schedule, args.warmup_steps, args.n_grpo_steps, updates_per_step)
    start_step = resume_from(checkpoint, optimizer, scheduler, run_dir, "rollouts.jsonl")
    log = make_logger(run_dir, args.track, args.wandb_project, asdict(args))
    # The engine loaded the same weights from disk: measure the probe's noise, prove a reload reaches every weight.
    reload_tol, start_gap = check_reload_at_start(policy, llm, probe_prompts, vllm_device, reload_tol)

    def evaluate_policy(step: int) -> dict:
        """Greedy evaluation through the engine (which follows the policy: checked at every reload), each dataset on
        its own eval split with its own template: eval/<dataset>/accuracy, and the totals over all of them."""
        t0 = time.time()
        metrics, records = {}, []
        for name, examples in eval_examples.items():
            part, part_records = evaluate(
                llm, examples, eval_prompts[name], templates[name], args.eval_max_tokens, vllm_device
            )
            metrics[f"eval/{name}/accuracy"] = part["eval/accuracy"]
            records += part_records
        metrics.update(eval_metrics(records))
        sample_metrics, samples = log_generations(policy, tokenizer, records[: args.n_log_generations], policy_device)
        append_jsonl(run_dir / "generations.jsonl", [{"step": step, **sample} for sample in samples])
        print(f"step {step:5d} | eval accuracy {metrics['eval/accuracy']:.3f} format {metrics['eval/format_rate']:.3f}")
        return {**metrics, **sample_metrics, "time/eval": time.time() - t0}

    if start_step == 0:
        log({**evaluate_policy(0), "reload/logprob_gap": start_gap}, 0)

    # --- ALGORITHM: the GRPO loop ---
    n_bad_in_a_row = 0
    for step in range(start_step, args.n_grpo_steps):
        t_step = time.time()
        # --- 1. Generate: group_size responses to each of the step's questions ---
        indices, seeds = step_questions_and_seeds(sizes, weights, orders, n_prompts, args.group_size, args.seed, step)
        examples = [train_examples[i] for i in indices]
        params = [SamplingParams(**sampling, stop=stops[ex["dataset"]], seed=seed)
                  for ex, seed in zip(examples, seeds, strict=True)]  # fmt: skip
        with engine_device(vllm_device):
            outputs = llm.generate([train_prompts[i] for i in indices], params, use_tqdm=False)
        # Flattened, group by group: responses j * G ... j * G + G - 1 answer question j.  (B,) lists, B = n_prompts G
        completions = [c for output in outputs for c in output.outputs]
        prompt_ids = [list(output.prompt_token_ids) for output in outputs for _ in output.outputs]
        response_ids = [list(c.token_ids) for c in completions]
        # log p_engine of each sampled token, after temperature (init_vllm asks for "processed_logprobs")
        engine_lps = [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)] for c in completions]
        t_generate = time.time() - t_step

        # --- 2. Score, and advantages within each group ---
        t0 = time.time()
        ground_truths = [ex for ex in examples for _ in range(args.group_size)]
        # One batch through score_batch (code examples run their programs in a pool), handed out in order.
        scores = iter(verifiers.score_batch([c.text for c in completions], ground_truths))
        advantages, raw_rewards, reward_metadata = compute_group_normalized_rewards(
            lambda response, example: next(scores),  # noqa: B023 (called here, in this step)
            [c.text for c in completions], ground_truths, args.group_size, args.advantage_eps,
            args.normalize_by_std,
        )  # fmt: skip
        has_signal = groups_with_signal(raw_rewards, args.group_size, args.loss_type)  # (n_prompts,)
        rows = [i for i, c in enumerate(completions)  # the responses trained on
                if (has_signal[i // args.group_size] or not args.drop_zero_variance_groups)
                and not (args.mask_truncated and c.finish_reason == "length")]  # fmt: skip
        t_score = time.time() - t0
        write_rollouts(run_dir / "rollouts.jsonl", step + 1, examples, [train_prompts[i] for i in indices], completions,
                       raw_rewards, advantages, set(rows), args.group_size)  # fmt: skip

        # --- 3. Update: epochs over the kept rollouts, optimizer steps on minibatches, gradient accumulation ---
        t0 = time.time()
        sums = {"loss": 0.0, "grad_norm": 0.0, "updates": 0, "positions": 0}  # the rest: device tensors
        if rows:
            batch = collate_token_ids([prompt_ids[i] for i in rows], [response_ids[i] for i in rows], pad_id)  # (n, T)
            batch["engine_log_probs"] = response_values(batch["response_mask"], [engine_lps[i] for i in rows])
            lengths = [len(prompt_ids[i]) + len(response_ids[i]) - 1 for i in rows]  # positions per row, unpadded
            sums["positions"] = sum(lengths) + len(rows)
            batch_advantages, batch_rewards = advantages[rows].to(policy_device), raw_rewards[rows].to(policy_device)
            # Old and reference log-probs: once per rollout batch, before the first optimizer step.  (n, T) each
            old_log_probs = ref_log_probs = None
            if args.loss_type == "grpo_clip" and updates_per_step > 1:
                old_log_probs = frozen_log_probs(policy, batch, lengths, args.microbatch_size, args.temperature)
            if reference is not None:
                ref_log_probs = frozen_log_probs(reference, batch, lengths, args.microbatch_size, args.temperature)
            for epoch in range(args.epochs_per_rollout_batch):
                order = np.random.default_rng([args.seed, step, epoch]).permutation(len(rows))
                for minibatch in [part.tolist() for part in np.array_split(order, n_minibatches)]:
                    if not minibatch:
                        continue
                    n_tokens = int(batch["response_mask"][minibatch].sum())
                    micro_list = microbatches(minibatch, lengths, args.microbatch_size)
                    update_loss = torch.zeros((), device=policy_device)
                    for micro_rows in micro_list:
                        micro = take_rows(batch, micro_rows, lengths, policy_device)
                        with autocast:
                            out = get_response_log_probs(
                                policy, micro["input_ids"], micro["labels"], True, args.temperature
                            )
                        width = micro["labels"].shape[1]
                        # With one optimizer step per rollout batch the policy IS the old policy: its own log-probs,
                        # detached, are the old ones (ratio 1, the same gradient), and no extra forward pass is spent.
                        old = out["log_probs"].detach() if old_log_probs is None else old_log_probs[micro_rows, :width]
                        ref = None if ref_log_probs is None else ref_log_probs[micro_rows, :width]
                        loss, metadata = grpo_microbatch_train_step(
                            out["log_probs"], micro["response_mask"], len(micro_list), args.loss_type,
                            raw_rewards=batch_rewards[micro_rows], advantages=batch_advantages[micro_rows],
                            old_log_probs=old, cliprange=(args.clip_low, args.clip_high),
                            loss_aggregation=args.loss_aggregation, n_batch_sequences=len(minibatch),
                            n_batch_tokens=n_tokens, normalize_constant=args.max_tokens, ref_log_probs=ref,
                            beta=args.beta, engine_log_probs=micro["engine_log_probs"],
                            is_cap=args.vllm_importance_sampling_cap,
                        )  # fmt: skip
                        update_loss += loss  # on the device: no host sync per microbatch
                        metadata.pop("ratio", None)
                        add_masked_sums(sums, micro["response_mask"], entropy=out["token_entropy"], **metadata)
                    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                    update_loss, grad_norm = torch.stack([update_loss, grad_norm]).tolist()  # the update's one sync
                    if math.isfinite(update_loss) and math.isfinite(grad_norm):
                        optimizer.step()
                        scheduler.step()
                        n_bad_in_a_row = 0
                        sums["loss"] += update_loss
                        sums["grad_norm"] += grad_norm
                        sums["updates"] += 1
                    else:  # warns; raises at the third in a row
                        n_bad_in_a_row = skip_non_finite_update(update_loss, grad_norm, step + 1, n_bad_in_a_row + 1)
                    optimizer.zero_grad(set_to_none=True)
        catch_up_scheduler(scheduler, step + 1, updates_per_step)
        t_train = time.time() - t0

        # --- 4. Reload the new weights into the engine, and prove it follows them ---
        t0 = time.time()
        load_policy_into_vllm(policy, llm, vllm_device)
        gap = check_vllm_follows_policy(policy, llm, probe_prompts, vllm_device, reload_tol)
        t_reload = time.time() - t0

        # --- 5. Log, evaluate, save ---
        step_done = step + 1
        extra = {"train/lr": scheduler.get_last_lr()[0], "reload/logprob_gap": gap, "time/generate": t_generate,
                 "time/score": t_score, "time/train": t_train, "time/reload": t_reload}  # fmt: skip
        metrics = step_metrics(reward_metadata, completions, len(rows), sums, extra, args)
        metrics.update(rollout_metrics_by_dataset(names, examples, raw_rewards.view(-1, args.group_size).tolist()))
        if step_done % args.eval_every == 0 or step_done == args.n_grpo_steps:
            metrics.update(evaluate_policy(step_done))
        metrics["time/step"] = time.time() - t_step
        log(metrics, step_done)
        m = {"train/loss": math.nan, "train/grad_norm": math.nan, **metrics}  # nan: no update this step
        print(f"step {step_done:5d}/{args.n_grpo_steps} | reward {m['rollout/reward_mean']:.3f} | "
              f"len {m['rollout/response_length']:.0f} trunc {m['rollout/truncation_rate']:.2f} | "
              f"zero-std groups {m['rollout/frac_zero_std_groups']:.2f} | loss {m['train/loss']:+.4f} "
              f"grad {m['train/grad_norm']:.3f} | gap {gap:.0e} | {m['time/step']:.1f} s")  # fmt: skip
        if step_done % args.save_every == 0 or step_done == args.n_grpo_steps:
            save_checkpoint(run_dir, step_done, policy, tokenizer, optimizer, scheduler, args.keep_checkpoints)
    return run_dir


if __name__ == "__main__":
    main(tyro.cli(Args))
