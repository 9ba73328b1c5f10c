"""LoRA (--lora-rank r): a frozen base W plus (alpha / r) B A. Before the first update the policy is
the base model exactly; an update moves only A and B, so every adapted weight moves by a matrix of
rank at most r and nothing else moves; the engine gets the merged weights, and the reload check
proves it (and stops a run whose engine got the base without the adapters); a resumed run ends
where a straight one does. The copies in the other scripts are the same text
(tests/test_shared_helpers.py): grpo.py's is tested."""

import json

import pytest
import torch
from conftest import interrupted_at_call
from transformers import AutoTokenizer

import data
import grpo

LAYERS = grpo.Args().lora_layers


def train_a_few_steps(policy, n_steps: int = 3, lr: float = 1e-2) -> None:
    """AdamW steps that raise the log-probs of random token sequences."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(n_steps):
        ids = torch.randint(3, 400, (4, 24), generator=g)  # (B, T + 1)
        out = grpo.get_response_log_probs(policy, ids[:, :-1], ids[:, 1:])
        (-out["log_probs"].mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def changes(before: dict, after: dict) -> dict:
    """Name -> after - before, for every weight that moved."""
    moved = {}
    for name, value in after.items():
        if not torch.equal(value, before[name]):
            moved[name] = value - before[name]
    return moved


def rank(delta: torch.Tensor) -> int:
    """The number of singular values above 1e-4 of the largest (float32 rounding is ~1e-7)."""
    s = torch.linalg.svdvals(delta.double())
    return int((s > 1e-4 * s[0]).sum())


def test_before_an_update_the_policy_is_the_base_model_exactly(tiny_model_dir):
    base, _ = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0)
    policy, _ = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0, 4, 32.0, LAYERS)
    ids = torch.randint(3, 400, (2, 30))
    with torch.no_grad():
        assert torch.equal(policy(ids).logits, base(ids).logits)
    # the engine and a checkpoint get the base's weights, under the base's names
    merged = grpo.merged_state_dict(policy)
    assert merged.keys() == base.state_dict().keys()
    for name, value in base.state_dict().items():
        assert torch.equal(merged[name], value), name
    trained = [name for name, p in policy.named_parameters() if p.requires_grad]
    # A and B of each of the 7 linear layers of the 2 layers
    assert len(trained) == 2 * 7 * 2
    assert all(name.endswith((".lora_A", ".lora_B")) for name in trained)


def test_an_update_moves_adapters_only_and_each_weight_by_rank_at_most_r(tiny_model_dir):
    r = 2
    policy, _ = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0, r, 32.0, LAYERS)
    params_before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged_before = {k: v.clone() for k, v in grpo.merged_state_dict(policy).items()}
    train_a_few_steps(policy)
    moved = changes(params_before, policy.state_dict())
    # every B moved (from 0) and every A; the base did not
    assert moved.keys() == {k for k in params_before if ".lora_" in k}
    moved = changes(merged_before, grpo.merged_state_dict(policy))
    adapted = {k for k in merged_before if k.split(".")[-2] in LAYERS}
    # every adapted weight moved, nothing else (embeddings, norms)
    assert moved.keys() == adapted
    ranks = {name: rank(delta) for name, delta in moved.items()}
    assert all(0 < n <= r for n in ranks.values()), ranks


def test_full_fine_tuning_moves_every_weight_by_more_than_rank_r(tiny_model_dir):
    # the rank check above can fail: the same steps without adapters move each matrix freely
    policy, _ = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    train_a_few_steps(policy)
    moved = changes(before, policy.state_dict())
    assert all(rank(moved[f"model.layers.0.{name}.weight"]) > 2 for name in ["self_attn.q_proj"])


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """An engine on the tiny model; first in the file: a run's engine tears down vLLM's
    process-wide state, after which this one cannot be used."""
    return grpo.init_vllm(str(tiny_model_dir), "cpu", 0, 0.3, 512)


def test_the_engine_follows_the_adapters_and_a_sync_without_them_is_caught(
    llm, tiny_model_dir, monkeypatch
):
    policy, _ = grpo.load_policy(str(tiny_model_dir), "cpu", False, 0, 2, 32.0, LAYERS)
    tokenizer = grpo.AutoTokenizer.from_pretrained(tiny_model_dir)
    probe = grpo.make_probe_prompts(tokenizer, ["Tom has 12 apples. He buys 30 more. 12 + 30 = 42"])
    train_a_few_steps(policy)
    # merged, the engine follows the trainer's base + adapters
    assert grpo.reload_and_check(policy, llm, probe, "cpu", 1e-3) <= 1e-5

    def without_adapters(model) -> dict:
        # the bug of adapter-only or base-only syncs: the engine gets W, not W + (alpha / r) B A
        state = model.state_dict()
        return {k.replace(".base.", "."): v for k, v in state.items() if ".lora_" not in k}

    with monkeypatch.context() as m:
        m.setattr(grpo, "merged_state_dict", without_adapters)
        gap = grpo.probe_gap(policy, llm, probe, "cpu")
        grpo.load_policy_into_vllm(policy, llm, "cpu")
        print(f"probe gap without the adapters: {grpo.probe_gap(policy, llm, probe, 'cpu'):.3g}")
        with pytest.raises(RuntimeError, match="does not follow"):
            grpo.reload_and_check(policy, llm, probe, "cpu", 1e-3)
    assert gap <= 1e-5
    # reloaded merged, the engine follows again
    assert grpo.reload_and_check(policy, llm, probe, "cpu", 1e-3) <= 1e-5


def letter_reward(response, example):
    """Test-only reward (as tests/test_grpo.py's): the share of letters in the response."""
    reward = sum(c.isalpha() for c in response) / max(len(response), 1)
    return {"reward": reward, "format_reward": 0.0, "answer_reward": reward}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def lora_args(tiny_model_dir, output_dir, **overrides):
    args = dict(
        model=str(tiny_model_dir),
        dataset="synthetic",
        template="question",
        output_dir=str(output_dir),
        n_grpo_steps=2,
        rollout_batch_size=16,
        group_size=4,
        train_batch_size=8,
        microbatch_size=16,
        epochs_per_rollout_batch=2,
        max_tokens=8,
        lr=5e-2,
        eval_every=1000,
        n_eval=2,
        eval_max_tokens=4,
        n_log_generations=1,
        save_every=1,
        lora_rank=2,
    )
    return grpo.Args(**{**args, **overrides})


def test_lora_resume_ends_where_a_straight_run_does(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo.verifiers, "score", letter_reward)
    load = grpo.data.load
    # 256 train problems, not 20,000: main() tokenizes every train prompt once
    monkeypatch.setattr(
        grpo.data, "load", lambda name, split, data_dir=None: load(name, split, data_dir)[:256]
    )
    # off-policy (2 minibatches x 2 epochs): the adapters' AdamW state must replay too
    straight = grpo.main(lora_args(tiny_model_dir, tmp_path / "straight"))
    with interrupted_at_call(grpo, "reload_and_check", 3):  # at the start, after steps 1 and 2
        grpo.main(lora_args(tiny_model_dir, tmp_path / "stopped"))
    (stopped,) = (tmp_path / "stopped").iterdir()
    resumed = grpo.main(lora_args(tiny_model_dir, tmp_path / "stopped", resume=str(stopped)))
    assert read_jsonl(resumed / "rollouts.jsonl") == read_jsonl(straight / "rollouts.jsonl")

    def final(run, name):
        folder = run / "checkpoints" / "step_000002"
        if name == "trainer_state.pt":
            return torch.load(folder / name, weights_only=False)["adapters"]
        model = grpo.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return model.state_dict()

    for name in ["model", "trainer_state.pt"]:
        want = final(straight, name)
        got = final(resumed, name)
        assert want.keys() == got.keys() and want
        for key, value in want.items():
            assert torch.equal(got[key], value), key
    # the checkpoint is a plain model folder with the merged weights: each adapted weight moved
    # by rank <= 2 from the starting model's, nothing else moved
    start = grpo.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    moved = changes(start.state_dict(), final(straight, "model"))
    assert {k.split(".")[-2] for k in moved} == set(LAYERS)
    assert all(0 < rank(delta) <= 2 for delta in moved.values())
    last = read_jsonl(straight / "metrics.jsonl")[-1]
    assert last["train/n_updates"] == 4


def test_gradient_checkpointing_gives_the_adapters_the_same_gradient(tiny_model_dir):
    # Reentrant checkpointing passes no gradient on from inputs that need none (the frozen
    # embeddings): the adapters would silently get none. transformers 5 checkpoints without it.
    grads = []
    for checkpointing in [False, True]:
        policy, _ = grpo.load_policy(str(tiny_model_dir), "cpu", checkpointing, 0, 2, 32.0, LAYERS)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if name.endswith(".lora_B"):
                    # B = 0 gives A no gradient: make both get one
                    p.fill_(0.01)
        ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))
        out = grpo.get_response_log_probs(policy, ids[:, :-1], ids[:, 1:])
        out["log_probs"].mean().backward()
        trained = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        assert all(p.grad is not None for _, p in trained)
        grads.append({n: p.grad for n, p in trained})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-8, msg=name)


def test_sft_with_lora_learns_and_its_checkpoint_moved_by_rank_at_most_r(tiny_model_dir, tmp_path):
    # sft.py's copy of the same blocks, end to end: 5 steps of 8 examples, evaluated (after a
    # checked reload) at the start and the end; the run stops if the engine does not follow
    import sft

    args = sft.Args(
        model=str(tiny_model_dir),
        dataset="synthetic",
        template="question",
        output_dir=str(tmp_path),
        n_examples=40,
        batch_size=8,
        microbatch_size=8,
        lr=2e-2,
        warmup_ratio=0.0,
        max_seq_len=128,
        n_eval=2,
        eval_max_tokens=4,
        eval_every=100,
        save_every=100,
        n_log_generations=1,
        lora_rank=2,
    )
    run = sft.main(args)
    metrics = read_jsonl(run / "metrics.jsonl")
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) == 5
    gaps = [m["reload/logprob_gap"] for m in metrics if "eval/accuracy" in m]
    assert len(gaps) == 2 and all(gap < 1e-4 for gap in gaps)
    (checkpoint,) = (run / "checkpoints").iterdir()
    start = grpo.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    end = grpo.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    # learns, like with like: the mean log-prob per token of the same 64 gold solutions of the
    # train split under the model before and after (not step 1's loss against step 5's, which is
    # another batch's)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = data.load("synthetic", "train")[:64]
    batch = grpo.tokenize_prompt_and_output(
        [data.render_prompt(ex, "question") for ex in examples],
        [data.render_response(ex, "question") for ex in examples],
        tokenizer,
    )

    def mean_log_prob(model) -> float:
        with torch.no_grad():
            out = grpo.get_response_log_probs(model, batch["input_ids"], batch["labels"])
        mask = batch["response_mask"]
        return ((out["log_probs"] * mask).sum() / mask.sum()).item()

    before, after = mean_log_prob(start), mean_log_prob(end)
    print(f"mean log-prob per token of the same 64 solutions: {before:.3f} -> {after:.3f}")
    assert after > before
    moved = changes(start.state_dict(), end.state_dict())
    assert {k.split(".")[-2] for k in moved} == set(LAYERS)
    assert all(0 < rank(delta) <= 2 for delta in moved.values())
    adapters = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["adapters"]
    assert len(adapters) == 2 * 7 * 2
