"""The bench scripts run and measure what they say, on tiny shapes; never a timing assertion (bench/ prints those)."""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import generate  # noqa: E402
import grpo_step  # noqa: E402
import overlap  # noqa: E402
import reload  # noqa: E402
import train_step  # noqa: E402


def test_qwen3_1_7b_shape_has_its_parameter_count():
    # Qwen3-1.7B: 1.72e9 parameters with tied embeddings (2.03e9 if the output layer were separate).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**train_step.SHAPES["qwen3-1.7b"]))
    n_params = sum(p.numel() for p in model.parameters())
    assert 1.70e9 < n_params < 1.74e9, n_params


def test_tiny_shape_trains_on_cpu():
    args = train_step.Args(shape="tiny", microbatch_sizes=[1, 2], seq_len=16, steps=1, accumulation=2)
    rows = train_step.main(args)
    assert [row["microbatch_size"] for row in rows] == [1, 2]
    # on a CPU the MFU is over the measured matmul peak: a fraction, though a noisy one on a shared machine
    assert all(row["tokens_per_s"] > 0 and 0 < row["mfu"] < 2 and row["peak_gib"] > 0 for row in rows)


def test_cpu_matmul_peak_is_a_positive_rate():
    assert 0 < train_step.cpu_matmul_tflops(n=128, repeats=2) < 100  # TFLOP/s: no CPU reaches 100 in float32


def test_ladder_and_25m_shapes_have_the_issue_parameter_counts():
    # the models tiny_model.py builds for the issue's two rows: 0.85M and 25.4M parameters
    for shape, (low, high) in {"ladder": (0.84e6, 0.86e6), "25m": (25.3e6, 25.5e6)}.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(Qwen3Config(**train_step.SHAPES[shape]))
        assert low < sum(p.numel() for p in model.parameters()) < high, shape


def test_grpo_step_medians_leave_out_the_warm_up_step():
    assert grpo_step.median_after_warmup([100.0, 1.0, 3.0, 2.0]) == 2.0
    assert grpo_step.median_after_warmup([5.0]) == 5.0
    assert grpo_step.describe("tiny") == "tiny: 256 completions (32 x 8), <= 64 tokens, microbatch 64"


def test_reload_bench_times_a_reload_and_a_plain_copy_of_the_same_bytes(tmp_path):
    # starts a vLLM engine in a subprocess; tiny model, one timed reload
    (row,) = reload.main(reload.Args(sizes=["tiny"], repeats=1, work_dir=str(tmp_path)))
    assert 3.0e6 < row["bytes"] < 4.0e6  # 0.85M float32 parameters, the tied lm_head counted once more: ~3.6 MB
    assert row["reload_s"] > 0 and row["copy_s"] > 0 and row["check_s"] > 0


def test_generate_bench_counts_tokens_of_both_sides(tmp_path):
    (row,) = generate.main(generate.Args(sizes=["tiny"], repeats=1, work_dir=str(tmp_path)))
    # 256 responses of 1..64 tokens each, on both sides
    for side in ("vllm", "hf"):
        assert 256 <= row[f"{side}_tokens"] <= 256 * 64, row
        assert row[f"{side}_s"] > 0


def test_overlap_bench_times_each_phase_apart_and_both_at_once(tmp_path):
    # starts a vLLM engine in a subprocess; tiny model; one timed round of each
    (row,) = overlap.main(overlap.Args(sizes=["tiny"], repeats=1, work_dir=str(tmp_path)))
    assert row["responses"] == 256 and min(row["generate_s"], row["train_s"], row["both_s"]) > 0
    # the most overlap can hide is the faster phase: between 1/2 (equal phases) and 1
    assert 0.5 <= row["best_ratio"] < 1 and row["ratio"] == row["both_s"] / (row["generate_s"] + row["train_s"])


def test_profile_adds_up_own_time_by_file():
    def work():
        return sorted(range(200_000), key=lambda i: -i)  # the key's calls are this file's own time

    seconds = dict(generate.own_time_by_file(work))
    assert seconds["test_bench.py"] > 0 and seconds["<built-in method builtins.sorted>"] > 0
