"""Evaluate a model or checkpoint on GSM8K, MATH, MATH-500, MBPP, HumanEval, IFEval or the
synthetic task, with vLLM or an OpenAI-compatible server; or on the whole baseline suite (--suite).

For every problem: render the prompt with one of data.py's templates, sample `n` responses (greedy
by default), score each with verifiers.score, and write one JSONL line. Then `summarize` turns those
lines into the metrics:
  accuracy          mean reward over all samples (= pass@1, averaged over problems)
  pass@k            the unbiased estimator of Chen et al. 2021 (the Codex paper)
  maj@k             majority vote over the extracted answers of the first k samples
  format_rate       share of samples whose strict answer could be extracted; and the counts of
                    correct / formatted but wrong / unformatted samples (they sum to problems x n)
  truncation_rate   share of samples cut off by --max-tokens (if high, the budget is too small)
  response_length   mean tokens per sample
  by_level, by_subject   MATH and MATH-500: accuracy per level and subject
  strict / flexible      GSM8K: lm-evaluation-harness's "strict-match" and "flexible-extract"
  prompt_level_*, inst_level_*, by_type   IFEval: lm-eval's four numbers and each instruction
                    type's strict and loose accuracy (no pass@k or maj@k: no answer to vote on)
  distinct_answers, distinct_responses   at n > 1: the share of distinct final answers and of
                    distinct responses among a problem's samples (1/n: all alike, 1: all differ)
Each rate that is a mean over problems (accuracy, format rate, pass@k, maj@k, GSM8K's two, IFEval's
four) has beside it its standard error (lm-eval's: the sample standard deviation of the
per-problem scores / sqrt(problems)) and a seeded bootstrap 95% interval over problems
(--bootstrap resamples): <key>_stderr, <key>_ci_low, <key>_ci_high.
For code (MBPP, HumanEval) a sample is correct iff its program passes every test in the sandbox,
"formatted" iff it compiles, and maj@k votes on identical programs.

--compare RUN_A RUN_B evaluates nothing: it reads two results folders of the same problems and
template, and prints A - B of each rate with its paired standard error and bootstrap interval, and
the problems only A and only B solved (McNemar's exact test).

The k-shot templates reproduce lm-eval's tasks (gsm8k, mbpp, humaneval, hendrycks_math), and --suite
runs them all with one engine beside Qwen3-1.7B-Base's lm-eval numbers: docs/eval.md has the
settings that match lm-eval and how each row still differs.

Deliberately left out:
  1. Symbolic equivalence for MATH (sympy / math_verify): the reward is exact match after
     normalisation (docs/tasks.md says why).
  2. Data parallelism: one engine; --tensor-parallel-size for models that do not fit one GPU.

Usage:
    python tiny_model.py --out runs/tiny-qwen3   # a tiny random model, to try this on a CPU
    python eval.py --model runs/tiny-qwen3 --dataset synthetic --split test --limit 32 \\
        --n 4 --k 1 2 4 --temperature 1.0 --max-tokens 64
    python eval.py --model Qwen/Qwen3-1.7B-Base --dataset gsm8k --split test \\
        --template gsm8k_kshot --n-shot 8 --max-tokens 256   # lm-eval's gsm8k, 8-shot
    python eval.py --model runs/sft__1__1763700000/checkpoints/step_000200 --dataset gsm8k \\
        --template r1_zero --n 8 --k 1 4 8 --temperature 1.0   # pass@k and maj@k from 8 samples
    python eval.py --suite --model Qwen/Qwen3-1.7B-Base --data-dir ../shared/data
    python eval.py --compare results/<new run> results/<old run>   # new - old, paired
"""

import asyncio
import json
import math
import os
import random
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
import tyro

import data
import verifiers


@dataclass
class Args:
    # --- run ---
    suite: bool = False
    """evaluate on the whole baseline suite (SUITE) in one engine start and print one table next to
    Qwen3-1.7B-Base's lm-eval numbers; each row sets its own dataset, split, template, n_shot and
    max_tokens"""
    out_dir: str = "results"
    """folder to create the results folder in:
    <out_dir>/<model>__<dataset>_<split>__<template>__<unix time>/"""
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
    """data root with one folder per dataset (e.g. ../shared/data: gsm8k/, math/, mbpp/, ...); None:
    the hub"""
    limit: int | None = None
    """evaluate only the first N problems of the split (None: all); with --suite, of each
    benchmark"""
    template: str = "r1_zero"
    """prompt template: r1_zero | question | chat | gsm8k_kshot | mbpp_kshot | humaneval |
    hendrycks_math_kshot"""
    n_shot: int = 8
    """number of exemplars in the prompt: GSM8K train rows (gsm8k_kshot), MBPP tasks 2, 3, 4
    (mbpp_kshot, at most 3), MATH train problems drawn per problem as lm-eval does
    (hendrycks_math_kshot, MATH test only)"""
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
    """most tokens generated per response (None: 1024; lm-eval's default is 256); with --suite, None
    keeps each row's lm-eval setting and a number caps every row (quick CPU runs, not comparable
    with the reference)"""
    # --- tools (as grpo_tools.py trains) ---
    tools: bool = False
    """generate through the tool loop: the prompt offers the template's tool (data.TOOL_PROTOCOLS),
    calls run in the sandbox, samples.jsonl shows each turn; --max-tokens counts tool tokens too"""
    max_tool_calls: int = 4
    """with --tools: calls per response, at most"""
    max_tool_output_tokens: int = 64
    """with --tools: a tool's output is cut to its first this many tokens"""
    tool_timeout_s: float = 5.0
    """with --tools: wall clock per call in the sandbox"""
    # --- engine ---
    max_model_len: int | None = None
    """most tokens of prompt + response the engine accepts (None: the model's own limit)"""
    gpu_memory_utilization: float = 0.9
    """fraction of each GPU's memory the engine may take (weights + KV cache)"""
    tensor_parallel_size: int = 1
    """GPUs to shard the model over"""
    # --- or a server instead of a local engine (a hosted teacher, or `vllm serve` elsewhere) ---
    api_base: str | None = None
    """generate through the server at this URL (e.g. https://api.deepseek.com/v1,
    http://127.0.0.1:8000/v1)"""
    api_model: str | None = None
    """the server's name of the model (required with --api-base)"""
    api_endpoint: str = "chat"
    """chat: the prompt as a user message (a reasoning server's thinking goes in the template's
    think section); completions: the rendered prompt as it is, as the local engine gets it"""
    api_key_env: str = "OPENAI_API_KEY"
    """the environment variable that holds the key (unset: no key is sent); the key is never written
    anywhere"""
    concurrency: int = 4
    """requests in flight"""
    request_timeout: float = 600.0
    """seconds a request may take before it is retried"""
    max_retries: int = 5
    """retries of a request (429, 5xx, timeouts, dropped connections, malformed answers) before its
    problem fails"""
    resume: str | None = None
    """a results folder of an --api-base run: keep its finished problems, ask again for the
    others"""
    # --- a judge beside the verifier: how often does it agree with the rule? ---
    judge_base_url: str | None = None
    """grade every sample also by the judge model at this OpenAI-compatible URL (e.g.
    http://127.0.0.1:8001/v1) and compare its verdicts with the verifier's (docs/eval.md, "How good
    is a judge?")"""
    judge_model: str | None = None
    """the judge server's name of its model (required with --judge-base-url)"""
    judge_api_key_env: str = "JUDGE_API_KEY"
    """the environment variable that holds the judge's key (unset: no key is sent)"""
    judge_rubric: str | None = None
    """a text file with the rubric for every problem (None: the dataset's, data.JUDGE_RUBRICS)"""
    judge_concurrency: int = 8
    """judge calls in flight"""
    judge_timeout_s: float = 60.0
    """seconds a judge call may take before it is retried"""
    judge_structured: str = "choice"
    """how the verdict is asked for: choice (vLLM's structured_outputs), json_schema (OpenAI's
    response_format) or none (plain text); a server that refuses one gets the next"""
    judge_threshold: float = 0.5
    """a verdict at or above this counts as "right" against the verifier's reward of 1"""
    # --- output ---
    save_sft_pairs: str | None = None
    """write every sample the verifier accepts (reward 1) to this JSONL file, as sft.py --sft-file
    reads it"""
    # --- uncertainty, and two runs compared ---
    bootstrap: int = 1000
    """resamples of the problems for each rate's 95% bootstrap interval, seeded by --seed (0: no
    interval; the standard errors are always given)"""
    compare: tuple[str, str] | None = None
    """RUN_A RUN_B: two results folders of the same problems and template; print A - B of each rate
    with its paired standard error and interval, and McNemar's test (nothing is evaluated)"""
    compare_out: str | None = None
    """with --compare: also write the comparison to this JSON file"""


# The baseline suite: Qwen3-1.7B-Base's lm-evaluation-harness results (%, vLLM, greedy) as reported
# in the field notes the project started from (shared/FIELD_NOTES.md, "Numbers worth knowing"; not
# measured here, lm-eval version unrecorded), and our setting for each (docs/eval.md, "Reference
# numbers": how each differs from lm-eval's). Row: (name, dataset, template, n_shot, max_tokens,
# {metric: reference}).
SUITE = [
    (
        "gsm8k_0shot",
        "gsm8k",
        "gsm8k_kshot",
        0,
        256,
        {"eval/flexible_accuracy": 14.71, "eval/strict_accuracy": 0.00},
    ),
    (
        "gsm8k_4shot",
        "gsm8k",
        "gsm8k_kshot",
        4,
        256,
        {"eval/flexible_accuracy": 67.48, "eval/strict_accuracy": 59.14},
    ),
    (
        "gsm8k_8shot",
        "gsm8k",
        "gsm8k_kshot",
        8,
        256,
        {"eval/flexible_accuracy": 69.60, "eval/strict_accuracy": 68.92},
    ),
    ("math_4shot", "math", "hendrycks_math_kshot", 4, 256, {"eval/accuracy": 17.68}),
    (
        "ifeval",
        "ifeval",
        "question",
        0,
        1280,
        {"eval/prompt_level_strict_acc": 22.00, "eval/inst_level_strict_acc": 33.81},
    ),
    ("mbpp_3shot", "mbpp", "mbpp_kshot", 3, 256, {"eval/pass@1": 55.8}),
    ("humaneval_0shot", "humaneval", "humaneval", 0, 1024, {"eval/pass@1": 48.78}),
]


# --- metrics: pure functions of the per-problem records ---


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al.
    2021).

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


def summarize(
    records: list[dict], ks: tuple[int, ...] = (1,), n_bootstrap: int = 1000, seed: int = 0
) -> dict:
    """All metrics, from the per-problem records alone (each with "rewards": n reward dicts, see
    main). Each rate that problem_scores gives per problem has its standard error and 95%
    bootstrap interval beside it (with_uncertainty; n_bootstrap resamples, 0: no interval)."""
    scores = problem_scores(records, ks)
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
    }
    # the names of the training scripts' evaluation (data.eval_metrics), for the same quantities
    truncated = [f == "length" for record in records for f in record["finish_reasons"]]
    metrics["eval/truncation_rate"] = float(np.mean(truncated))
    n_tokens = [n for record in records for n in record["n_tokens"]]
    metrics["eval/response_length"] = float(np.mean(n_tokens))
    is_ifeval = all("strict" in r for r in rewards)
    # Collapse (grpo-gsm8k's metric): 1/n where a problem's n samples are all alike, 1 where all
    # differ. IFEval extracts no answer, so only its responses are counted.
    if max(len(record["rewards"]) for record in records) > 1:
        metrics["eval/distinct_responses"] = float(
            np.mean([distinct_share(record["responses"]) for record in records])
        )
        if not is_ifeval:
            answers = [[r["extracted"] for r in record["rewards"]] for record in records]
            metrics["eval/distinct_answers"] = float(np.mean(list(map(distinct_share, answers))))
    # IFEval: lm-eval's four numbers, then each instruction type's
    if is_ifeval:
        metrics.update(ifeval_metrics(records))
        return with_uncertainty(metrics, scores, n_bootstrap, seed)
    for k in ks:
        metrics[f"eval/pass@{k}"] = float(np.mean(scores[f"eval/pass@{k}"]))
        metrics[f"eval/maj@{k}"] = float(np.mean(scores[f"eval/maj@{k}"]))
    if all("flexible_reward" in r for r in rewards):  # GSM8K: the two lm-eval filters
        metrics["eval/strict_accuracy"] = metrics["eval/accuracy"]
        metrics["eval/flexible_accuracy"] = float(
            np.mean([r["flexible_reward"] == 1.0 for r in rewards])
        )
    for key in ("level", "subject"):  # MATH, MATH-500: accuracy of the samples in each group
        groups = defaultdict(list)
        for record in records:
            if key in record:
                groups[record[key]].extend(r["reward"] == 1.0 for r in record["rewards"])
        for group in sorted(groups, key=str):
            metrics[f"eval/by_{key}/{group}"] = float(np.mean(groups[group]))
    return with_uncertainty(metrics, scores, n_bootstrap, seed)


def distinct_share(values: list) -> float:
    """The share of distinct values among a problem's samples: 1/k for k identical ones, 1 for k
    different ones. An unextracted answer (None) counts as one more value."""
    return len(set(values)) / len(values)


def problem_scores(records: list[dict], ks: tuple[int, ...] = (1,)) -> dict[str, np.ndarray]:
    """Each rate of the summary that is a mean over problems, as one score per problem, (P,): the
    share of its n samples correct (accuracy) or formatted, its unbiased pass@k, its majority
    vote's verdict (maj@k), GSM8K's strict and flexible shares, IFEval's prompt-level shares.
    IFEval's instruction level is a ratio over instructions, not a mean over problems: its
    per-problem scores are ratio_scores. Problems, not samples, are the units of the uncertainty:
    a problem's n samples are not independent draws of the benchmark."""
    rewards = [record["rewards"] for record in records]

    def share(key, test=lambda value: value == 1.0) -> np.ndarray:
        return np.array([np.mean([test(r[key]) for r in group]) for group in rewards])

    scores = {"eval/accuracy": share("reward"), "eval/format_rate": share("format_reward")}
    if all("strict" in r for group in rewards for r in group):  # IFEval
        for mode in ("strict", "loose"):
            scores[f"eval/prompt_level_{mode}_acc"] = share(mode, all)
            followed = np.array([sum(sum(r[mode]) for r in group) for group in rewards])
            given = np.array([sum(len(r[mode]) for r in group) for group in rewards])
            scores[f"eval/inst_level_{mode}_acc"] = ratio_scores(followed, given)
        return scores
    for k in ks:
        pass_k = []
        maj_k = []
        for group in rewards:
            n_correct = sum(r["reward"] == 1.0 for r in group)
            pass_k.append(pass_at_k(len(group), n_correct, k))
            first_k = group[:k]
            winner = majority_vote([r["extracted"] for r in first_k])
            # Samples with equal `extracted` have equal rewards: the first with the winning answer
            # speaks for all.
            maj_k.append(
                winner is not None
                and next(r for r in first_k if r["extracted"] == winner)["reward"] == 1.0
            )
        scores[f"eval/pass@{k}"] = np.array(pass_k, dtype=float)
        scores[f"eval/maj@{k}"] = np.array(maj_k, dtype=float)
    if all("flexible_reward" in r for group in rewards for r in group):  # GSM8K
        scores["eval/strict_accuracy"] = scores["eval/accuracy"]
        scores["eval/flexible_accuracy"] = share("flexible_reward")
    return scores


def ratio_scores(hits: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Per-problem scores (P,) for a ratio of sums R = sum(hits) / sum(totals) (IFEval's
    instructions followed of those given): z_i = R + (hits_i - R totals_i) / mean(totals). Their
    mean is R, and their mean_stderr is R's delta-method standard error with problems as
    clusters. With equal totals, z_i = hits_i / totals_i: a plain mean of per-problem shares."""
    ratio = hits.sum() / totals.sum()
    return ratio + (hits - ratio * totals) / totals.mean()


def mean_stderr(scores: np.ndarray) -> float:
    """lm-evaluation-harness's standard error of a mean (lm_eval.api.metrics.mean_stderr): the
    sample standard deviation over problems (ddof 1) / sqrt(P). Example: scores 1, 0, 1, 0: sd
    0.577, stderr 0.289."""
    return float(np.std(scores, ddof=1) / np.sqrt(len(scores)))


def bootstrap_interval(
    scores: np.ndarray, n_bootstrap: int, seed: int, level: float = 0.95
) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean: resample the P problems with replacement
    n_bootstrap times, and take the middle `level` of the resampled means. The same seed draws
    the same resamples for every metric of a run."""
    rng = np.random.default_rng(seed)
    means = []
    # 100 resamples at a time: memory stays at 100 x P, whatever n_bootstrap is
    for start in range(0, n_bootstrap, 100):
        rows = min(100, n_bootstrap - start)
        means.append(scores[rng.integers(0, len(scores), (rows, len(scores)))].mean(axis=1))
    tails = [(1 - level) / 2, (1 + level) / 2]
    low, high = np.quantile(np.concatenate(means), tails)
    return float(low), float(high)


def with_uncertainty(
    metrics: dict, scores: dict[str, np.ndarray], n_bootstrap: int, seed: int
) -> dict:
    """metrics with <key>_stderr, <key>_ci_low and <key>_ci_high after each key of scores. One
    problem has no spread to measure: then nothing is added."""
    out = {}
    for key, value in metrics.items():
        out[key] = value
        if key not in scores or len(scores[key]) < 2:
            continue
        out[f"{key}_stderr"] = mean_stderr(scores[key])
        if n_bootstrap:
            low, high = bootstrap_interval(scores[key], n_bootstrap, seed)
            out[f"{key}_ci_low"] = low
            out[f"{key}_ci_high"] = high
    return out


def ifeval_metrics(records: list[dict]) -> dict:
    """lm-eval's ifeval metrics over all samples: prompt level (all instructions followed) and
    instruction level (each instruction counted once), strict and loose; then instruction-level
    accuracy per instruction type."""
    metrics = {}
    for mode in ("strict", "loose"):
        verdicts = [r[mode] for record in records for r in record["rewards"]]
        metrics[f"eval/prompt_level_{mode}_acc"] = float(np.mean([all(v) for v in verdicts]))
        metrics[f"eval/inst_level_{mode}_acc"] = float(np.mean([x for v in verdicts for x in v]))
    # instruction id -> a (strict, loose) pair per sample
    by_type = defaultdict(list)
    for record in records:
        for r in record["rewards"]:
            ids = record["answer"]["instruction_id_list"]
            for instruction_id, verdicts in zip(
                ids, zip(r["strict"], r["loose"], strict=True), strict=True
            ):
                by_type[instruction_id].append(verdicts)
    for instruction_id in sorted(by_type):
        strict, loose = np.mean(by_type[instruction_id], axis=0)
        metrics[f"eval/by_type/{instruction_id}/strict"] = float(strict)
        metrics[f"eval/by_type/{instruction_id}/loose"] = float(loose)
    return metrics


def format_table(metrics: dict) -> str:
    """One metric per line: counts as integers, rates as percentages, a rate's standard error and
    95% interval on its line (`eval/accuracy  41.80% ± 2.20  [37.60, 46.00]`)."""
    lines = []
    shown = [key for key in metrics if not key.endswith(("_stderr", "_ci_low", "_ci_high"))]
    width = max(map(len, shown)) + 1
    for key in shown:
        value = metrics[key]
        # every float is a rate but the times and the mean length in tokens
        is_rate = isinstance(value, float) and not key.startswith("time/")
        is_rate = is_rate and not key.endswith("response_length")
        # tool calls per response, tool tokens per generated token
        is_rate = is_rate and "_per_" not in key
        # the judge's kappa, seconds and dollars
        is_rate = is_rate and not key.endswith(("kappa", "seconds", "cost_usd"))
        if is_rate:
            line = f"{key:<{width}} {100 * value:8.2f}%"
            if f"{key}_stderr" in metrics:
                line += f" ± {100 * metrics[f'{key}_stderr']:.2f}"
            if f"{key}_ci_low" in metrics:
                low = 100 * metrics[f"{key}_ci_low"]
                line += f"  [{low:.2f}, {100 * metrics[f'{key}_ci_high']:.2f}]"
            lines.append(line)
        else:
            lines.append(f"{key:<{width}} {value:9.6g}")
    return "\n".join(lines)


# --- two runs over the same problems: the paired comparison ---


def paired_comparison(
    scores_a: np.ndarray, scores_b: np.ndarray, n_bootstrap: int, seed: int
) -> dict:
    """A - B from two runs' per-problem scores, (P,) each in the same order of problems. Paired:
    the standard error and the bootstrap interval are those of the mean of the per-problem
    differences, so the problems both runs solve (or both fail) add no noise. Two independent
    standard errors, sqrt(se_a^2 + se_b^2), would count it."""
    differences = scores_a - scores_b
    result = {
        "a": float(np.mean(scores_a)),
        "b": float(np.mean(scores_b)),
        "difference": float(np.mean(differences)),
        "stderr": mean_stderr(differences),
    }
    if n_bootstrap:
        low, high = bootstrap_interval(differences, n_bootstrap, seed)
        result.update(ci_low=low, ci_high=high)
    return result


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """McNemar's exact test, two-sided. Under "A and B are as good", each of the only_a + only_b
    problems that one run solved and the other did not went either way with probability 1/2; p =
    min(1, 2 P(Binomial(only_a + only_b, 1/2) <= min(only_a, only_b))). The problems both or
    neither solved say nothing about which is better. Example: 9 and 1: p = 2 x 11 / 2^10 =
    0.021."""
    m = only_a + only_b
    tail = sum(math.comb(m, i) for i in range(min(only_a, only_b) + 1)) / 2**m
    return min(1.0, 2 * tail)


def format_comparison(result: dict) -> str:
    """compare_runs's result as a table: A, B, A - B ± its paired standard error, its interval;
    then the problems only one run solved."""
    lines = [f"A: {result['run_a']}", f"B: {result['run_b']}"]
    lines.append(f"{result['n_problems']} problems, the same in both")
    width = max(map(len, result["metrics"])) + 1
    header = f"{'':<{width}} {'A':>8} {'B':>8} {'A - B ± stderr':>16}"
    lines.append(f"{header}  paired 95% interval")
    for key, row in result["metrics"].items():
        difference = f"{100 * row['difference']:+.2f} ± {100 * row['stderr']:.2f}"
        line = f"{key:<{width}} {100 * row['a']:7.2f}% {100 * row['b']:7.2f}% {difference:>16}"
        if "ci_low" in row:
            line += f"  [{100 * row['ci_low']:+.2f}, {100 * row['ci_high']:+.2f}]"
        lines.append(line)
    lines.append(
        f"solved (more than half of a problem's samples right): by A only {result['only_a']}, "
        f"by B only {result['only_b']}, by both {result['both']}, by neither {result['neither']}; "
        f"McNemar's exact p = {result['mcnemar_p']:.3g}"
    )
    return "\n".join(lines)


# --- a judge against the verifier: pure functions of the paired verdicts ---


def confusion_table(judge_right: list[bool], rule_right: list[bool]) -> dict:
    """Counts of the four pairs of verdicts on the same samples: both say right, only the judge,
    only the rule, neither."""
    pairs = list(zip(judge_right, rule_right, strict=True))
    return {
        "both_right": sum(j and r for j, r in pairs),
        "judge_only": sum(j and not r for j, r in pairs),
        "rule_only": sum(r and not j for j, r in pairs),
        "both_wrong": sum(not j and not r for j, r in pairs),
    }


def cohen_kappa(table: dict) -> float | None:
    """Cohen's kappa of a confusion_table: (p_o - p_e) / (1 - p_e), the agreement p_o beyond the
    p_e that two raters with these rates of "right" would reach by chance. 1: always agree; 0: no
    better than chance. None where p_e = 1 (both raters always say the same one thing).
    Example: 20, 5, 10, 15 of 50: p_o = 0.7, p_e = (25 x 30 + 25 x 20) / 50^2 = 0.5, kappa 0.4."""
    n = sum(table.values())
    judge_right = table["both_right"] + table["judge_only"]
    rule_right = table["both_right"] + table["rule_only"]
    p_o = (table["both_right"] + table["both_wrong"]) / n
    p_e = (judge_right * rule_right + (n - judge_right) * (n - rule_right)) / n**2
    return None if p_e == 1 else (p_o - p_e) / (1 - p_e)


def format_confusion(table: dict) -> str:
    """The table as rows of the judge's verdict and columns of the rule's."""
    return "\n".join(
        [
            f"{'':<14} {'rule: right':>12} {'rule: wrong':>12}",
            f"{'judge: right':<14} {table['both_right']:>12} {table['judge_only']:>12}",
            f"{'judge: wrong':<14} {table['rule_only']:>12} {table['both_wrong']:>12}",
        ]
    )


# --- ALGORITHM: the tool loop (grpo_tools.py holds the same copy) ---


@dataclass
class Rollout:
    """One response of the tool loop. token_ids, text and finish_reason as in vLLM's
    CompletionOutput, which the rest of the loop reads; the rest is what the loop adds."""

    token_ids: list[int] = field(default_factory=list)
    """the generated and the tool's tokens, in the order the engine was fed them"""
    is_tool: list[bool] = field(default_factory=list)
    """per token: written by the tool, not sampled"""
    logprobs: list[float] = field(default_factory=list)
    """the engine's log-prob of each generated token (none for the tool's)"""
    text: str = ""
    finish_reason: str | None = None
    turns: list[dict] = field(default_factory=list)
    """{"generated": text} and {"tool": output, "status": ...}, in order"""
    n_calls: int = 0
    n_errors: int = 0
    n_timeouts: int = 0


def turn_seed(response_seed: int, turn: int) -> int:
    """The engine's seed for one turn of one response. response_seed comes from (seed, step,
    question, sample): a resumed run replays every turn."""
    return int(np.random.SeedSequence([response_seed, turn]).generate_state(1)[0])


def tool_message_ids(output: str, protocol: dict, tokenizer, max_tokens: int) -> list[int]:
    """The ids of a tool's answer: protocol["output"] around the output's first max_tokens
    tokens, each piece tokenized alone. Never joined to the response's text and tokenized
    again: BPE would merge across the seam, and the trainer would score tokens that the engine
    never sampled or saw."""
    before, after = protocol["output"].split("{}")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    return encode(before) + encode(output)[:max_tokens] + encode(after)


def generate_with_tools(
    llm,
    prompt_ids: list[list[int]],
    protocols: list[dict | None],
    stops: list[list[str] | None],
    seeds: list[int] | None,
    sampling: dict,
    tokenizer,
    args: Args,
) -> list[Rollout]:
    """One response to each prompt (token ids), through the tool loop. Each turn the engine
    continues every open response from its whole sequence (prompt + all its tokens so far)
    until it ends or stops at its protocol's stop string (None: no tool); the calls of the turn
    run in the sandbox together; each output, cut to --max-tool-output-tokens, is appended as
    tokens, and those responses go on. sampling: SamplingParams' arguments, its max_tokens the
    budget of generated and tool tokens. seeds: one per response (turn_seed), None for greedy."""
    # here, not at the top: eval.py imports vLLM only when it starts an engine
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rollouts = [Rollout() for _ in prompt_ids]
    open_rows = list(range(len(prompt_ids)))
    turn = 0
    while open_rows:
        requests = []
        params = []
        for i in open_rows:
            rollout = rollouts[i]
            stop = list(stops[i] or [])
            # after the last call allowed, a call is text like any other
            if protocols[i] and rollout.n_calls < args.max_tool_calls:
                stop.append(protocols[i]["stop"])
            budget = sampling["max_tokens"] - len(rollout.token_ids)
            turn_params = {**sampling, "n": 1, "max_tokens": budget, "stop": stop}
            if seeds is not None:
                turn_params["seed"] = turn_seed(seeds[i], turn)
            params.append(SamplingParams(**turn_params))
            # token ids in, token ids out: nothing is tokenized again
            ids = prompt_ids[i] + rollout.token_ids
            requests.append(TokensPrompt(prompt_token_ids=ids))
        outputs = llm.generate(requests, params, use_tqdm=False)
        calls = []
        for i, output in zip(open_rows, outputs, strict=True):
            c = output.outputs[0]
            rollout = rollouts[i]
            rollout.token_ids += c.token_ids
            rollout.is_tool += [False] * len(c.token_ids)
            if c.logprobs is not None:
                for lp, t in zip(c.logprobs, c.token_ids, strict=True):
                    rollout.logprobs.append(lp[t].logprob)
            rollout.text += c.text
            rollout.turns.append({"generated": c.text})
            rollout.finish_reason = c.finish_reason
            if protocols[i] and c.stop_reason == protocols[i]["stop"]:
                calls.append(i)
        programs = []
        for i in calls:
            programs.append(data.tool_program(rollouts[i].turns[-1]["generated"], protocols[i]))
        results = verifiers.run_tool_calls(programs, args.tool_timeout_s)
        open_rows = []
        for i, result in zip(calls, results, strict=True):
            rollout = rollouts[i]
            ids = tool_message_ids(
                result["output"], protocols[i], tokenizer, args.max_tool_output_tokens
            )
            room = sampling["max_tokens"] - len(rollout.token_ids)
            # the budget ends in the tool's message: cut off, as at --max-tokens
            if len(ids) >= room:
                ids = ids[:room]
                rollout.finish_reason = "length"
            else:
                open_rows.append(i)
            rollout.token_ids += ids
            rollout.is_tool += [True] * len(ids)
            tool_text = tokenizer.decode(ids)
            rollout.text += tool_text
            rollout.turns.append({"tool": tool_text, "status": result["status"]})
            rollout.n_calls += 1
            rollout.n_errors += result["status"] == "error"
            rollout.n_timeouts += result["status"] == "timeout"
        turn += 1
    return rollouts


def tool_metrics(rollouts: list[Rollout], rewards: list[float], prefix: str, name: str) -> dict:
    """prefix/: tool calls per response, the share of responses that call, the share of calls
    that failed and that timed out, tool tokens per generated token, and the mean `name`
    (reward, accuracy) of the responses with a call and without (None where there are none)."""
    n_calls = [r.n_calls for r in rollouts]
    called = [n > 0 for n in n_calls]
    n_tool_tokens = sum(sum(r.is_tool) for r in rollouts)
    n_generated = sum(len(r.token_ids) for r in rollouts) - n_tool_tokens
    # None, not NaN, where nothing is counted: metrics.jsonl is strict JSON
    mean = lambda values: float(np.mean(values)) if values else None
    with_call = [w for w, c in zip(rewards, called, strict=True) if c]
    without_call = [w for w, c in zip(rewards, called, strict=True) if not c]
    errors = None
    timeouts = None
    if sum(n_calls):
        errors = sum(r.n_errors for r in rollouts) / sum(n_calls)
        timeouts = sum(r.n_timeouts for r in rollouts) / sum(n_calls)
    metrics = {
        "tool_calls_per_response": mean(n_calls),
        "frac_calling": mean(called),
        "tool_error_rate": errors,
        "tool_timeout_rate": timeouts,
        "tool_tokens_per_generated_token": n_tool_tokens / max(n_generated, 1),
        f"{name}_with_call": mean(with_call),
        f"{name}_without_call": mean(without_call),
    }
    return {f"{prefix}/{key}": value for key, value in metrics.items()}


# --- checks and the engine ---


def validate(args: Args) -> None:
    """Every error a typo can cause, raised before any data is downloaded or any engine starts."""
    if args.api_base and not args.api_model:
        raise ValueError("--api-base needs --api-model: the name the server gives the model")
    if (
        args.api_endpoint not in ("chat", "completions")
        or (args.resume and not args.api_base)
        or args.concurrency < 1
    ):
        raise ValueError(
            f"need --api-endpoint chat|completions, --resume only with --api-base, --concurrency >= 1; "
            f"got {args.api_endpoint!r}, {args.resume=}, {args.concurrency=}"
        )
    model = Path(args.model).expanduser()
    # A hub name is "org/name"; anything that starts like a path, exists here, or has more parts is
    # a local folder.
    looks_local = args.model.startswith((".", "/", "~")) or Path(args.model.split("/")[0]).exists()
    looks_local = (looks_local or args.model.count("/") > 1) and (
        not args.api_base or args.template == "chat"
    )
    if looks_local and not (model / "config.json").is_file():
        raise ValueError(
            f"model {args.model!r} looks like a local path, but {model / 'config.json'} does not exist"
        )
    if args.dataset not in data.SPLITS:
        raise ValueError(f"unknown dataset {args.dataset!r}; choose from {list(data.SPLITS)}")
    if args.split not in data.SPLITS[args.dataset]:
        raise ValueError(
            f"dataset {args.dataset!r} has no split {args.split!r}; it has {data.SPLITS[args.dataset]}"
        )
    if args.template not in data.TEMPLATES:
        raise ValueError(f"unknown template {args.template!r}; choose from {list(data.TEMPLATES)}")
    for template, datasets in (
        ("mbpp_kshot", ("mbpp", "mbpp_sanitized")),
        ("humaneval", ("humaneval",)),
    ):
        if (args.template == template) != (args.dataset in datasets):
            raise ValueError(f"template {args.template!r} does not fit dataset {args.dataset!r}")
    if args.template == "hendrycks_math_kshot" and (args.dataset, args.split) != ("math", "test"):
        raise ValueError(
            f"template 'hendrycks_math_kshot' is for the math test split, not {args.dataset}/{args.split}"
        )
    if args.n < 1 or args.n_shot < 0 or (args.limit is not None and args.limit < 1):
        raise ValueError(
            f"need n >= 1, n_shot >= 0, limit >= 1; got n={args.n}, n_shot={args.n_shot}, {args.limit=}"
        )
    for k in args.k:
        if not 1 <= k <= args.n:
            raise ValueError(
                f"k={k} must be between 1 and n={args.n} (pass@k and maj@k use k of the n samples)"
            )
    # the dataset's verifier, as its examples name it
    verifier = {"math500": "math"}.get(args.dataset, args.dataset)
    tool = data.tool_protocol({"verifier": verifier}, args.template)
    if args.tools and (args.api_base or tool is None):
        raise ValueError(
            f"--tools needs the local engine and a template with a tool for the dataset "
            f"(data.tool_protocol); got {args.dataset} with {args.template}"
        )
    if args.n > 1 and args.temperature == 0:
        raise ValueError(
            f"n={args.n} greedy samples would be {args.n} copies of one response; set --temperature"
        )


def start_engine(args: Args):
    """A vLLM engine in this process: bf16 on GPU; float32 without CUDA graphs on CPU (starts in
    seconds)."""
    from vllm import LLM
    from vllm.platforms import current_platform

    # vLLM asks NVML, not CUDA: torch.cuda.is_available() would initialize CUDA here, and the
    # workers --tensor-parallel-size then forks from this process could not use it.
    on_gpu = current_platform.is_cuda_alike()
    # Read at engine start. In-process engine: deterministic, no worker processes to spawn.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # otherwise the CPU engine claims half the machine's memory for its KV cache (GiB)
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return LLM(
        model=args.model,
        dtype="bfloat16" if on_gpu else "float32",
        # CUDA graphs pay off on GPU; on CPU compiling costs ~1 min for nothing
        enforce_eager=not on_gpu,
        seed=args.seed,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def load_examples(args: Args) -> tuple[list[dict], list[list[dict] | None]]:
    """The problems, and for each problem its shots (None for a template without shots)."""
    examples = data.load(args.dataset, args.split, args.data_dir)[: args.limit]
    per_question = {
        "gsm8k_kshot": data.gsm8k_lm_eval_fewshot,
        "hendrycks_math_kshot": data.math_fewshot,
    }
    # lm-eval's test shots: drawn per question
    if args.template in per_question and args.split == "test":
        shots = per_question[args.template](args.n_shot, args.data_dir)
        return examples, [shots[ex["id"]] for ex in examples]
    fewshot = None
    if args.template == "gsm8k_kshot":
        fewshot = data.gsm8k_fewshot(args.n_shot, args.data_dir)
    if args.template == "mbpp_kshot":
        fewshot = data.mbpp_fewshot(args.data_dir)[: args.n_shot]
    return examples, [fewshot] * len(examples)


def hendrycks_math_score(response: str, example: dict) -> dict:
    """The MATH reward for "hendrycks_math_kshot", whose answers come bare (" $\\frac{1}{2}$"). The
    answer is what lm-eval's hendrycks_math reads: the text between the first and the last "$", else
    the whole response. Our MATH verifier compares it with the gold (handed over in answer tags,
    which it reads first); lm-eval compares strings after its own normalisation (docs/eval.md,
    "Reference numbers": where the two differ)."""
    dollars = [i for i, char in enumerate(response) if char == "$"]
    span = response[dollars[0] + 1 : dollars[-1]] if len(dollars) > 1 else response
    return verifiers.score(f"<answer>{span}</answer>", example)


def evaluate(llm, args: Args, examples: list[dict], shots: list) -> tuple[list[dict], dict]:
    """Generate n responses per problem and score them: one record per problem, and the times
    taken."""
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    prompts = [
        data.render_prompt(ex, args.template, tokenizer, s, tools=args.tools)
        for ex, s in zip(examples, shots, strict=True)
    ]
    if args.tools:
        return evaluate_with_tools(llm, args, examples, prompts)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        stop=data.stop_strings(args.template),
        # keep "</answer>": the verifier needs the tag closed
        include_stop_str_in_output=args.template == "r1_zero",
    )
    start = time.time()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    generate_s = time.time() - start
    samples = [
        [(s.text, len(s.token_ids), s.finish_reason) for s in output.outputs] for output in outputs
    ]
    start = time.time()
    records = score_records(args, examples, prompts, samples)
    return records, {"time/generate_s": generate_s, "time/score_s": time.time() - start}


def evaluate_with_tools(
    llm, args: Args, examples: list[dict], prompts: list[str]
) -> tuple[list[dict], dict]:
    """evaluate through the tool loop (generate_with_tools, the loop grpo_tools.py trains with):
    one record per problem with each sample's turns, and the times and tool metrics."""
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer(prompts)["input_ids"]
    # the n samples of problem i are rows i n ... i n + n - 1
    rows = [i for i in range(len(examples)) for _ in range(args.n)]
    sampling = dict(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        # the verifier reads r1_zero's "</answer>"; a call ends in its stop string
        include_stop_str_in_output=True,
    )
    # a seed per (--seed, sample) and turn: a sampled evaluation repeats exactly
    seeds = None
    if args.temperature > 0:
        seeds = [args.seed * len(rows) + row for row in range(len(rows))]
    start = time.time()
    rollouts = generate_with_tools(
        llm,
        [prompt_ids[i] for i in rows],
        [data.tool_protocol(examples[i], args.template) for i in rows],
        [data.stop_strings(args.template) for _ in rows],
        seeds,
        sampling,
        tokenizer,
        args,
    )
    generate_s = time.time() - start
    samples = []
    for i in range(len(examples)):
        group = rollouts[i * args.n : (i + 1) * args.n]
        samples.append([(r.text, len(r.token_ids), r.finish_reason) for r in group])
    start = time.time()
    records = score_records(args, examples, prompts, samples)
    for i, record in enumerate(records):
        group = rollouts[i * args.n : (i + 1) * args.n]
        record["turns"] = [r.turns for r in group]
        record["n_tool_calls"] = [r.n_calls for r in group]
    rewards = [reward["reward"] for record in records for reward in record["rewards"]]
    metrics = tool_metrics(rollouts, rewards, "eval", "accuracy")
    # summary.json and the table leave out what was not counted (no calls: no error rate)
    metrics = {key: value for key, value in metrics.items() if value is not None}
    times = {"time/generate_s": generate_s, "time/score_s": time.time() - start}
    return records, {**times, **metrics}


def score_records(
    args: Args, examples: list[dict], prompts: list[str], samples: list[list[tuple]]
) -> list[dict]:
    """One record per problem from its n samples, (text, n_tokens, finish_reason) each, scored all
    in one batch (programs run in a pool, one per core)."""
    texts = [[text for text, _, _ in group] for group in samples]
    # all samples in one list, each beside its problem
    sample_texts = [t for group in texts for t in group]
    sample_examples = [ex for ex in examples for _ in range(args.n)]
    if args.template == "hendrycks_math_kshot":
        pairs = zip(sample_texts, sample_examples, strict=True)
        rewards = [hendrycks_math_score(t, ex) for t, ex in pairs]
    else:
        rewards = verifiers.score_batch(sample_texts, sample_examples)
    records = []
    for i, (example, prompt, group) in enumerate(zip(examples, prompts, samples, strict=True)):
        record = {"id": example["id"], "prompt": prompt, "answer": example["answer"]}
        # MATH only
        record.update({key: example[key] for key in ("level", "subject") if key in example})
        record["responses"] = texts[i]
        record["rewards"] = rewards[i * args.n : (i + 1) * args.n]
        record["n_tokens"] = [n_tokens for _, n_tokens, _ in group]
        record["finish_reasons"] = [finish for _, _, finish in group]  # "stop" or "length"
        records.append(record)
    return records


# --- or generate through an OpenAI-compatible server (samples.jsonl grows as problems finish) ---


def check_server(args: Args, key: str | None) -> None:
    """Before any request: the server answers, accepts the key (if it needs one) and serves the
    model."""
    try:
        response = httpx.get(f"{args.api_base.rstrip('/')}/models", headers=auth(key), timeout=30)
    except httpx.HTTPError as error:
        raise ValueError(f"cannot reach {args.api_base}: {type(error).__name__}: {error}") from None
    if response.status_code in (401, 403):
        hint = (
            f"check the key in ${args.api_key_env}"
            if key
            else f"it needs a key: set ${args.api_key_env}"
        )
        raise ValueError(
            f"{args.api_base} refused the request (HTTP {response.status_code}): {hint}"
        )
    if response.status_code != 200:
        raise ValueError(f"{args.api_base}/models answered HTTP {response.status_code}")
    served = [model["id"] for model in response.json().get("data", [])]
    if args.api_model not in served:
        raise ValueError(
            f"{args.api_base} does not serve {args.api_model!r} (HTTP 404 to come); it serves {served}"
        )


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def request_body(args: Args, example: dict, prompt: str) -> tuple[str, dict]:
    """The endpoint and JSON body of one sample's request. Chat: the server applies its chat
    template to one user message (the "chat" template's message, or else the rendered prompt);
    completions: the prompt as it is."""
    body = {
        "model": args.api_model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stop": data.stop_strings(args.template),
    }
    if args.api_endpoint == "completions":
        return "/completions", {**body, "prompt": prompt}
    content = data.chat_message(example) if args.template == "chat" else prompt
    return "/chat/completions", {**body, "messages": [{"role": "user", "content": content}]}


def parse_answer(answer: dict, template: str) -> tuple[str, int, str]:
    """(text, completion tokens, finish_reason) of an answer, as the local engine would give them: a
    reasoning server's thinking ("reasoning_content" in DeepSeek's API, "reasoning" in vLLM's) in
    the template's think section, and r1_zero's "</answer>", after which the server stopped and
    which it leaves out, put back. KeyError, IndexError or TypeError: a malformed answer."""
    choice = answer["choices"][0]
    finish = choice["finish_reason"]
    if "message" in choice:
        text = choice["message"]["content"] or ""
        thinking = choice["message"].get("reasoning_content")
        thinking = thinking or choice["message"].get("reasoning")
        if thinking and template == "r1_zero":
            text = f" {thinking} </think> {text}"
        elif thinking:
            text = f"<think>\n{thinking}\n</think>\n\n{text}"
    else:
        text = choice["text"]
    answer_left_open = "<answer>" in text and "</answer>" not in text
    if template == "r1_zero" and finish == "stop" and answer_left_open:
        text += "</answer>"
    n_tokens = (answer.get("usage") or {}).get("completion_tokens", 0)
    return text, n_tokens, finish


async def ask(client: httpx.AsyncClient, path: str, body: dict, args: Args) -> tuple[tuple, dict]:
    """One sample: (parse_answer's triple, usage). Retried with exponential backoff and jitter, or
    after the server's Retry-After, on 429, 5xx, timeouts, dropped connections and malformed
    answers; another 4xx is final at once. Raises RuntimeError with the last error once the retries
    run out."""
    for attempt in range(args.max_retries + 1):
        wait = min(60.0, 0.5 * 2**attempt) * random.uniform(0.5, 1.5)
        try:
            response = await client.post(path, json=body)
            if response.status_code == 429 or response.status_code >= 500:
                error = f"HTTP {response.status_code}"
                retry_after = response.headers.get("retry-after", "")
                wait = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else wait
            elif response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
            else:
                answer = response.json()
                return parse_answer(answer, args.template), answer.get("usage") or {}
        except httpx.TransportError as exception:  # timeouts, refused or reset connections
            error = f"{type(exception).__name__}: {exception}"
        # not JSON, no choices, a missing field
        except (ValueError, KeyError, IndexError, TypeError) as exception:
            error = f"malformed answer: {type(exception).__name__}: {exception}"
        if attempt < args.max_retries:
            await asyncio.sleep(wait)
    raise RuntimeError(f"{args.max_retries + 1} attempts; the last: {error}")


async def ask_all(
    args: Args, key: str | None, examples: list[dict], prompts: list[str], samples_file: Path
) -> None:
    """Every problem's n samples, --concurrency requests in flight; each problem scored and appended
    to samples_file as it finishes, or appended as failed (with its last error) once a sample's
    retries ran out."""
    semaphore = asyncio.Semaphore(args.concurrency)
    base_url = args.api_base.rstrip("/")
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(base_url=base_url, headers=auth(key), timeout=timeout) as client:

        async def sample(path: str, body: dict):
            async with semaphore:
                return await ask(client, path, body, args)

        async def problem(example: dict, prompt: str) -> None:
            results = await asyncio.gather(
                *[sample(*request_body(args, example, prompt)) for _ in range(args.n)],
                return_exceptions=True,
            )
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                record = {
                    "id": example["id"],
                    "prompt": prompt,
                    "failed": str(failed[0]).replace(key or "\0", "***"),
                }
            else:
                (record,) = await asyncio.to_thread(
                    score_records, args, [example], [prompt], [[r[0] for r in results]]
                )
                record["usage"] = {
                    k: sum(r[1].get(k, 0) for r in results)
                    for k in ("prompt_tokens", "completion_tokens")
                }
            # one write per problem: a kill loses none written
            with open(samples_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")

        await asyncio.gather(
            *[problem(example, prompt) for example, prompt in zip(examples, prompts, strict=True)]
        )


def finished_records(samples_file: Path) -> list[dict]:
    """The answered problems of an earlier run, each once; samples_file is rewritten with them alone
    (by rename), so its failed problems and a line cut by a kill are asked again."""
    lines = samples_file.read_text(encoding="utf-8").splitlines() if samples_file.exists() else []
    records = {}
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1:  # only the last line can be cut short by a kill
                raise ValueError(f"{samples_file}, line {i + 1}: not JSON") from None
            print(f"{samples_file}: dropped its last line, cut short")
            continue
        if "failed" not in record:
            records[record["id"]] = record
    samples_file.with_suffix(".tmp").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records.values())
    )
    os.replace(samples_file.with_suffix(".tmp"), samples_file)
    return list(records.values())


def generate_through_server(
    args: Args, examples: list[dict], shots: list, run_dir: Path
) -> tuple[list[dict], dict]:
    """Ask the server for the problems run_dir's samples.jsonl does not hold yet; returns all
    records and metrics: summarize's over the answered problems, the failed count, and the tokens
    the server counted (the bill)."""
    key = os.environ.get(args.api_key_env) or None
    check_server(args, key)
    tokenizer = None
    # the recorded prompt, for sft.py, in the student's (--model's) chat template
    if args.template == "chat":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    run_dir.mkdir(parents=True, exist_ok=True)
    done = {record["id"] for record in finished_records(run_dir / "samples.jsonl")}
    todo = [(ex, s) for ex, s in zip(examples, shots, strict=True) if ex["id"] not in done]
    prompts = [data.render_prompt(ex, args.template, tokenizer, s) for ex, s in todo]
    print(
        f"{len(done)} problems answered before, {len(todo)} to ask {args.api_base} ({args.api_model}) for"
    )
    start = time.time()
    asyncio.run(ask_all(args, key, [ex for ex, _ in todo], prompts, run_dir / "samples.jsonl"))
    lines = (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    records = [r for r in map(json.loads, lines) if "failed" not in r]
    metrics = {
        **(summarize(records, args.k, args.bootstrap, args.seed) if records else {}),
        "eval/n_failed": len(lines) - len(records),
        "time/generate_s": time.time() - start,
    }
    for kind in ("prompt_tokens", "completion_tokens"):
        metrics[f"usage/{kind}"] = sum(r["usage"][kind] for r in records)
    for record in map(json.loads, lines):
        if "failed" in record:
            print(f"failed: {record['id']}: {record['failed']}")
    return records, metrics


def judge_samples(judge, args: Args, records: list[dict], examples: list[dict], run_dir: Path):
    """Every sample graded by the judge as well (its cache in run_dir: --resume pays no call
    twice), its verdicts written to run_dir/judge.jsonl beside the rule's; returns the judge/
    metrics (the confusion table, agreement and kappa over the samples it gave a verdict on; its
    calls, failures and seconds) and the table."""
    run_dir.mkdir(parents=True, exist_ok=True)
    judge.open_cache(run_dir)
    by_id = {example["id"]: {"dataset": args.dataset, **example} for example in examples}
    rubric_file = data.read_rubric_file(args.judge_rubric)
    items = []
    rows = []
    for record in records:
        example = by_id[record["id"]]
        rubric = data.judge_rubric(example, rubric_file)
        samples = zip(record["responses"], record["rewards"], strict=True)
        for j, (response, reward) in enumerate(samples):
            items.append((example["prompt"], rubric, response))
            rows.append({"id": record["id"], "sample": j, "rule": reward["reward"]})
    verdicts = judge.grade_all(items)
    with open(run_dir / "judge.jsonl", "w", encoding="utf-8") as f:
        for row, verdict in zip(rows, verdicts, strict=True):
            row["judge"] = None if verdict["judge_failed"] else verdict["judge_reward"]
            row["error"] = verdict.get("judge_error")
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    # a failure is no verdict: counted, and left out of the table
    graded = [row for row in rows if row["judge"] is not None]
    judge_right = [row["judge"] >= args.judge_threshold for row in graded]
    table = confusion_table(judge_right, [row["rule"] == 1 for row in graded])
    metrics = {f"judge/{key}": value for key, value in table.items()}
    metrics["judge/n_graded"] = len(graded)
    metrics["judge/n_failed"] = len(rows) - len(graded)
    if graded:
        metrics["judge/agreement"] = (table["both_right"] + table["both_wrong"]) / len(graded)
        metrics["judge/kappa"] = cohen_kappa(table)
        metrics["judge/score_mean"] = float(np.mean([row["judge"] for row in graded]))
    # null, not NaN: summary.json is strict JSON
    metrics = {key: value for key, value in metrics.items() if value is not None}
    stats = judge.take_stats()
    metrics.update({key: value for key, value in stats.items() if key != "judge/failures"})
    failures = [row["error"] for row in rows if row["error"]]
    if failures:
        print(f"the judge failed {len(failures)} times; the first: {failures[0]}")
    return metrics, table


def write_results(run_dir: Path, args: Args, records: list[dict], metrics: dict) -> None:
    """summary.json, and samples.jsonl unless it grew as problems finished (--api-base)."""
    run_dir.mkdir(parents=True, exist_ok=bool(args.api_base or args.judge_model))
    if not args.api_base:
        with open(run_dir / "samples.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    (run_dir / "summary.json").write_text(
        json.dumps({"args": asdict(args), "metrics": metrics}, indent=2) + "\n"
    )


def write_sft_pairs(path: str, records: list[dict], examples: list[dict]) -> int:
    """Every sample the verifier accepts, a data.sft_row each (what sft.py --sft-file reads);
    returns their count."""
    by_id = {example["id"]: example for example in examples}
    rows = []
    for record in records:
        for response, reward in zip(record["responses"], record["rewards"], strict=True):
            if reward["reward"] == 1:
                rows.append(data.sft_row(record["prompt"], response, by_id[record["id"]]))
    Path(path).write_text(
        "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8"
    )
    return len(rows)


def model_name(args: Args) -> str:
    """The last 3 path parts, so a checkpoint keeps its run's name:
    "sft__1__1763700000_checkpoints_step_000200"."""
    return re.sub(
        r"[^A-Za-z0-9._-]+", "_", "_".join(Path(args.api_model or args.model).parts[-3:])
    ).strip("_")


def main(args: Args) -> Path | None:
    """Evaluate and write samples.jsonl and summary.json; returns the results folder (None with
    --compare, which evaluates nothing)."""
    if args.bootstrap < 0:
        raise ValueError(f"--bootstrap is a number of resamples (0: none), not {args.bootstrap}")
    if args.compare:
        result = compare_runs(*args.compare, args.bootstrap, args.seed)
        print(format_comparison(result))
        if args.compare_out:
            Path(args.compare_out).write_text(json.dumps(result, indent=2) + "\n")
        return None
    if args.suite:
        return run_suite(args)
    args = replace(args, max_tokens=args.max_tokens or 1024)
    # 1. Check the arguments and load the data: a mistake fails in seconds, before the engine.
    validate(args)
    examples, shots = load_examples(args)
    # the judge's flags and server checked before the engine starts; None without --judge-model
    judge = data.make_judge(args)

    # 2. Generate n responses per problem (a local engine, or a server) and score them.
    # the folder's name gives the shot count: gsm8k_kshot8
    template = args.template
    if shots and shots[0] is not None:
        template = f"{args.template}{len(shots[0])}"
    name = f"{model_name(args)}__{args.dataset}_{args.split}__{template}__{int(time.time())}"
    run_dir = Path(args.resume) if args.resume else Path(args.out_dir) / name
    if args.api_base:
        records, metrics = generate_through_server(args, examples, shots, run_dir)
    else:
        start = time.time()
        llm = start_engine(args)
        engine_start_s = time.time() - start
        records, times = evaluate(llm, args, examples, shots)
        metrics = {
            **summarize(records, args.k, args.bootstrap, args.seed),
            "time/engine_start_s": engine_start_s,
            **times,
        }

    # 3. The judge on the same samples (--judge-model): its verdicts against the verifier's.
    table = None
    if judge is not None:
        judge_metrics, table = judge_samples(judge, args, records, examples, run_dir)
        metrics.update(judge_metrics)

    # 4. Metrics, files, table.
    write_results(run_dir, args, records, metrics)
    if args.save_sft_pairs:
        n_pairs = write_sft_pairs(
            args.save_sft_pairs, records, [{"dataset": args.dataset, **ex} for ex in examples]
        )
        print(
            f"wrote {n_pairs} samples the verifier accepts to {args.save_sft_pairs} (sft.py --sft-file)"
        )
    print(
        f"{args.api_model or args.model} on {args.dataset}/{args.split}, template {template}, n={args.n}, "
        f"T={args.temperature}"
    )
    print(format_table(metrics))
    if table is not None:
        print(f"{args.judge_model} against the verifier (verdict >= {args.judge_threshold}: right)")
        print(format_confusion(table))
    print(f"wrote {run_dir}/samples.jsonl and summary.json")
    return run_dir


def run_suite(args: Args) -> Path:
    """Every SUITE row with one engine:
    <out_dir>/<model>__suite__<time>/<row>/{samples.jsonl,summary.json}."""
    rows = [
        replace(
            args,
            suite=False,
            dataset=dataset,
            split="test",
            template=template,
            n_shot=n_shot,
            max_tokens=args.max_tokens or max_tokens,
        )
        for _, dataset, template, n_shot, max_tokens, _ in SUITE
    ]
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
        metrics = {**summarize(records, row.k, row.bootstrap, row.seed), **times}
        write_results(suite_dir / name, row, records, metrics)
        table += [
            (name, key, 100 * metrics[key], reference) for key, reference in references.items()
        ]
    (suite_dir / "suite.json").write_text(
        json.dumps(
            {"args": asdict(args), "engine_start_s": engine_start_s, "table": table}, indent=2
        )
        + "\n"
    )
    print(
        f"{args.model}: the baseline suite, {'first ' + str(args.limit) if args.limit else 'all'} problems each"
    )
    print(f"{'benchmark':<16} {'metric':<30} {'ours':>7} {'Qwen3-1.7B-Base (lm-eval)':>26}")
    for name, key, ours, reference in table:
        print(f"{name:<16} {key:<30} {ours:7.2f} {reference:26.2f}")
    print(
        f"wrote {suite_dir}/<benchmark>/samples.jsonl and summary.json, and {suite_dir}/suite.json"
    )
    return suite_dir


# --- two results folders compared (--compare) ---


def read_results(run_dir: Path) -> tuple[dict, dict]:
    """A results folder's arguments (summary.json) and its answered problems by id
    (samples.jsonl; an --api-base run's failed problems left out)."""
    if not (run_dir / "samples.jsonl").is_file() or not (run_dir / "summary.json").is_file():
        raise ValueError(
            f"{run_dir} is not an evaluation folder (samples.jsonl and summary.json); with "
            f"--suite, give one benchmark's folder"
        )
    args = json.loads((run_dir / "summary.json").read_text())["args"]
    lines = (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    records = [record for record in map(json.loads, lines) if "failed" not in record]
    return args, {record["id"]: record for record in records}


def compare_runs(run_a: str, run_b: str, n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """The paired comparison of two results folders over the same problems: A - B of each rate both
    summaries hold (paired_comparison), and the problems only one run solved (McNemar's exact
    test), a problem solved where more than half of its samples are right. Raises ValueError,
    naming what differs, for two runs of another dataset, split, template, shots or tool use, or
    over other problems (ids, gold answers, or prompts but with the chat template, which each
    model's tokenizer renders its own way)."""
    args_a, records_a = read_results(Path(run_a))
    args_b, records_b = read_results(Path(run_b))
    fields = ["dataset", "split", "template", "tools"]
    if "kshot" in args_a["template"]:
        fields.append("n_shot")
    for name in fields:
        if args_a.get(name) != args_b.get(name):
            raise ValueError(
                f"{run_a} and {run_b} differ in {name}: {args_a.get(name)!r} and "
                f"{args_b.get(name)!r}; a paired comparison needs the same problems and template"
            )
    only_in_a = [i for i in records_a if i not in records_b]
    only_in_b = [i for i in records_b if i not in records_a]
    if only_in_a or only_in_b:
        raise ValueError(
            f"{run_a} and {run_b} hold different problems: {len(only_in_a)} only in A "
            f"{only_in_a[:3]}, {len(only_in_b)} only in B {only_in_b[:3]} (--limit? failed "
            f"problems of an --api-base run?)"
        )
    ids = list(records_a)
    if len(ids) < 2:
        raise ValueError(f"{run_a} holds {len(ids)} problem(s): no spread to compare")
    for i in ids:
        a = records_a[i]
        b = records_b[i]
        if a["answer"] != b["answer"]:
            raise ValueError(f"{run_a} and {run_b} differ in the gold answer of problem {i}")
        if args_a["template"] != "chat" and a["prompt"] != b["prompt"]:
            raise ValueError(f"{run_a} and {run_b} differ in the prompt of problem {i}")
    # pass@k and maj@k for the k both runs counted
    ks = tuple(k for k in args_a["k"] if k in args_b["k"])
    scores_a = problem_scores([records_a[i] for i in ids], ks)
    scores_b = problem_scores([records_b[i] for i in ids], ks)
    result = {"run_a": str(run_a), "run_b": str(run_b), "n_problems": len(ids), "metrics": {}}
    for key in scores_a:
        if key in scores_b:
            comparison = paired_comparison(scores_a[key], scores_b[key], n_bootstrap, seed)
            result["metrics"][key] = comparison
    solved_a = scores_a["eval/accuracy"] > 0.5
    solved_b = scores_b["eval/accuracy"] > 0.5
    result["only_a"] = int(np.sum(solved_a & ~solved_b))
    result["only_b"] = int(np.sum(solved_b & ~solved_a))
    result["both"] = int(np.sum(solved_a & solved_b))
    result["neither"] = int(np.sum(~solved_a & ~solved_b))
    result["mcnemar_p"] = mcnemar_exact(result["only_a"], result["only_b"])
    return result


if __name__ == "__main__":
    results = main(tyro.cli(Args))
    summary = {}
    if results is not None and (results / "summary.json").exists():
        summary = json.loads((results / "summary.json").read_text())
    # 3: some problems failed (--api-base)
    sys.exit(3 if summary.get("metrics", {}).get("eval/n_failed") else 0)
