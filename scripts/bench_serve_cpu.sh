#!/usr/bin/env bash
# Runs every `tokenmill bench serve` workload against a CPU tokenmill server and writes the JSON
# reports and plots to docs/bench/. The model has tiny-llama-cpu's shapes (8 layers, hidden 512)
# with a 512-token trained tokenizer, random weights; lengths are scaled by 0.1 for 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench
model=$(mktemp -d)/tiny-llama-cpu
python - "$model" <<'PY'
import sys
from tokenmill.testing.checkpoints import build_checkpoint
build_checkpoint(sys.argv[1], "llama", hidden_size=512, intermediate_size=1408,
                 num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                 max_position_embeddings=4096, initializer_range=0.02, rope_scaling=None)
PY
port=8199
tokenmill --log-level WARNING serve "$model" --port $port --served-model-name tiny-cpu \
  --max-model-len 4096 --device cpu &
server=$!
trap 'kill $server' EXIT
until curl -sf localhost:$port/health >/dev/null; do sleep 0.5; done
run() {  # workload extra-args...
  local w=$1; shift
  tokenmill --log-level WARNING bench serve --base-url http://127.0.0.1:$port --model tiny-cpu \
    --workload "$w" --length-scale 0.1 --slo ttft:500,itl:50 \
    --output "$out/$w.json" --plot "$out/$w.png" "$@" | tee "$out/$w.txt"
}
run random --num-requests 16 --request-rate 2 --input-len 1024 --output-len 1280
run shared-prefix --num-requests 16 --request-rate 2
run chatbot --num-requests 8 --request-rate 1
run agent --num-requests 2 --request-rate 1
run data --num-requests 16 --max-concurrency 8
tokenmill --log-level WARNING bench serve --base-url http://127.0.0.1:$port --model tiny-cpu \
  --workload random --length-scale 0.1 --input-len 1024 --output-len 1280 --num-requests 12 \
  --sweep-rates 1,2,4,8 --output "$out/sweep.json" --plot "$out/sweep.png" | tail -3
