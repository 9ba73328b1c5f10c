"""Evaluate a model or checkpoint on GSM8K, MATH, MATH-500, MBPP, HumanEval, IFEval or the synthetic task,
with vLLM; or on the whole baseline suite at once (--suite).

For every problem: render the prompt with one of data.py's templates, sample `n` responses (greedy by default),
score each with verifiers.score, and write one JSONL line. Then `summarize` turns those lines into the metrics:
  accuracy       mean reward over all samples (= pass@1, averaged over problems)
  pass@k         unbiased estimator of Chen et al. 2021 ("Evaluating LLMs trained on code", the Codex paper)
  maj@k          majority vote over the extracted answers of the first k samples (ties: see `majority_vote`)
  format_rate    share of samples whose strict answer could be extracted; and the breakdown of all samples
                 into correct / formatted but wrong / unformatted (the three counts sum to problems x n)
  truncated_rate share of samples cut off by --max-tokens (a high value means the budget is too small)
  by_level, by_subject   accuracy per MATH level and subject (MATH and MATH-500)
  strict / flexible      GSM8K only: lm-evaluation-harness's "strict-match" and "flexible-extract" accuracies
For code (MBPP, HumanEval) a sample is correct iff its program passes every test in the sandbox (verifiers.py),
"formatted" iff it compiles, and maj@k votes on identical programs.
  prompt_level_*, inst_level_*, by_type   IFEval only (lm-eval's four numbers, then each instruction type's
                 strict and loose accuracy); pass@k and maj@k are left out, as there is no answer to vote on

Matching lm-evaluation-harness's `gsm8k` task (vLLM, greedy): use --template gsm8k_kshot --n-shot K
--max-tokens 256 (lm-eval's default max_gen_toks). The prompt ("Question: ...\\nAnswer:", shots joined by
blank lines, stop at "Question:") is lm-eval's; strict = its "strict-match", flexible = its "flexible-extract".
On the test split each question gets the shots lm-eval draws for it (data.lm_eval_fewshot); on the others, the
first K train rows. One known difference: our strict reader takes the last "####" (lm-eval the first; equal when
generation stops at "Question:"), and normalises numbers its own way. Expect numbers within a point, not identical.
lm-eval's `mbpp` (3-shot) is --template mbpp_kshot --max-tokens 256; its `humaneval` (0-shot) is --template
humaneval --max-tokens 1024 (greedy: lm-eval's humaneval-greedy; its default samples). Its `hendrycks_math` (4-shot)
is --dataset math --template hendrycks_math_kshot --n-shot 4 --max-tokens 256: lm-eval's prompt and shots exactly,
its answer span (between the first and last "$"), and our MATH verifier's comparison (`hendrycks_math_score`).

--suite runs all of these (SUITE: GSM8K 0/4/8-shot, MATH 4-shot, IFEval, MBPP 3-shot, HumanEval) with one engine,
writes each benchmark's samples.jsonl and summary.json in its own folder, and prints our numbers next to
Qwen3-1.7B-Base's lm-eval numbers. docs/eval.md, "Reference numbers", says how each row differs from lm-eval's.

Deliberately left out:
  1. Symbolic equivalence for MATH (sympy / math_verify): see verifiers.py for why; the reward is exact match.
  2. Data parallelism: one engine; use --tensor-parallel-size for models that do not fit one GPU.

Usage:
    python tiny_model.py --out runs/tiny-qwen3   # a tiny random model, for trying this on a CPU
    python eval.py --model runs/tiny-qwen3 --dataset synthetic --split test --limit 32 --n 4 --k 1 2 4 \\
        --temperature 1.0 --max-tokens 64
    python eval.py --model Qwen/Qwen3-1.7B-Base --dataset gsm8k --split test --template gsm8k_kshot --n-shot 8 \\
        --max-tokens 256
    python eval.py --model Qwen/Qwen3-1.7B-Base --dataset mbpp --data-dir ../shared/data --template mbpp_kshot \\
        --max-tokens 256
    python eval.py --model Qwen/Qwen3-1.7B-Base --dataset humaneval --data-dir ../shared/data \\
        --template humaneval --max-tokens 1024
    python eval.py --model Qwen/Qwen3-1.7B-Base --dataset ifeval --data-dir ../shared/data --template question \\
        --max-tokens 1280   # lm-eval's ifeval: 0-shot, greedy; prompt/instruction-level strict and loose
    python eval.py --model runs/sft__1__1763700000/checkpoints/step_000200 --dataset gsm8k --template r1_zero \\
        --n 8 --k 1 4 8 --temperature 1.0   # a checkpoint of sft.py: pass@k and maj@k from 8 samples
    python eval.py --suite --model Qwen/Qwen3-1.7B-Base --data-dir ../shared/data   # the baseline suite, one table
"""

import json
import os
import re
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import tyro

import data
import verifiers


@dataclass
class Args:
    # --- run ---
    suite: bool = False
    """evaluate on the whole baseline suite (SUITE) in one engine start and print one table next to Qwen3-1.7B-Base's
    lm-eval numbers; each row sets its own dataset, split, template, n_shot and max_tokens"""
    out_dir: str = "results"
    """folder to create the results folder in: <out_dir>/<model>__<dataset>_<split>__<template>__<unix time>/"""
    seed: int = 0
    """seed of the engine's sampler"""
    # --- model ---
    model: str = "Qwen/Qwen3-1.7B-Base"
    """Hugging Face model name, or a local checkpoint folder (one with a config.json)"""
    # --- data ---
    dataset: str = "gsm8k"
    """gsm8k | math | math500 | synthetic | mbpp | mbpp_sanitized | humaneval | ifeval"""
    split: str = "test"
    """gsm8k, synthetic: train/val/test; math, ifeval: train/test; math500, humaneval: test;
    mbpp, mbpp_sanitized: train/val/test/prompt"""
    data_dir: str | None = None
    """data root with one folder per dataset (e.g. ../shared/data: gsm8k/, math/, mbpp/, ...); None: the hub"""
    limit: int | None = None
    """evaluate only the first N problems of the split (None: all); with --suite, of each benchmark"""
    template: str = "r1_zero"
    """prompt template: r1_zero | question | chat | gsm8k_kshot | mbpp_kshot | humaneval | hendrycks_math_kshot"""
    n_shot: int = 8
    """number of exemplars in the prompt: GSM8K train rows (gsm8k_kshot), MBPP tasks 2, 3, 4 (mbpp_kshot, at most 3),
    MATH train problems drawn per problem as lm-eval does (hendrycks_math_kshot, MATH test only)"""
    # --- sampling ---
    n: int = 1
    """responses sampled per problem"""
    k: tuple[int, ...] = (1,)
    """values of k for pass@k and maj@k (each <= n), e.g. --k 1 4 8"""
    temperature: float = 0.0
    """sampling temperature; 0 is greedy"""
    top_p: float = 1.0
    """nucleus sampling: keep the smallest set of tokens with this much probability"""
    max_tokens: int | None = None
    """most tokens generated per response (None: 1024; lm-eval's default is 256); with --suite, None keeps each row's
    lm-eval setting and a number caps every row (quick CPU runs, not comparable with the reference)"""
    # --- engine ---
    max_model_len: int | None = None
    """most tokens of prompt + response the engine accepts (None: the model's own limit)"""
    gpu_memory_utilization: float = 0.9
    """fraction of each GPU's memory the engine may take (weights + KV cache)"""
    tensor_parallel_size: int = 1
    """GPUs to shard the model over"""


# The baseline suite: Qwen3-1.7B-Base's lm-evaluation-harness results (%, vLLM, greedy) and our setting for each
# (docs/eval.md, "Reference numbers": how each differs from lm-eval's). Row: (name, dataset, template, n_shot,
# max_tokens, {metric: reference}).
SUITE = [
    ("gsm8k_0shot", "gsm8k", "gsm8k_kshot", 0, 256, {"eval/flexible_accuracy": 14.71, "eval/strict_accuracy": 0.00}),
    ("gsm8k_4shot", "gsm8k", "gsm8k_kshot", 4, 256, {"eval/flexible_accuracy": 67.48, "eval/strict_accuracy": 59.14}),
    ("gsm8k_8shot", "gsm8k", "gsm8k_kshot", 8, 256, {"eval/flexible_accuracy": 69.60, "eval/strict_accuracy": 68.92}),
    ("math_4shot", "math", "hendrycks_math_kshot", 4, 256, {"eval/accuracy": 17.68}),
    ("ifeval", "ifeval", "question", 0, 1280,
     {"eval/prompt_level_strict_acc": 22.00, "eval/inst_level_strict_acc": 33.81}),
    ("mbpp_3shot", "mbpp", "mbpp_kshot", 3, 256, {"eval/pass@1": 55.8}),
    ("humaneval_0shot", "humaneval", "humaneval", 0, 1024, {"eval/pass@1": 48.78}),
]  # fmt: skip


# --- metrics: pure functions of the per-problem records ---


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_vote(answers: list[str | None]) -> str | None:
    """The most frequent answer; None only if no answer was extracted.

    None (unextracted) never wins. Ties go to the tied answer that appears first in sample order
    (Counter keeps first-seen order and max returns the first maximum). The result is deterministic.
    """
    counts = Counter(answer for answer in answers if answer is not None)
    return max(counts, key=counts.get) if counts else None


def summarize(records: list[dict], ks: tuple[int, ...] = (1,)) -> dict:
    """All metrics, from the per-problem records alone (each with "rewards": n reward dicts, see main)."""
    rewards = [r for record in records for r in record["rewards"]]
    correct = [r["reward"] == 1.0 for r in rewards]
    formatted = [r["format_reward"] == 1.0 for r in rewards]
    metrics = {
        "eval/n_problems": len(records),
        "eval/n_samples": len(rewards),
        "eval/accuracy": float(np.mean(correct)),
        "eval/format_rate": float(np.mean(formatted)),
        # A partition of all samples: correct, else formatted but wrong, else unformatted.
        "eval/n_correct": sum(correct),
        "eval/n_formatted_wrong": sum(f and not c for c, f in zip(correct, formatted, strict=True)),
        "eval/n_unformatted": sum(not f and not c for c, f in zip(correct, formatted, strict=True)),
        "eval/truncated_rate": float(np.mean([f == "length" for rec in records for f in rec["finish_reasons"]])),
        "eval/mean_response_tokens": float(np.mean([t for rec in records for t in rec["n_tokens"]])),
    }
    if all("strict" in r for r in rewards):  # IFEval: lm-eval's four numbers, then each instruction type's
        metrics.update(ifeval_metrics(records))
        return metrics
    for k in ks:
        pass_k, maj_k = [], []
        for record in records:
            n, c = len(record["rewards"]), sum(r["reward"] == 1.0 for r in record["rewards"])
            pass_k.append(pass_at_k(n, c, k))
            first_k = record["rewards"][:k]
            winner = majority_vote([r["extracted"] for r in first_k])
            # Samples with equal `extracted` have equal rewards: the first with the winning answer speaks for all.
            maj_k.append(winner is not None and next(r for r in first_k if r["extracted"] == winner)["reward"] == 1.0)
        metrics[f"eval/pass@{k}"] = float(np.mean(pass_k))
        metrics[f"eval/maj@{k}"] = float(np.mean(maj_k))
    if all("flexible_reward" in r for r in rewards):  # GSM8K: the two lm-eval filters
        metrics["eval/strict_accuracy"] = metrics["eval/accuracy"]
        metrics["eval/flexible_accuracy"] = float(np.mean([r["flexible_reward"] == 1.0 for r in rewards]))
    for key in ("level", "subject"):  # MATH, MATH-500: accuracy of the samples in each group
        groups = defaultdict(list)
        for record in records:
            if key in record:
                groups[record[key]].extend(r["reward"] == 1.0 for r in record["rewards"])
        for group in sorted(groups, key=str):
            metrics[f"eval/by_{key}/{group}"] = float(np.mean(groups[group]))
    return metrics


def ifeval_metrics(records: list[dict]) -> dict:
    """lm-eval's ifeval metrics over all samples: prompt level (all instructions followed) and instruction level
    (each instruction counted once), strict and loose; then instruction-level accuracy per instruction type."""
    metrics, by_type = {}, defaultdict(list)
    for mode in ("strict", "loose"):
        verdicts = [r[mode] for record in records for r in record["rewards"]]
        metrics[f"eval/prompt_level_{mode}_acc"] = float(np.mean([all(v) for v in verdicts]))
        metrics[f"eval/inst_level_{mode}_acc"] = float(np.mean([x for v in verdicts for x in v]))
    for record in records:
        for r in record["rewards"]:
            ids = record["answer"]["instruction_id_list"]
            for instruction_id, verdicts in zip(ids, zip(r["strict"], r["loose"], strict=True), strict=True):
                by_type[instruction_id].append(verdicts)
    for instruction_id in sorted(by_type):
        strict, loose = np.mean(by_type[instruction_id], axis=0)
        metrics[f"eval/by_type/{instruction_id}/strict"] = float(strict)
        metrics[f"eval/by_type/{instruction_id}/loose"] = float(loose)
    return metrics


def format_table(metrics: dict) -> str:
    """One metric per line: counts as integers, rates as percentages."""
    lines, width = [], max(map(len, metrics)) + 1
    for key, value in metrics.items():
        is_rate = isinstance(value, float) and not key.endswith("tokens") and not key.startswith("time/")
        lines.append(f"{key:<{width}} {100 * value:8.2f}%" if is_rate else f"{key:<{width}} {value:9.6g}")
    return "\n".join(lines)


# --- checks and the engine ---


def validate(args: Args) -> None:
    """Every error a typo can cause, raised before any data is downloaded or any engine starts."""
    model = Path(args.model).expanduser()
    # A hub name is "org/name"; anything that starts like a path, exists here, or has more parts is a local folder.
    looks_local = args.model.startswith((".", "/", "~")) or Path(args.model.split("/")[0]).exists()
    looks_local = looks_local or args.model.count("/") > 1
    if looks_local and not (model / "config.json").is_file():
        raise ValueError(f"model {args.model!r} looks like a local path, but {model / 'config.json'} does not exist")
    if args.dataset not in data.SPLITS:
        raise ValueError(f"unknown dataset {args.dataset!r}; choose from {list(data.SPLITS)}")
    if args.split not in data.SPLITS[args.dataset]:
        raise ValueError(f"dataset {args.dataset!r} has no split {args.split!r}; it has {data.SPLITS[args.dataset]}")
    if args.template not in data.TEMPLATES:
        raise ValueError(f"unknown template {args.template!r}; choose from {list(data.TEMPLATES)}")
    for template, datasets in (("mbpp_kshot", ("mbpp", "mbpp_sanitized")), ("humaneval", ("humaneval",))):
        if (args.template == template) != (args.dataset in datasets):
            raise ValueError(f"template {args.template!r} does not fit dataset {args.dataset!r}")
    if args.template == "hendrycks_math_kshot" and (args.dataset, args.split) != ("math", "test"):
        raise ValueError(f"template 'hendrycks_math_kshot' is for the math test split, not {args.dataset}/{args.split}")
    if args.n < 1 or args.n_shot < 0 or (args.limit is not None and args.limit < 1):
        raise ValueError(f"need n >= 1, n_shot >= 0, limit >= 1; got n={args.n}, n_shot={args.n_shot}, {args.limit=}")
    for k in args.k:
        if not 1 <= k <= args.n:
            raise ValueError(f"k={k} must be between 1 and n={args.n} (pass@k and maj@k use k of the n samples)")
    if args.n > 1 and args.temperature == 0:
        raise ValueError(f"n={args.n} greedy samples would be {args.n} copies of one response; set --temperature")


def start_engine(args: Args):
    """A vLLM engine in this process: bf16 on GPU; float32 without CUDA graphs on CPU (starts in seconds)."""
    import torch

    on_gpu = torch.cuda.is_available()
    # Read at engine start. In-process engine: deterministic, no worker processes to spawn.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not on_gpu:  # otherwise the CPU engine claims half the machine's memory for its KV cache (GiB)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(
        model=args.model,
        dtype="bfloat16" if on_gpu else "float32",
        enforce_eager=not on_gpu,  # CUDA graphs pay off on GPU; on CPU compiling costs ~1 min for nothing
        seed=args.seed,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def load_examples(args: Args) -> tuple[list[dict], list[list[dict] | None]]:
    """The problems, and for each problem its shots (None for a template without shots)."""
    examples = data.load(args.dataset, args.split, args.data_dir)[: args.limit]
    per_question = {"gsm8k_kshot": data.gsm8k_lm_eval_fewshot, "hendrycks_math_kshot": data.math_fewshot}
    if args.template in per_question and args.split == "test":  # lm-eval's test shots: drawn per question
        shots = per_question[args.template](args.n_shot, args.data_dir)
        return examples, [shots[ex["id"]] for ex in examples]
    fewshot = None
    if args.template == "gsm8k_kshot":
        fewshot = data.gsm8k_fewshot(args.n_shot, args.data_dir)
    if args.template == "mbpp_kshot":
        fewshot = data.mbpp_fewshot(args.data_dir)[: args.n_shot]
    return examples, [fewshot] * len(examples)


def hendrycks_math_score(response: str, example: dict) -> dict:
    """The MATH reward for "hendrycks_math_kshot", whose answers come bare (" $\\frac{1}{2}$"). The answer is what
    lm-eval's hendrycks_math reads: the text between the first and the last "$", else the whole response. Our MATH
    verifier compares it with the gold (handed over in answer tags, which it reads first); lm-eval compares strings
    after its own normalisation (docs/eval.md, "Reference numbers": where the two differ)."""
    dollars = [i for i, char in enumerate(response) if char == "$"]
    span = response[dollars[0] + 1 : dollars[-1]] if len(dollars) > 1 else response
    return verifiers.score(f"<answer>{span}</answer>", example)


def evaluate(llm, args: Args, examples: list[dict], shots: list) -> tuple[list[dict], dict]:
    """Generate n responses per problem and score them: one record per problem, and the times taken."""
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    prompts = [data.render_prompt(ex, args.template, tokenizer, s) for ex, s in zip(examples, shots, strict=True)]
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        stop=data.stop_strings(args.template),
        include_stop_str_in_output=args.template == "r1_zero",  # keep "</answer>": the verifier needs the tag closed
    )
    start = time.time()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    generate_s = time.time() - start

    # Score every response (in one batch: programs run in a pool, one per core); one record per problem.
    texts = [[sample.text for sample in output.outputs] for output in outputs]  # n completions each, in sample order
    start = time.time()
    flat_texts, flat_examples = [t for group in texts for t in group], [ex for ex in examples for _ in range(args.n)]
    if args.template == "hendrycks_math_kshot":
        flat = [hendrycks_math_score(t, ex) for t, ex in zip(flat_texts, flat_examples, strict=True)]
    else:
        flat = verifiers.score_batch(flat_texts, flat_examples)
    score_s = time.time() - start
    records = []
    for i, (example, prompt, output) in enumerate(zip(examples, prompts, outputs, strict=True)):
        samples = output.outputs
        record = {"id": example["id"], "prompt": prompt, "answer": example["answer"]}
        record.update({key: example[key] for key in ("level", "subject") if key in example})  # MATH only
        record["responses"] = texts[i]
        record["rewards"] = flat[i * args.n : (i + 1) * args.n]
        record["n_tokens"] = [len(sample.token_ids) for sample in samples]
        record["finish_reasons"] = [sample.finish_reason for sample in samples]  # "stop" or "length"
        records.append(record)
    return records, {"time/generate_s": generate_s, "time/score_s": score_s}


def write_results(run_dir: Path, args: Args, records: list[dict], metrics: dict) -> None:
    run_dir.mkdir(parents=True)
    with open(run_dir / "samples.jsonl", "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"args": asdict(args), "metrics": metrics}, indent=2) + "\n")


def model_name(args: Args) -> str:
    """The last 3 path parts, so a checkpoint keeps its run's name: "sft__1__1763700000_checkpoints_step_000200"."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "_".join(Path(args.model).parts[-3:])).strip("_")


def main(args: Args) -> Path:
    """Evaluate and write samples.jsonl and summary.json; returns the results folder."""
    if args.suite:
        return run_suite(args)
    args = replace(args, max_tokens=args.max_tokens or 1024)
    # 1. Check the arguments and load the data, so a mistake fails in seconds and not after the engine started.
    validate(args)
    examples, shots = load_examples(args)

    # 2. Generate n responses per problem and score them.
    start = time.time()
    llm = start_engine(args)
    engine_start_s = time.time() - start
    records, times = evaluate(llm, args, examples, shots)

    # 3. Metrics, files, table.
    metrics = {**summarize(records, args.k), "time/engine_start_s": engine_start_s, **times}
    template = f"{args.template}{len(shots[0])}" if shots and shots[0] is not None else args.template
    run_dir = Path(args.out_dir) / f"{model_name(args)}__{args.dataset}_{args.split}__{template}__{int(time.time())}"
    write_results(run_dir, args, records, metrics)
    print(f"{args.model} on {args.dataset}/{args.split}, template {template}, n={args.n}, T={args.temperature}")
    print(format_table(metrics))
    print(f"wrote {run_dir}/samples.jsonl and summary.json")
    return run_dir


def run_suite(args: Args) -> Path:
    """Every SUITE row with one engine: <out_dir>/<model>__suite__<time>/<row>/{samples.jsonl,summary.json}."""
    rows = [
        replace(args, suite=False, dataset=dataset, split="test", template=template, n_shot=n_shot,
                max_tokens=args.max_tokens or max_tokens)
        for _, dataset, template, n_shot, max_tokens, _ in SUITE
    ]  # fmt: skip
    for row in rows:  # every mistake before the engine starts
        validate(row)
    loaded = [load_examples(row) for row in rows]
    start = time.time()
    llm = start_engine(args)
    engine_start_s = time.time() - start
    suite_dir = Path(args.out_dir) / f"{model_name(args)}__suite__{int(time.time())}"
    table = []  # (row name, metric, ours, reference)
    for (name, *_, references), row, (examples, shots) in zip(SUITE, rows, loaded, strict=True):
        records, times = evaluate(llm, row, examples, shots)
        metrics = {**summarize(records, row.k), **times}
        write_results(suite_dir / name, row, records, metrics)
        table += [(name, key, 100 * metrics[key], reference) for key, reference in references.items()]
    (suite_dir / "suite.json").write_text(json.dumps({"args": asdict(args), "engine_start_s": engine_start_s,
                                                      "table": table}, indent=2) + "\n")  # fmt: skip
    print(f"{args.model}: the baseline suite, {'first ' + str(args.limit) if args.limit else 'all'} problems each")
    print(f"{'benchmark':<16} {'metric':<30} {'ours':>7} {'Qwen3-1.7B-Base (lm-eval)':>26}")
    for name, key, ours, reference in table:
        print(f"{name:<16} {key:<30} {ours:7.2f} {reference:26.2f}")
    print(f"wrote {suite_dir}/<benchmark>/samples.jsonl and summary.json, and {suite_dir}/suite.json")
    return suite_dir


if __name__ == "__main__":
    main(tyro.cli(Args))
