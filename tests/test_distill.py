"""distill.py: the advantage and loss by hand, the reverse-KL gradient they give, then whole runs on
the tiny model with a real vLLM engine: a teacher equal to the student changes nothing; another
teacher is approached; a bad teacher stops the run before its folder and the engine."""

import gc
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import distill
import tiny_model

# --- the advantage and the loss, by hand ---


def test_advantage_by_hand():
    # The student gives its two sampled tokens 0.5 and 0.25, the teacher 0.25 and 0.5.
    student = torch.log(torch.tensor([[0.5, 0.25]]))
    teacher = torch.log(torch.tensor([[0.25, 0.5]]))
    # A_t = -(log p - log q): -(log 2) where the student is too sure, +log 2 where it is not sure
    # enough.
    advantages = distill.compute_distill_advantages(student, teacher)
    assert advantages[0].tolist() == pytest.approx([-math.log(2), math.log(2)])
    # --reward-weight 0.5 with a group-normalised reward of 2 adds 1 to every token of the response.
    mixed = distill.compute_distill_advantages(
        student, teacher, torch.tensor([2.0]), reward_weight=0.5
    )
    assert mixed[0].tolist() == pytest.approx([1 - math.log(2), 1 + math.log(2)])


def test_loss_and_gradient_by_hand():
    student = torch.log(torch.tensor([[0.5, 0.25, 0.9]])).requires_grad_()
    teacher = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    mask = torch.tensor([[1, 1, 0]])  # the third token is padding: no loss, no gradient
    loss, reverse_kl = distill.distill_microbatch_train_step(
        student, teacher, mask, n_batch_tokens=2
    )
    # loss = (-A_1 log p_1 - A_2 log p_2) / 2 = (ln2 ln0.5 - ln2 ln0.25) / 2 = (-ln2^2 + 2 ln2^2) /
    # 2 = ln2^2 / 2
    assert loss.item() == pytest.approx(math.log(2) ** 2 / 2)
    # d loss / d log p_t = -A_t / 2 (A detached): +ln2/2 for the over-sure token, -ln2/2 for the
    # other, 0 for padding
    assert student.grad[0].tolist() == pytest.approx([math.log(2) / 2, -math.log(2) / 2, 0.0])
    assert reverse_kl[0, :2].tolist() == pytest.approx([math.log(2), -math.log(2)])


def test_group_normalize_by_hand():
    # Group [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group [1,
    # 1, 1, 1]: all 0.
    advantages = distill.group_normalize(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1]), 4, 0.0, True)
    assert advantages[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    # 0 / 0 with eps = 0: NaN in IEEE arithmetic on every CPU (distill.py passes eps 1e-6, below)
    assert torch.isnan(advantages[4:]).all()
    # distill.py's eps, 1e-6
    assert (
        distill.group_normalize(torch.tensor([1.0, 1, 1, 1]), 4, 1e-6, True).tolist() == [0.0] * 4
    )


def test_a_teacher_too_big_for_a_gpu_the_engine_shares_is_refused():
    # 80 GB (79.6 GiB), the engine's 0.3: a Qwen3-1.7B student (1.72e9 parameters) in training
    # beside Qwen3-8B (8.19e9) needs 23.9 + 44.9 + 15.3 GiB: ~4.5 GiB short. Beside Qwen3-4B
    # (4.02e9, 7.5 GiB) it fits.
    gpu = 85_520_000_000
    short = distill.shared_gpu_shortfall(gpu, 0.3, 1_720_000_000, 8_190_000_000)
    assert 4 < short / 2**30 < 5
    assert distill.shared_gpu_shortfall(gpu, 0.3, 1_720_000_000, 4_020_000_000) < 0
    # with LoRA the student's base is bf16: 2 + 12 bytes a parameter, 22.4 GiB: Qwen3-8B fits, with
    # 79.6 - 23.9 - 22.4 - 15.3 = 18.0 GiB to spare
    spare = -distill.shared_gpu_shortfall(gpu, 0.3, 1_720_000_000, 8_190_000_000, lora=True)
    assert 17.5 < spare / 2**30 < 18.5


def test_parameter_count_from_the_config_alone(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    count = sum(p.numel() for p in model.parameters())
    assert distill.n_parameters(str(tiny_model_dir)) == count


def test_expected_gradient_is_the_reverse_kl_gradient():
    # One position, five tokens: weighting each token's loss gradient by its probability p(x) (the
    # expectation over the student's samples) gives exactly the gradient of KL(p || q) = sum_x p(x)
    # (log p(x) - log q(x)).
    torch.manual_seed(0)
    logits, q = torch.randn(5, requires_grad=True), torch.softmax(torch.randn(5), dim=0)
    log_p = torch.log_softmax(logits, dim=0)
    advantages = distill.compute_distill_advantages(log_p, torch.log(q))
    (-(log_p.exp().detach() * advantages * log_p).sum()).backward()
    expected = logits.grad.clone()
    logits.grad = None
    kl = (torch.softmax(logits, 0) * (torch.log_softmax(logits, 0) - torch.log(q))).sum()
    kl.backward()
    assert expected.tolist() == pytest.approx(logits.grad.tolist(), abs=1e-6)


def test_the_update_with_share_prompt_is_the_plain_update(tiny_model_dir):
    # two prompts' groups of 4, shuffled, a teacher with sharper logits: the same SGD step and
    # metrics to float rounding with the prompt run once per microbatch
    from test_grpo import assert_same_step, group_batch

    batch, lengths, _ = group_batch([9, 6], 4, seed=2)
    batch["reward_advantages"] = batch.pop("advantages")
    teacher = distill.load_frozen_model(str(tiny_model_dir), "cpu")
    with torch.no_grad():
        teacher.model.norm.weight.mul_(2)
    moved, metrics = [], []
    for share_prompt in (False, True):
        args = distill.Args(microbatch_size=4, max_grad_norm=1e9, share_prompt=share_prompt)
        policy, autocast = distill.load_policy(str(tiny_model_dir), "cpu", False, 0)
        start = {k: v.clone() for k, v in policy.state_dict().items()}
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        update_metrics = distill.distill_update(
            policy, teacher, optimizer, batch, lengths, 1.0, args, autocast
        )
        moved.append({k: start[k] - v for k, v in policy.state_dict().items()})
        metrics.append(update_metrics)
    assert_same_step(moved, start)
    for key in ("train/loss", "train/entropy", "rollout/reverse_kl", "train/grad_norm"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-4, abs=1e-7), key


# --- whole runs on the tiny model, real vLLM engine on the CPU ---


@pytest.fixture(scope="module")
def student_and_teacher(tmp_path_factory) -> tuple:
    """A tiny model (other random weights than tiny_model_dir's) and, as its teacher, the same model
    with 4x sharper next-token distributions (the final norm scaled: logits x 4): the student has
    far to go, in a direction a few steps can take."""
    student = tiny_model.main(
        tiny_model.Args(out=str(tmp_path_factory.mktemp("student") / "tiny"), seed=7)
    )
    teacher = AutoModelForCausalLM.from_pretrained(student)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(4)
    teacher.save_pretrained(student.parent / "teacher")
    AutoTokenizer.from_pretrained(student).save_pretrained(student.parent / "teacher")
    return student, student.parent / "teacher"


def run_args(student, teacher, tmp_path, **overrides) -> distill.Args:
    settings = dict(
        model=str(student),
        teacher=str(teacher),
        dataset="synthetic",
        template="question",
        output_dir=str(tmp_path),
        n_distill_steps=2,
        rollout_batch_size=16,
        group_size=4,
        max_tokens=16,
        lr=3e-3,
        microbatch_size=8,
        n_eval=16,
        eval_every=100,
        eval_max_tokens=16,
        save_every=100,
        n_log_generations=1,
    )
    return distill.Args(**{**settings, **overrides})


def metrics_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.fixture
def free_engines():
    yield
    gc.collect()


@pytest.mark.usefixtures("free_engines")
def test_teacher_equal_to_student_gives_zero_kl_and_changes_nothing(tiny_model_dir, tmp_path):
    run_dir = distill.main(run_args(tiny_model_dir, tiny_model_dir, tmp_path))
    metrics = metrics_of(run_dir)
    steps = [m for m in metrics if "rollout/reverse_kl" in m]
    assert len(steps) == 2 and all(abs(m["rollout/reverse_kl"]) < 1e-6 for m in steps)
    assert all(abs(m["eval/reverse_kl"]) < 1e-6 for m in metrics if "eval/reverse_kl" in m)
    assert all(m["train/grad_norm"] < 1e-6 for m in steps)  # A = 0 on every token: no gradient
    trained = AutoModelForCausalLM.from_pretrained(distill.checkpoints(run_dir)[-1]).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert all(torch.equal(trained[name], initial[name]) for name in initial)


@pytest.mark.usefixtures("free_engines")
def test_a_short_run_lowers_the_held_out_reverse_kl_to_the_teacher(student_and_teacher, tmp_path):
    # One token per response: the per-token advantage is then the exact reverse-KL gradient at each
    # prompt, in expectation. (Over longer responses, moving the early tokens moves the prefixes the
    # later ones are graded at: on these random models the KL at the student's own later positions
    # does not fall in 20 steps.)
    run_dir = distill.main(
        run_args(
            *student_and_teacher,
            tmp_path,
            n_distill_steps=20,
            eval_every=20,
            lr=1e-3,
            rollout_batch_size=64,
            n_eval=64,
            max_tokens=1,
            eval_max_tokens=1,
        )
    )
    held_out = [m["eval/reverse_kl"] for m in metrics_of(run_dir) if "eval/reverse_kl" in m]
    assert held_out[1] < 0.8 * held_out[0], held_out


def test_a_bad_teacher_stops_before_the_run_folder_and_the_engine(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(distill, "init_vllm", lambda *a: pytest.fail("the engine must not start"))
    with pytest.raises(ValueError, match="no model folder there"):
        distill.main(run_args(tiny_model_dir, tmp_path / "nope", tmp_path / "runs"))
    other = tiny_model.main(tiny_model.Args(out=str(tmp_path / "other-vocab"), vocab_size=400))
    with pytest.raises(ValueError, match="another vocabulary \\(400 tokens\\)"):
        distill.main(run_args(tiny_model_dir, other, tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()
