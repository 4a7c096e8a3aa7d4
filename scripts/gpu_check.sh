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

# 1. Kernels compiled for the GPU (no interpreter), fp32/fp16/bf16, against the torch reference
#    (INT8 KV cache included), and CUDA graph capture/replay against eager decoding.
INFERLAB_TRITON_DEVICE=cuda $PY -m pytest tests/engines/builtin/attention/test_triton_kernels.py \
    tests/engines/builtin/attention/test_triton_kv_int8.py \
    tests/engines/builtin/layers/test_quant_triton.py \
    tests/engines/builtin/test_cuda_graphs.py -q 2>&1 \
    | tee "$OUT/pytest_triton_cuda.txt"

# 1b. Tensor parallelism's NCCL path: the model's collectives on a real NCCL world of one (one
#     GPU lends no second rank; tests/engines/builtin/distributed/ covers two ranks on gloo).
$PY -m pytest tests/engines/builtin/distributed/test_tp_group.py -q 2>&1 \
    | tee "$OUT/pytest_tp_nccl.txt"

# 2. A short matrix on the llama3-8b shape (dummy weights, bf16): attention backend x KV
#    layout on one mixed workload; sweep.csv has throughput, TTFT/TPOT, KV utilization.
$PY -m harness.cli run -m model=llama3-8b engine.device=cuda engine.dtype=bf16 \
    engine.max_model_len=4096 engine.max_num_seqs=64 \
    engine.attention_backend=sdpa,triton engine.kv_cache=contiguous,paged \
    workload=mixed workload.num_requests=64 run.warmup_requests=2 \
    "hydra.sweep.dir=$OUT/llama3_8b_matrix" 2>&1 | tail -40 | tee "$OUT/matrix.txt"

# 3. Batch-1 decode on the llama3-8b shape, Triton attention, eager vs CUDA graphs (the issue-7
#    MBU figure comes from this sweep's steps; 4 requests of 512 output tokens, one at a time).
$PY -m harness.cli run -m model=llama3-8b engine.device=cuda engine.dtype=bf16 \
    engine.max_model_len=2048 engine.max_num_seqs=1 engine.attention_backend=triton \
    engine.kv_cache=paged ++engine.enforce_eager=true,false \
    workload.num_requests=4 workload.input_len=128 workload.output_len=512 \
    run.warmup_requests=1 "hydra.sweep.dir=$OUT/llama3_8b_graphs" 2>&1 | tail -20 \
    | tee "$OUT/graphs.txt"
echo "results in $OUT"
