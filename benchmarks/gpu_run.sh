#!/usr/bin/env bash
# The prepared GPU check (one run, about 6 minutes on an H200; the
# table printed last): the MLP block's training step, bf16 against every
# 8-bit preset, timed side by side, profiled, each variant's cold compile in
# a fresh process (trace, lower, XLA compile; and without autotuning); then
# the example transformer at its GPU size in bf16, fp8_delayed, and fp8 and
# fp8_delayed with attention's two einsums in bf16 (fp8_proj,
# fp8_delayed_proj: qbits._experiments.LM_RECIPES; plain fp8 measured 0.89x
# on 2026-11-27, estimated 0.86x now: see benchmarks/results/gpu_estimate.md).
# Writes benchmarks/results/train_step_{mlp,lm}_gpu.{json,md} (or into $OUT)
# and the optimized HLO of every variant (hlo_gpu.tgz).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
hlo=$(mktemp -d)
python3 benchmarks/train_step.py --gpu --cold-compile --rounds 10 --reps 3 \
  --hlo-dir "$hlo/mlp" --json "$out/train_step_mlp_gpu.json" \
  --md "$out/train_step_mlp_gpu.md" > "$out/gpu_run.log" 2>&1
python3 benchmarks/train_step.py --gpu --model lm --variants bf16,fp8_delayed,fp8_proj,fp8_delayed_proj \
  --rounds 5 --reps 2 --hlo-dir "$hlo/lm" --json "$out/train_step_lm_gpu.json" \
  --md "$out/train_step_lm_gpu.md" >> "$out/gpu_run.log" 2>&1
tar czf "$out/hlo_gpu.tgz" -C "$hlo" .
tail -n 5 "$out/gpu_run.log"
cat "$out/train_step_lm_gpu.md" "$out/train_step_mlp_gpu.md"
