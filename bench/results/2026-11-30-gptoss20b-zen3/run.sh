#!/bin/bash
# gpt-oss-20b-shaped stand-in (random weights, MXFP4 experts, Q8_0 beside them; 12.10 GB) against
# llama-server (build 11434, native), each server alone, on an otherwise idle 2-core Zen 3.
# Made by:  .venv/bin/python -m bench.standin gpt-oss-20b --out /tmp/standins --llama-cpp SRC
# Sized for about 20-25 minutes in all (loads included: each run starts each server afresh);
# every run is cut at 10 minutes. Run from the repository root:
#   bash bench/results/2026-11-30-gptoss20b-zen3/run.sh
set -u
M=${M:-/tmp/standins/gpt-oss-20b-standin.MXFP4_MOE.gguf}
L=${L:-/tmp/lbuild/bin/llama-server}
R=bench/results/2026-11-30-gptoss20b-zen3
PY=${PY:-.venv/bin/python}
# llama-server: its 4 default slots, 4096 tokens each (its default context, the model's 131072,
# would hold 3.2 GB more of KV than this workload uses); flash attention off, as in the
# Qwen3-MoE runs.
LARGS="-fa off -c 16384"
run() {  # name, bench compare args...
  local name=$1; shift
  bash $R/rss_sampler.sh $R/$name.rss &
  local s=$!
  { uptime; grep -E '^(MemAvailable|Cached):' /proc/meminfo; } > $R/$name.log
  timeout 600 $PY -m bench compare --model $M --llama-server $L --no-plots --no-progress \
    --llama-server-args "$LARGS" --out $R/$name "$@" >> $R/$name.log 2>&1
  echo "exit $?" >> $R/$name.log
  kill $s
  # the peak of each process: VmHWM, and the RssAnon / RssFile / Cached beside the largest RSS
  awk '{hwm[$1]=$2>hwm[$1]?$2:hwm[$1]; r=$3+$4; if (r>=rss[$1]) {rss[$1]=r; l[$1]=$0}}
       END {for (p in hwm) print "pid", p, "VmHWM_kB", hwm[p], "at_peak(pid hwm anon file cached cmd):", l[p]}' \
    $R/$name.rss > $R/$name.rss.peak
}
# batch 1: ITL p50 is the goal's figure (at most llama-server's); short unique prompts.
# pagedserve serves the MXFP4 experts from a regrouped copy unless the file is more than 3/4 of
# MemAvailable (12.1 GB against about 23 GB here: the copy); c1-mapped measures the mapped
# file's path too (pagedserve alone, ~2 min).
run c1 --servers pagedserve,llama-server --workload unique --concurrency 1 --num-requests 3 \
  --prefix-len 128 --max-tokens 32
PAGEDSERVE_GGUF_MAPPED=always run c1-mapped --servers pagedserve --workload unique --concurrency 1 \
  --num-requests 3 --prefix-len 128 --max-tokens 32
# 8 and 32 streams sharing 2 prefixes: output tok/s (goals 2x and 3x llama-server's)
run c8 --servers pagedserve,llama-server --workload shared-prefix --concurrency 8 --num-requests 16 \
  --prefix-len 128 --num-prefixes 2 --max-tokens 32
run c32 --servers pagedserve,llama-server --workload shared-prefix --concurrency 32 \
  --num-requests 32 --prefix-len 128 --num-prefixes 2 --max-tokens 16
echo ALLDONE >> $R/done
