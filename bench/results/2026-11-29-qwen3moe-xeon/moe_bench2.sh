#!/bin/bash
# 8 and 32 streams again on the final build (754e1b0+), pagedserve and llama-server (4 slots), each alone.
cd /work/main
M=/tmp/standins/qwen3-moe-7b-a1b-standin.Q4_K_M.gguf
L=/tmp/lcb/llama.cpp-11434/build/bin/llama-server
R=bench/results/2026-11-29-qwen3moe-xeon
export TORCH_EXTENSIONS_DIR=/tmp/te_merge
run() {
  local name=$1; shift
  /tmp/rss_sampler.sh $R/$name.rss &
  local s=$!
  uptime > $R/$name.log
  .venv/bin/python -m bench compare --model $M --llama-server $L --no-plots --no-progress --out $R/$name "$@" >> $R/$name.log 2>&1
  kill $s
}
run c8-final --servers pagedserve,llama-server --llama-server-args "-fa off" --workload shared-prefix --concurrency 8 --num-requests 16 --prefix-len 500 --num-prefixes 2 --max-tokens 32
run c32-final --servers pagedserve,llama-server --llama-server-args "-fa off" --workload shared-prefix --concurrency 32 --num-requests 64 --prefix-len 500 --num-prefixes 2 --max-tokens 32
echo ALLDONE >> $R/done2
