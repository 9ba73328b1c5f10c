"""The benches run and measure what they say, on tiny shapes; never a timing assertion (bench/
prints those). They import as bench.<name>, as `python -m bench.<name>` runs them from the
repository root (conftest's sys.path)."""

from pathlib import Path

import pytest
import torch
import tyro
from transformers import AutoModelForCausalLM, Qwen3Config

from bench import generate, grpo_step, overlap, reload, train_step


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> str:
    """One work folder for the benches that start engines: they build the tiny model in it once
    (make_model)."""
    return str(tmp_path_factory.mktemp("bench"))


def test_qwen3_1_7b_shape_has_its_parameter_count():
    # Qwen3-1.7B: 1.72e9 parameters with tied embeddings (2.03e9 if the output layer were separate).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**train_step.SHAPES["qwen3-1.7b"]))
    n_params = sum(p.numel() for p in model.parameters())
    assert 1.70e9 < n_params < 1.74e9, n_params


def test_smollm2_shape_has_the_real_models_parameter_count():
    # SmolLM2-135M-Instruct: 134,515,008 parameters; the Qwen3 shape adds q/k norms, 2 x 64 a layer
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**train_step.SHAPES["smollm2"]))
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == 134_515_008 + 30 * 2 * 64, n_params


@pytest.mark.parametrize(
    ("size", "shape", "low", "high"),
    [("tiny", "ladder", 0.845e6, 0.855e6), ("25m", "25m", 25.35e6, 25.45e6)],
)
def test_bench_shapes_are_the_models_tiny_model_builds(size, shape, low, high):
    """The models tiny_model.py builds with the benches' flags (bench.grpo_step.MODELS; "tiny" is
    the ladder's, --n-layers 4): 0.85M and 25.4M parameters as the README and docs/performance.md
    say, and train_step's copies of their shapes (SHAPES) are those models' configs."""
    import tyro

    import tiny_model

    args = tyro.cli(tiny_model.Args, args=[*grpo_step.MODELS[size], "--out", "unused"])
    tokenizer = tiny_model.build_tokenizer(tiny_model.tokenizer_corpus(), args.vocab_size)
    with torch.device("meta"):
        model = tiny_model.build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{size}: {n_params} parameters, vocab {len(tokenizer)}")
    assert low < n_params < high, n_params
    for key, value in train_step.SHAPES[shape].items():
        assert getattr(model.config, key) == value, key


def test_train_step_copy_has_the_reinforce_gradient_and_the_entropy():
    # On-policy (ratio 1) the clipped surrogate's gradient is REINFORCE's: -A grad log p, token-mean
    # over the batch.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        Qwen3Config(**{**train_step.SHAPES["ladder"], "num_hidden_layers": 1})
    )
    ids = torch.randint(0, 477, (3, 9))  # (B, T + 1)
    mask = torch.rand(3, 8) < 0.6  # (B, T)
    advantages, n_tokens = torch.tensor([1.0, -0.5, 2.0]), 11
    entropy_sum = train_step.microbatch_backward(model, ids, mask, advantages, n_tokens)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(ids[:, :-1]).logits  # (B, T, V)
    log_probs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-(advantages[:, None] * log_probs * mask).sum() / n_tokens).backward()
    for got, want in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    entropy = torch.distributions.Categorical(logits=logits.detach()).entropy()  # (B, T)
    torch.testing.assert_close(entropy_sum, (entropy * mask).sum())


def test_train_step_bench_reports_a_row_per_microbatch_size():
    args = train_step.Args(
        shape="tiny", microbatch_sizes=[1, 2], seq_len=16, steps=1, accumulation=2
    )
    rows = train_step.main(args)
    assert [row["microbatch_size"] for row in rows] == [1, 2]
    # on a CPU the MFU is over the measured matmul peak: a fraction, though a noisy one on a shared
    # machine
    assert all(
        row["tokens_per_s"] > 0 and 0 < row["mfu"] < 2 and row["peak_gib"] > 0 for row in rows
    )


def test_train_step_lora_is_grpo_py_s_with_its_parameter_count():
    # grpo.py's add_lora, read from its source, on Qwen3-1.7B's shape: r (d_in + d_out) for each of
    # the seven linear layers, 4096 + 3072 + 3072 + 4096 + 3 x 8192 = 38,912 r a layer (gpu.md)
    lora = train_step.grpo_lora()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**train_step.SHAPES["qwen3-1.7b"]))
        lora["add_lora"](model, 8, 32.0, train_step.LORA_LAYERS)
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n_trained == 38912 * 8 * 28
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "LoRALinear"
    # and the bench trains the adapters alone
    args = train_step.Args(
        shape="ladder", microbatch_sizes=[2], seq_len=16, steps=1, accumulation=1, lora_rank=2
    )
    rows = train_step.main(args)
    assert rows[0]["tokens_per_s"] > 0


def test_cpu_matmul_peak_is_a_positive_rate():
    # TFLOP/s: no CPU reaches 100 in float32
    assert 0 < train_step.cpu_matmul_tflops(n=128, repeats=2) < 100


def test_grpo_step_medians_leave_out_the_warm_up_step():
    assert grpo_step.median_after_warmup([100.0, 1.0, 3.0, 2.0]) == 2.0
    assert grpo_step.median_after_warmup([5.0]) == 5.0
    assert (
        grpo_step.describe("tiny") == "tiny: 256 completions (32 x 8), <= 64 tokens, microbatch 64"
    )


def test_grpo_step_reads_the_phases_from_a_grpo_py_run(work, monkeypatch):
    # grpo.py's command line and its metrics.jsonl keys, on a batch of 4 questions x 2 responses of
    # <= 8 tokens
    monkeypatch.setitem(grpo_step.SIZES, "tiny", (4, 2, 8, 8))
    args = grpo_step.Args(sizes=["tiny"], steps=2, work_dir=work, grpo_args=["--n-eval", "2"])
    (row,) = grpo_step.main(args)
    g = row["grpo"]
    assert (
        all(g[phase] >= 0 for phase in grpo_step.PHASES) and g["generate"] > 0 and g["train"] > 0
    ), g
    assert 1 <= g["response_length"] <= 8 and "trl" not in row


def test_reload_bench_times_a_reload_and_a_plain_copy_of_the_same_bytes(work):
    # starts a vLLM engine in a subprocess; tiny model, one timed reload
    (row,) = reload.main(reload.Args(sizes=["tiny"], repeats=1, work_dir=work))
    # 0.85M float32 parameters, the tied lm_head counted once more: ~3.6 MB
    assert 3.0e6 < row["bytes"] < 4.0e6
    assert row["reload_s"] > 0 and row["copy_s"] > 0


def test_generate_bench_counts_tokens_of_both_sides(work, monkeypatch):
    # starts a vLLM engine in a subprocess, which gets the batch from here: 4 prompts x 2 responses
    # of <= 8 tokens
    monkeypatch.setitem(generate.SIZES, "tiny", (4, 2, 8, 8))
    (row,) = generate.main(generate.Args(sizes=["tiny"], repeats=1, work_dir=work))
    for side in ("vllm", "hf"):  # 8 responses of 1..8 tokens each, on both sides
        assert 8 <= row[f"{side}_tokens"] <= 8 * 8, row
        assert row[f"{side}_s"] > 0


def test_overlap_bench_times_each_phase_apart_and_both_at_once(work, monkeypatch):
    # starts a vLLM engine in a subprocess; tiny model, 4 prompts x 2 responses of <= 8 tokens; one
    # timed round of each
    monkeypatch.setitem(overlap.SIZES, "tiny", (4, 2, 8, 4))
    (row,) = overlap.main(overlap.Args(sizes=["tiny"], repeats=1, work_dir=work))
    assert row["responses"] == 8 and min(row["generate_s"], row["train_s"], row["both_s"]) > 0


def test_profile_adds_up_own_time_by_file():
    def busy():
        return sorted(range(200_000), key=lambda i: -i)  # the key's calls are this file's own time

    seconds = dict(generate.own_time_by_file(busy))
    assert seconds["test_bench.py"] > 0 and seconds["<built-in method builtins.sorted>"] > 0


def test_overlap_gpu_bench_times_each_side_apart_at_once_and_in_a_process():
    """bench/overlap_gpu.py at a small shape on the CPU: the stand-in in a thread and in a process
    of its own, each timed (the numbers are the GPU's to give: docs/async.md)."""
    from bench import overlap_gpu

    args = overlap_gpu.Args(
        shape="ladder",
        seq_len=16,
        microbatch_size=1,
        accumulation=1,
        gen_batch=2,
        prompt_len=4,
        gen_tokens=3,
        repeats=1,
        engine_process=True,
    )
    seconds = overlap_gpu.main(args)
    assert all(seconds[key] > 0 for key in ("generate_s", "train_s", "both_s", "process_s"))


def test_real_step_bench_splits_grpo_py_steps_into_phases(work, shared_data):
    """bench/real_step.py on the tiny model (the real one takes minutes a step): ladder_real.py's
    recipe at a small batch, 2 steps, each split into its phases, the median of step 2 alone."""
    from bench import real_step

    model = grpo_step.make_model(Path(work), "tiny")
    small = "--rollout-batch-size 8 --group-size 4 --train-batch-size 8 --max-tokens 16"
    small += " --ifeval-partial-credit 1.0 --overlong-buffer 0"
    result = real_step.main(
        real_step.Args(
            steps=2, model=model, data_dir=str(shared_data), grpo_flags=small, work_dir=work
        )
    )
    assert len(result["steps"]) == 2
    for step in result["steps"]:
        phases = [step[f"{p}_s"] for p in ("generate", "score", "train", "reload")]
        assert all(s > 0 for s in phases) and step["step_s"] == pytest.approx(sum(phases))
    assert result["median"]["step_s"] == result["steps"][1]["step_s"]
    # MFU by hand: 6 x parameters x trained tokens/s over the measured peak
    m = result["median"]
    expected = 6 * result["n_params"] * m["train_tokens_s"] / (result["peak_tflops"] * 1e12)
    assert m["train_mfu"] == pytest.approx(expected)
    assert 0.845e6 < result["n_params"] < 0.855e6


def test_mfu_by_hand():
    from bench import real_step

    # 100 tokens/s x 6 x 135e6 FLOPs = 81 GFLOP/s of a 0.162 TFLOP/s peak: half
    assert real_step.mfu(100.0, 6 * 135e6, 0.162) == pytest.approx(0.5)


def test_trls_side_reads_the_recipe_as_grpo_py_parses_it():
    import grpo
    import ladder_real
    from bench import real_step

    recipe = tyro.cli(grpo.Args, args=["--model", "m", *ladder_real.RECIPE.split()])
    (n_prompts, group, max_tokens, micro), task = real_step.trl_settings()
    assert n_prompts * group == recipe.rollout_batch_size and group == recipe.group_size
    assert (max_tokens, micro) == (recipe.max_tokens, recipe.microbatch_size)
    assert task == {
        "dataset": recipe.dataset,
        "template": recipe.template,
        "temperature": recipe.temperature,
        "lr": recipe.lr,
    }


def test_shared_prompt_bench_times_both_sides_and_finds_them_equal():
    from bench import shared_prompt

    args = shared_prompt.Args(model="tiny", prompt_len=24, response_len=8, group_size=4, repeats=1)
    result = shared_prompt.main(args)
    assert result["plain"]["seconds"] > 0 and result["shared"]["seconds"] > 0
    # float rounding only (measured ~1e-6 of a gradient's largest entry)
    assert result["max_log_prob_diff"] < 1e-4 and result["max_grad_diff"] < 1e-4


def test_planted_mismatch_moves_a_share_of_the_response_tokens_by_the_offset():
    from bench.planted_mismatch import plant

    mask = torch.zeros(50, 40, dtype=torch.bool)
    mask[:, 5:35] = True  # 1,500 response tokens
    # log-probs in quarters: adding and taking 1 is exact
    engine = -torch.randint(0, 20, (50, 40)) / 4
    moved = plant(engine, mask, share=0.1, offset=1.0, seed=7) - engine
    # every token moved by exactly +-1 nat, and only response tokens
    assert set(moved.unique().tolist()) == {-1.0, 0.0, 1.0}
    assert not moved[~mask].any()
    ups, downs = int((moved == 1).sum()), int((moved == -1).sum())
    # about 10% of 1,500 (150, std ~12), about half of them each way (75, std ~6)
    assert 110 < ups + downs < 190 and 40 < ups < 110 and 40 < downs < 110
    # the same seed, the same tokens; another seed, others; share 0 or 1: none or all
    assert torch.equal(plant(engine, mask, 0.1, 1.0, 7), engine + moved)
    assert not torch.equal(plant(engine, mask, 0.1, 1.0, 8), engine + moved)
    assert torch.equal(plant(engine, mask, 0.0, 1.0, 7), engine)
    assert ((plant(engine, mask, 1.0, 0.5, 7) - engine).abs()[mask] == 0.5).all()
