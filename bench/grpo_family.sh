#!/usr/bin/env bash
# The GRPO family table (docs/grpo_family.md): every variant from one SFT checkpoint, the ladder's GRPO settings but
# --n-grpo-steps $STEPS, seeds in SEEDS, the variants in ORDER; one run folder each under $OUT/<variant>, a log beside it.
# Usage: SFT=runs/ladder__1__.../sft__1__.../checkpoints/step_000625 bash bench/grpo_family.sh
# FLAGS: more flags for every run (FLAGS=--cpu-bf16: a bf16 engine, the planted mismatch); PIN: the ISA the runs hold
# torch and oneDNN to (default AVX2, as the ladder; PIN= holds none, which --cpu-bf16 needs); SCRIPT: what runs
# (default grpo_family.py; SCRIPT="-m bench.planted_mismatch": the same with a planted engine/trainer mismatch).
set -u
SFT=${SFT:?the SFT checkpoint}; OUT=${OUT:-runs/grpo_family}; STEPS=${STEPS:-10}; SEEDS=${SEEDS:-"1 2 3"}
FLAGS=${FLAGS:-}; PIN=${PIN-"ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"}; SCRIPT=${SCRIPT:-grpo_family.py}
declare -A VARIANTS=(
  [no_baseline]="--loss-type no_baseline" [reinforce_with_baseline]="--loss-type reinforce_with_baseline"
  [grpo_clip_token_mean]="" [grpo_clip_sequence_mean]="--loss-aggregation sequence_mean"
  [grpo_clip_constant]="--loss-aggregation constant" [clip_higher]="--clip-high 0.28" [kl]="--beta 0.04"
  [gspo]="--loss-type gspo --clip-low 3e-4 --clip-high 4e-4" [cispo]="--loss-type cispo --clip-low 1 --clip-high 0.28"
  [overlong]="--overlong-buffer 16 --overlong-penalty 1" [dynamic_sampling]="--dynamic-sampling --max-draws 4"
  [is_sequence]="--is-level sequence" [is_mask]="--is-mode mask --vllm-importance-sampling-cap 3"
  [icepop]="--is-mode icepop --vllm-importance-sampling-cap 5" [kl_is_correction]="--beta 0.04 --kl-is-correction"
  [off_policy_seq_mask]="--off-policy-seq-mask 0.1" [gdpo]="--reward-aggregation gdpo"
)
ORDER=${ORDER:-"grpo_clip_token_mean gspo cispo reinforce_with_baseline no_baseline grpo_clip_sequence_mean
grpo_clip_constant clip_higher kl overlong dynamic_sampling is_sequence is_mask icepop kl_is_correction
off_policy_seq_mask gdpo"}
for seed in $SEEDS; do
  for name in $ORDER; do
    mkdir -p "$OUT/$name"
    start=$(date +%s)
    # shellcheck disable=SC2086
    env $PIN python $SCRIPT --model "$SFT" --dataset synthetic \
      --template question --seed "$seed" --output-dir "$OUT/$name" --n-grpo-steps "$STEPS" \
      --rollout-batch-size 256 --group-size 8 --train-batch-size 64 --microbatch-size 64 --lr 1e-4 \
      --warmup-steps 20 --lr-schedule cosine --max-tokens 64 --eval-max-tokens 64 --n-eval 256 \
      --eval-split test --eval-every 100000 --save-every 100000 ${VARIANTS[$name]} $FLAGS > "$OUT/$name/seed$seed.log" 2>&1
    echo "$name seed $seed rc $? wall $(( $(date +%s) - start )) s" >> "$OUT/done.txt"
  done
done
