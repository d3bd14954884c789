#!/usr/bin/env bash
# AIPerf (NVIDIA's LLM benchmark client) and `dflash-trt bench --url` against the same running
# server, streaming, over the same GSM8K prompts, greedy, thinking off, at each concurrency;
# each client's CPU seconds are measured too (on a small machine the client competes with the
# server for cores).
#
#   bash bench/aiperf_compare.sh OUT_DIR [AIPERF_BIN] [CONCURRENCIES] [PROMPTS] [MAX_TOKENS]
#
# OUT_DIR: a built output directory (`dflash-trt build -o OUT_DIR`); it is served on ports
# 18000-18002 (Triton) and 19000 (OpenAI) for the run. AIPERF_BIN: an `aiperf` executable
# (pip install aiperf; a venv of its own keeps its dependencies apart). Results: $RESULTS
# (default OUT_DIR/../aiperf_compare): aiperf_c*.json (AIPerf's export), bench.json, cpu.txt.
set -euo pipefail
out=$(realpath "$1")
aiperf=${2:-aiperf}
concurrencies=${3:-1,8}
n=${4:-16}
max_tokens=${5:-64}
results=${RESULTS:-$out/../aiperf_compare}
mkdir -p "$results"
python3 -c "
import json, sys
from dflash_trt.benchmark.datasets import load_prompts
for p in load_prompts('gsm8k', $n):
    print(json.dumps({'text': p}))" >"$results/prompts.jsonl"

setsid dflash-trt serve "$out" --http-port 18000 --grpc-port 18001 --metrics-port 18002 --openai-port 19000 \
  >"$results/serve.txt" 2>&1 &
serve=$!
trap 'kill -TERM $serve; wait $serve' EXIT
for _ in $(seq 1 300); do curl -sf localhost:18000/v2/health/ready >/dev/null && break; sleep 1; done

: >"$results/cpu.txt"
for c in ${concurrencies//,/ }; do
  /usr/bin/time -f "aiperf c=$c: %U s user + %S s system CPU, %e s wall" -a -o "$results/cpu.txt" \
    "$aiperf" profile --model dflash-trt --url http://127.0.0.1:19000 --endpoint-type chat --streaming \
    --concurrency "$c" --request-count "$n" --warmup-request-count 1 --input-file "$results/prompts.jsonl" \
    --custom-dataset-type single_turn --tokenizer "$out/engine/tokenizer" --use-server-token-count \
    --extra-inputs "max_tokens:$max_tokens" --extra-inputs temperature:0 \
    --extra-inputs '{"chat_template_kwargs": {"enable_thinking": false}}' \
    --output-artifact-dir "$results/aiperf_c$c" >"$results/aiperf_c$c.txt" 2>&1
  cp "$results/aiperf_c$c/profile_export_aiperf.json" "$results/aiperf_c$c.json"
done
/usr/bin/time -f "bench: %U s user + %S s system CPU, %e s wall" -a -o "$results/cpu.txt" \
  dflash-trt bench --url http://127.0.0.1:19000 --url 127.0.0.1:18001 --dataset gsm8k --num-prompts "$n" \
  --max-tokens "$max_tokens" --concurrency "$concurrencies" --no-thinking --json "$results/bench.json"
cat "$results/cpu.txt"
