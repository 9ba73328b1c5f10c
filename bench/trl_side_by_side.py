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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from grpo_step import SIZES, describe, make_model, median_after_warmup, run_grpo  # noqa: E402

import data  # noqa: E402  (these three import only the standard library: TRL's venv has them too)
import verifiers  # noqa: E402


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


def main(args: Args) -> list[dict]:
    if args.side == "trl":
        print(json.dumps(run_trl(args.model, args.size, args.steps)))
        return []
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="side_by_side_"))
    rows = []
    for size in args.sizes:
        model = make_model(work, size)
        row = {"size": size}
        if args.side in ("both", "grpo"):
            row["grpo"] = run_grpo(model, size, args.steps, work / f"grpo-{size}-{time.time_ns()}", args.grpo_args)
        if args.side in ("both", "trl"):
            cmd = [args.trl_python, __file__, "--side", "trl", "--model", model, "--size", size,
                   "--steps", str(args.steps)]  # fmt: skip
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
            row["trl"] = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print_row(row)
    return rows


def print_row(row: dict) -> None:
    print(f"{describe(row['size'])}; seconds per step, median of the steps after the first")
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
