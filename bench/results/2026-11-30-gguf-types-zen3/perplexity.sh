# Issue 67's quality table: each default-model recipe file, llama-perplexity against
# pagedserve's bench.quality by llama-perplexity's protocol, on the same text (-c 512).
T=/tmp/recipes/eval.txt
for t in "$@"; do
  f=/tmp/recipes/smol.$t.gguf
  p=$(/tmp/lbuild/bin/llama-perplexity -m $f -f $T -c 512 -b 512 -t 2 2>&1 | grep "Final estimate" | sed 's/.*PPL = \([0-9.]*\).*/\1/')
  echo "llama $t $p"
  (cd /work/main && TORCH_EXTENSIONS_DIR=/tmp/te17 .venv/bin/python -m bench.quality --model $f --modes auto+auto --llama-ctx 512 --text $T 2>&1 | grep "protocol" | sed "s/^/ours $t /")
done
