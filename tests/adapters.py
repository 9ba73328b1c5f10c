"""CS336 assignment 5's functions whose signatures serve the course's scaffolding rather than our
loop, mapped onto the loop's own functions, as CS336's own tests/adapters.py maps its names onto a
student's code. A suite written against CS336's signatures runs against these, and gets the loop's
numbers: the scripts hold only what their runs call (one function, one name).

- compute_group_normalized_rewards: the loop scores (score_responses) and normalises
  (group_normalize) in two parts, so that each rank scores only its share.
- compute_naive_policy_gradient_loss and compute_policy_gradient_loss: grpo_family.py's loop calls
  them (--loss-type); grpo.py has one loss and calls compute_grpo_clip_loss itself.
- grpo_microbatch_train_step: the loop's update takes a mean over a minibatch's tokens (grpo.py) or
  the aggregation of --loss-aggregation (grpo_family.py, whose sequence_mean gives this gradient
  with microbatches of one size: tests/test_grpo_family.py).
- masked_mean: no loop takes a mean over a mask's own count; the loss divides by the minibatch's
  tokens (masked_normalize)."""

from collections.abc import Callable

import torch

import grpo
from grpo_family import compute_naive_policy_gradient_loss, compute_policy_gradient_loss

__all__ = [
    "compute_group_normalized_rewards",
    "compute_naive_policy_gradient_loss",
    "compute_policy_gradient_loss",
    "grpo_microbatch_train_step",
    "masked_mean",
]


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `tensor` over the elements where mask is 1, along `dim` (all dims if None)."""
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, dict], dict],
    rollout_responses: list[str],
    repeated_ground_truths: list,
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score each response with reward_fn(response, ground_truth), a dict with "reward"
    (verifiers.score(response, example) is one), and normalise the rewards within their groups
    with grpo.group_normalize: (advantages (B,), raw_rewards (B,), grpo.reward_statistics)."""
    if len(rollout_responses) % group_size != 0:
        raise ValueError(
            f"{len(rollout_responses)} responses do not make whole groups of {group_size}"
        )
    reward_dicts = []
    for response, ground_truth in zip(rollout_responses, repeated_ground_truths, strict=True):
        reward_dicts.append(reward_fn(response, ground_truth))
    raw_rewards = torch.tensor([d["reward"] for d in reward_dicts], dtype=torch.float32)  # (B,)
    advantages = grpo.group_normalize(raw_rewards, group_size, advantage_eps, normalize_by_std)
    statistics = grpo.reward_statistics(reward_dicts, raw_rewards, group_size)
    return advantages, raw_rewards, statistics


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CS336's microbatch step; calls backward(). The per-token loss of loss_type
    (grpo_family.compute_policy_gradient_loss), averaged over each response's tokens, then over
    the microbatch's responses, divided by gradient_accumulation_steps. Returns the loss
    (detached) and the per-token metadata."""
    per_token_loss, metadata = compute_policy_gradient_loss(
        policy_log_probs,
        loss_type,
        raw_rewards,
        advantages,
        old_log_probs,
        cliprange,
        response_mask,
    )
    loss = masked_mean(per_token_loss, response_mask, dim=-1).mean() / gradient_accumulation_steps
    loss.backward()
    return loss.detach(), metadata
