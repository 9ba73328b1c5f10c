"""A whole grpo.py step, split into generate / score / train / reload from grpo.py's own metrics.jsonl; with
--trl-python, TRL's GRPOTrainer beside it at the same settings, and the ratio grpo.py / TRL.

Both sides: a random-weight model from tiny_model.py (so every run generates about the same amount of work), the
synthetic task's train prompts (template "question") scored by verifiers.score, group size 8, float32, beta 0,
token-mean loss (TRL loss_type="dapo"), constant learning rate, one optimizer step per generation batch, temperature
1, no gradient checkpointing; grpo.py's step run as grpo_family.py --no-drop-zero-variance-groups, so that it
trains on every response, as TRL does.
TRL generates with transformers' generate (its best CPU mode). Two sizes, the issue's (SIZES):

    tiny  the ladder's 4-layer model (0.85M): 256 completions (32 prompts x 8), <= 64 tokens, microbatch 64
    25m   --hidden-size 512 --n-layers 8 ... (25.4M): 128 completions (16 x 8), <= 128 tokens, microbatch 32

From the repository root (every bench runs as a module: `python -m bench.<name>`):

    python -m bench.grpo_step                                    # grpo.py alone, both sizes
    python -m bench.grpo_step --sizes tiny --steps 3 --grpo-args --microbatch-size 16    # try an option
    python -m venv .venv-trl && .venv-trl/bin/pip install -r bench/requirements-trl.txt  # TRL's own environment
    python -m bench.grpo_step --trl-python .venv-trl/bin/python  # both sides, ~10 min on 2 cores

It prints seconds per step, the median over the steps after the first (a warm-up): grpo.py's time/generate,
time/score, time/train and time/reload (the reload and its check), and TRL's generate+score (timed around its
_generate_and_score_completions) and train (the rest of its step). Each grpo.py run starts a vLLM engine: where
engines share a machine, wrap the command in `flock /tmp/vllm.lock`. The standard library only at import: TRL's python
runs this file too (--trl-model), and the other benches take their models and child processes from here.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generate", "score", "train", "reload")
# tiny_model.py flags: the two sizes, and a few-hundred-million-parameter one
# (bench/reload.py)
MODELS = {
    "tiny": ["--n-layers", "4"],
    "25m": [
        "--hidden-size",
        "512",
        "--n-layers",
        "8",
        "--n-heads",
        "8",
        "--n-kv-heads",
        "4",
        "--head-dim",
        "64",
        "--intermediate-size",
        "1536",
    ],
    "300m": [
        "--hidden-size",
        "1024",
        "--n-layers",
        "24",
        "--n-heads",
        "16",
        "--n-kv-heads",
        "8",
        "--head-dim",
        "64",
        "--intermediate-size",
        "3072",
    ],
}
# the rows: prompts, group, max tokens, microbatch
SIZES = {"tiny": (32, 8, 64, 64), "25m": (16, 8, 128, 32)}
# grpo.py's CPU engine, in-process
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class Args:
    sizes: list[str] = field(default_factory=lambda: list(SIZES))
    """keys of SIZES"""
    steps: int = 4
    """steps per side; the first is a warm-up and not counted"""
    work_dir: str | None = None
    """where the models and runs go (None: a temporary folder)"""
    grpo_args: list[str] = field(default_factory=list)
    """extra grpo.py arguments (they override the settings above)"""
    trl_python: str | None = None
    """the python of TRL's own virtual environment (e.g. .venv-trl/bin/python); None: grpo.py
    alone"""
    trl_model: str | None = None
    """run TRL on this model folder here, in this interpreter, and print one JSON line (what TRL's
    python runs)"""
    batch: tuple[int, int, int, int] = SIZES["tiny"]
    """with --trl-model: the batch, a value of SIZES (prompts, group size, max new tokens,
    microbatch)"""


def run(cmd: list[str], env: dict | None = None) -> str:
    """Run cmd in the repository root; its stdout, or an error that shows the end of its stderr."""
    done = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def make_model(work: Path, size: str) -> str:
    """The size's random-weight model (tiny_model.py, seed 0), built once in work/."""
    model = work / f"model-{size}"
    if not (model / "config.json").exists():
        run([sys.executable, "tiny_model.py", "--out", str(model), *MODELS[size]])
    return str(model)


def run_in_own_process(module: str, args: list[str]) -> dict:
    """`python -m module *args` in a fresh process with the engine's environment (one vLLM engine
    per process), and the JSON object it prints on its last line: how reload.py, generate.py and
    overlap.py time one model each."""
    return json.loads(
        run([sys.executable, "-m", module, *args], ENGINE_ENV).strip().splitlines()[-1]
    )


def start_engine(model: str, device: str = "cpu", max_model_len: int = 1024):
    """A vLLM engine in this process, started as grpo.py starts its own: float32 and eager on a CPU
    (no chunked prefill: it fails with seeded sampling there), bf16 on a GPU beside the trainer; a
    sampled token's log-prob as it was sampled. For the benches that time the engine in their own
    process (run_in_own_process)."""
    from vllm import LLM

    common = dict(
        model=model,
        seed=1,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
    )
    if device == "cpu":
        return LLM(**common, dtype="float32", enforce_eager=True, enable_chunked_prefill=False)
    gpu = int(device.split(":")[1]) if ":" in device else 0
    return LLM(**common, dtype="bfloat16", device_ids=[gpu], gpu_memory_utilization=0.3)


def run_grpo(
    model: str, size: str, steps: int, out: Path, extra: list[str] = ()
) -> dict[str, list[float]]:
    """grpo.py at the size's settings; per-step seconds of each phase, and "step", their sum (the
    last step's time/step also holds the final evaluation: the sum leaves it out)."""
    n_prompts, group, max_tokens, micro = SIZES[size]
    run(
        [
            sys.executable,
            # grpo.py's own step, run from grpo_family.py: grpo.py leaves out the groups with no
            # signal, and only the family's --no-drop-zero-variance-groups trains on every
            # response, as TRL does
            "grpo_family.py",
            "--model",
            model,
            "--dataset",
            "synthetic",
            "--template",
            "question",
            "--n-grpo-steps",
            str(steps),
            "--rollout-batch-size",
            str(n_prompts * group),
            "--train-batch-size",
            str(n_prompts * group),
            "--group-size",
            str(group),
            "--microbatch-size",
            str(micro),
            "--max-tokens",
            str(max_tokens),
            "--lr",
            "1e-5",
            "--lr-schedule",
            "constant",
            "--beta",
            "0",
            "--loss-aggregation",
            "token_mean",
            "--no-drop-zero-variance-groups",
            "--n-eval",
            "8",
            "--eval-max-tokens",
            "8",
            "--eval-every",
            "100000",
            "--save-every",
            "100000",
            "--output-dir",
            str(out),
            *extra,
        ],
        ENGINE_ENV,
    )
    (metrics_file,) = out.glob("*/metrics.jsonl")
    # not the evaluation at 0
    rows = [row for row in map(json.loads, metrics_file.open()) if "time/train" in row]
    times = {phase: [r[f"time/{phase}"] for r in rows] for phase in PHASES}
    times["step"] = [sum(phase_times) for phase_times in zip(*times.values(), strict=True)]
    times["response_length"] = [r["rollout/response_length"] for r in rows]
    return times


# the synthetic task's settings (above); bench/real_step.py passes ladder_real.py's
SYNTHETIC = dict(dataset="synthetic", template="question", temperature=1.0, lr=1e-5, data_dir=None)


def run_trl(model: str, batch: tuple, steps: int, task: dict = SYNTHETIC) -> dict[str, list[float]]:
    """TRL GRPOTrainer at these settings, this batch and task (SYNTHETIC's keys); per-step seconds:
    step, generate (+ score), train."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # data.py and verifiers.py need only numpy beside the standard library: TRL's venv has them
    import data
    import verifiers

    n_prompts, group, max_tokens, micro = batch
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = data.load(task["dataset"], "train", task["data_dir"])
    dataset = Dataset.from_list(
        [
            {"prompt": data.render_prompt(ex, task["template"], tokenizer), "idx": i}
            for i, ex in enumerate(examples)
        ]
    )

    def reward(prompts, completions, idx, **kwargs):
        return [
            verifiers.score(c, examples[i])["reward"] for c, i in zip(completions, idx, strict=True)
        ]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=False,
        max_steps=steps,
        seed=1,
        # one step/batch
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n_prompts * group // micro,
        num_generations=group,
        max_completion_length=max_tokens,
        temperature=task["temperature"],
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        num_iterations=1,
        learning_rate=task["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        gradient_checkpointing=False,
        dataloader_num_workers=0,
    )
    times = {"step": [], "generate": []}

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            times["generate"].append(time.perf_counter() - t0)
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times["step"].append(time.perf_counter() - self.t0)

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = Timed(
        model=policy,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer.train()
    times["train"] = [s - g for s, g in zip(times["step"], times["generate"], strict=True)]
    return times


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def describe(size: str) -> str:
    n_prompts, group, max_tokens, micro = SIZES[size]
    return f"{size}: {n_prompts * group} completions ({n_prompts} x {group}), <= {max_tokens} tokens, microbatch {micro}"


def main(args: Args) -> list[dict]:
    if args.trl_model:
        print(json.dumps(run_trl(args.trl_model, args.batch, args.steps)))
        return []
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="grpo_step_"))
    print(
        f"seconds per step, median of steps 2..{args.steps}; load average {os.getloadavg()[0]:.1f}"
    )
    rows = []
    for size in args.sizes:
        model = make_model(work, size)
        times = run_grpo(
            model, size, args.steps, work / f"grpo-{size}-{time.time_ns()}", args.grpo_args
        )
        g = {key: median_after_warmup(values) for key, values in times.items()}
        print(
            f"{describe(size)}\n  grpo.py  {g['step']:6.2f}  (generate {g['generate']:.2f} / score {g['score']:.2f} "
            f"/ train {g['train']:.2f} / reload {g['reload']:.2f}); mean response {g['response_length']:.0f} tokens",
            flush=True,
        )
        row = {"size": size, "grpo": g}
        if args.trl_python:
            trl_run = [
                args.trl_python,
                "-m",
                "bench.grpo_step",
                "--trl-model",
                model,
                "--batch",
                *map(str, SIZES[size]),
                "--steps",
                str(args.steps),
            ]
            t = {
                k: median_after_warmup(v)
                for k, v in json.loads(run(trl_run).strip().splitlines()[-1]).items()
            }
            print(
                f"  TRL      {t['step']:6.2f}  (generate+score {t['generate']:.2f} / train {t['train']:.2f})\n"
                f"  ratio grpo.py / TRL: {g['step'] / t['step']:.2f}",
                flush=True,
            )
            row["trl"] = t
        rows.append(row)
    return rows


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
