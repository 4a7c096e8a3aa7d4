#!/usr/bin/env bash
# The one prepared GPU check (run it on a machine with a CUDA GPU; see README "GPU"):
# the Triton kernels compiled for real against their torch references, then a short
# benchmark matrix on a real model shape. Everything lands under results/gpu/<time>/.
#
#   bash scripts/gpu_check.sh            # OUT=... to choose the folder
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

# The GPU machine brings its own CUDA torch; install the rest without touching it.
$PY -m pip install -q -e ".[dev]" triton 2>&1 | tail -2 || true
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
$PY -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))" \
    | tee "$OUT/versions.txt"

# 1. Kernels compiled for the GPU (no interpreter), fp32/fp16/bf16, against the torch reference.
INFERLAB_TRITON_DEVICE=cuda $PY -m pytest tests/test_triton_kernels.py \
    tests/test_quant_triton.py -q 2>&1 | tee "$OUT/pytest_triton_cuda.txt"

# 2. A short matrix on the llama3-8b shape (dummy weights, bf16): attention backend x KV
#    layout on one mixed workload; sweep.csv has throughput, TTFT/TPOT, KV utilization.
$PY -m harness.cli run -m model=llama3-8b engine.device=cuda engine.dtype=bf16 \
    engine.max_model_len=4096 engine.max_num_seqs=64 \
    engine.attention_backend=sdpa,triton engine.kv_cache=contiguous,paged \
    workload=mixed workload.num_requests=64 run.warmup_requests=2 \
    "hydra.sweep.dir=$OUT/llama3_8b_matrix" 2>&1 | tail -40 | tee "$OUT/matrix.txt"
echo "results in $OUT"
