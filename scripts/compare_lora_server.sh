#!/bin/bash
# The same LoRA adapter workload in process and through `inferlab serve` (engine=openai), two
# rounds each, alternated (docs/lora.md, Measured). Run folders under ${OUT:-results/lora_cmp}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/lora_cmp}
PORT=${PORT:-8123}
ENGINE="engine.enable_lora=true engine.max_loras=16 engine.max_lora_rank=64 engine.lora_dummy_adapters=16 engine.lora_dummy_rank=8 engine.max_model_len=512 engine.max_num_seqs=16"
W="workload.num_requests=32 workload.input_len=64 workload.output_len=64 workload.arrival={process:closed,concurrency:16} workload.lora_adapters=[dummy-0,dummy-1,dummy-2,dummy-3] run.warmup_requests=2 run.progress=false"
.venv/bin/inferlab serve model=smollm2-135m $ENGINE port=$PORT log_level=warning &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
for round in 1 2; do
  .venv/bin/inferlab run model=smollm2-135m $ENGINE $W hydra.run.dir=$OUT/inproc-$round
  .venv/bin/inferlab run engine=openai model=smollm2-135m engine.base_url=http://127.0.0.1:$PORT/v1 \
    $W hydra.run.dir=$OUT/server-$round
done
