#!/usr/bin/env bash
# GPU benchmark for a lent NVIDIA H100/H200 (the device tool), one call of at most 9 min:
#   bash benchmarks/gpu.sh            # results in $OUT (or ./gpu-results)
# 1. the CUDA-marked tests; 2. `mixprec bench --device cuda` on a compute-bound GPT
# (12 layers, d=2048, seq 2048, ~600M parameters) for fp32, tf32, bf16, bf16-master,
# bf16-master with wgrad=fp32 (its cost on a GPU), fp16, fp8, fp8-rowwise, and the block
# recipes fp8-block, mxfp8, nvfp4 (their dequantizing fp32 GEMMs; torch's block-scaled
# _scaled_mm is not wired yet); 3. the same on the plain MLP; 4. the per-layer planner's
# predicted step and peak against measured ones (benchmarks/plan.py) on the medium GPT.
# Each step is time-boxed so the whole stays < 9 min.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
timeout 170 python -m pytest -q -m cuda tests -p no:cacheprovider 2>&1 | tee "$OUT/cuda-tests.txt"
timeout 250 python -m mixprec bench --device cuda --size large --batch 8 --steps 4 \
  --recipes "fp32;tf32;bf16;bf16-master;bf16-master,wgrad=fp32;fp16;fp8;fp8-rowwise;fp8-block;mxfp8;nvfp4" 2>&1 | tee "$OUT/bench-gpt.txt"
timeout 50 python -m mixprec bench --device cuda --model mlp --batch 64 --seq 256 --steps 5 \
  --recipes "fp32;bf16;fp16;fp8;fp8-block;mxfp8;nvfp4" 2>&1 | tee "$OUT/bench-mlp.txt"
timeout 90 python benchmarks/plan.py --device cuda --models gpt --size medium --batch 32 \
  --steps 5 2>&1 | tee "$OUT/plan.txt"
echo "results in $OUT"
