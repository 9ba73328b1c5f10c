"""Tests for the mixtures in data.py: parse_mixture, read_order (the curriculum) and
mixture_questions_and_seeds.

The counts: 500 steps of 8 questions are N = 4000 draws; a dataset of weight p is drawn Binomial(N,
p) times, mean Np, sigma sqrt(N p (1 - p)): for p = 0.25, 1000 +- 27.4, so 4 sigma is +- 110 (a
false failure about once in 16,000 runs, but the draws are seeded, so a test either always passes or
always fails).
"""

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
from conftest import interrupted_at_call, plant_right_in_score_batch
from transformers import AutoTokenizer

import data
import expert_iter
import grpo
import sft
import verifiers
from data import mixture_questions_and_seeds, parse_mixture, read_order

SIZES = [100, 60, 40, 80]  # four datasets, as gsm8k, math, mbpp, ifeval in a four-way mixture


def draws(weights, steps, n_prompts=8, seed=0, orders=None, sizes=SIZES):
    """The (dataset, index) picks of steps 0 .. steps - 1, one list per step."""
    return [
        mixture_questions_and_seeds(sizes, weights, n_prompts, 4, seed, s, orders)[0]
        for s in range(steps)
    ]


# --- parse_mixture ---


def test_parse_mixture():
    assert parse_mixture("gsm8k") == [("gsm8k", 1.0)]
    assert parse_mixture("gsm8k:0.25,math:0.25,mbpp:0.25,ifeval:0.25") == [
        ("gsm8k", 0.25),
        ("math", 0.25),
        ("mbpp", 0.25),
        ("ifeval", 0.25),
    ]
    # relative weights, spaces ok
    assert parse_mixture(" gsm8k : 3 , math:1 ") == [("gsm8k", 3.0), ("math", 1.0)]
    # a zero weight is never drawn
    assert parse_mixture("gsm8k:1,math:0") == [("gsm8k", 1.0), ("math", 0.0)]


@pytest.mark.parametrize(
    "spec, named",
    [
        ("gsm9k:0.5,math:0.5", "unknown dataset 'gsm9k'"),
        ("gsm8k:0.5,math:-0.5", "weight of 'math' must be finite and >= 0, got '-0.5'"),
        ("gsm8k:0,math:0", "the weights sum to zero"),
        ("gsm8k:abc", "weight 'abc' of 'gsm8k' is not a number"),
        ("gsm8k:nan", "weight of 'gsm8k' must be finite"),
        ("gsm8k:inf", "weight of 'gsm8k' must be finite"),
        ("gsm8k:", "malformed part 'gsm8k:'"),
        ("gsm8k,,math", "malformed part ''"),
        (":0.5", "malformed part ':0.5'"),
        ("", "malformed part ''"),
        ("gsm8k:0.5,math:0.2,gsm8k:0.3", "dataset 'gsm8k' given twice"),
    ],
)
def test_parse_mixture_rejects(spec, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")) as error:
        parse_mixture(spec)
    assert repr(spec) in str(error.value)  # the whole spec too, as the user typed it


# --- drawing the questions of a step ---


def step_questions_and_seeds_before_mixtures(n_questions, n_prompts, group_size, seed, step):
    """grpo.py's and expert_iter.py's draw before mixtures (ece0a0c), verbatim: what a plain
    --dataset replays."""
    rng = np.random.default_rng([seed, step])
    indices = rng.choice(n_questions, size=n_prompts, replace=False).tolist()
    first_seed = int(rng.integers(2**30))
    return indices, [first_seed + j * group_size for j in range(n_prompts)]


def test_one_dataset_draws_exactly_as_before_mixtures():
    """A plain --dataset must replay every existing run: same questions, same sampling seeds,
    through data.Task's questions, which grpo.py and expert_iter.py both draw each step's questions
    with."""
    train = [{"id": f"q{i}", "dataset": "gsm8k"} for i in range(100)]
    task = data.Task(["gsm8k"], [1.0], {"gsm8k": "r1_zero"}, train, [100], [None], {})
    for seed in (0, 1, 42):
        for n_prompts in (1, 4, 16):
            for step in range(25):
                before = step_questions_and_seeds_before_mixtures(100, n_prompts, 4, seed, step)
                picks, seeds = mixture_questions_and_seeds([100], [1.0], n_prompts, 4, seed, step)
                assert (picks, seeds) == ([(0, i) for i in before[0]], before[1])
                examples, task_seeds = task.questions(n_prompts, 4, seed, step)
                assert (examples, task_seeds) == ([train[i] for i in before[0]], before[1])


def test_counts_follow_the_weights():
    """500 steps x 8 questions: each dataset's count within 4 sigma of N p (bound computed here, see
    the docstring)."""
    n = 500 * 8
    for weights in ([0.25] * 4, [0.5, 0.3, 0.2, 0.0], [3, 1, 0, 0]):
        counts = [0] * 4
        for picks in draws(weights, 500):
            for d, _ in picks:
                counts[d] += 1
        for d, w in enumerate(weights):
            p = w / sum(weights)
            assert abs(counts[d] - n * p) <= 4 * math.sqrt(n * p * (1 - p)), (weights, counts)
    assert counts[2] == counts[3] == 0  # weight 0: never drawn


def test_draws_are_a_function_of_seed_and_step():
    weights = [0.25] * 4
    a, b = draws(weights, 30, seed=7), draws(weights, 30, seed=7)
    assert a == b
    assert a != draws(weights, 30, seed=8)
    assert len({tuple(picks) for picks in a}) == 30  # every step draws anew
    for picks in a:
        assert len(set(picks)) == len(picks)  # distinct questions within a step
        assert all(0 <= i < SIZES[d] for d, i in picks)
    # Each question gets its own group of sampling seeds, group_size apart
    _, seeds = mixture_questions_and_seeds(SIZES, weights, 8, 4, 7, 3)
    assert [s - seeds[0] for s in seeds] == [0, 4, 8, 12, 16, 20, 24, 28]


# --- the curriculum: an order per dataset ---

# an order for dataset 2 (size 40), shorter than a run: it wraps around
ORDER = [39, 0, 17, 5, 38, 2, 11]


def test_curriculum_order_across_steps():
    """The k-th question ever drawn from dataset 2 is ORDER[k % 7], across 40 steps."""
    weights = [0.25] * 4
    steps = draws(weights, 40, orders=[None, None, ORDER, None])
    drawn = [i for picks in steps for d, i in picks if d == 2]
    assert len(drawn) > 2 * len(ORDER)  # the order wrapped around at least twice
    assert drawn == [ORDER[k % len(ORDER)] for k in range(len(drawn))]
    # The order fixes which questions, not how many: the datasets of each step are those of the
    # unordered run
    assert [[d for d, _ in picks] for picks in steps] == [
        [d for d, _ in picks] for picks in draws(weights, 40)
    ]


def test_curriculum_resume_continues_the_order():
    """A resumed run computes step 25 from (seed, step) alone and continues the order where step 24
    left it."""
    orders = [ORDER, None, None, [1, 2, 3]]
    run = draws([0.4, 0.3, 0.2, 0.1], 40, seed=3, orders=orders)
    for step in (25, 39, 0):
        data._DRAWN.clear()  # a fresh process: nothing remembered of the steps before
        alone, _ = mixture_questions_and_seeds(SIZES, [0.4, 0.3, 0.2, 0.1], 8, 4, 3, step, orders)
        assert alone == run[step]
    drawn = [i for picks in run for d, i in picks if d == 0]
    assert drawn == [ORDER[k % len(ORDER)] for k in range(len(drawn))]


def test_a_step_that_draws_more_than_a_dataset_has_says_so():
    with pytest.raises(
        ValueError, match="step 0 drew 10 questions of dataset 2 of the mixture, which has 3"
    ):
        draws([0.5, 0.5], 1, n_prompts=16, sizes=[100, 3])


def test_curriculum_one_dataset():
    """One dataset with an order: step s takes order[8 s], ..., order[8 s + 7] (wrapping around)."""
    order = list(range(99, -1, -1))  # hardest first, say
    picks, _ = mixture_questions_and_seeds([100], [1.0], 8, 4, 0, 12, [order])
    # k = 96 .. 103 -> 3, 2, 1, 0, 99, 98, 97, 96
    assert picks == [(0, 99 - (96 + j) % 100) for j in range(8)]


def test_read_order(tmp_path):
    examples = [{"id": f"q{i}"} for i in range(5)]
    path = tmp_path / "order.txt"
    path.write_text("q3\nq0\n\nq4\n")
    assert read_order(path, examples) == [3, 0, 4]
    path.write_text("q3\nq0\nq9\n")
    with pytest.raises(data.DataError, match=f"{path}:3: id 'q9' is not in the dataset"):
        read_order(path, examples)
    path.write_text("\n")
    with pytest.raises(data.DataError, match="no ids"):
        read_order(path, examples)


def test_four_way_mixture_on_the_shared_data(tmp_path, shared_data):
    """The issue's mixture on the real train splits, with a curriculum for MBPP: 200 steps of 16
    questions, N = 3200, each dataset 800 +- 98 (4 sigma); every pick's example names the verifier
    of its dataset."""
    mixture = parse_mixture("gsm8k:0.25,math:0.25,mbpp:0.25,ifeval:0.25")
    train = [data.load(name, "train", shared_data) for name, _ in mixture]
    # the file backwards, as a stand-in for easiest-first
    mbpp_ids = [ex["id"] for ex in train[2]][::-1]
    (tmp_path / "mbpp_order.txt").write_text("\n".join(mbpp_ids) + "\n")
    orders = [None, None, read_order(tmp_path / "mbpp_order.txt", train[2]), None]
    sizes, weights = [len(examples) for examples in train], [w for _, w in mixture]
    steps = draws(weights, 200, n_prompts=16, orders=orders, sizes=sizes)
    counts = [sum(d == k for picks in steps for d, _ in picks) for k in range(4)]
    assert all(abs(c - 800) <= 4 * math.sqrt(3200 * 0.25 * 0.75) for c in counts), counts
    verifier = {"gsm8k": "gsm8k", "math": "math", "mbpp": "code", "ifeval": "ifeval"}
    assert all(
        train[d][i]["verifier"] == verifier[mixture[d][0]] for picks in steps for d, i in picks
    )
    mbpp_drawn = [train[2][i]["id"] for picks in steps for d, i in picks if d == 2]
    assert mbpp_drawn == [mbpp_ids[k % len(mbpp_ids)] for k in range(counts[2])]


# --- the flags beside --dataset: per-dataset templates, eval splits ---


def test_parse_per_dataset_and_templates():
    names = ["gsm8k", "mbpp", "ifeval"]
    assert data.parse_per_dataset(["mbpp=a.txt", " gsm8k = b=c.txt "], names, "--curriculum") == {
        "mbpp": "a.txt",
        "gsm8k": "b=c.txt",
    }
    for pair, named in [
        ("math=a.txt", "'math' is not in the mixture"),
        ("mbpp", "write dataset=value"),
        ("mbpp=", "write dataset=value"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"--curriculum {pair!r}: {named}")):
            data.parse_per_dataset([pair], names, "--curriculum")
    with pytest.raises(ValueError, match="given twice"):
        data.parse_per_dataset(["mbpp=a", "mbpp=b"], names, "--curriculum")
    templates = data.dataset_templates(names, "r1_zero", ["ifeval=question"])
    assert templates == {"gsm8k": "r1_zero", "mbpp": "r1_zero", "ifeval": "question"}
    with pytest.raises(ValueError, match="--dataset-templates ifeval=question"):
        # IFEval's verifier reads the whole response, not <answer>
        data.dataset_templates(names, "r1_zero", [])
    with pytest.raises(ValueError, match="template 'r2_zero' of 'mbpp': unknown"):
        data.dataset_templates(names, "question", ["mbpp=r2_zero"])


def test_eval_split_falls_back_to_test_where_there_is_no_val():
    assert [
        data.eval_split(name, "val") for name in ("gsm8k", "math", "mbpp", "ifeval", "synthetic")
    ] == ["val", "test", "val", "test", "val"]
    assert (
        data.eval_split("gsm8k", "test") == "test" and data.eval_split("math", "train") == "train"
    )


# --- SFT: the examples of a mixture ---


def test_sft_mixes_pairs_by_weight_reproducibly():
    sets = [[{"d": d, "i": i} for i in range(size)] for d, size in enumerate([100, 40, 30])]
    # one dataset: its first n, as before mixtures
    assert data.mix_pairs(sets[:1], [1.0], 7, seed=0) == sets[0][:7]
    assert data.mix_pairs(sets[:1], [1.0], None, seed=0) == sets[0]
    # mbpp-like set of 30 limits: n = 120
    mixed = data.mix_pairs(sets, [0.5, 0.25, 0.25], None, seed=0)
    assert [sum(p["d"] == d for p in mixed) for d in range(3)] == [60, 30, 30]
    assert len({(p["d"], p["i"]) for p in mixed}) == len(mixed)  # no pair twice
    assert mixed == data.mix_pairs(sets, [0.5, 0.25, 0.25], None, seed=0)
    # another random subset of dataset 0
    assert mixed != data.mix_pairs(sets, [0.5, 0.25, 0.25], None, seed=1)
    assert [
        sum(p["d"] == d for p in data.mix_pairs(sets, [2, 1, 1], 40, seed=0)) for d in range(3)
    ] == [20, 10, 10]
    with pytest.raises(ValueError, match="dataset 3 of the mixture has 30, its weight asks for 50"):
        data.mix_pairs(sets, [0.5, 0.0, 0.5], 100, seed=0)


def test_sft_pairs_of_a_three_way_mixture(tiny_model_dir, shared_data):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = sft.Args(
        dataset="gsm8k:0.5,math:0.25,mbpp:0.25",
        data_dir=str(shared_data),
        template="question",
        dataset_templates=["mbpp=r1_zero"],
        batch_size=4,
    )
    task = data.load_task(args, tokenizer)  # as sft.main builds its pairs
    pairs = data.sft_pairs(task, args.sft_file, args.n_examples, args.seed)
    counts = {
        name: sum(p["example"]["dataset"] == name for p in pairs)
        for name in ("gsm8k", "math", "mbpp")
    }
    # MBPP's 374 train tasks are a quarter: n = 1496
    assert counts == {"gsm8k": 748, "math": 374, "mbpp": 374}
    assert all(
        p["prompt"].startswith("A conversation") == (p["example"]["dataset"] == "mbpp")
        for p in pairs
    )
    # Each response is its dataset's worked solution in its template (sft.main then appends EOS:
    # test_sft.py)
    assert all(p["response"] == task.response(p["example"]) for p in pairs)


# --- the scripts: a bad spec stops before the engine starts ---


@pytest.mark.parametrize("script", [grpo, expert_iter, sft])
@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"dataset": "gsm8k:0.5,maths:0.5"}, "unknown dataset 'maths'"),
        ({"dataset": "gsm8k:-1,math:2"}, "weight of 'gsm8k' must be finite and >= 0, got '-1'"),
        ({"dataset": "gsm8k:0,math:0"}, "the weights sum to zero"),
        ({"dataset": "gsm8k:0.5:math"}, "weight '0.5:math' of 'gsm8k' is not a number"),
        ({"dataset": "gsm8k,math,"}, "malformed part ''"),
        # under the default r1_zero
        ({"dataset": "gsm8k,mbpp,ifeval"}, "ifeval is scored on the whole response"),
        (
            {"dataset": "gsm8k,math", "dataset_templates": ["mbpp=question"]},
            "'mbpp' is not in the mixture",
        ),
        (
            {"dataset_templates": ["gsm8k:question"]},
            "--dataset-templates 'gsm8k:question': write dataset=value",
        ),
    ],
)
def test_bad_specs_stop_before_the_engine_starts(script, overrides, named, tmp_path, monkeypatch):
    monkeypatch.setattr(script, "init_vllm", lambda *a: pytest.fail("the engine must not start"))
    with pytest.raises(ValueError, match=re.escape(named)):
        script.main(script.Args(output_dir=str(tmp_path), **overrides))
    assert not list(tmp_path.iterdir())  # not even a run folder


@pytest.mark.parametrize("script", [grpo, expert_iter])
def test_bad_curriculum_stops_before_the_engine_starts(
    script, tiny_model_dir, shared_data, tmp_path, monkeypatch
):
    monkeypatch.setattr(script, "init_vllm", lambda *a: pytest.fail("the engine must not start"))
    common = dict(
        model=str(tiny_model_dir),
        dataset="gsm8k,mbpp",
        data_dir=str(shared_data),
        output_dir=str(tmp_path),
    )
    with pytest.raises(
        ValueError, match=re.escape("--curriculum 'math=o.txt': 'math' is not in the mixture")
    ):
        script.main(script.Args(**common, curriculum=["math=o.txt"]))
    order = tmp_path / "order.txt"
    order.write_text("mbpp/601\nmbpp/2\n")  # task 2 is in MBPP's prompt split, not train
    with pytest.raises(
        data.DataError, match=re.escape(f"{order}:2: id 'mbpp/2' is not in the dataset")
    ):
        script.main(script.Args(**common, curriculum=[f"mbpp={order}"]))
    # 800 questions a step, half of them MBPP's: more than its 374 train tasks
    many = (
        {"n_questions": 800}
        if script is expert_iter
        else {"rollout_batch_size": 1600, "train_batch_size": 1600}
    )
    with pytest.raises(ValueError, match="50% from mbpp, but its train split has 374"):
        script.main(script.Args(**common, **many, group_size=2))


def test_sft_refuses_ifeval_without_solutions(shared_data, tmp_path, monkeypatch):
    # data.sft_pairs refuses, after data.load_task has read the train splits (hence --data-dir: no
    # hub download).
    monkeypatch.setattr(sft, "init_vllm", lambda *a: pytest.fail("the engine must not start"))
    with pytest.raises(ValueError, match="ifeval has no worked solutions"):
        sft.main(
            sft.Args(
                dataset="gsm8k,ifeval",
                dataset_templates=["ifeval=question"],
                data_dir=str(shared_data),
                output_dir=str(tmp_path),
            )
        )
    assert not list(tmp_path.iterdir())  # not even a run folder


# --- whole runs on the four-way mixture: the tiny model, the real engine, the real data (first 64 of each split) ---

MIXTURE = "gsm8k:0.4,math:0.3,mbpp:0.2,ifeval:0.1"
NAMES, WEIGHTS = ["gsm8k", "math", "mbpp", "ifeval"], [0.4, 0.3, 0.2, 0.1]
N_SLICE = 64


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_settings(tiny_model_dir, shared_data, tmp_path, **overrides) -> dict:
    """Template "question" (short prompts; IFEval needs it), but r1_zero for MBPP: a mixed batch of
    two templates."""
    return dict(
        model=str(tiny_model_dir),
        dataset=MIXTURE,
        data_dir=str(shared_data),
        template="question",
        dataset_templates=["mbpp=r1_zero"],
        output_dir=str(tmp_path),
        group_size=2,
        max_tokens=8,
        n_eval=2,
        eval_max_tokens=4,
        n_log_generations=1,
        **overrides,
    )


@pytest.fixture(scope="module")
def small_splits():
    """The first 64 examples of every split: the scripts render (GRPO also tokenizes) every train
    prompt, and the tiny model's 2,048-token context cannot hold the longest MATH prompts in its
    character-level tokens."""
    load = data.load
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            data, "load", lambda name, split, data_dir=None: load(name, split, data_dir)[:N_SLICE]
        )
        yield


def expected_counts(n_prompts, seed, steps):
    """The number of questions of each dataset that data.mixture_questions_and_seeds draws in these
    steps."""
    draws = [
        mixture_questions_and_seeds([N_SLICE] * 4, WEIGHTS, n_prompts, 2, seed, step)[0]
        for step in steps
    ]
    picks = [pick for step in draws for pick in step]
    return [sum(d == k for d, _ in picks) for k in range(4)]


def assert_within_4_sigma(counts):
    n = sum(counts)
    for count, w in zip(counts, WEIGHTS, strict=True):
        assert abs(count - n * w) <= 4 * math.sqrt(n * w * (1 - w)), (counts, n)


@pytest.fixture(scope="module")
def grpo_curriculum_run(small_splits, tiny_model_dir, shared_data, tmp_path_factory):
    """GRPO, 2 steps of 48 questions x 2 responses, MBPP in a fixed order (its 64 ids backwards),
    real verifiers, with gold solutions planted in place of even-length responses
    (conftest.plant_right_in_score_batch: a mix of right and wrong to recount): stopped during step
    2 (after step 1's checkpoint), then resumed in a fresh draw memory, as a new process."""
    tmp_path = tmp_path_factory.mktemp("grpo_mixture")
    order = [ex["id"] for ex in data.load("mbpp", "train", shared_data)][::-1]
    (tmp_path / "mbpp_order.txt").write_text("\n".join(order) + "\n")
    args = grpo.Args(
        **run_settings(
            tiny_model_dir,
            shared_data,
            tmp_path / "runs",
            n_grpo_steps=2,
            save_every=1,
            rollout_batch_size=96,
            train_batch_size=96,
            microbatch_size=32,
            lr=1e-2,
            eval_every=1000,
            curriculum=[f"mbpp={tmp_path / 'mbpp_order.txt'}"],
        )
    )
    with pytest.MonkeyPatch.context() as mp:
        plant_right_in_score_batch(mp)
        # once a step: step 2 dies after writing its rollouts
        with interrupted_at_call(grpo, "write_rollouts", 2):
            grpo.main(args)
        (run_dir,) = (tmp_path / "runs").iterdir()
        data._DRAWN.clear()
        assert grpo.main(replace(args, resume=str(run_dir))) == run_dir
    return run_dir, order


def test_grpo_on_a_four_way_mixture_draws_by_weight_and_logs_each_task(
    grpo_curriculum_run, shared_data
):
    run_dir, _ = grpo_curriculum_run
    rollouts, metrics = (
        read_jsonl(run_dir / "rollouts.jsonl"),
        read_jsonl(run_dir / "metrics.jsonl"),
    )
    assert [m["step"] for m in metrics] == [0, 1, 2]  # the stopped step 2 was dropped and rewritten
    counts = [sum(row["dataset"] == name for row in rollouts) for name in NAMES]
    # exactly the draws of data.mixture_questions_...
    assert counts == expected_counts(48, seed=1, steps=[0, 1])
    assert_within_4_sigma(counts)  # ... which follow the weights: 96 draws, e.g. gsm8k 38.4 +- 19.2
    # a mix of right and wrong in each task the gold was planted in, or the recount proves little
    for name in ("gsm8k", "math", "mbpp"):
        rewards = [r for row in rollouts if row["dataset"] == name for r in row["rewards"]]
        print(f"{name}: {sum(rewards):.0f} right of {len(rewards)}")
        assert 0 < sum(rewards) < len(rewards), name
    for step, m in zip([1, 2], metrics[1:], strict=True):
        rows = [row for row in rollouts if row["step"] == step]
        assert m["rollout/reward_mean"] == pytest.approx(
            np.mean([r for row in rows for r in row["rewards"]])
        )
        for name in NAMES:
            mine = [r for row in rows if row["dataset"] == name for r in row["rewards"]]
            assert m[f"rollout/{name}/count"] == len(mine) // 2
            assert m[f"rollout/{name}/reward_mean"] == (
                pytest.approx(np.mean(mine)) if mine else None
            )
    # evaluations: each dataset on its own split, and the total over all 4 x 2
    for m in (metrics[0], metrics[2]):
        accuracies = [m[f"eval/{name}/accuracy"] for name in NAMES]
        # 2 problems each: the mean of the means
        assert m["eval/accuracy"] == pytest.approx(np.mean(accuracies))
    # Each row names its dataset, holds one of that dataset's questions, rendered in that dataset's
    # template
    assert all(
        row["prompt"].startswith("A conversation") == (row["dataset"] == "mbpp") for row in rollouts
    )
    ids = {name: {ex["id"] for ex in data.load(name, "train", shared_data)} for name in NAMES}
    assert all(row["id"] in ids[row["dataset"]] for row in rollouts)


def test_curriculum_order_continues_across_a_resume(grpo_curriculum_run):
    run_dir, order = grpo_curriculum_run
    mbpp = [row for row in read_jsonl(run_dir / "rollouts.jsonl") if row["dataset"] == "mbpp"]
    # step 1 before the stop, step 2 after the resume
    assert {row["step"] for row in mbpp} == {1, 2}
    # the k-th MBPP question drawn is the k-th id of the file
    assert [row["id"] for row in mbpp] == order[: len(mbpp)]


def test_expert_iteration_on_a_four_way_mixture(
    small_splits, tiny_model_dir, shared_data, tmp_path, monkeypatch
):
    """2 EI steps of 48 questions x 2 responses, the real verifiers: a random tiny model solves
    nothing, so even-length responses to GSM8K, MATH and MBPP are scored as their gold solutions
    (conftest.plant_right_in_score_batch), and something is kept."""
    plant_right_in_score_batch(monkeypatch)
    run_dir = expert_iter.main(
        expert_iter.Args(
            **run_settings(
                tiny_model_dir,
                shared_data,
                tmp_path,
                n_ei_steps=2,
                n_questions=48,
                n_sft_epochs=1,
                batch_size=32,
                microbatch_size=32,
                lr=1e-3,
                warmup_steps=0,
                max_seq_len=1024,
            )
        )
    )
    metrics, kept = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "kept.jsonl")
    train = {(name, ex["id"]): ex for name in NAMES for ex in data.load(name, "train", shared_data)}
    # what was drawn
    counts = [sum(m[f"rollout/{name}/count"] for m in metrics[1:]) for name in NAMES]
    assert counts == expected_counts(48, seed=1, steps=[0, 1])
    assert_within_4_sigma(counts)
    right, responses = dict.fromkeys(NAMES, 0), dict.fromkeys(NAMES, 0)
    for m in metrics[1:]:
        assert sum(m[f"rollout/{name}/count"] for name in NAMES) == 48
        kept_here = [row for row in kept if row["step"] == m["step"]]
        assert len(kept_here) == m["rollout/n_kept"] > 0
        # kept.jsonl names each row's dataset: at most the 2 responses of each question drawn
        for name in NAMES:
            assert (
                sum(row["dataset"] == name for row in kept_here) <= 2 * m[f"rollout/{name}/count"]
            )
        # the per-task reward means recount from kept.jsonl: of a task's 2 n responses, n_right =
        # mean x 2 n are right, and the kept rows are those, a right text kept once a question
        # (so between n_right / 2 and n_right of them)
        for name in NAMES:
            n = m[f"rollout/{name}/count"]
            if not n:
                assert m[f"rollout/{name}/reward_mean"] is None, name
                continue
            n_right = round(m[f"rollout/{name}/reward_mean"] * 2 * n, 6)
            assert n_right == int(n_right), (name, n_right)
            n_kept = sum(row["dataset"] == name for row in kept_here)
            assert math.ceil(n_right / 2) <= n_kept <= n_right, (name, n_right, n_kept)
            right[name] += n_right
            responses[name] += 2 * n
        # the kept rows are the step's right answers, once per question: the real verifier
        # accepts each one's planted gold (even length) or, for IFEval, the response itself
        for row in kept_here:
            example = train[row["dataset"], row["id"]]
            planted = len(row["response"]) % 2 == 0 and row["verifier"] != "ifeval"
            response = data.render_response(example, "question") if planted else row["response"]
            assert verifiers.score_batch([response], [example])[0]["reward"] == 1.0, row["id"]
    # a mix of right and wrong where gold was planted, or the recount proves little
    print({name: f"{right[name]:.0f} right of {responses[name]}" for name in NAMES})
    assert all(0 < right[name] < responses[name] for name in ("gsm8k", "math", "mbpp")), right
    assert {row["dataset"] for row in kept} <= set(NAMES) and len(
        {row["dataset"] for row in kept}
    ) >= 3
    for m in (metrics[0], metrics[2]):
        assert all(f"eval/{name}/accuracy" in m for name in NAMES) and "eval/accuracy" in m
