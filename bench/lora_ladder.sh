#!/usr/bin/env bash
# The LoRA table (docs/lora.md): GRPO with LoRA adapters of rank 1, 8 and 32 beside full fine-tuning, from one SFT
# checkpoint, the ladder's GRPO settings but --n-grpo-steps $STEPS, seeds in SEEDS. RUNS lists name:lr pairs (full:
# every weight; rN: --lora-rank N, alpha 32); a learning-rate sweep is several pairs of one name. One run folder each
# under $OUT/<name>_lr<lr>, a log beside it; at the end the table: final greedy test accuracy, wall time, trained
# parameters (the line load_policy prints).
# Usage: SFT=runs/ladder__1__.../sft__1__.../checkpoints/step_000625 bash bench/lora_ladder.sh
#        RUNS="r8:3e-4 r8:1e-3 r8:3e-3" SEEDS=1 bash bench/lora_ladder.sh     # the sweep
set -u
SFT=${SFT:?the SFT checkpoint}; OUT=${OUT:-runs/lora_ladder}; STEPS=${STEPS:-10}; SEEDS=${SEEDS:-"1 2 3"}
RUNS=${RUNS:-"full:1e-4 r1:1e-3 r8:1e-3 r32:1e-3"}
PYTHON=${PYTHON:-python}
for seed in $SEEDS; do
  for run in $RUNS; do
    name=${run%%:*}; lr=${run##*:}; rank=0
    if [ "$name" != full ]; then rank=${name#r}; fi
    dir="$OUT/${name}_lr$lr"
    mkdir -p "$dir"
    start=$(date +%s)
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $PYTHON grpo.py --model "$SFT" --dataset synthetic \
      --template question --seed "$seed" --output-dir "$dir" --n-grpo-steps "$STEPS" \
      --rollout-batch-size 256 --group-size 8 --train-batch-size 64 --microbatch-size 64 --lr "$lr" \
      --warmup-steps 20 --lr-schedule cosine --max-tokens 64 --eval-max-tokens 64 --n-eval 256 \
      --eval-split test --eval-every 100000 --save-every 100000 --lora-rank "$rank" > "$dir/seed$seed.log" 2>&1
    echo "${name}_lr$lr seed $seed rc $? wall $(( $(date +%s) - start )) s" >> "$OUT/done.txt"
  done
done
# The table: per run name, the final test accuracy (mean +- standard error over seeds), the mean reward of the last 3
# steps' rollouts (train split: what a sweep may choose by without looking at the test split), the mean wall time.
$PYTHON - "$OUT" <<'EOF'
import json, re, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
walls = {}
for line in (out / "done.txt").read_text().splitlines():
    name, _, _, _, rc, _, wall, _ = line.split()
    if rc == "0":
        walls.setdefault(name, []).append(int(wall))
print("| run | trained parameters | seeds | start | final test accuracy | reward, last 3 steps | wall per run |")
print("|---|---:|---|---|---|---|---|")
for name in walls:
    first, last, reward = [], [], []
    for metrics in sorted((out / name).glob("*/metrics.jsonl")):
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
        rewards = [r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r]
        if len(evals) > 1:
            first.append(evals[0])
            last.append(evals[-1])
            reward.append(statistics.mean(rewards[-3:]))
    if not last:
        continue
    n_trained = re.search(r"trained parameters: ([\d,]+)", next((out / name).glob("seed*.log")).read_text())
    se = statistics.stdev(last) / len(last) ** 0.5 if len(last) > 1 else float("nan")
    print(
        f"| {name} | {n_trained.group(1) if n_trained else '?'} | {len(last)} | {100 * statistics.mean(first):.1f}%"
        f" | {100 * statistics.mean(last):.1f}% ± {100 * se:.1f} | {statistics.mean(reward):.3f}"
        f" | {statistics.mean(walls[name]):.0f} s |"
    )
EOF
