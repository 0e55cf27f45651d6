#!/bin/bash
# Issue 68: a Cascade Lake's path (PAGEDSERVE_CPU_KERNELS=avx512_vnni) on an AVX512-BF16 Xeon
# against llama-server built for a Cascade Lake (AVX-512 + VNNI, no BF16, no VBMI, no AMX:
# cmake -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON, the rest OFF), each server
# alone, in sequence, on the same files. Usage: vnni_bench.sh [RUN...] (default: all).
cd "$(dirname "$0")/../../.."
L=${LLAMA_SERVER:-/tmp/lcb/llama.cpp-11434/build-clx/bin/llama-server}
R=bench/results/2026-11-29-vnni512-xeon
export PAGEDSERVE_CPU_KERNELS=${PAGEDSERVE_CPU_KERNELS:-avx512_vnni}
SHARED="--workload shared-prefix --prefix-len 500 --num-prefixes 2 --max-tokens 32"
run() { # name, model, extra args...
  local name=$1 model=$2; shift 2
  { uptime; echo "PAGEDSERVE_CPU_KERNELS=$PAGEDSERVE_CPU_KERNELS llama-server=$L"; } > $R/$name.log
  .venv/bin/python -m bench compare --model "$model" --llama-server "$L" --no-plots \
    --no-progress --out $R/$name "$@" >> $R/$name.log 2>&1
}
suite() { # tag, model
  local t=$1 m=$2
  run $t-c1 $m --servers pagedserve,llama-server --workload unique --concurrency 1 --num-requests 4 --max-tokens 64
  run $t-c8 $m --servers pagedserve,llama-server $SHARED --concurrency 8 --num-requests 16
  run $t-c8-np8 $m --servers llama-server --llama-server-args "-np 8 -c 8192" $SHARED --concurrency 8 --num-requests 16
  run $t-c32 $m --servers pagedserve,llama-server $SHARED --concurrency 32 --num-requests 64
  run $t-c32-np32 $m --servers llama-server --llama-server-args "-np 32 -c 32768" $SHARED --concurrency 32 --num-requests 64
}
for s in ${@:-1b 135m 1b-avx2}; do
  case $s in
    1b) suite 1b /tmp/standins/1b-standin.Q4_K_M.gguf ;;
    135m) suite 135m /tmp/standins/smollm2-135m.Q4_0.gguf ;;
    # pagedserve's AVX2 build on the same machine: what the VNNI build buys
    1b-avx2) PAGEDSERVE_CPU_KERNELS=avx2
      for c in 8 32; do
        run 1b-avx2-c$c /tmp/standins/1b-standin.Q4_K_M.gguf --servers pagedserve $SHARED \
          --concurrency $c --num-requests $((2 * c))
      done
      PAGEDSERVE_CPU_KERNELS=avx512_vnni ;;
  esac
done
