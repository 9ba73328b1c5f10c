"""The CS336 assignment-5 vocabulary, pinned: every name with its parameters, in the scripts
whose runs call it, or in tests/adapters.py where a signature serves the course's scaffolding
rather than our loop (mapped onto the loop's functions, as CS336's own tests/adapters.py does), so
that a suite written against CS336's signatures runs against ours and no change can drop a name
quietly. Extra parameters are allowed only after CS336's, with defaults. The numbers of each
function are checked in the script's own tests (the adapters' in tests/test_grpo.py); masked_mean's
here."""

import importlib
import inspect

import pytest
import torch

EVERY_SCRIPT = ["sft", "expert_iter", "grpo", "distill"]
# name -> (CS336's parameters in order, the scripts that must define it)
CONTRACT = {
    "tokenize_prompt_and_output": (["prompt_strs", "output_strs", "tokenizer"], EVERY_SCRIPT),
    "compute_entropy": (["logits"], EVERY_SCRIPT),
    "get_response_log_probs": (
        ["model", "input_ids", "labels", "return_token_entropy"],
        EVERY_SCRIPT,
    ),
    "masked_normalize": (["tensor", "mask", "normalize_constant", "dim"], EVERY_SCRIPT),
    "masked_mean": (["tensor", "mask", "dim"], ["grpo_family", "adapters"]),
    "log_generations": (["policy", "tokenizer", "records"], EVERY_SCRIPT),
    "sft_microbatch_train_step": (
        ["policy_log_probs", "response_mask", "gradient_accumulation_steps", "normalize_constant"],
        ["sft", "expert_iter"],
    ),
    "compute_group_normalized_rewards": (
        [
            "reward_fn",
            "rollout_responses",
            "repeated_ground_truths",
            "group_size",
            "advantage_eps",
            "normalize_by_std",
        ],
        ["adapters"],
    ),
    "compute_naive_policy_gradient_loss": (
        ["raw_rewards_or_advantages", "policy_log_probs"],
        ["grpo_family", "adapters"],
    ),
    "compute_grpo_clip_loss": (
        ["advantages", "policy_log_probs", "old_log_probs", "cliprange"],
        ["grpo"],
    ),
    "compute_policy_gradient_loss": (
        [
            "policy_log_probs",
            "loss_type",
            "raw_rewards",
            "advantages",
            "old_log_probs",
            "cliprange",
        ],
        ["grpo_family", "adapters"],
    ),
    "grpo_microbatch_train_step": (
        [
            "policy_log_probs",
            "response_mask",
            "gradient_accumulation_steps",
            "loss_type",
            "raw_rewards",
            "advantages",
            "old_log_probs",
            "cliprange",
        ],
        ["adapters"],
    ),
}
CASES = [(name, script) for name, (_, scripts) in CONTRACT.items() for script in scripts]


@pytest.mark.parametrize(("name", "script"), CASES)
def test_cs336_name_and_parameters(name, script):
    function = getattr(importlib.import_module(script), name, None)
    assert function is not None, f"{script}.py lost CS336's {name}"
    parameters = list(inspect.signature(function).parameters.values())
    expected = CONTRACT[name][0]
    assert [p.name for p in parameters[: len(expected)]] == expected
    extra = [p.name for p in parameters[len(expected) :] if p.default is inspect.Parameter.empty]
    assert not extra, f"{script}.{name}: parameters beyond CS336's need defaults: {extra}"


def test_masked_mean_by_hand():
    from adapters import masked_mean

    tensor = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 1]])
    # (1 + 2 + 6) / 3 over all; rows: (1 + 2) / 2 and 6 / 1; columns: 1 / 1, 2 / 1, 6 / 1
    assert masked_mean(tensor, mask).item() == pytest.approx(3.0)
    assert masked_mean(tensor, mask, dim=1).tolist() == pytest.approx([1.5, 6.0])
    assert masked_mean(tensor, mask, dim=0).tolist() == pytest.approx([1.0, 2.0, 6.0])
