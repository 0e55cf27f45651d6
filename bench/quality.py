"""The quality gate's figures for each faster mode against the float32 reference.

    .venv/bin/python -m bench.quality --modes bfloat16,bfloat16+int8
    .venv/bin/python -m bench.quality --model F.gguf --modes auto+auto,bfloat16+none

For each mode (a dtype, optionally +quantization): perplexity of the model (the default
one, or `--model`'s, whose float32 reference is its own weights dequantized) on
`tests/data/quality_text.txt` (and its change from float32), as a prefill and fed one
token per step through the decode path (float32's is the same both ways, 10.6035), and
greedy agreement with float32 on fixed chat prompts: the fraction of generated tokens
before the first token that differs, over all prompts.

``--llama-ctx N`` gives instead each mode's perplexity (and float32's) by `llama-perplexity`'s own protocol (``-c N``:
the text cut into chunks of N tokens, each evaluated alone, the chunk's first token made
BOS where the vocabulary adds one, and only the second half of each chunk scored), so a
GGUF's figure is comparable to llama.cpp's on the same file and text:

    llama-perplexity -m F.gguf -f tests/data/quality_text.txt -c 128 -b 128
    .venv/bin/python -m bench.quality --model F.gguf --modes auto+auto,float32 --llama-ctx 128
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.machine import machine_line

QUALITY_TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "quality_text.txt"
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "How do plants make their food?",
    "Give me a short tip for learning to cook.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and German.",
)
NEW_TOKENS = 48


def agreement_before_divergence(reference: list[list[int]], other: list[list[int]]) -> float:
    """Tokens before the first difference, summed over prompts, / reference tokens."""
    same = 0
    for ref, out in zip(reference, other, strict=True):
        same += next(
            (i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b),
            min(len(ref), len(out)),
        )
    return same / max(sum(len(r) for r in reference), 1)


def llama_protocol_perplexity(llm, ids: list[int], n_ctx: int) -> float:
    """Perplexity as `llama-perplexity -c n_ctx` computes it (its `perplexity()`): whole
    chunks of n_ctx tokens, the first of each replaced by BOS where the vocabulary adds
    one, the logits of positions n_ctx / 2 ... n_ctx - 2 scored against the next token."""
    import torch

    from engine.perplexity import text_logits

    bos = llm.tokenizer.bos_token_id if getattr(llm.tokenizer, "add_bos_token", False) else None
    nll, count = 0.0, 0
    for start in range(0, len(ids) - n_ctx + 1, n_ctx):
        chunk = ids[start : start + n_ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        logits = torch.cat([lg for lg, _ in text_logits(llm.engine, chunk)]).float()
        first = n_ctx // 2
        logp = torch.log_softmax(logits[first : n_ctx - 1], dim=-1)
        nll -= logp.gather(1, torch.tensor(chunk[first + 1 :])[:, None]).sum().item()
        count += n_ctx - 1 - first
    return math.exp(nll / count)


def measure(
    dtype: str,
    decode_path: bool = False,
    greedy: bool = True,
    llama_ctx: int = 0,
    text: Path = QUALITY_TEXT,
    **engine_fields,
) -> tuple[float, list[list[int]]] | tuple[float, list[list[int]], float]:
    """(perplexity on the quality text, greedy tokens for PROMPTS) with this dtype, and
    with ``decode_path`` the perplexity of the text fed one token per step (the decode
    path: its kernels never run in the prefill the first figure measures). Without
    ``greedy`` the tokens are not generated (an empty list): a caller that only needs the
    perplexities saves the generation."""
    from engine import LLM, SamplingParams
    from engine.perplexity import perplexity

    llm = LLM(dtype=dtype, **engine_fields)
    text = text.read_text(encoding="utf-8")
    if llama_ctx:  # tokenized as llama.cpp does: the BOS the vocabulary asks for, then the text
        return llama_protocol_perplexity(llm, llm.tokenizer.encode(text), llama_ctx)
    ids = llm.tokenizer.encode(text)
    ppl = perplexity(llm.engine, ids)
    tokens: list[list[int]] = []
    if greedy:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        chats = [[{"role": "user", "content": p}] for p in PROMPTS]
        tokens = [o.token_ids for o in llm.chat(chats, params, use_tqdm=False)]
    if decode_path:
        return ppl, tokens, perplexity(llm.engine, ids, chunk=1)
    return ppl, tokens


def llama_protocol_figures(args: argparse.Namespace) -> int:
    """Each mode's perplexity by llama-perplexity's protocol (--llama-ctx; name float32 among
    the modes for the same weights dequantized exactly)."""
    for mode in args.modes.split(","):
        dtype, _, quantization = mode.partition("+")
        chosen = {"quantization": quantization} if quantization else {}
        kv = {"kv_cache_dtype": args.kv_cache_dtype} if mode != "float32" else {}
        ppl = measure(dtype, greedy=False, llama_ctx=args.llama_ctx, text=args.text,
                      model=args.model, **kv, **chosen)  # fmt: skip
        print(f"{mode}: perplexity by llama-perplexity's protocol (-c {args.llama_ctx}) {ppl:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="bfloat16,bfloat16+int8,bfloat16+int4")
    parser.add_argument("--model", default=None, help="a model path or GGUF (default: ours)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                        help="the modes' KV cache (the float32 reference keeps its own)")  # fmt: skip
    parser.add_argument(
        "--text",
        type=Path,
        default=QUALITY_TEXT,
        help="the text of the --llama-ctx figures (default: the quality text)",
    )
    parser.add_argument("--llama-ctx", type=int, default=0,
                        help="instead, each mode's perplexity by llama-perplexity's protocol, -c N")  # fmt: skip
    args = parser.parse_args(argv)
    print(machine_line())
    print(f"model: {args.model or 'the default'}")
    if args.llama_ctx:
        return llama_protocol_figures(args)
    ref_ppl, ref_tokens = measure("float32", model=args.model)
    print(f"float32: perplexity {ref_ppl:.4f} (the reference)")
    for mode in [m for m in args.modes.split(",") if m != "float32"]:
        dtype, _, quantization = mode.partition("+")
        # "auto" alone: the engine's own choice (a GGUF's blocks where the kernels run).
        chosen = {"quantization": quantization} if quantization else {}
        ppl, tokens, decode_ppl = measure(
            dtype, decode_path=True, model=args.model, kv_cache_dtype=args.kv_cache_dtype,
            **chosen,
        )  # fmt: skip
        agree = agreement_before_divergence(ref_tokens, tokens)
        print(f"{mode}: perplexity {ppl:.4f} ({ppl / ref_ppl - 1:+.2%} vs float32), "
              f"through the decode path {decode_ppl:.4f} ({decode_ppl / ref_ppl - 1:+.2%}), "
              f"greedy tokens before the first divergence {agree:.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
