#!/bin/sh
# The GPU run (issue 28), on a bare NVIDIA host: python 3.12 with torch, triton and
# transformers, nothing downloadable. Bring the checkout and .gpu/ (made here by
# `.venv/bin/python -m bench.gpu_pack`: the server's wheels and the tokenizer), then, in
# the checkout's root there:
#
#     OUT=/some/dir sh bench/gpu_run.sh          # default OUT: bench/results/gpu-<date>
#
# Stages (STAGES="tests family-step family-serve step", the default, or any of these), each under
# a timeout of at most 200 s and of what is left of BUDGET (570 s: one 10-minute device
# call), so one that hangs cannot eat the others' time; together they write 8 files (the
# device tool's most) into OUT:
#   tests  pytest --device cuda -m device: the Triton kernels compiled for the GPU against
#          the reference, CUDA graph replays against eager steps, greedy tokens against
#          transformers' on the same GPU (float32), sdpa and triton   -> gpu-tests.log
#   step   a random-weight stand-in of TinyLlama-1.1B's shape (bench/standin.py), decode
#          step at batch 1 and 64: sdpa eager, triton eager, triton + CUDA graphs, against
#          the weight-bytes / HBM-bandwidth floor; Triton decode attention's GB/s at batch
#          64 x 2,000 tokens                                          -> gpu-step.json/.log
#   sweep  the decode attention under other splits, warps and tile sizes (bench/
#          triton_decode_sweep.py), each timed from a CUDA graph      -> gpu-sweep.log
#   profile where a graph-replayed batch-1 step's time goes (bench/gpu_step_profile.py)
#                                                                     -> gpu-profile.txt
#   serve  the stand-in behind pagedserve (triton, graphs) and `transformers serve
#          --continuous-batching` (bf16, cuda), shared-prefix workload at c=64
#                                                                     -> gpu-serve.tgz/.log
#   family-step   `step` on stand-ins of the 2026 layer kinds (FAMILIES: Qwen3.5-0.8B's
#          Gated DeltaNet hybrid, Gemma 3 1B's sliding windows)  -> gpu-family-step.log
#   family-serve  `serve` on the same stand-ins                   -> gpu-family-serve.log
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-$(date +%F)}
STAGES=${STAGES:-tests family-step family-serve step}
STANDIN=${STANDIN:-/tmp/standin-1b}
FAMILIES=${FAMILIES:-qwen3.5-0.8b gemma3-1b}
TESTS=${TESTS:-tests/engine}  # the tests stage's files
BUDGET=${BUDGET:-570}
mkdir -p "$OUT" /tmp/gpu-family
DEADLINE=$(($(date +%s) + BUDGET))

# limit CAP CMD...: run CMD under a timeout of CAP seconds or what is left of BUDGET.
limit() {
    cap=$1
    shift
    left=$((DEADLINE - $(date +%s)))
    [ "$left" -lt "$cap" ] && cap=$left
    [ "$cap" -gt 10 ] || { echo "gpu_run: out of time (BUDGET=$BUDGET s) for: $*"; return 124; }
    timeout "$cap" "$@"
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pagedserve-site .gpu/wheels/*.whl || exit 1
export PYTHONPATH="/tmp/pagedserve-site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    PAGEDSERVE_TEST_TOKENIZER="$PWD/.gpu/tokenizer" PAGEDSERVE_CACHE=/tmp/pagedserve-cache

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import sys, torch, triton, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
    git log -1 --format='checkout %h %s' 2>/dev/null
} >"$OUT/gpu-env.txt" 2>&1
cat "$OUT/gpu-env.txt"

# standin [SHAPE DIR]: build bench/standin.py's SHAPE (default 1b) into DIR once.
standin() {
    shape=${1:-1b}
    dir=${2:-$STANDIN}
    [ -f "$dir/config.json" ] || limit 120 python3 -m bench.standin "$shape" --hf-only \
        --tokenizer .gpu/tokenizer --out "$dir"
}

# serve_compare CAP DIR OUTDIR: pagedserve (triton) against transformers serve at c=64.
serve_compare() {
    limit "$1" python3 -m bench compare --model "$2" \
        --servers pagedserve,transformers-serve --dtype bfloat16 \
        --pagedserve-args "--attention-backend triton --max-num-seqs 64" \
        --transformers-serve-args "--device cuda --dtype bfloat16" \
        --workload shared-prefix --concurrency 64 --num-requests 256 --max-tokens 64 \
        --no-plots --no-progress --out "$3"
}

for stage in $STAGES; do
    echo "== $stage"
    case $stage in
    tests)
        # 8 workers: most of the stage is Triton compiling kernel variants, on 16 cores;
        # a per-test timeout names a test that hangs instead of losing the stage's log.
        limit 170 python3 -m pytest --device cuda -m device $TESTS -q -n 8 \
            --timeout 120 -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" ;;
    step)
        standin && limit 180 python3 -m bench.gpu_step --model "$STANDIN" \
            --out "$OUT/gpu-step.json" 2>&1 | tee "$OUT/gpu-step.log" ;;
    sweep)
        limit 90 python3 -m bench.triton_decode_sweep --batch 64,1 2>&1 | tee "$OUT/gpu-sweep.log" ;;
    profile)
        standin && limit 90 python3 -m bench.gpu_step_profile --model "$STANDIN" --batch 1 \
            >"$OUT/gpu-profile.txt" 2>&1
        head -3 "$OUT/gpu-profile.txt" ;;
    serve)
        standin && serve_compare 200 "$STANDIN" /tmp/gpu-serve 2>&1 | tee "$OUT/gpu-serve.log"
        tar czf "$OUT/gpu-serve.tgz" -C /tmp gpu-serve ;;
    family-step)
        for f in $FAMILIES; do
            echo "== family-step $f"
            standin "$f" "/tmp/standin-$f" && limit 100 python3 -m bench.gpu_step \
                --model "/tmp/standin-$f" --context 1000 --out "/tmp/gpu-family/step-$f.json"
        done 2>&1 | tee "$OUT/gpu-family-step.log"
        tar czf "$OUT/gpu-family.tgz" -C /tmp gpu-family ;;
    family-serve)
        for f in $FAMILIES; do
            echo "== family-serve $f"
            standin "$f" "/tmp/standin-$f" && serve_compare 150 "/tmp/standin-$f" \
                "/tmp/gpu-family/serve-$f"
        done 2>&1 | tee "$OUT/gpu-family-serve.log"
        tar czf "$OUT/gpu-family.tgz" -C /tmp gpu-family ;;
    *) echo "unknown stage $stage" ;;
    esac
done
