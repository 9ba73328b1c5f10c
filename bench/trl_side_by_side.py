"""grpo.py against TRL's GRPOTrainer at the same settings, on the same random model and synthetic prompts.

Both sides: a random-weight model from tiny_model.py (so every run generates about the same amount of work), the
synthetic task's train prompts (template "question") scored by verifiers.score, group size 8, float32, beta 0,
token-mean loss (TRL loss_type="dapo"), constant learning rate, one optimizer step per generation batch, temperature
1, no gradient checkpointing; grpo.py with --no-drop-zero-variance-groups so it trains on every response, as TRL does.
TRL generates with transformers' generate (its best CPU mode). Two sizes, the issue's:

    tiny  the ladder's 4-layer model (0.85M): 256 completions (32 prompts x 8), <= 64 tokens, microbatch 64
    25m   --hidden-size 512 --n-layers 8 ... (25.4M): 128 completions (16 x 8), <= 128 tokens, microbatch 32

TRL runs in its OWN virtual environment (never the project's install; bench/requirements-trl.txt):

    python -m venv .venv-trl && .venv-trl/bin/pip install -r bench/requirements-trl.txt
    python bench/trl_side_by_side.py --trl-python .venv-trl/bin/python          # both sizes, ~10 min on 2 cores
    python bench/trl_side_by_side.py --sizes tiny --steps 3

It prints seconds per step (the median over the steps after the first, which warms up) for each side, split into
generate / score / train / reload for grpo.py (its metrics.jsonl) and generate+score / train for TRL (timed around
its _generate_and_score_completions), and the ratio grpo.py / TRL. The TRL side is this file run with --side trl.
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
sys.path.insert(0, str(ROOT))
import data  # noqa: E402  (stdlib only: importable from TRL's venv too)
import verifiers  # noqa: E402

SIZES = {  # tiny_model.py flags, then batch settings: (prompts, group size, max new tokens, microbatch)
    "tiny": (["--n-layers", "4"], (32, 8, 64, 64)),
    "25m": (["--hidden-size", "512", "--n-layers", "8", "--n-heads", "8", "--n-kv-heads", "4", "--head-dim", "64",
             "--intermediate-size", "1536"], (16, 8, 128, 32)),
}  # fmt: skip
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class Args:
    sizes: list[str] = field(default_factory=lambda: ["tiny", "25m"])
    """keys of SIZES"""
    steps: int = 4
    """steps per side; the first is a warm-up and not counted"""
    trl_python: str = ".venv-trl/bin/python"
    """the python of TRL's own virtual environment"""
    work_dir: str | None = None
    """where the models and runs go (None: a temporary folder)"""
    side: str = "both"
    """both | grpo | trl (trl: run TRL here, in this interpreter, and print one JSON line)"""
    model: str | None = None
    """--side trl: the model folder"""
    size: str = "tiny"
    """--side trl: a key of SIZES (the batch settings)"""
    grpo_args: list[str] = field(default_factory=list)
    """extra grpo.py arguments (e.g. to try an option)"""


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def run_trl(model: str, size: str, steps: int) -> dict:
    """TRL GRPOTrainer, the issue's settings; returns per-step seconds: step, generate (+ score), train."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    n_prompts, group, max_tokens, micro = SIZES[size][1]
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = data.load("synthetic", "train")
    dataset = Dataset.from_list(
        [{"prompt": data.render_prompt(ex, "question", tokenizer), "idx": i} for i, ex in enumerate(examples)]
    )

    def reward(prompts, completions, idx, **kwargs):
        return [verifiers.score(c, examples[i])["reward"] for c, i in zip(completions, idx, strict=True)]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, max_steps=steps, seed=1,
        per_device_train_batch_size=micro, gradient_accumulation_steps=n_prompts * group // micro,  # one step/batch
        num_generations=group, max_completion_length=max_tokens, temperature=1.0, top_p=1.0,
        beta=0.0, loss_type="dapo", num_iterations=1, learning_rate=1e-5, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none",
        gradient_checkpointing=False, dataloader_num_workers=0,
    )  # fmt: skip
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
    trainer = Timed(model=policy, reward_funcs=reward, args=config, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[StepTimer()])  # fmt: skip
    trainer.train()
    times["train"] = [s - g for s, g in zip(times["step"], times["generate"], strict=True)]
    return {"torch_threads": torch.get_num_threads(), **times}


def run_grpo(model: str, size: str, steps: int, out: Path, extra: list[str]) -> dict:
    """grpo.py at the same settings (under flock: one vLLM engine at a time); per-step seconds from metrics.jsonl."""
    n_prompts, group, max_tokens, micro = SIZES[size][1]
    cmd = ["flock", "/tmp/vllm.lock", sys.executable, str(ROOT / "grpo.py"), "--model", model, "--dataset", "synthetic",
           "--template", "question", "--n-grpo-steps", str(steps), "--rollout-batch-size", str(n_prompts * group),
           "--train-batch-size", str(n_prompts * group), "--group-size", str(group), "--microbatch-size", str(micro),
           "--max-tokens", str(max_tokens), "--lr", "1e-5", "--lr-schedule", "constant", "--beta", "0",
           "--loss-aggregation", "token_mean", "--no-drop-zero-variance-groups", "--n-eval", "8",
           "--eval-max-tokens", "8", "--eval-every", "100000", "--save-every", "100000", "--output-dir", str(out),
           *extra]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, **ENGINE_ENV}, stdout=subprocess.DEVNULL)
    (metrics_file,) = out.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics_file.open()][1:]  # [0]: the evaluation at step 0
    return {key: [r[f"time/{key}"] for r in rows] for key in ("generate", "score", "train", "reload")} | {
        "step": [sum(r[f"time/{k}"] for k in ("generate", "score", "train", "reload")) for r in rows]
    }  # the last step's time/step also holds its evaluation: the sum of the phases leaves it out


def main(args: Args) -> list[dict]:
    if args.side == "trl":
        print(json.dumps(run_trl(args.model, args.size, args.steps)))
        return []
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="side_by_side_"))
    rows = []
    for size in args.sizes:
        model = work / f"model-{size}"
        if not (model / "config.json").exists():
            subprocess.run([sys.executable, str(ROOT / "tiny_model.py"), "--out", str(model), *SIZES[size][0]],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        row = {"size": size}
        if args.side in ("both", "grpo"):
            out = work / f"grpo-{size}-{int(time.time())}"
            row["grpo"] = run_grpo(str(model), size, args.steps, out, args.grpo_args)
        if args.side in ("both", "trl"):
            cmd = [args.trl_python, __file__, "--side", "trl", "--model", str(model), "--size", size,
                   "--steps", str(args.steps)]  # fmt: skip
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
            row["trl"] = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print_row(row)
    return rows


def print_row(row: dict) -> None:
    n_prompts, group, max_tokens, micro = SIZES[row["size"]][1]
    print(f"{row['size']}: {n_prompts * group} completions ({n_prompts} x {group}), <= {max_tokens} tokens, "
          f"microbatch {micro}; seconds per step, median of the steps after the first")  # fmt: skip
    cols = {}
    if "trl" in row:
        t = {k: median_after_warmup(v) for k, v in row["trl"].items() if isinstance(v, list)}
        cols["trl"] = t["step"]
        print(f"  TRL      {t['step']:6.2f}  (generate+score {t['generate']:.2f} / train {t['train']:.2f})")
    if "grpo" in row:
        g = {k: median_after_warmup(v) for k, v in row["grpo"].items()}
        cols["grpo"] = g["step"]
        print(f"  grpo.py  {g['step']:6.2f}  (generate {g['generate']:.2f} / score {g['score']:.2f} / "
              f"train {g['train']:.2f} / reload {g['reload']:.2f})")  # fmt: skip
    if len(cols) == 2:
        print(f"  ratio grpo.py / TRL: {cols['grpo'] / cols['trl']:.2f}", flush=True)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
