#!/bin/bash
# Qwen3-MoE stand-in against llama-server, each server alone, runs in sequence.
cd /work/main
M=/tmp/standins/qwen3-moe-7b-a1b-standin.Q4_K_M.gguf
L=/tmp/lcb/llama.cpp-11434/build/bin/llama-server
R=bench/results/2026-11-29-qwen3moe-xeon
mkdir -p $R
export TORCH_EXTENSIONS_DIR=/tmp/te_merge
run() { # name, extra args...
  local name=$1; shift
  /tmp/rss_sampler.sh $R/$name.rss &
  local s=$!
  uptime > $R/$name.log
  .venv/bin/python -m bench compare --model $M --llama-server $L --no-plots --no-progress --out $R/$name "$@" >> $R/$name.log 2>&1
  kill $s
}
run c1 --servers pagedserve,llama-server --llama-server-args "-fa off" --workload unique --concurrency 1 --num-requests 4 --max-tokens 64
run c8 --servers pagedserve,llama-server --llama-server-args "-fa off" --workload shared-prefix --concurrency 8 --num-requests 16 --prefix-len 500 --num-prefixes 2 --max-tokens 32
run c8-llama-np8 --servers llama-server --llama-server-args "-fa off -np 8 -c 8192" --workload shared-prefix --concurrency 8 --num-requests 16 --prefix-len 500 --num-prefixes 2 --max-tokens 32
run c32 --servers pagedserve,llama-server --llama-server-args "-fa off" --workload shared-prefix --concurrency 32 --num-requests 64 --prefix-len 500 --num-prefixes 2 --max-tokens 32
run c32-llama-np32 --servers llama-server --llama-server-args "-fa off -np 32 -c 32768" --workload shared-prefix --concurrency 32 --num-requests 64 --prefix-len 500 --num-prefixes 2 --max-tokens 32
echo ALLDONE >> $R/done
