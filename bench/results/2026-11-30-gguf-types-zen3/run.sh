#!/bin/sh
# Issue 67's per-type table: each recipe file of the 1B stand-in (random weights), pagedserve
# against llama-server on the same file, each alone: batch 1 (ITL) and 8 shared-prefix streams.
#   sh bench/results/2026-11-30-gguf-types-zen3/run.sh /tmp/recipes OUT Q2_K Q3_K_M ...
# Files: DIR/1b.TYPE.gguf (python -m bench.standin 1b, then llama-quantize --imatrix; see
# docs/gguf.md "Every recipe"). llama-server: /tmp/lbuild/bin (native build, -fa off, 4 slots).
set -e
dir=$1; out=$2; shift 2
for t in "$@"; do
  .venv/bin/python -m bench compare --model "$dir/1b.$t.gguf" --servers pagedserve,llama-server \
    --llama-server /tmp/lbuild/bin/llama-server "--llama-server-args=-fa off" \
    --workload unique --concurrency 1 --num-requests 3 --prefix-len 100 --max-tokens 48 \
    --no-plots --no-progress --out "$out/$t-c1"
  .venv/bin/python -m bench compare --model "$dir/1b.$t.gguf" --servers pagedserve,llama-server \
    --llama-server /tmp/lbuild/bin/llama-server "--llama-server-args=-fa off" \
    --workload shared-prefix --concurrency 8 --num-requests 16 --prefix-len 500 --num-prefixes 2 \
    --max-tokens 32 --no-plots --no-progress --out "$out/$t-c8"
done
