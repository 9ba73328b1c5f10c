"""The CPU ladder: watch SFT, expert iteration and GRPO each make a model better, on a laptop.

    python ladder.py              # about 11 minutes on 2 CPU cores; no GPU, no internet
    python ladder.py --seed 2     # the README's table has seeds 1, 2 and 3
    python ladder.py --combine runs/ladder__1__* runs/ladder__2__* runs/ladder__3__*   # their table, the mean

It runs the project's own scripts, each as a subprocess with the command line it prints first (copy one to rerun a
stage alone), all inside one run folder, runs/ladder__<seed>__<unix time>/:

  1. tiny_model.py    a 4-layer Qwen3 (0.85M parameters) with random weights, and a tokenizer trained here
     teacher traces   the synthetic train problems worked by a flawed teacher (data.flawed_teacher): it forgets
                      to carry 70% of the time (17 + 5 = 12), so about half of its traces end in a wrong answer
  2. sft.py           fine-tune the tiny model on those traces: it learns the arithmetic, and the flaw with it
  3. expert_iter.py   from the sft checkpoint: sample, keep what the verifier accepts, fine-tune, repeat
  4. grpo.py          from the sft checkpoint: GRPO on the verifier's reward
  5. eval.py          every model above (the random one too) on the held-out synthetic test split

Expert iteration and GRPO never see the teacher: they learn from the verifier, which knows the gold answers, and
so can unlearn the teacher's flaw. The ladder ends with a table (accuracy of each stage, the share of carries it
gets right, its wall time, and its gain over the model it started from: `eval.py --compare`'s paired standard error
and 95% interval), ladder.json, and ladder.png: eval accuracy, rollout reward and the share of distinct answers in a
group against step per stage. The terminal shows each stage's command and its own lines; the libraries' progress
bars and warnings go to the stage's log in the run folder (on a terminal, one status line redrawn in place).
The stage settings below are the whole recipe; docs/ladder.md explains why each is what it is. A ladder that dies can
be continued: `python ladder.py --resume runs/ladder__1__...` skips the stages that finished (each writes its result
to ladder.json as it ends).

Every stage runs with torch and oneDNN held to AVX2 code (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, printed in
front of each command), so that an AVX-512 machine computes torch's part as an AVX2 one does: the README's SFT and
expert-iteration rows reproduce on either to the digit, GRPO's within a point (vLLM's own kernels still follow the
hardware); `--no-pin-isa` lets them use the widest instructions (docs/ladder.md, "Reproducibility").
"""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tyro

import data


@dataclass
class Args:
    seed: int = 1
    """seed of every stage (model init, data order, sampling)"""
    output_dir: str = "runs"
    """where the ladder's run folder is made"""
    resume: str | None = None
    """a ladder run folder to continue: its finished stages are skipped"""
    n_layers: int = 4
    """layers of the tiny model"""
    forget_carry: float = 0.7
    """how often the teacher of the SFT traces forgets a carry (0: SFT on the gold solutions)"""
    sft_examples: int = 20000
    """teacher traces sft.py trains on, one epoch in batches of 32 (20,000: the whole train split,
    625 steps)"""
    ei_steps: int = 10
    """expert-iteration steps"""
    grpo_steps: int = 60
    """GRPO steps"""
    n_test: int | None = None
    """evaluate on the first n_test test problems (None: all 512)"""
    pin_isa: bool = True
    """run the stages with torch and oneDNN held to AVX2 kernels (PIN_ISA), as the README's numbers
    were made"""
    distill: bool = False
    """also SFT on the gold solutions (a teacher that carries right) and distill it into the SFT
    checkpoint"""
    tools: bool = False
    """also the tool row: a teacher that calls the calculator on --call-rate of its additions, SFT
    on its traces, then grpo_tools.py from there (beside grpo.py's row, the same steps)"""
    call_rate: float = 0.3
    """with --tools: the share of the teacher's additions done by the calculator"""
    grpo_async: bool = False
    """also grpo_async.py from the SFT checkpoint (its rollouts one step stale, sampled while the
    trainer learns), beside grpo.py's row, the same steps"""
    combine: list[str] = field(default_factory=list)
    """finished ladder run folders, one a seed: print their accuracies side by side with the mean,
    plot their tool rows together (output_dir/ladder_tools.png), and run no stage"""


DESCRIPTION = (
    "The CPU ladder: a tiny model, SFT on a flawed teacher's traces, then expert iteration and GRPO "
    "from SFT, each evaluated (docs/ladder.md). The stages run with vLLM's logging at ERROR; "
    "VLLM_LOGGING_LEVEL=INFO python ladder.py shows the engine's own lines too."
)
STAGES = (
    "base",
    "teacher",
    "sft",
    "expert_iter",
    "grpo",
    "grpo_async",
    "gold_sft",
    "distill",
    "tools_teacher",
    "tools_sft",
    "grpo_tools",
)
LABELS = {
    "base": "base (random init)",
    "teacher": "teacher's traces (train split)",
    "sft": "SFT on the traces",
    "expert_iter": "expert iteration from SFT",
    "grpo": "GRPO from SFT",
    "grpo_async": "GRPO, rollouts overlapping training (1 step stale), from SFT",
    "gold_sft": "SFT on the gold solutions (distill's teacher)",
    "distill": "distillation from SFT",
    "tools_teacher": "calculator teacher's traces (train split)",
    "tools_sft": "SFT on the calculator traces",
    "grpo_tools": "GRPO with the calculator, from that SFT",
}
# the model each trained stage starts from: its gain is measured against that model's evaluation
# (tools_sft has none: it is evaluated with the tool loop, the random model without)
STARTS = {
    "sft": "base",
    "expert_iter": "sft",
    "grpo": "sft",
    "grpo_async": "sft",
    "gold_sft": "base",
    "distill": "sft",
    "grpo_tools": "tools_sft",
}
TRACES = "teacher_traces.jsonl"  # in the run folder: sft.py's --sft-file
TOOL_TRACES = "tool_teacher_traces.jsonl"
# the stages that are evaluated with the tool loop (eval.py --tools)
TOOL_STAGES = ("tools_sft", "grpo_tools")
CARRY = re.compile(r"(-?\d+) \+ (\d+) = (-?\d+)\.")  # "17 + 5 = 22." in a worked solution
# every script: the same task and prompt
SHARED = ["--dataset", "synthetic", "--template", "question"]
LENGTHS = ["--max-tokens", "64", "--eval-max-tokens", "64"]  # a 4-step solution is ~40 tokens
# Floating-point kernels differ by instruction set, and a run that samples from its model amplifies
# the last bits: the same seed's SFT stage ended at 15.0% unpinned on an AVX-512 + AMX machine,
# 29.7% on it pinned, 29.9% on AVX2. Read by torch and oneDNN at start; an explicit value in the
# environment wins. vLLM's own kernels (attention, norms) still follow the hardware:
# vllm/platforms/cpu.py, CpuPlatform.import_kernels loads _C_AVX2 only on an AVX2 CPU.
PIN_ISA = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def stage_commands(
    args: Args, run_dir: Path, sft_checkpoint: str, teacher: str = ""
) -> dict[str, list[str]]:
    """The command line of every training stage. The checkpoints are only known once sft.py
    has run."""
    common = [*SHARED, "--seed", str(args.seed), "--output-dir", str(run_dir)]
    base = str(run_dir / "base")
    sft = (
        "--batch-size 32 --microbatch-size 32 --lr 3e-3 --max-seq-len 128 --eval-every 125"
        " --n-eval 256 --eval-max-tokens 64 --save-every 100000"
    ).split()
    # GRPO's 5 warmup steps: 4 optimizer steps each (256 responses, 64 per update)
    grpo = (
        "--rollout-batch-size 256 --group-size 8 --train-batch-size 64 --microbatch-size 64"
        " --lr 1e-4 --warmup-steps 20 --lr-schedule cosine --n-eval 256 --eval-every 10"
        " --save-every 100000"
    ).split()
    distill = (
        "--rollout-batch-size 256 --group-size 8 --microbatch-size 64 --lr 1e-4"
        " --warmup-steps 5 --n-eval 256 --eval-every 10 --save-every 100000"
    ).split()
    expert_iter = (
        "--n-questions 256 --group-size 4 --lr 1e-4 --warmup-steps 5 --batch-size 32"
        " --microbatch-size 32 --max-seq-len 160 --n-eval 256"
    ).split()
    n_examples = ["--n-examples", str(args.sft_examples)]
    return {
        "tiny_model": [
            "tiny_model.py",
            *["--out", base, "--n-layers", str(args.n_layers), "--seed", str(args.seed)],
        ],
        "sft": [
            "sft.py",
            *["--model", base, *common, "--sft-file", str(run_dir / TRACES), *n_examples, *sft],
        ],
        "gold_sft": [
            "sft.py",
            *["--model", base, *common, "--exp-name", "gold_sft", *n_examples, *sft],
        ],
        "distill": [
            "distill.py",
            *["--model", sft_checkpoint, "--teacher", teacher, *common],
            *["--n-distill-steps", str(args.grpo_steps), *LENGTHS, *distill],
        ],
        "expert_iter": [
            "expert_iter.py",
            *["--model", sft_checkpoint, *common],
            *["--n-ei-steps", str(args.ei_steps), *LENGTHS, *expert_iter],
        ],
        "grpo": [
            "grpo.py",
            *["--model", sft_checkpoint, *common],
            *["--n-grpo-steps", str(args.grpo_steps), *LENGTHS, *grpo],
        ],
        "grpo_async": [
            "grpo_async.py",
            *["--model", sft_checkpoint, *common, "--max-staleness", "1"],
            *["--n-grpo-steps", str(args.grpo_steps), *LENGTHS, *grpo],
        ],
        # sft_checkpoint: the tools_sft one here
        "tools_sft": [
            "sft.py",
            *["--model", base, *common, "--exp-name", "tools_sft"],
            *["--sft-file", str(run_dir / TOOL_TRACES), *n_examples, *sft],
        ],
        "grpo_tools": [
            "grpo_tools.py",
            *["--model", sft_checkpoint, *common],
            *["--n-grpo-steps", str(args.grpo_steps), *LENGTHS, *grpo],
        ],
    }


def write_teacher_traces(
    args: Args, run_dir: Path, tools: bool = False
) -> tuple[float, float | None]:
    """teacher_traces.jsonl, sft.py's --sft-file: the flawed teacher's worked solutions of the
    synthetic train split, each row with the gold answer (so `sft.py --filter-correct` could drop
    the wrong ones). With tools, tool_teacher_traces.jsonl: data.calculator_teacher's traces, the
    prompt offering the calculator, each row with `tool_spans`, the [start, end) of every tool
    output in the response, which SFT must not train on. Returns the fraction of traces whose
    final answer is right, and of their carries (made in the head)."""
    rng = random.Random(args.seed)
    n_right = 0
    responses = []
    with open(run_dir / (TOOL_TRACES if tools else TRACES), "w") as f:
        for example in data.load("synthetic", "train")[: args.sft_examples]:
            if tools:
                traced = data.calculator_teacher(example, args.forget_carry, args.call_rate, rng)
            else:
                traced = data.flawed_teacher(example, args.forget_carry, rng)
            n_right += traced["answer"] == example["answer"]
            response = data.render_response(traced, "question")
            row = {
                "prompt": data.render_prompt(traced, "question", tools=tools),
                "response": response,
                "answer": example["answer"],
                "verifier": "synthetic",
            }
            if tools:
                # the "question" response is "\n" + the solution + ...
                offset = response.index(traced["solution"])
                row["tool_spans"] = [[a + offset, b + offset] for a, b in traced["tool_spans"]]
            f.write(json.dumps(row) + "\n")
            responses.append(response)
    return n_right / args.sft_examples, carries_right(responses)


def stage_env(args: Args) -> dict[str, str]:
    """The environment variables every stage runs with, beyond this process's own."""
    return {k: os.environ.get(k, v) for k, v in PIN_ISA.items()} if args.pin_isa else {}


def machine() -> dict:
    """What the numbers depend on: the CPU, its widest vector instructions, and the kernels torch
    chose."""
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    flags = (
        set(re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.M).group(1).split())
        if "flags" in cpuinfo
        else set()
    )
    return {
        "cpu": model.group(1) if model else "unknown",
        "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags],
        "n_cpus": os.cpu_count(),
        # of this process: stages may be pinned
        "torch_kernels": torch.backends.cpu.get_cpu_capability(),
    }


def run(cmd: list[str], log: Path, env: dict[str, str], quiet: bool = False) -> float:
    """Run `python <cmd>` from this folder with env added; return its wall time. Raise if it
    fails. Its whole output goes to log; the terminal gets the stage's own lines (quiet: none),
    not the libraries' progress bars and warnings (noise_kind), which a terminal sees as one line
    redrawn in place."""
    print(f"\n$ {''.join(f'{k}={v} ' for k, v in env.items())}python {' '.join(cmd)}", flush=True)
    start = time.time()
    # a terminal sees the hidden lines as one status line, redrawn in place; a file, none of them
    redraw = sys.stdout.isatty() and not quiet
    width = shutil.get_terminal_size().columns - 1
    noise = None
    n_hidden = 0
    with (
        open(log, "w") as f,
        subprocess.Popen(
            [sys.executable, *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path(__file__).parent,
            env={**os.environ, **env},
        ) as proc,
    ):
        # text mode reads each "\r" redraw of a progress bar as a line of its own
        for line in proc.stdout:
            f.write(line)
            noise = noise_kind(line, noise)
            n_hidden += bool(noise) or quiet
            if redraw:
                # "\033[K": erase the status line's rest
                sys.stdout.write("\r\033[K")
            if noise and redraw:
                sys.stdout.write(f"  {cmd[0]}: {line.strip()}"[:width])
            elif not noise and not quiet:
                sys.stdout.write(line)
            sys.stdout.flush()
    if redraw:
        sys.stdout.write("\r\033[K")
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} failed (exit {proc.returncode}); its output is in {log}")
    if n_hidden:
        hidden = "its output" if quiet else "progress bars and warnings"
        print(f"  ({n_hidden} lines in {log}: {hidden})", flush=True)
    return time.time() - start


def find_one(pattern: str, folder: Path) -> Path:
    """The single (or, for checkpoints, last) path matching pattern in folder."""
    found = sorted(folder.glob(pattern))
    if not found:
        raise FileNotFoundError(f"no {pattern} in {folder}")
    return found[-1]


def carries_right(texts: list[str]) -> float | None:
    """Of the additions that carry (data.carries: 17 + 5) written in texts, the fraction whose sum
    is right: the teacher's flaw, measured. None if no text has one."""
    sums = [(int(a), int(x), int(total)) for text in texts for a, x, total in CARRY.findall(text)]
    right = [a + x == total for a, x, total in sums if data.carries(a, x)]
    return sum(right) / len(right) if right else None


def evaluate(
    args: Args, model: Path, run_dir: Path, name: str
) -> tuple[float, float | None, float]:
    """Greedy accuracy of model on the synthetic test split (eval.py); returns (accuracy, carries
    right, wall time)."""
    out = run_dir / "eval" / name
    limit = [] if args.n_test is None else ["--limit", str(args.n_test)]
    # a tool stage is measured the way it was trained
    if name in TOOL_STAGES:
        limit.append("--tools")
    cmd = [
        "eval.py",
        "--model",
        str(model),
        *SHARED,
        "--split",
        "test",
        *limit,
        "--max-tokens",
        "64",
        "--out-dir",
        str(out),
    ]
    seconds = run(cmd, run_dir / f"eval_{name}.log", stage_env(args))
    summary = json.loads(find_one("*/summary.json", out).read_text())
    samples = [
        json.loads(line) for line in find_one("*/samples.jsonl", out).read_text().splitlines()
    ]
    return (
        summary["metrics"]["eval/accuracy"],
        carries_right([s["responses"][0] for s in samples]),
        seconds,
    )


def compare(args: Args, run_dir: Path, stage: str) -> dict:
    """`eval.py --compare` of a stage's evaluation against the one of the model it started from
    (STARTS): the change in accuracy on the same test problems, its paired standard error and 95%
    bootstrap interval, and the problems only one of them solved, with McNemar's p. The whole
    comparison (every rate eval.py holds) is in eval/<stage>_vs_<start>.json."""
    start = STARTS[stage]
    folders = [
        find_one("*/summary.json", run_dir / "eval" / name).parent for name in (stage, start)
    ]
    out = run_dir / "eval" / f"{stage}_vs_{start}.json"
    cmd = ["eval.py", "--compare", *map(str, folders), "--compare-out", str(out)]
    run(cmd, run_dir / f"compare_{stage}.log", stage_env(args), quiet=True)
    result = json.loads(out.read_text())
    counts = {key: result[key] for key in ("only_a", "only_b", "both", "neither", "mcnemar_p")}
    return {"against": start, **result["metrics"]["eval/accuracy"], **counts}


def gain(comparison: dict) -> str:
    """A comparison in words: "+11.1 points over sft (paired s.e. 2.0, 95% CI [7.2, 15.0])"."""
    points = 100 * comparison["difference"]
    se = 100 * comparison["stderr"]
    interval = f"[{100 * comparison['ci_low']:.1f}, {100 * comparison['ci_high']:.1f}]"
    over = f"over {comparison['against']}"
    return f"{points:+.1f} points {over} (paired s.e. {se:.1f}, 95% CI {interval})"


def read_metrics(run_folder: Path) -> list[dict]:
    return [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]


def curves(run_dir: Path, stage: str) -> dict[str, list[tuple[int, float]]]:
    """(step, value) series of a stage's metrics.jsonl: eval accuracy (greedy, val split), rollout
    reward, and the share of distinct final answers in a question's rollouts (the collapse
    metric: 1/G when all G agree; empty where the stage does not log it)."""
    records = read_metrics(find_one(f"{stage}__*", run_dir))
    reward_key = {
        "expert_iter": "rollout/accuracy",
        "grpo": "rollout/reward_mean",
        "grpo_tools": "rollout/reward_mean",
    }.get(stage)
    return {
        "eval accuracy (val, greedy)": [
            (r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r
        ],
        "rollout reward (train, sampled)": [
            (r["step"], r[reward_key]) for r in records if reward_key in r
        ],
        "distinct answers in a group (rollouts)": [
            (r["step"], r["rollout/distinct_answers"])
            for r in records
            if "rollout/distinct_answers" in r
        ],
    }


def plot(run_dir: Path, results: dict) -> Path:
    """ladder.png: one panel a training stage, eval accuracy, rollout reward and the share of
    distinct answers in a group (where logged) against its step."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
    for ax, stage in zip(axes, ("sft", "expert_iter", "grpo"), strict=True):
        for label, points in curves(run_dir, stage).items():
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o", markersize=3, label=label)
        ax.axhline(
            results["sft"]["accuracy"], color="gray", linestyle=":", label="SFT checkpoint (test)"
        )
        ax.set_title(f"{stage}: test accuracy {results[stage]['accuracy']:.1%}")
        ax.set_xlabel(f"{stage} step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy / reward / share")
    axes[-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = run_dir / "ladder.png"
    fig.savefig(path, dpi=110)
    return path


def plot_tools(run_dirs: list[Path], path: Path) -> Path:
    """ladder_tools.png: GRPO with the calculator beside GRPO without it, a line a seed: eval
    accuracy against step, and the share of responses that call the calculator (greedy on val,
    sampled in the rollouts)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    runs = [json.loads((d / "ladder.json").read_text())["results"] for d in run_dirs]
    for color, stage in (("C0", "grpo"), ("C1", "grpo_tools")):
        mean = sum(results[stage]["accuracy"] for results in runs) / len(runs)
        label = f"{LABELS[stage]} (test {mean:.1%})"
        for run_dir in run_dirs:
            points = curves(run_dir, stage)["eval accuracy (val, greedy)"]
            steps, values = zip(*points, strict=True)
            left.plot(steps, values, color=color, marker="o", markersize=2, label=label)
            # one legend entry a stage, not a seed
            label = None
    keys = (
        ("C2", "eval/frac_calling", "calling, val (greedy)"),
        ("C3", "rollout/frac_calling", "calling, rollouts (sampled)"),
    )
    tool_runs = [read_metrics(find_one("grpo_tools__*", d)) for d in run_dirs]
    for color, key, label in keys:
        for records in tool_runs:
            points = [(r["step"], r[key]) for r in records if key in r]
            steps, values = zip(*points, strict=True)
            right.plot(steps, values, color=color, marker="o", markersize=2, label=label)
            label = None
    left.set_ylabel("eval accuracy (val)")
    right.set_ylabel("share of responses that call")
    for ax in (left, right):
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if len(run_dirs) > 1:
        fig.suptitle(f"{len(run_dirs)} seeds, a line each; test accuracy: their mean", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def combine(run_dirs: list[Path], out_dir: Path) -> str:
    """The README's table from finished ladder runs, one a seed: each stage's test accuracy per
    seed and their mean, and the tool row's calls; ladder_tools.png of the runs with a tool row."""
    runs = [json.loads((d / "ladder.json").read_text()) for d in run_dirs]
    seeds = " | ".join(f"seed {run['args']['seed']}" for run in runs)
    rows = [f"| stage | {seeds} | mean |", "|---" * (len(runs) + 2) + "|"]
    for stage in STAGES:
        found = [run["results"][stage]["accuracy"] for run in runs if stage in run["results"]]
        if len(found) == len(runs):
            cells = " | ".join(f"{accuracy:.1%}" for accuracy in found)
            rows.append(f"| {LABELS[stage]} | {cells} | {sum(found) / len(found):.1%} |")
    with_tools = [
        d for d, run in zip(run_dirs, runs, strict=True) if "grpo_tools" in run["results"]
    ]
    # the tool stages' evaluations: how often the greedy answers call, and how they score
    for stage in TOOL_STAGES if with_tools == run_dirs else ():
        metrics = [eval_metrics(d, stage) for d in run_dirs]
        for key in TOOL_METRICS:
            # None: no answer called (accuracy_with_call), or none did without
            found = [m.get(key) for m in metrics]
            cells = " | ".join("-" if value is None else f"{value:.2f}" for value in found)
            known = [value for value in found if value is not None]
            mean = f"{sum(known) / len(known):.2f}" if known else "-"
            rows.append(f"| {LABELS[stage]}: {key} | {cells} | {mean} |")
    text = "\n".join(rows)
    print(text)
    if with_tools:
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"wrote {plot_tools(with_tools, out_dir / 'ladder_tools.png')}")
    return text


TOOL_METRICS = (
    "eval/tool_calls_per_response",
    "eval/frac_calling",
    "eval/accuracy_with_call",
    "eval/accuracy_without_call",
)


def eval_metrics(run_dir: Path, stage: str) -> dict:
    """The metrics of eval.py's summary.json for a stage of a ladder run."""
    summary = find_one("*/summary.json", run_dir / "eval" / stage)
    return json.loads(summary.read_text())["metrics"]


def table(results: dict) -> str:
    rows = [
        "| stage | accuracy | carries right | wall time | gain over its start (eval.py --compare) |",
        "|---|---|---|---|---|",
    ]
    for stage in [stage for stage in STAGES if stage in results]:
        r = results[stage]
        carries = "-" if r["carries_right"] is None else f"{r['carries_right']:.0%}"
        change = gain(r["comparison"]) if "comparison" in r else ""
        minutes = f"{r['seconds'] / 60:.1f} min"
        rows.append(f"| {LABELS[stage]} | {r['accuracy']:.1%} | {carries} | {minutes} | {change} |")
    total = sum(r["seconds"] for r in results.values())
    rows.append(f"| total | | | {total / 60:.1f} min | |")
    return "\n".join(rows)


def main(args: Args) -> dict:
    run_dir = Path(
        args.resume or Path(args.output_dir) / f"ladder__{args.seed}__{int(time.time())}"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    results_path = run_dir / "ladder.json"
    results, where = {}, {**machine(), "env": stage_env(args)}
    # a resumed ladder: its own settings, not this command line's defaults
    if results_path.exists():
        saved = json.loads(results_path.read_text())
        args, results = (
            Args(
                **{
                    **saved["args"],
                    "resume": args.resume,
                    "distill": args.distill,
                    "tools": args.tools,
                    "grpo_async": args.grpo_async,
                }
            ),
            saved["results"],
        )
        where = saved.get("machine", where)
    print(f"machine: {where}", flush=True)

    def save() -> None:
        saved = {"args": asdict(args), "machine": where, "results": results}
        results_path.write_text(json.dumps(saved, indent=2) + "\n")

    def finish(stage: str, accuracy: float, carries: float | None, seconds: float) -> None:
        results[stage] = {"accuracy": accuracy, "carries_right": carries, "seconds": seconds}
        save()
        print(f"\n=== {stage}: accuracy {accuracy:.1%} ({seconds / 60:.1f} min) ===", flush=True)

    cmds = stage_commands(args, run_dir, sft_checkpoint="<after sft>")
    if "base" not in results:
        seconds = run(cmds["tiny_model"], run_dir / "tiny_model.log", stage_env(args))
        accuracy, carries, eval_seconds = evaluate(args, run_dir / "base", run_dir, "base")
        finish("base", accuracy, carries, seconds + eval_seconds)
    if "teacher" not in results:
        start = time.time()
        finish("teacher", *write_teacher_traces(args, run_dir), time.time() - start)
    stages = ["sft", "expert_iter", "grpo", *(["grpo_async"] if args.grpo_async else [])]
    for stage in [*stages, *(("gold_sft", "distill") if args.distill else ())]:
        if stage not in results:
            # they start from the SFT checkpoint
            if stage in ("expert_iter", "grpo", "grpo_async", "distill"):
                teacher = (
                    str(find_one("gold_sft__*/checkpoints/step_*", run_dir))
                    if stage == "distill"
                    else ""
                )
                cmds = stage_commands(
                    args, run_dir, str(find_one("sft__*/checkpoints/step_*", run_dir)), teacher
                )
            seconds = run(cmds[stage], run_dir / f"{stage}.log", stage_env(args))
            checkpoint = find_one(f"{stage}__*/checkpoints/step_*", run_dir)
            accuracy, carries, eval_seconds = evaluate(args, checkpoint, run_dir, stage)
            finish(stage, accuracy, carries, seconds + eval_seconds)
    if args.tools and "tools_teacher" not in results:
        start = time.time()
        finish(
            "tools_teacher", *write_teacher_traces(args, run_dir, tools=True), time.time() - start
        )
    for stage in TOOL_STAGES if args.tools else ():
        if stage not in results:
            sft_checkpoint = "<after tools_sft>"
            if stage == "grpo_tools":
                sft_checkpoint = str(find_one("tools_sft__*/checkpoints/step_*", run_dir))
            cmds = stage_commands(args, run_dir, sft_checkpoint)
            seconds = run(cmds[stage], run_dir / f"{stage}.log", stage_env(args))
            checkpoint = find_one(f"{stage}__*/checkpoints/step_*", run_dir)
            accuracy, carries, eval_seconds = evaluate(args, checkpoint, run_dir, stage)
            finish(stage, accuracy, carries, seconds + eval_seconds)

    # each trained stage against the model it started from, from their evaluation folders (a
    # ladder.json from before the comparisons gets them here too)
    for stage, start in STARTS.items():
        if stage in results and start in results and "comparison" not in results[stage]:
            results[stage]["comparison"] = compare(args, run_dir, stage)
            save()

    print(
        f"\nladder, seed {args.seed}; accuracy on the synthetic test split (greedy; the teacher's: train split)"
    )
    pins = " ".join(f"{k}={v}" for k, v in where["env"].items()) or "unpinned"
    print(f"{where['cpu']} ({' '.join(where['isa'])}), {pins}")
    print(table(results))
    print(f"wrote {results_path} and {plot(run_dir, results)}")
    if "grpo_tools" in results:
        print(f"wrote {plot_tools([run_dir], run_dir / 'ladder_tools.png')}")
    return results


# --- PLUMBING: what of a stage's output the terminal shows (its log keeps it all) ---

# What the libraries print in every stage, which says nothing of the stage: the progress bars of
# tqdm ("Processed prompts:  45%|████▌     | 230/512") and of vLLM's weight loading ("Loading
# safetensors checkpoint shards: 100% Completed | 1/1"), Python's warnings ("dispatcher.py:138:
# FutureWarning: ..."), torch's C++ ones ("[W1128 14:34:26.709 utils.cpp:68] Warning: NUMA
# binding ..."), and vLLM's note that Triton has no CPU backend.
PROGRESS = re.compile(r"\d+%\||\d+% Completed \|")
WARNING = re.compile(r":\d+: [A-Z]\w*Warning: |^\[W\d{4} |^Triton is installed")


def noise_kind(line: str, before: str | None) -> str | None:
    """ "progress" or "warning" if a stage's output line is a library's noise, else None; before:
    the kind of the line before. A Python warning's next line, indented, is its source line; an
    empty line after noise is a progress bar's last redraw: the same kind."""
    if PROGRESS.search(line):
        return "progress"
    if WARNING.search(line):
        return "warning"
    if before and not line.strip():
        return before
    if before == "warning" and line.startswith("  "):
        return before
    return None


if __name__ == "__main__":
    # GiB of KV cache on CPU: plenty for a tiny model
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the engine in-process: faster start on CPU
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM's log would drown the stages' own lines: at INFO, 139 of a ladder's first 300 lines
    # (a ~3,500-character config line at each engine start), 53 of them warnings that every CPU
    # engine start repeats (no tcmalloc, no Triton, eager mode). Errors still show;
    # VLLM_LOGGING_LEVEL=INFO (or WARNING) brings the rest back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    args = tyro.cli(Args, description=DESCRIPTION)
    if args.combine:
        combine([Path(d) for d in args.combine], Path(args.output_dir))
    else:
        main(args)
