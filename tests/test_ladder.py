"""ladder.py end to end on tiny budgets: every stage runs as a subprocess, the table matches the
evaluations, the plot is a PNG, and a resumed ladder reruns nothing. (The ladder's real numbers are
in the README, not asserted here.)"""

import json
from pathlib import Path

import pytest

import ladder


def test_ladder_runs_every_stage_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for name in ladder.PIN_ISA:
        monkeypatch.delenv(name, raising=False)
    args = ladder.Args(
        seed=3,
        output_dir=str(tmp_path),
        n_layers=2,
        sft_examples=64,
        ei_steps=1,
        grpo_steps=1,
        n_test=8,
        distill=True,
    )
    # At these sizes every stage scores 0.0, so a ladder that read another stage's summary would
    # pass unseen: each evaluation's summary.json gets a number of its own stage (its real
    # accuracy kept aside) before the ladder reads it.
    evaluated = ("base", "sft", "expert_iter", "grpo", "gold_sft", "distill")
    marks = {stage: (i + 1) / 10 + 0.01 for i, stage in enumerate(evaluated)}
    real_accuracy = {}
    run = ladder.run

    def run_and_mark(cmd, log, env, **kwargs):
        seconds = run(cmd, log, env, **kwargs)
        if cmd[0] == "eval.py" and "--out-dir" in cmd:
            out = Path(cmd[cmd.index("--out-dir") + 1])
            (summary,) = out.glob("*/summary.json")
            written = json.loads(summary.read_text())
            real_accuracy[out.name] = written["metrics"]["eval/accuracy"]
            written["metrics"]["eval/accuracy"] = marks[out.name]
            summary.write_text(json.dumps(written))
        return seconds

    monkeypatch.setattr(ladder, "run", run_and_mark)
    results = ladder.main(args)
    (run_dir,) = tmp_path.glob("ladder__3__*")

    # every stage but the tool row's, which runs with --tools, and grpo_async's (--grpo-async)
    not_run = ("tools_teacher", *ladder.TOOL_STAGES, "grpo_async")
    assert list(results) == [stage for stage in ladder.STAGES if stage not in not_run]
    assert sorted(real_accuracy) == sorted(evaluated)
    printed = ladder.table(results)
    for stage in evaluated:
        (summary,) = (run_dir / "eval" / stage).glob("*/summary.json")
        metrics = json.loads(summary.read_text())["metrics"]
        assert metrics["eval/n_problems"] == 8
        assert results[stage]["accuracy"] == metrics["eval/accuracy"] == marks[stage]
        assert f"| {ladder.LABELS[stage]} | {marks[stage]:.1%} |" in printed
        assert results[stage]["seconds"] > 0
    assert real_accuracy["base"] == 0.0  # random weights cannot answer
    # sft.py trained on the teacher's traces, whose answers are right as often as the table says
    rows = [json.loads(line) for line in (run_dir / ladder.TRACES).read_text().splitlines()]
    assert len(rows) == 64
    right = [row["response"].endswith(f"#### {row['answer']}") for row in rows]
    assert results["teacher"]["accuracy"] == sum(right) / 64 and 0 < sum(right) < 64
    assert (run_dir / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the stages ran with the instruction set pinned, and ladder.json says so and on which CPU
    saved = json.loads((run_dir / "ladder.json").read_text())
    assert saved["machine"]["env"] == ladder.PIN_ISA and saved["machine"]["cpu"]
    # the stages started from the right models: expert iteration and GRPO from the SFT checkpoint
    sft_checkpoint = str(sorted(run_dir.glob("sft__*/checkpoints/step_*"))[-1])
    for stage in ("expert_iter", "grpo"):
        (stage_dir,) = run_dir.glob(f"{stage}__*")
        assert json.loads((stage_dir / "args.json").read_text())["model"] == sft_checkpoint
    (sft_dir,) = run_dir.glob("sft__*")
    assert json.loads((sft_dir / "args.json").read_text())["sft_file"] == str(
        run_dir / ladder.TRACES
    )
    # distillation: from the SFT checkpoint, toward the SFT on the gold solutions (no --sft-file:
    # the solutions)
    (gold_dir,), (distill_dir,) = run_dir.glob("gold_sft__*"), run_dir.glob("distill__*")
    assert json.loads((gold_dir / "args.json").read_text())["sft_file"] is None
    distilled = json.loads((distill_dir / "args.json").read_text())
    assert distilled["model"] == sft_checkpoint
    assert distilled["teacher"] == str(sorted(gold_dir.glob("checkpoints/step_*"))[-1])

    # A resumed ladder whose stages all finished runs none of them again.
    before = sorted(p.name for p in run_dir.iterdir())
    monkeypatch.setattr(
        ladder, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a stage ran again"))
    )
    assert ladder.main(ladder.Args(resume=str(run_dir))) == results
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_carries_right_counts_only_additions_that_carry():
    texts = [
        "4 - 3 = 1. 1 + 9 = 0. 0 + 6 = 6. 6 + 7 = 13.",
        "17 + 5 = 22. 22 - 9 = 13.\n#### 13",
        "2 + 2 = 4.",
    ]
    # 1 + 9 wrong; 6 + 7 and 17 + 5 right; the rest do not carry
    assert ladder.carries_right(texts) == 2 / 3
    assert ladder.carries_right(["2 + 2 = 4.", "no arithmetic"]) is None


def test_combine_tables_the_seeds_and_their_mean(tmp_path):
    # two finished ladders with a tool row, written by hand: seed 1 and seed 2
    run_dirs = []
    for seed, (grpo, grpo_tools) in {1: (0.40, 0.70), 2: (0.50, 0.60)}.items():
        run_dir = tmp_path / f"ladder__{seed}__0"
        results = {
            stage: {"accuracy": accuracy, "carries_right": None, "seconds": 1.0}
            for stage, accuracy in (("sft", 0.3), ("grpo", grpo), ("grpo_tools", grpo_tools))
        }
        saved = {"args": {"seed": seed}, "results": results}
        write(run_dir / "ladder.json", json.dumps(saved))
        for stage in ("grpo", "grpo_tools"):
            records = [
                {"step": step, "eval/accuracy": 0.1 * step, "eval/frac_calling": 0.5}
                for step in (0, 1)
            ]
            records.append({"step": 1, "rollout/frac_calling": 0.25})
            lines = "\n".join(json.dumps(r) for r in records)
            write(run_dir / f"{stage}__{seed}__0" / "metrics.jsonl", lines)
        # tools_sft never called: no accuracy with a call
        tool_metrics = {
            "tools_sft": {"eval/tool_calls_per_response": 0.0, "eval/frac_calling": 0.0},
            "grpo_tools": {
                "eval/tool_calls_per_response": float(seed),
                "eval/frac_calling": 0.5,
                "eval/accuracy_with_call": 0.8,
                "eval/accuracy_without_call": 0.4,
            },
        }
        for stage, metrics in tool_metrics.items():
            summary = run_dir / "eval" / stage / "run" / "summary.json"
            write(summary, json.dumps({"metrics": metrics}))
        run_dirs.append(run_dir)

    text = ladder.combine(run_dirs, tmp_path / "out")

    lines = text.splitlines()
    assert lines[0] == "| stage | seed 1 | seed 2 | mean |"
    assert "| GRPO from SFT | 40.0% | 50.0% | 45.0% |" in lines
    assert "| GRPO with the calculator, from that SFT | 70.0% | 60.0% | 65.0% |" in lines
    # stages that no run has are left out
    assert not any(line.startswith("| expert iteration") for line in lines)
    calls = "| GRPO with the calculator, from that SFT: eval/tool_calls_per_response |"
    assert f"{calls} 1.00 | 2.00 | 1.50 |" in lines
    assert "| SFT on the calculator traces: eval/accuracy_with_call | - | - | - |" in lines
    png = (tmp_path / "out" / "ladder_tools.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def plant_eval(folder, right: list[bool], dataset="synthetic", template="question") -> None:
    """An eval.py results folder of len(right) problems, one greedy sample each: problem i right
    or wrong as right[i] says."""
    args = {"dataset": dataset, "split": "test", "template": template, "tools": False, "k": [1]}
    accuracy = sum(right) / len(right)
    write(
        folder / "summary.json", json.dumps({"args": args, "metrics": {"eval/accuracy": accuracy}})
    )
    records = []
    for i, ok in enumerate(right):
        reward = {"reward": float(ok), "format_reward": 1.0, "extracted": "7" if ok else "1"}
        records.append(
            {
                "id": str(i),
                "prompt": f"q{i}",
                "answer": "7",
                "responses": ["#### 7"],
                "rewards": [reward],
            }
        )
    write(folder / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in records))


def test_a_resumed_ladder_compares_each_stage_with_its_start(tmp_path):
    # A finished ladder whose ladder.json has no comparisons (written before they were kept): on
    # --resume it runs no stage, and gets each gain from eval.py --compare on the eval folders.
    run_dir = tmp_path / "ladder__1__0"
    right = {
        "base": [False] * 10,
        # 5 of 10 right, none of them wrong after
        "sft": [True] * 5 + [False] * 5,
        "expert_iter": [True] * 7 + [False] * 3,
        # 1 more right than SFT, 2 fewer: -10 points
        "grpo": [True] * 3 + [False] * 2 + [True] + [False] * 4,
    }
    results = {"teacher": {"accuracy": 0.5, "carries_right": 0.3, "seconds": 1.0}}
    for stage, marks in right.items():
        plant_eval(run_dir / "eval" / stage / "model", marks)
        results[stage] = {"accuracy": sum(marks) / 10, "carries_right": None, "seconds": 60.0}
    args = {**ladder.asdict(ladder.Args()), "output_dir": str(tmp_path)}
    saved = {"args": args, "machine": {"cpu": "x", "isa": [], "env": {}}, "results": results}
    write(run_dir / "ladder.json", json.dumps(saved))
    for stage in ("sft", "expert_iter", "grpo"):
        # grpo's rollouts collapse onto one answer; the others log no distinct_answers: no curve
        rows = [{"step": 0, "eval/accuracy": 0.1}]
        rows += [{"step": 1, "rollout/reward_mean": 0.5, "rollout/distinct_answers": 0.25}]
        write(run_dir / f"{stage}__1__0" / "metrics.jsonl", "\n".join(map(json.dumps, rows)))

    results = ladder.main(ladder.Args(resume=str(run_dir)))

    sft = results["sft"]["comparison"]
    assert sft["against"] == "base" and sft["difference"] == 0.5
    assert (sft["only_a"], sft["only_b"], sft["both"], sft["neither"]) == (5, 0, 0, 5)
    grpo = results["grpo"]["comparison"]
    assert grpo["against"] == "sft" and grpo["difference"] == pytest.approx(-0.1)
    assert (grpo["only_a"], grpo["only_b"]) == (1, 2)
    # eval.py's own numbers, as its --compare wrote them
    written = json.loads((run_dir / "eval" / "grpo_vs_sft.json").read_text())
    row = written["metrics"]["eval/accuracy"]
    assert grpo["stderr"] == row["stderr"] > 0 and grpo["ci_low"] == row["ci_low"]
    assert written["mcnemar_p"] == grpo["mcnemar_p"] == 1.0
    # in ladder.json, and in the table
    saved = json.loads((run_dir / "ladder.json").read_text())
    assert saved["results"]["grpo"]["comparison"] == grpo
    assert "comparison" not in saved["results"]["base"]
    printed = ladder.table(results)
    se = 100 * grpo["stderr"]
    interval = f"[{100 * grpo['ci_low']:.1f}, {100 * grpo['ci_high']:.1f}]"
    gain = f"-10.0 points over sft (paired s.e. {se:.1f}, 95% CI {interval})"
    assert f"| GRPO from SFT | 40.0% | - | 1.0 min | {gain} |" in printed.splitlines()
    assert "| SFT on the traces | 50.0% | - | 1.0 min | +50.0 points over base" in printed
    assert (run_dir / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = ladder.curves(run_dir, "grpo")
    assert curves["distinct answers in a group (rollouts)"] == [(1, 0.25)]


# what a stage printed, as the ladder reads it ("\r" redraws as lines of their own)
STAGE_OUTPUT = """\
Triton is installed, but doesn't include CPU backend. Disabling Triton.
/x/vllm/triton_utils/dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op` is deprecated
  if hasattr(value, "__dict__"):
[W1128 14:34:26.709100664 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy (function operator())

Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]

Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 12.83it/s]

step     0 | eval accuracy 0.000 format 0.000
Rendering prompts:  98%|█████████▊| 501/512 [00:00<00:00, 5002.86it/s]
Processed prompts: 100%|██████████| 256/256 [00:01<00:00, 200.1it/s, est. speed input: 1.0 toks/s]

step     1/625 | loss 6.2435 | grad norm 5.611 | lr 0.00e+00 | 2.71 s
  indented line of the stage's own
Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 218.24it/s]
wrote runs/x: Qwen3, 4 layers x 128, 0.85M parameters, vocab 477

eval/accuracy 0.012
"""


def test_the_terminal_gets_a_stages_own_lines_and_the_log_all(tmp_path, capsys):
    kept = []
    noise = None
    for line in STAGE_OUTPUT.splitlines(keepends=True):
        noise = ladder.noise_kind(line, noise)
        if noise is None:
            kept.append(line.rstrip("\n"))
    assert kept == [
        "step     0 | eval accuracy 0.000 format 0.000",
        "step     1/625 | loss 6.2435 | grad norm 5.611 | lr 0.00e+00 | 2.71 s",
        "  indented line of the stage's own",
        "wrote runs/x: Qwen3, 4 layers x 128, 0.85M parameters, vocab 477",
        "",
        "eval/accuracy 0.012",
    ]

    # run(): the same, with every line in the log and a line saying where the rest is
    script = tmp_path / "stage.py"
    script.write_text(f"import sys\nsys.stdout.write({STAGE_OUTPUT!r})\n")
    log = tmp_path / "stage.log"
    ladder.run([str(script)], log, {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[-len(kept) - 1 : -1] == kept
    n_hidden = len(STAGE_OUTPUT.splitlines()) - len(kept)
    assert printed[-1] == f"  ({n_hidden} lines in {log}: progress bars and warnings)"
    assert log.read_text() == STAGE_OUTPUT
