"""eval.py's uncertainty: each rate's standard error against lm-evaluation-harness's own function,
the bootstrap interval's coverage on simulated benchmarks, the paired comparison of two planted
results folders (--compare) with McNemar's counts, its refusal of runs over other problems or
templates, and the collapse metric's extremes. Pure functions and files written by hand: no engine,
a few seconds."""

import json
import math
from dataclasses import asdict
from fractions import Fraction

import numpy as np
import pytest
import tyro
from lm_eval.api.metrics import mean_stderr as lm_eval_mean_stderr

import eval as eval_script
from eval import Args, pass_at_k, summarize


def reward(extracted, right, **extra):
    return {
        "reward": float(right),
        "format_reward": float(extracted is not None),
        "answer_reward": float(right),
        "extracted": extracted,
        **extra,
    }


def record(id, rewards, responses=None, prompt="p", answer="a"):
    return {
        "id": id,
        "prompt": prompt,
        "answer": answer,
        "responses": responses or [f"response {j}" for j in range(len(rewards))],
        "rewards": rewards,
        "n_tokens": [10] * len(rewards),
        "finish_reasons": ["stop"] * len(rewards),
    }


def random_records(n_problems, n, seed, p=0.4):
    """Problems of n samples, each right with probability p (its answer "1", else "2" or none)."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n_problems):
        rewards = []
        for _ in range(n):
            right = rng.random() < p
            extracted = "1" if right else rng.choice(["2", None])
            rewards.append(reward(extracted, right))
        records.append(record(f"test/{i}", rewards))
    return records


# --- standard errors: lm-eval's formula on the same per-problem scores ---


def test_stderr_matches_lm_eval():
    records = random_records(50, 4, seed=0)
    metrics = summarize(records, ks=(1, 2, 4), n_bootstrap=0)
    per_problem = {
        "eval/accuracy": [np.mean([r["reward"] for r in rec["rewards"]]) for rec in records],
        "eval/format_rate": [
            np.mean([r["format_reward"] for r in rec["rewards"]]) for rec in records
        ],
    }
    for k in (1, 2, 4):
        counts = [sum(r["reward"] for r in rec["rewards"]) for rec in records]
        per_problem[f"eval/pass@{k}"] = [pass_at_k(4, int(c), k) for c in counts]
    for key, scores in per_problem.items():
        # the rate is the mean of its per-problem scores, its standard error lm-eval's of them
        assert metrics[key] == pytest.approx(np.mean(scores)), key
        assert metrics[f"{key}_stderr"] == pytest.approx(lm_eval_mean_stderr(scores)), key
        assert f"{key}_ci_low" not in metrics  # --bootstrap 0: no interval
    # maj@k: each problem's vote is right or wrong, a 0/1 score
    votes = eval_script.problem_scores(records, (4,))["eval/maj@4"]
    assert set(votes) <= {0.0, 1.0} and metrics["eval/maj@4"] == np.mean(votes)
    assert metrics["eval/maj@4_stderr"] == pytest.approx(lm_eval_mean_stderr(list(votes)))
    # by hand: scores 1, 0, 1, 0: sample sd sqrt(1/3), over sqrt(4)
    assert eval_script.mean_stderr(np.array([1, 0, 1, 0])) == pytest.approx(math.sqrt(1 / 3) / 2)


def test_ifeval_stderr():
    # two instructions per prompt, one sample: the instruction level is then the mean of
    # per-prompt shares, and lm-eval's formula applies to it as to the prompt level
    verdicts = [[True, True], [True, False], [False, False], [True, True], [False, True]]
    records = [
        record(
            f"test/{i}", [{"reward": float(all(v)), "format_reward": 1.0, "strict": v, "loose": v}]
        )
        for i, v in enumerate(verdicts)
    ]
    for rec in records:
        rec["answer"] = {"instruction_id_list": ["a", "b"]}
    metrics = summarize(records, n_bootstrap=0)
    prompt_level = [float(all(v)) for v in verdicts]
    shares = [sum(v) / 2 for v in verdicts]
    for mode in ("strict", "loose"):
        stderr = metrics[f"eval/prompt_level_{mode}_acc_stderr"]
        assert stderr == pytest.approx(lm_eval_mean_stderr(prompt_level))
        stderr = metrics[f"eval/inst_level_{mode}_acc_stderr"]
        assert stderr == pytest.approx(lm_eval_mean_stderr(shares))


def test_ratio_scores_by_hand():
    # instructions followed of given, per prompt: 1 of 1, 0 of 3, 2 of 2: R = 3/6
    hits = np.array([1.0, 0.0, 2.0])
    totals = np.array([1.0, 3.0, 2.0])
    z = eval_script.ratio_scores(hits, totals)
    # z_i = R + (hits_i - R totals_i) / mean(totals), mean(totals) = 2
    assert z == pytest.approx([0.5 + 0.5 / 2, 0.5 - 1.5 / 2, 0.5 + 1 / 2])
    assert z.mean() == pytest.approx(0.5)


# --- the bootstrap interval: seeded, and it covers the true rate about 95% of the time ---


def test_bootstrap_interval_is_seeded():
    scores = np.random.default_rng(0).random(40)
    interval = eval_script.bootstrap_interval(scores, 500, seed=3)
    assert interval == eval_script.bootstrap_interval(scores, 500, seed=3)
    assert interval != eval_script.bootstrap_interval(scores, 500, seed=4)
    assert interval[0] < scores.mean() < interval[1]


def test_bootstrap_covers_the_true_rate_at_its_nominal_rate():
    # 1,000 benchmarks of 200 problems, each solved with probability 0.3. The coverage of a 95%
    # interval, counted over 1,000 draws, has a noise of sqrt(0.95 x 0.05 / 1000) = 0.007; the
    # percentile bootstrap undercovers a little at this size (~0.94). Tolerance: 0.03.
    rng = np.random.default_rng(0)
    true_rate = 0.3
    covered = 0
    estimates = []
    stderrs = []
    for draw in range(1000):
        scores = (rng.random(200) < true_rate).astype(float)
        low, high = eval_script.bootstrap_interval(scores, 400, seed=draw)
        covered += low <= true_rate <= high
        estimates.append(scores.mean())
        stderrs.append(eval_script.mean_stderr(scores))
    assert abs(covered / 1000 - 0.95) < 0.03, covered
    # the standard error is the spread of the estimate across benchmarks: sqrt(0.3 x 0.7 / 200)
    assert np.mean(stderrs) == pytest.approx(np.std(estimates), rel=0.1)
    assert np.mean(stderrs) == pytest.approx(math.sqrt(0.21 / 200), rel=0.02)


def test_the_table_shows_each_rate_with_its_stderr_and_interval():
    records = random_records(40, 1, seed=1)
    metrics = summarize(records, n_bootstrap=200, seed=0)
    # every existing key and value as before; the uncertainty beside each rate
    keys = list(metrics)
    i = keys.index("eval/accuracy")
    assert keys[i + 1 : i + 4] == [
        "eval/accuracy_stderr",
        "eval/accuracy_ci_low",
        "eval/accuracy_ci_high",
    ]
    assert metrics["eval/accuracy_ci_low"] < metrics["eval/accuracy"]
    assert metrics["eval/accuracy"] < metrics["eval/accuracy_ci_high"]
    assert "eval/truncation_rate_stderr" not in metrics  # a diagnostic, not a benchmark's rate
    line = next(
        line for line in eval_script.format_table(metrics).splitlines() if "accuracy" in line
    )
    accuracy = 100 * metrics["eval/accuracy"]
    stderr = 100 * metrics["eval/accuracy_stderr"]
    assert f"{accuracy:.2f}% ± {stderr:.2f}  [" in line
    assert "_stderr" not in eval_script.format_table(metrics)
    # one problem: no spread, no standard error
    assert "eval/accuracy_stderr" not in summarize(records[:1])


# --- the collapse metric: the share of distinct answers and responses among a problem's samples ---


def test_collapse_extremes():
    same = [record("a", [reward("7", False)] * 4, responses=["x"] * 4)]
    metrics = summarize(same, ks=(1,))
    assert metrics["eval/distinct_answers"] == metrics["eval/distinct_responses"] == 1 / 4
    different = [record("a", [reward(str(j), j == 0) for j in range(4)], responses=list("wxyz"))]
    metrics = summarize(different, ks=(1,))
    assert metrics["eval/distinct_answers"] == metrics["eval/distinct_responses"] == 1.0
    # averaged over problems; an unextracted answer is one more value
    both = [*same, record("b", [reward(None, False), reward("1", True)])]
    metrics = summarize(both)
    assert metrics["eval/distinct_answers"] == (1 / 4 + 1) / 2
    # one sample per problem: nothing to compare
    assert "eval/distinct_answers" not in summarize([record("a", [reward("1", True)])])


# --- --compare: two planted results folders ---


def write_run(path, records, **overrides):
    """A results folder as eval.py writes it: samples.jsonl and summary.json."""
    path.mkdir(parents=True)
    lines = [json.dumps(rec) + "\n" for rec in records]
    (path / "samples.jsonl").write_text("".join(lines))
    summary = {"args": asdict(Args(**overrides)), "metrics": summarize(records)}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def planted(solved):
    """One greedy sample per problem: right on the problems in `solved`, of 100."""
    return [record(f"test/{i}", [reward(str(int(i in solved)), i in solved)]) for i in range(100)]


def test_compare_identical_runs(tmp_path):
    solved = set(range(0, 100, 3))
    a = write_run(tmp_path / "a", planted(solved))
    b = write_run(tmp_path / "b", planted(solved))
    result = eval_script.compare_runs(str(a), str(b), n_bootstrap=500)
    accuracy = result["metrics"]["eval/accuracy"]
    assert accuracy["difference"] == 0 and accuracy["stderr"] == 0
    assert accuracy["ci_low"] <= 0 <= accuracy["ci_high"]
    assert (result["only_a"], result["only_b"], result["mcnemar_p"]) == (0, 0, 1.0)
    assert result["both"] == len(solved) and result["neither"] == 100 - len(solved)


def test_compare_one_run_better_on_20_planted_problems(tmp_path, capsys):
    rng = np.random.default_rng(0)
    order = rng.permutation(100)
    both = set(order[:40])
    only_a = set(order[40:60])  # A better on 20
    only_b = set(order[60:65])  # B better on 5
    a = write_run(tmp_path / "a", planted(both | only_a))
    b = write_run(tmp_path / "b", planted(both | only_b))
    out = tmp_path / "comparison.json"
    args = tyro.cli(Args, args=["--compare", str(a), str(b), "--compare-out", str(out)])
    assert eval_script.main(args) is None
    result = json.loads(out.read_text())
    assert (result["only_a"], result["only_b"], result["both"], result["neither"]) == (
        20,
        5,
        40,
        35,
    )
    accuracy = result["metrics"]["eval/accuracy"]
    assert (accuracy["a"], accuracy["b"]) == (0.6, 0.45)
    assert accuracy["difference"] == pytest.approx(0.15)
    # paired: the standard error of the per-problem differences (20 of +1, 5 of -1, 75 of 0)
    differences = [1.0] * 20 + [-1.0] * 5 + [0.0] * 75
    assert accuracy["stderr"] == pytest.approx(lm_eval_mean_stderr(differences))
    assert 0 < accuracy["ci_low"] < 0.15 < accuracy["ci_high"]
    # McNemar: 5 or fewer of 25 fair coins on the smaller side, two-sided
    tail = sum(Fraction(math.comb(25, i), 2**25) for i in range(6))
    assert result["mcnemar_p"] == pytest.approx(float(2 * tail))
    printed = capsys.readouterr().out
    assert "+15.00 ±" in printed and "by A only 20, by B only 5" in printed


def test_mcnemar_by_hand():
    assert eval_script.mcnemar_exact(9, 1) == pytest.approx(2 * (1 + 10) / 2**10)
    assert eval_script.mcnemar_exact(1, 9) == eval_script.mcnemar_exact(9, 1)
    assert eval_script.mcnemar_exact(3, 3) == 1.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"template": "question"}, r"differ in template: 'r1_zero' and 'question'"),
        ({"dataset": "math"}, r"differ in dataset"),
        ({"tools": True}, r"differ in tools"),
        ({"limit": 90}, r"different problems: 0 only in A \[\], 10 only in B \['test/90'"),
        ({"answer": "b"}, r"gold answer of problem test/0"),
        ({"prompt": "q"}, r"prompt of problem test/0"),
    ],
)
def test_compare_refuses_runs_over_other_problems_or_templates(tmp_path, change, message):
    records = planted({1, 2, 3})
    a = write_run(tmp_path / "a", records[: change.get("limit", 100)])
    other = [dict(rec, **{k: v for k, v in change.items() if k in rec}) for rec in records]
    args = {k: v for k, v in change.items() if k in ("template", "dataset", "tools")}
    b = write_run(tmp_path / "b", other, **args)
    with pytest.raises(ValueError, match=message):
        eval_script.compare_runs(str(a), str(b))


def test_compare_refuses_a_folder_that_is_no_evaluation(tmp_path):
    a = write_run(tmp_path / "a", planted({1}))
    with pytest.raises(ValueError, match="not an evaluation folder"):
        eval_script.compare_runs(str(a), str(tmp_path))
