"""grpo_family.py: the research family's losses and sampling, checked by hand on small tensors
(GSPO, CISPO, the three loss aggregations and the per-token weights of aggregate_loss's table,
which groups carry a signal and which responses are trained on); the properties the family relies
on (microbatches accumulate to the batch's gradient, padding changes nothing, the on-policy
clipped loss has the REINFORCE gradient, in every aggregation); its argument checks; and runs
with a real vLLM engine on the tiny model: dynamic sampling fills the batch and resumes exactly,
non-finite updates of a batch of all groups are skipped and then stop the run. grpo.py's own
losses and loop: tests/test_grpo.py.

As there, the tiny model's weights are random and the real verifier gives every response 0: the
runs replace verifiers.score with `letter_reward` (the share of letters in the response).
"""

import json
import math
from dataclasses import replace

import pytest
import torch
from adapters import grpo_microbatch_train_step
from conftest import interrupted_at_call
from transformers import AutoTokenizer

import grpo_family
from grpo_family import (
    Args,
    aggregate_loss,
    compute_k3_kl,
    compute_k3_kl_is,
    compute_policy_gradient_loss,
    gdpo_advantages,
    groups_with_signal,
)

# --- the family's per-token losses ---


def test_gspo_loss_by_hand():
    # Response 0: log p - log p_old = [ln 2, 0] over 2 tokens: s = exp(ln 2 / 2) = sqrt 2 = 1.41421;
    # A = 1. Response 1: [ln 1/2] over 1 token (then padding, left out of the mean): s = 1/2; A =
    # -1. Range 0.2: both clipped (sqrt 2 > 1.2, A > 0: -1.2; 1/2 < 0.8, A < 0: -min(-0.5, -0.8) =
    # 0.8), no gradient. Range 10: unclipped, -s A on every token of the response; d/d log p_t = -A
    # s / |o_i| = -0.70711 (row 0), and 1/2 / 1 = 0.5 (row 1), 0 on the padding.
    old = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    advantages = torch.tensor([[1.0], [-1.0]])
    for cliprange, loss_0, loss_1, grad in [
        (0.2, -1.2, 0.8, [[0.0, 0.0], [0.0, 0.0]]),
        (10.0, -math.sqrt(2), 0.5, [[-math.sqrt(2) / 2] * 2, [0.5, 0.0]]),
    ]:
        log_probs = torch.tensor([[math.log(2), 0.0], [-math.log(2), 5.0]], requires_grad=True)
        loss, meta = compute_policy_gradient_loss(
            log_probs,
            "gspo",
            advantages=advantages,
            old_log_probs=old,
            cliprange=cliprange,
            response_mask=mask,
        )
        assert loss.shape == (2, 2) and loss[:, 0].tolist() == pytest.approx([loss_0, loss_1])
        assert meta["clipped"].all() == (cliprange == 0.2)
        loss[:, 0].sum().backward()  # one loss per response: its first token's
        assert [
            row == pytest.approx(g) for row, g in zip(log_probs.grad.tolist(), grad, strict=True)
        ] == [True, True]
    with pytest.raises(ValueError, match="needs response_mask"):
        compute_policy_gradient_loss(
            old, "gspo", advantages=advantages, old_log_probs=old, cliprange=0.2
        )


def test_cispo_loss_keeps_the_gradient_of_clipped_tokens():
    # p / p_old = [0.5 / 0.25, 0.5 / 0.5] = [2, 1]; range (1, 0.28): weights [1.28, 1] (detached); A
    # = 2. loss = -w A log p = [-1.28 * 2 * ln 0.5, -2 ln 0.5] = [1.77446, 1.38629]; d/d log p = -w
    # A = [-2.56, -2]. grpo_clip on the same tokens: the first is clipped (r = 2 > 1.28, A > 0):
    # gradient 0 there.
    old = torch.tensor([[math.log(0.25), math.log(0.5)]])
    advantages = torch.tensor([[2.0]])
    grads = {}
    for loss_type in ("cispo", "grpo_clip"):
        log_probs = torch.full((1, 2), math.log(0.5), requires_grad=True)
        loss, meta = compute_policy_gradient_loss(
            log_probs, loss_type, advantages=advantages, old_log_probs=old, cliprange=(1.0, 0.28)
        )
        loss.sum().backward()
        grads[loss_type] = log_probs.grad.tolist()[0]
        assert meta["clipped"].tolist() == [[True, False]]
        if loss_type == "cispo":
            assert loss.tolist()[0] == pytest.approx([1.28 * 2 * math.log(2), 2 * math.log(2)])
    assert grads["cispo"] == pytest.approx([-2.56, -2.0])
    assert grads["grpo_clip"] == pytest.approx([0.0, -2.0])  # -A r = -2 * 1 on the unclipped token


# --- the loss as grpo_update puts it together: aggregations, accumulation, padding ---

# The aggregate_loss docstring's weights: one batch of two responses of 4 and 7 tokens, padded to 9.
MASK = torch.tensor([[1] * 4 + [0] * 5, [1] * 7 + [0] * 2], dtype=torch.bool)
WEIGHTS = {
    # 1 / (N |o_i|), N = 2
    "sequence_mean": torch.tensor([[1 / 8] * 4 + [0] * 5, [1 / 14] * 7 + [0] * 2]),
    "token_mean": MASK / 11,  # 1 / (4 + 7)
    "constant": MASK / 16,  # 1 / (N L), L = 8
}
ADVANTAGES = torch.tensor([[1.5], [-2.0]])


def microbatch_loss(
    log_probs,
    mask=MASK,
    advantages=ADVANTAGES,
    loss_type="reinforce_with_baseline",
    loss_aggregation="sequence_mean",
    n_sequences=2,
    n_tokens=11,
    old_log_probs=None,
    cliprange=0.2,
    ref_log_probs=None,
    beta=0.0,
    engine_log_probs=None,
    is_cap=None,
):
    """One microbatch's loss from leaf log-probs, put together as grpo_update does it (the
    policy-gradient loss, the IS weight, the k3 KL, the aggregation), backward included: (loss,
    gradient wrt the log-probs, per-token metadata). By default the whole batch of MASK."""
    log_probs = log_probs.clone().requires_grad_(True)
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    per_token, meta = compute_policy_gradient_loss(
        log_probs, loss_type, None, advantages, old, cliprange, mask
    )
    if engine_log_probs is not None:
        meta["engine_gap"] = (old - engine_log_probs).abs()
    if is_cap is not None:
        weights, meta["above_is_cap"] = grpo_family.engine_importance_weights(
            old, engine_log_probs, is_cap
        )
        per_token = per_token * weights
    if beta > 0:
        meta["kl"] = compute_k3_kl(log_probs, ref_log_probs).detach()
        per_token = per_token + beta * compute_k3_kl(log_probs, ref_log_probs)
    loss = aggregate_loss(per_token, mask, loss_aggregation, n_sequences, n_tokens, 8)
    loss.backward()
    return loss.detach(), log_probs.grad, meta


@pytest.mark.parametrize("aggregation", list(WEIGHTS))
def test_aggregation_weights_match_the_docstring_table(aggregation):
    torch.manual_seed(0)
    log_probs = -torch.rand(2, 9)
    loss, grad, _ = microbatch_loss(log_probs, loss_aggregation=aggregation)
    # loss = sum_it w_it (-A_i log p_it), so d loss / d log p_it = -A_i w_it, and 0 on padding.
    assert torch.allclose(grad, -ADVANTAGES * WEIGHTS[aggregation])
    assert loss.item() == pytest.approx(
        (WEIGHTS[aggregation] * -ADVANTAGES * log_probs).sum().item()
    )


def test_grpo_microbatch_train_step_is_cs336s_and_the_updates_sequence_mean():
    # CS336's step: masked_mean(loss, mask, dim=-1).mean() / gradient_accumulation_steps, each
    # row's mean over its response tokens, then the mean over rows. It is the update's
    # sequence_mean over a minibatch of 4 microbatches of these 2 rows: N = 2 x 4.
    torch.manual_seed(0)
    log_probs = -torch.rand(2, 9)
    log_probs_leaf = log_probs.clone().requires_grad_(True)
    loss, _ = grpo_microbatch_train_step(
        log_probs_leaf, MASK, 4, "reinforce_with_baseline", advantages=ADVANTAGES
    )
    expected = ((-ADVANTAGES * log_probs * MASK).sum(-1) / MASK.sum(-1)).mean() / 4
    assert loss.item() == pytest.approx(expected.item())
    _, grad, _ = microbatch_loss(log_probs, n_sequences=8)
    assert torch.allclose(log_probs_leaf.grad, grad)


@pytest.mark.parametrize("aggregation", list(WEIGHTS))
def test_microbatches_accumulate_to_the_batch_gradient(aggregation):
    # The batch in one microbatch, or in two microbatches of one response each (of different
    # lengths) given the batch's counts: the same accumulated gradient.
    torch.manual_seed(0)
    log_probs = -torch.rand(2, 9)
    _, whole, _ = microbatch_loss(log_probs, loss_aggregation=aggregation)
    parts = []
    for i in range(2):
        _, grad, _ = microbatch_loss(
            log_probs[i : i + 1],
            MASK[i : i + 1],
            ADVANTAGES[i : i + 1],
            loss_aggregation=aggregation,
            n_sequences=2,
            n_tokens=11,
        )
        parts.append(grad)
    assert torch.allclose(torch.cat(parts), whole)


@pytest.mark.parametrize("aggregation", list(WEIGHTS))
@pytest.mark.parametrize("loss_type", ["reinforce_with_baseline", "grpo_clip"])
def test_padding_changes_neither_loss_nor_gradient(aggregation, loss_type):
    torch.manual_seed(0)
    log_probs, old = -torch.rand(2, 9), -torch.rand(2, 9)
    kwargs = {"loss_type": loss_type, "loss_aggregation": aggregation, "old_log_probs": old}
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


@pytest.mark.parametrize("aggregation", list(WEIGHTS))
def test_on_policy_clipped_loss_has_the_reinforce_gradient(aggregation):
    # First step on a rollout batch: policy == old policy, ratio 1. Clipping is inactive and d(r
    # A)/d log p = A r = A: the same gradient as -A log p, and a clip fraction of 0.
    torch.manual_seed(0)
    log_probs = -torch.rand(2, 9)
    _, reinforce, _ = microbatch_loss(log_probs, loss_aggregation=aggregation)
    _, clipped, meta = microbatch_loss(
        log_probs,
        loss_type="grpo_clip",
        old_log_probs=log_probs.clone(),
        loss_aggregation=aggregation,
    )
    assert torch.allclose(clipped, reinforce, atol=1e-7)
    assert not meta["clipped"].any()


def test_unknown_aggregation_and_missing_constant():
    with pytest.raises(ValueError, match="unknown loss_aggregation"):
        microbatch_loss(torch.zeros(2, 9), loss_aggregation="sum")
    with pytest.raises(ValueError, match="normalize_constant"):
        aggregate_loss(torch.zeros(2, 9), MASK, "constant", 2, 11, None)


# --- which responses are trained on ---


def test_groups_with_signal():
    # Groups of 2: all correct, all wrong, mixed. With an advantage only the mixed group has a
    # gradient; with no_baseline (-r log p) the all-correct group has one too (dropping it would
    # bias REINFORCE), the all-wrong none.
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert groups_with_signal(rewards, 2, "no_baseline").tolist() == [True, False, True]
    for loss_type in ("reinforce_with_baseline", "grpo_clip"):
        assert groups_with_signal(rewards, 2, loss_type).tolist() == [False, False, True]


def test_responses_to_train():
    # Groups of 2: mixed, all equal, mixed, mixed. At most 2 groups: the first two with a signal
    # (groups 0 and 2); response 1 was cut off at --max-tokens.
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    truncated = [False, True] + [False] * 6
    args = Args(group_size=2)
    assert grpo_family.responses_to_train(rewards, truncated, 2, args) == [0, 1, 4, 5]
    assert grpo_family.responses_to_train(rewards, truncated, 4, args) == [0, 1, 4, 5, 6, 7]
    masked = Args(group_size=2, mask_truncated=True)
    assert grpo_family.responses_to_train(rewards, truncated, 2, masked) == [0, 4, 5]
    every_group = Args(group_size=2, drop_zero_variance_groups=False)
    assert grpo_family.responses_to_train(rewards, truncated, 2, every_group) == list(range(8))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_type": "ppo"}, "unknown loss_type"),
        ({"loss_aggregation": "sum"}, "unknown loss_aggregation"),
        (
            {"dynamic_sampling": True, "drop_zero_variance_groups": False},
            "drops zero-variance groups",
        ),
        ({"is_mode": "clip"}, "unknown is_mode"),
        ({"is_level": "group"}, "unknown is_level"),
        ({"is_mode": "icepop", "is_low": 3.0}, "is_low must be in"),
        ({"kl_is_correction": True}, "set beta"),
        ({"reward_aggregation": "gdpo", "loss_type": "no_baseline"}, "gdpo normalises"),
        ({"reward_aggregation": "mean"}, "unknown reward_aggregation"),
        ({"sft_coef": -0.1}, "sft_coef must be"),
        ({"sft_coef": 0.1, "dataset": "gsm8k:0.5,ifeval:0.5"}, "not ifeval"),
    ],
)
def test_argument_errors_before_the_engine_starts(overrides, message, monkeypatch):
    monkeypatch.setattr(
        grpo_family, "init_vllm", lambda *a: pytest.fail("the engine must not start")
    )
    with pytest.raises(ValueError, match=message):
        grpo_family.main(Args(**overrides))


# --- the auxiliary SFT loss (--sft-coef) ---


def sft_solutions(tiny_model_dir):
    """Three prompts and their reference solutions of different lengths, as main tokenizes
    them, and the token ids of each, unpadded."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = ["Q: 2 + 3?\nA:", "Q: 40 + 9 - 7?\nA:", "Q: 1?\nA:"]
    solutions = [
        s + tokenizer.eos_token for s in (" 2 + 3 = 5.", " 40 + 9 = 49. 49 - 7 = 42.", " 1.")
    ]
    batch = grpo_family.tokenize_prompt_and_output(prompts, solutions, tokenizer)
    ids = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
    return batch, list(zip(ids(prompts), ids(solutions), strict=True))


def nll_by_hand(policy, pairs):
    """The mean NLL per solution token, written out: each prompt + solution alone through the
    model, the full logits' log_softmax at each solution token (predicted from the position
    before it), summed over the solutions, / their number of tokens."""
    total = 0.0
    for prompt, solution in pairs:
        logits = policy(torch.tensor([prompt + solution])).logits[0]  # (L, V)
        log_p = logits.log_softmax(-1)[len(prompt) - 1 : -1]  # (|solution|, V)
        total = total - log_p.gather(1, torch.tensor(solution)[:, None]).sum()
    return total / sum(len(solution) for _, solution in pairs)


def test_sft_nll_by_hand_in_any_microbatches(tiny_model_dir):
    batch, pairs = sft_solutions(tiny_model_dir)
    policy, autocast = grpo_family.load_policy(str(tiny_model_dir), "cpu", False, 0)
    expected = nll_by_hand(policy, pairs)
    # a random model: about ln V per token
    assert 3 < expected.item() < 10
    for size in (1, 2, 3):
        args = Args(sft_coef=1.0, microbatch_size=size)
        nll = grpo_family.sft_nll_backward(policy, batch, args, autocast)
        assert nll.item() == pytest.approx(expected.item(), rel=1e-5)


def test_sft_coef_adds_lambda_times_the_nlls_gradient(tiny_model_dir):
    # One optimizer step of SGD at lr 1, no clipping: the weights move by minus the gradient.
    # With --sft-coef 0.5 it is GRPO's gradient (the update without it) + 0.5 x the gradient
    # of nll_by_hand; the loss logged is GRPO's + 0.5 NLL, and the SFT term's share of it.
    from test_grpo import rollout_batch

    batch, lengths = rollout_batch(4)
    batch["raw_rewards"] = torch.zeros(4, 1)
    sft_batch, pairs = sft_solutions(tiny_model_dir)
    args = Args(
        rollout_batch_size=4, group_size=2, train_batch_size=4, microbatch_size=3, max_grad_norm=1e9
    )

    def update(sft_coef, sft_batch):
        policy, autocast = grpo_family.load_policy(str(tiny_model_dir), "cpu", False, 0)
        start = {k: v.clone() for k, v in policy.state_dict().items()}
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        args_here = replace(args, sft_coef=sft_coef)
        metrics = grpo_family.grpo_update(
            policy, optimizer, batch, lengths, [1.0], None, args_here, 0, autocast, sft_batch
        )
        return {k: start[k] - v for k, v in policy.state_dict().items()}, metrics

    both, metrics = update(0.5, sft_batch)
    grpo_alone, grpo_metrics = update(0.0, None)
    policy, _ = grpo_family.load_policy(str(tiny_model_dir), "cpu", False, 0)
    nll = nll_by_hand(policy, pairs)
    nll.backward()
    for name, p in policy.named_parameters():
        assert torch.allclose(both[name], grpo_alone[name] + 0.5 * p.grad, atol=1e-6), name
    assert metrics["train/sft_nll"] == pytest.approx(nll.item(), rel=1e-5)
    grpo_loss = grpo_metrics["train/loss"]
    assert metrics["train/loss"] == pytest.approx(grpo_loss + 0.5 * nll.item(), rel=1e-5)
    share = 0.5 * nll.item() / (abs(grpo_loss) + 0.5 * nll.item())
    assert metrics["train/sft_share"] == pytest.approx(share, rel=1e-5)
    assert not {"train/sft_nll", "train/sft_share"} & set(grpo_metrics)


# --- the engine/trainer mismatch: IS level and mode, DeepSeek-V3.2's KL and sequence mask ---


def mismatch(ratios, level="token", mode="truncate", low=0.5, cap=2.0):
    """engine_mismatch_weights on log p_old = log of the ratios, log p_engine = 0, with rows padded
    by 0 (a padded token has ratio 0 here: the mask must leave it out of a sequence's product)."""
    old = torch.tensor(ratios).log()
    mask = old > -math.inf
    old = old.masked_fill(~mask, 0.0)
    return grpo_family.engine_mismatch_weights(
        old, torch.zeros_like(old), mask, level, mode, low, cap
    )


def test_engine_mismatch_weights_by_hand():
    # Row 0: ratios p_old / p_engine [1/4, 1, 3]; row 1: [3/2, 5/2] and padding. Cap 2, low 1/2.
    ratios = [[0.25, 1.0, 3.0], [1.5, 2.5, 0.0]]
    expected = {
        # token: each ratio on its own
        ("token", "truncate"): ([[0.25, 1, 2], [1.5, 2, 2]], [[0, 0, 1], [0, 1, 1]]),
        ("token", "mask"): ([[0.25, 1, 0], [1.5, 0, 0]], [[0, 0, 1], [0, 1, 1]]),
        ("token", "icepop"): ([[0, 1, 0], [1.5, 0, 0]], [[1, 0, 1], [0, 1, 1]]),
        # sequence: the product, 1/4 x 1 x 3 = 3/4 and 3/2 x 5/2 = 15/4, on every token
        ("sequence", "truncate"): ([[0.75] * 3, [2] * 3], [[0] * 3, [1] * 3]),
        ("sequence", "mask"): ([[0.75] * 3, [0] * 3], [[0] * 3, [1] * 3]),
        ("sequence", "icepop"): ([[0.75] * 3, [0] * 3], [[0] * 3, [1] * 3]),
    }
    for (level, mode), (weights, flagged) in expected.items():
        w, stats = mismatch(ratios, level, mode)
        mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
        assert torch.allclose(w * mask, torch.tensor(weights) * mask), (level, mode)
        assert (stats["above_is_cap"] & mask).tolist() == (
            torch.tensor(flagged).bool() & mask
        ).tolist()
    # icepop's lower bound: 3/4 < 0.8 masks the first sequence too
    w, _ = mismatch(ratios, "sequence", "icepop", low=0.8)
    assert w[0].tolist() == [0, 0, 0]


def test_default_mismatch_weights_are_grpo_pys_bit_for_bit():
    args = Args()
    old, engine = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    w, stats = grpo_family.engine_mismatch_weights(
        old,
        engine,
        mask,
        args.is_level,
        args.is_mode,
        args.is_low,
        args.vllm_importance_sampling_cap,
    )
    w_grpo, above_grpo = grpo_family.engine_importance_weights(old, engine, 2.0)
    assert torch.equal(w, w_grpo) and torch.equal(stats["above_is_cap"], above_grpo)
    assert set(stats) == {"above_is_cap"}  # the default logs what grpo.py logs


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_thresholds_that_admit_everything_mask_nothing(level):
    old, engine = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    plain = None
    for mode in ("truncate", "mask", "icepop"):
        w, stats = grpo_family.engine_mismatch_weights(
            old, engine, mask, level, mode, 0.0, math.inf
        )
        assert not stats["above_is_cap"].any()
        plain = w if plain is None else plain
        assert torch.allclose(w, plain)  # every mode is the plain importance ratio
    keep, _ = grpo_family.off_policy_sequence_mask(
        torch.tensor([-1.0, -1.0, 1.0]), old, engine, mask, math.inf
    )
    assert keep.all()


def test_a_planted_mismatch_is_handled_as_each_paper_says():
    # Four responses of 4 tokens; the trainer's p_old and p agree with the engine on every token
    # but three: on token 1 of responses 0 and 2 the engine's log-prob is 1 lower (ratio p_old /
    # p_engine = e = 2.718), on token 2 of response 1 it is 1 higher (ratio 1/e = 0.368).
    old = torch.full((4, 4), -1.0)
    engine = old.clone()
    engine[0, 1] = engine[2, 1] = -2.0
    engine[1, 2] = 0.0
    mask = torch.ones(4, 4, dtype=torch.bool)
    e = math.e
    cases = {
        # TIS caps the high ratio at 2 and keeps the low one as a weight
        ("token", "truncate"): {(0, 1): 2, (2, 1): 2, (1, 2): 1 / e},
        # TRL's mask drops the tokens above the cap
        ("token", "mask"): {(0, 1): 0, (2, 1): 0, (1, 2): 1 / e},
        # IcePop drops both sides of [1/2, 2]
        ("token", "icepop"): {(0, 1): 0, (2, 1): 0, (1, 2): 0},
    }
    for (level, mode), changed in cases.items():
        w, _ = grpo_family.engine_mismatch_weights(old, engine, mask, level, mode, 0.5, 2.0)
        expected = torch.ones(4, 4)
        for index, value in changed.items():
            expected[index] = value
        assert torch.allclose(w, expected), (level, mode)
    # the sequence level weighs the whole response by its product: e, 1/e, e, 1
    rows = {"truncate": [2, 1 / e, 2, 1], "mask": [0, 1 / e, 0, 1], "icepop": [0, 0, 0, 1]}
    for mode, row_weights in rows.items():
        w, _ = grpo_family.engine_mismatch_weights(old, engine, mask, "sequence", mode, 0.5, 2.0)
        assert torch.allclose(
            w, torch.tensor(row_weights, dtype=torch.float32).unsqueeze(1).expand(4, 4)
        ), mode
    # DeepSeek-V3.2: mean_t log(p_engine / p) = [-1/4, 1/4, -1/4, 0]; with delta 0.1 only response
    # 1 passes it, and it is left out only because its advantage is negative (response 3's A < 0
    # too, but its sampler agrees)
    keep, kl = grpo_family.off_policy_sequence_mask(
        torch.tensor([1.0, -1.0, -1.0, -1.0]), old, engine, mask, 0.1
    )
    assert kl.squeeze(1).tolist() == pytest.approx([-0.25, 0.25, -0.25, 0.0])
    assert keep.squeeze(1).tolist() == [True, False, True, True]
    keep, _ = grpo_family.off_policy_sequence_mask(
        torch.tensor([1.0, 1.0, -1.0, -1.0]), old, engine, mask, 0.1
    )
    assert keep.all()  # A >= 0 is always kept


def test_corrected_kl_is_the_kl_and_its_gradient_off_policy():
    # One position, a vocabulary of 3: the tokens are sampled from p_old, the loss is p's. The
    # expectation over p_old of the corrected estimate, sum_v p_old(v) (p(v) / p_old(v)) k3(v),
    # is KL(p || p_ref) = sum_v p(v) log(p(v) / p_ref(v)), and so is its gradient wrt p's
    # logits. Plain k3 under p_old is neither.
    p_old = torch.tensor([0.5, 0.3, 0.2])
    p_ref = torch.tensor([0.2, 0.5, 0.3])
    logits = torch.tensor([0.3, -0.2, 0.1], requires_grad=True)
    log_p = torch.log_softmax(logits, dim=0)
    exact = (log_p.exp() * (log_p - p_ref.log())).sum()
    corrected = (p_old * compute_k3_kl_is(log_p, p_ref.log(), p_old.log())).sum()
    plain = (p_old * compute_k3_kl(log_p, p_ref.log())).sum()
    assert corrected.item() == pytest.approx(exact.item())
    assert abs(plain.item() - exact.item()) > 0.01
    (grad_exact,) = torch.autograd.grad(exact, logits, retain_graph=True)
    (grad_corrected,) = torch.autograd.grad(corrected, logits, retain_graph=True)
    assert torch.allclose(grad_corrected, grad_exact)
    # on-policy (p_old = p, detached) the values agree, the gradients do not: plain k3's is that
    # of KL(p_ref || p)
    on_policy = log_p.detach()
    plain = (on_policy.exp() * compute_k3_kl(log_p, p_ref.log())).sum()
    corrected = (on_policy.exp() * compute_k3_kl_is(log_p, p_ref.log(), on_policy)).sum()
    reverse = (p_ref * (p_ref.log() - log_p)).sum()
    assert plain.item() == pytest.approx(corrected.item())
    (grad_plain,) = torch.autograd.grad(plain, logits, retain_graph=True)
    (grad_corrected,) = torch.autograd.grad(corrected, logits, retain_graph=True)
    (grad_reverse,) = torch.autograd.grad(reverse, logits)
    assert torch.allclose(grad_corrected, grad_exact) and torch.allclose(grad_plain, grad_reverse)
    assert not torch.allclose(grad_plain, grad_exact)


# --- GDPO: the reward's components normalised one by one ---


def test_gdpo_advantages_by_hand():
    # The docstring's 2 x 3 groups: format [1, 1, 0 | 1, 1, 1], answer [1, 0, 0 | 1, 0, 0].
    # Group 0's format: mean 2/3, std 1/sqrt 3: [1, 1, -2] / sqrt 3; its answer [2, -1, -1] /
    # sqrt 3; group 1's format does not vary (0). Sum [sqrt 3, 0, -sqrt 3, 2, -1, -1] / sqrt 3 has
    # mean 0 and std sqrt(8 / 5): the advantages are the sum / sqrt 1.6.
    values = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1], [1, 0], [1, 0]], dtype=torch.float32)
    advantages = gdpo_advantages(values, torch.ones(6, 2), 3, 1e-6, True)
    s3, s16 = math.sqrt(3), math.sqrt(1.6)
    expected = [s3 / s16, 0, -s3 / s16, 2 / s3 / s16, -1 / s3 / s16, -1 / s3 / s16]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-5)
    # GRPO on the verifier's reward (the answer) cannot tell response 1 (formatted) from 2
    grpo = grpo_family.group_normalize(values[:, 1], 3, 1e-6, True)
    assert grpo[1] == grpo[2] and advantages[1] > advantages[2]


def test_gdpo_with_one_component_is_grpo():
    # One component: its group-normalised advantages, then divided by one number for the whole
    # batch (their std; their mean is 0): the same direction, the same order, every group's signs.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0, 0.25, 0.75, 0.5])
    grpo = grpo_family.group_normalize(rewards, 4, 1e-6, True)
    gdpo = gdpo_advantages(rewards.unsqueeze(1), torch.ones(12, 1), 4, 1e-6, True)
    assert torch.allclose(gdpo, grpo / (grpo.std() + 1e-6), atol=1e-6)
    # a weight scales a lone component away
    assert torch.allclose(
        gdpo_advantages(rewards.unsqueeze(1), torch.full((12, 1), 3.0), 4, 1e-6, True),
        gdpo,
        atol=1e-6,
    )


def test_reward_components_of_math_and_ifeval():
    # A math answer: format and answer, weight 1 each. An IFEval response that followed
    # instructions 1 and 3 of 3, with partial credit 1/2: reward 1/2 x 0 + 1/2 x 2/3 = 1/3, in parts
    # all-followed 0 (weight 1/2) and each instruction (weight 1/6). The weighted parts after the
    # format add up to the verifier's reward.
    scores = [
        {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0},
        {
            "reward": 1 / 3,
            "format_reward": 1.0,
            "answer_reward": 1 / 3,
            "strict": [True, False, True],
        },
    ]
    values, weights = grpo_family.reward_components(scores, 0.5)
    assert values.tolist() == [[1, 1, 0, 0, 0], [1, 0, 1, 0, 1]]
    assert torch.allclose(weights, torch.tensor([[1, 1, 0, 0, 0], [1, 0.5] + [1 / 6] * 3]))
    parts = (values * weights)[:, 1:].sum(dim=1)
    assert parts.tolist() == pytest.approx([s["reward"] for s in scores])


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
    load = grpo_family.data.load
    monkeypatch.setattr(
        grpo_family.data,
        "load",
        lambda name, split, data_dir=None: load(name, split, data_dir)[:256],
    )


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.usefixtures("small_train_split")
def test_dynamic_sampling_fills_the_batch_with_signal_and_resumes_exactly(
    tiny_model_dir, tmp_path, monkeypatch
):
    # Only the questions with an even id digit sum carry a signal (letter_reward); the others score
    # 0 throughout. A draw of 4 questions holds ~2 such groups: the step draws again until 4 groups
    # have a signal, at most 4 times.
    signal, zero = (
        lambda example: sum(map(ord, str(example["id"]))) % 2 == 0,
        {"reward": 0.0, "format_reward": 0.0},
    )
    monkeypatch.setattr(
        grpo_family.verifiers, "score", lambda r, ex: letter_reward(r, ex) if signal(ex) else zero
    )
    kwargs = dict(n_grpo_steps=2, save_every=1, dynamic_sampling=True, max_draws=4)
    full = grpo_family.main(tiny_args(tiny_model_dir, tmp_path / "full", **kwargs))
    rollouts, metrics = read_jsonl(full / "rollouts.jsonl"), read_jsonl(full / "metrics.jsonl")[1:]
    for m in metrics:
        groups = [g for g in rollouts if g["step"] == m["step"]]
        assert len(groups) == 4 * m["rollout/n_draws"]  # whole draws of 4 questions
        trained = [any(g["trained"]) for g in groups]
        with_signal = [len(set(g["rewards"])) > 1 for g in groups]
        # the first 4
        assert trained == [s and sum(with_signal[: i + 1]) <= 4 for i, s in enumerate(with_signal)]
        assert sum(trained) == 4 or m["rollout/n_draws"] == 4
    assert max(m["rollout/n_draws"] for m in metrics) > 1

    # Stopped during step 2 and resumed: the same draws (from seed, step and the draw's index), the
    # same samples.
    with interrupted_at_call(grpo_family, "reload_and_check", 3):
        grpo_family.main(tiny_args(tiny_model_dir, tmp_path / "stopped", **kwargs))
    (stopped,) = (tmp_path / "stopped").iterdir()
    resumed = grpo_family.main(
        tiny_args(tiny_model_dir, tmp_path / "stopped", resume=str(stopped), **kwargs)
    )
    assert read_jsonl(resumed / "rollouts.jsonl") == rollouts


@pytest.mark.usefixtures("small_train_split")
def test_non_finite_updates_are_skipped_then_stop_the_run(tiny_model_dir, tmp_path, monkeypatch):
    # groups whose advantages are NaN: every update is NaN (a NaN reward is no reward, a judge's
    # failure: left out of the update, not a way to make one non-finite)
    monkeypatch.setattr(grpo_family.verifiers, "score", letter_reward)
    nan_advantages = lambda raw_rewards, *a: torch.full_like(raw_rewards, float("nan"))
    monkeypatch.setattr(grpo_family, "group_normalize", nan_advantages)
    args = tiny_args(tiny_model_dir, tmp_path, train_batch_size=4, drop_zero_variance_groups=False)
    with (
        pytest.warns(UserWarning, match="not finite"),
        pytest.raises(RuntimeError, match="3 non-finite updates"),
    ):
        grpo_family.main(args)


@pytest.mark.usefixtures("small_train_split")
def test_defaults_reproduce_grpo_py(tiny_model_dir, tmp_path, monkeypatch):
    # Every metric grpo.py logs in a three-step run, rewards that differ within groups, is the
    # family's, bit for bit: its flags at their defaults change nothing (the times aside). The
    # family adds one, rollout/n_draws (dynamic sampling's).
    import grpo

    monkeypatch.setattr(grpo_family.verifiers, "score", letter_reward)
    args = tiny_args(tiny_model_dir, tmp_path / "family")
    family = read_jsonl(grpo_family.main(args) / "metrics.jsonl")
    shared = {k: v for k, v in vars(args).items() if k in grpo.Args.__dataclass_fields__}
    course = read_jsonl(
        grpo.main(grpo.Args(**{**shared, "output_dir": str(tmp_path)})) / "metrics.jsonl"
    )
    assert len(family) == len(course) == 4
    for ours, theirs in zip(family, course, strict=True):
        assert set(ours) - set(theirs) <= {"rollout/n_draws"}
        for key, value in theirs.items():
            assert key.startswith("time/") or "per_second" in key or ours[key] == value, key
    assert all(m["rollout/reward_std"] > 0 for m in family[1:])


@pytest.mark.usefixtures("small_train_split")
def test_a_planted_mismatch_in_a_run_is_masked_and_logged(tiny_model_dir, tmp_path, monkeypatch):
    # The engine's log-prob of every sampled token raised by 1 nat (p_old / p_engine = 1/e): IcePop's
    # band [1/2, 2] masks every token; DeepSeek-V3.2's mask, mean log(p_engine / p) ~ 1 > 0.5, leaves
    # out the responses with A < 0 and keeps the others; GDPO logs the components (letter_reward's
    # format is always 0: no signal from it); the corrected KL is logged.
    monkeypatch.setattr(grpo_family.verifiers, "score", letter_reward)
    collate = grpo_family.collate_rollouts

    def planted(*a):
        batch, lengths = collate(*a)
        batch["engine_log_probs"] += batch["response_mask"]
        return batch, lengths

    monkeypatch.setattr(grpo_family, "collate_rollouts", planted)
    flags = dict(
        is_mode="icepop",
        off_policy_seq_mask=0.5,
        reward_aggregation="gdpo",
        beta=0.04,
        kl_is_correction=True,
    )
    run = grpo_family.main(tiny_args(tiny_model_dir, tmp_path, **flags))
    for m in read_jsonl(run / "metrics.jsonl")[1:]:
        assert m["train/frac_above_is_cap"] == 1.0 and m["train/is_weight"] == 0.0
        assert m["train/off_policy_seq_kl"] == pytest.approx(1.0, abs=1e-3)
        assert 0 < m["train/frac_off_policy_masked"] < 1
        assert (
            m["rollout/gdpo_format_frac_zero_std"] == 1.0 and m["rollout/gdpo_answer_group_std"] > 0
        )
        assert math.isfinite(m["train/kl"])
