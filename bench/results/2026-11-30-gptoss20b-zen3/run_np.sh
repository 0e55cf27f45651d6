#!/bin/bash
# llama-server at a slot per stream (-np 8, -np 32) on the same workloads as run.sh's c8 and c32
# (its default 4 slots there; its c32 run was cut by the 10-minute limit). llama-server alone:
#   bash bench/results/2026-11-30-gptoss20b-zen3/run_np.sh
set -u
M=${M:-/tmp/standins/gpt-oss-20b-standin.MXFP4_MOE.gguf}
L=${L:-/tmp/lbuild/bin/llama-server}
R=bench/results/2026-11-30-gptoss20b-zen3
PY=${PY:-.venv/bin/python}
run() {  # name, slots, bench compare args...
  local name=$1 np=$2; shift 2
  bash $R/rss_sampler.sh $R/$name.rss &
  local s=$!
  { uptime; grep -E '^(MemAvailable|Cached):' /proc/meminfo; } > $R/$name.log
  timeout 1200 $PY -m bench compare --model $M --llama-server $L --no-plots --no-progress \
    --llama-server-args "-fa off -c 16384 -np $np" --servers llama-server --out $R/$name "$@" \
    >> $R/$name.log 2>&1
  echo "exit $?" >> $R/$name.log
  kill $s
}
run c32-llama-np32 32 --workload shared-prefix --concurrency 32 --num-requests 32 --prefix-len 128 \
  --num-prefixes 2 --max-tokens 16
run c8-llama-np8 8 --workload shared-prefix --concurrency 8 --num-requests 16 --prefix-len 128 \
  --num-prefixes 2 --max-tokens 32
echo ALLDONE >> $R/done_np
