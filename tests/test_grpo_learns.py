"""GRPO learns, on a CPU, in a few minutes: a tiny model fine-tuned on a flawed teacher's traces (it
forgets carries, see data.flawed_teacher) learns the flaw with the arithmetic; a few GRPO steps on
the verifier's reward then raise its greedy reward on the same 256 held-out problems far above where
it started, by several times the spread between GRPO seeds.

Like with like, so that the margins hold on any x86-64 CPU: the float kernels differ by instruction
set (AVX2, AVX-512, AMX), so the numbers differ by machine type (docs/ladder.md, "Reproducibility"),
and only the greedy reward on one fixed set of problems, before and after, is compared. Measured
(start -> after 10 steps, seeds 1 / 2 / 3):
  AMD EPYC, AVX2 (pinned or not: the same bits): 0.387 -> 0.762 / 0.742 / 0.703, gains >= 0.316,
    seed std 0.030
  AVX-512 + AMX, unpinned: 0.391 -> 0.711 / 0.703 / 0.695, gains >= 0.304, seed std 0.008
  AMD EPYC, AVX-512 without AMX, unpinned: 0.391 -> 0.789 / 0.801 / 0.820
  the same, with the chunked log-probs (2026-11-26, idle cores): pinned to AVX2 0.395 -> 0.758 /
    0.758 / 0.762, gains >= 0.363, seed std 0.002; unpinned 0.402 -> 0.770 / 0.773 / 0.785,
    gains >= 0.367, seed std 0.008 (7 min for both learning tests, SFT fixture included)
The smallest gain is twice the 0.15 asserted, and ~7 standard errors of a difference of two
accuracies on 256 problems (~0.043). The sampled reward of the rollouts is not asserted on: each
step draws new questions, so its steps-6-10-vs-steps-1-2 comparison had a noise of the size of its
margin (it failed on the AVX-512 machine).

The budget (2 CPU cores): the tiny model and SFT (conftest.flawed_sft_checkpoint, shared with
test_expert_iter_learns.py) ~3 minutes, then GRPO 10 steps of 128 responses, 3 seeds x ~40 s.
ladder.py runs the same recipe with longer RL; its numbers are in the README.
"""

import json
import statistics

import grpo

GRPO_SEEDS = (1, 2, 3)
TASK = dict(dataset="synthetic", template="question")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_grpo_raises_the_reward_by_several_times_the_seed_spread(flawed_sft_checkpoint, tmp_path):
    starts, finals, rollout = [], [], {}
    for seed in GRPO_SEEDS:
        run = grpo.main(
            grpo.Args(
                model=str(flawed_sft_checkpoint),
                **TASK,
                seed=seed,
                output_dir=str(tmp_path),
                n_grpo_steps=10,
                rollout_batch_size=128,
                group_size=8,
                train_batch_size=64,
                microbatch_size=64,
                lr=1e-4,
                # 2 GRPO steps of 2 optimizer steps (128 responses, 64 an update)
                warmup_steps=4,
                max_tokens=64,
                eval_every=10,
                n_eval=256,
                eval_max_tokens=64,
                save_every=100000,
            )
        )
        metrics = read_jsonl(run / "metrics.jsonl")
        # greedy, held-out val: mean reward
        evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
        starts.append(evals[0])
        finals.append(evals[-1])
        rollout[seed] = [m["rollout/reward_mean"] for m in metrics if "rollout/reward_mean" in m]

    gains = [final - start for start, final in zip(starts, finals, strict=True)]
    spread = statistics.stdev(finals)
    print(
        f"val reward {starts[0]:.3f} -> {finals}; gains {gains}; seed std {spread:.3f}; rollout rewards {rollout}"
    )
    assert len(set(starts)) == 1  # every seed starts from the same checkpoint, evaluated greedily
    # the SFT model gets some right (a reward to learn from), and has room to improve
    assert 0.2 < starts[0] < 0.6
    assert min(gains) > 0.15 and min(gains) > 4 * spread
