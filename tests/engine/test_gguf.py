"""GGUF weights served from their own blocks: the kernels dequantize exactly as ggml does
(the `gguf` package's numpy code is the reference), multiply within int8-activation
rounding of the dequantized weights, and a model mixing every format serves as the same
weights dequantized do."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from engine import LLM, SamplingParams
from engine.gguf_weights import NATIVE_TYPES, GGUFFile, GGUFTensor
from engine.kernels import ggml_kernels
from engine.loader import default_gguf_path
from engine.models.linear import GGML_DOT_MAX_ROWS, GGUF, Linear
from engine.perplexity import text_logits
from tests.engine.gguf_models import MIXED_LAYERS, UNSERVED, random_blocks, write_mixed_gguf
from tests.engine.test_engine_golden import assert_all_blocks_free

pytestmark = pytest.mark.skipif(ggml_kernels() is None, reason="the GGUF kernels need AVX2")
TYPES = sorted(NATIVE_TYPES, key=lambda t: t.name)


def _exact(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_dequantizes_as_ggml_bit_for_bit(qtype):
    blocks = random_blocks(qtype, 24, 512, np.random.default_rng(int(qtype)))
    got = ggml_kernels().ggml_dequantize(torch.from_numpy(blocks), int(qtype), 512)
    assert _exact(got.numpy(), quants.dequantize(blocks, qtype))
    rows = torch.tensor([5, 0, 23, 5])  # the embedding's path: rows by token id
    picked = ggml_kernels().ggml_dequantize(torch.from_numpy(blocks), int(qtype), 512, rows)
    assert torch.equal(picked, got[rows])
    # Into a bf16 tensor (the prefill path's weight): the exact values, rounded once.
    out = torch.empty(24, 512, dtype=torch.bfloat16)
    ggml_kernels().ggml_dequantize(torch.from_numpy(blocks), int(qtype), 512, None, out)
    assert torch.equal(out, got.to(torch.bfloat16))


def test_the_default_models_real_blocks_dequantize_bit_for_bit():
    table = GGUFFile(default_gguf_path())
    seen = set()
    for info in table.tensors:
        first = info.type not in seen  # the first tensor of each type, and all of a layer
        if info.type in NATIVE_TYPES and (first or info.name.startswith("blk.29.")):
            seen.add(info.type)
            blocks = np.array(table.array(info)).reshape(info.shape[0], -1)
            got = ggml_kernels().ggml_dequantize(torch.from_numpy(blocks), int(info.type),
                                                 info.shape[1])  # fmt: skip
            assert _exact(got.numpy(), quants.dequantize(blocks, info.type)), info.name
    assert {t.name for t in seen} == {"Q4_1", "Q8_0"}


def _super_blocks(qtype: T) -> bool:
    return GGML_QUANT_SIZES[qtype][0] == 256


def _relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_matches_the_dequantized_weights(qtype, dtype):
    # Activations are quantized to int8 per 32 (256 for the K-quants) values, as llama.cpp
    # does: within about 1% of the dense product. Every tile shape: 1-4 rows and the rest.
    cols = 512 if _super_blocks(qtype) else 736  # 736: 23 blocks of 32, not of 256
    blocks = random_blocks(qtype, 40, cols, np.random.default_rng(7))
    dense = torch.from_numpy(quants.dequantize(blocks, qtype))
    for rows in (1, 3, 4, 7, 33):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
        y = ggml_kernels().ggml_linear(x, [torch.from_numpy(blocks)], [int(qtype)])
        assert y.dtype == dtype and y.shape == (rows, 40)
        assert _relative_error(y, x.float() @ dense.T) < 0.015, (qtype.name, rows)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("regroup", [False, True], ids=["file layout", "regrouped"])
def test_a_rows_product_is_the_same_bits_in_any_tile(qtype, regroup):
    # Speculative decoding verifies 1 + k rows in one call where plain decoding multiplies
    # one: greedy output is the same with it on and off only if a row's sums are added in
    # the same order whatever tile (1-8 rows, and the rest) the row falls in.
    cols = 512 if _super_blocks(qtype) else 736
    blocks = torch.from_numpy(random_blocks(qtype, 48, cols, np.random.default_rng(11)))
    weight, wtype = (ggml_kernels().ggml_repack(blocks, int(qtype), cols) if regroup
                     else (blocks, int(qtype)))  # fmt: skip
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(3))
    alone = torch.cat(
        [ggml_kernels().ggml_linear(x[i : i + 1], [weight], [wtype]) for i in range(13)]
    )
    for rows in (2, 3, 4, 5, 8, 9, 13):
        together = ggml_kernels().ggml_linear(x[:rows], [weight], [wtype])
        assert torch.equal(together, alone[:rows]), (qtype.name, wtype, rows)


# The regrouped layouts' bytes per 8-row group and block column (Q4_Kx8 unpacks the scales).
REGROUPED = {T.Q4_0: (736, 18 * 8), T.Q4_1: (736, 20 * 8), T.Q5_0: (736, 22 * 8),
             T.Q5_1: (736, 24 * 8), T.Q8_0: (736, 34 * 8), T.Q4_K: (512, 148 * 8),
             T.Q6_K: (512, 210 * 8)}  # fmt: skip


@pytest.mark.parametrize("source", list(REGROUPED), ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_regrouped_by_8_rows_multiplies_and_dequantizes_as_its_blocks(source, dtype):
    # ggml_repack regroups Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K 8 rows at a time: the
    # same weights (bit for bit), and products that differ from the plain layout's only in
    # float summation order.
    cols, column_bytes = REGROUPED[source]
    # 56 rows: pairs of 8-row groups and one group alone (AVX-512's wide path and its rest)
    blocks = torch.from_numpy(random_blocks(source, 56, cols, np.random.default_rng(9)))
    grouped, qtype = ggml_kernels().ggml_repack(blocks, int(source), cols)
    columns = cols // (256 if source in (T.Q4_K, T.Q6_K) else 32)
    assert qtype != int(source) and grouped.shape == (7, columns * column_bytes)
    plain = ggml_kernels().ggml_dequantize(blocks, int(source), cols)
    assert torch.equal(ggml_kernels().ggml_dequantize(grouped, qtype, cols), plain)
    rows = torch.tensor([47, 0, 9])
    assert torch.equal(ggml_kernels().ggml_dequantize(grouped, qtype, cols, rows), plain[rows])
    for m in (1, 3, 4, 6, 8, 13):  # every tile: 1-8 rows, and 8 + 5
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = ggml_kernels().ggml_linear(x, [grouped], [qtype])
        reference = ggml_kernels().ggml_linear(x, [blocks], [int(source)])
        assert y.dtype == dtype and y.shape == (m, 56)
        assert _relative_error(y, reference.float()) < (1e-5 if dtype == torch.float32 else 8e-3)
        assert _relative_error(y, x.float() @ plain.T) < 0.015
    odd = blocks[:44]  # not a multiple of 8 rows: kept as it is
    assert ggml_kernels().ggml_repack(odd, int(source), cols)[1] == int(source)


# Byte ranges of each regrouped type's quant bits and 6-bit scales (set to all ones below),
# its int8 scales (Q6_K) or values (Q8_0), and its f16 factors, in the file's block layout.
EXTREME_LAYOUT = {  # type: (block bytes, all-ones ranges, int8 ranges, f16 offsets)
    T.Q4_0: (18, [(2, 18)], [], [0]),
    T.Q4_1: (20, [(4, 20)], [], [0, 2]),
    T.Q5_0: (22, [(2, 22)], [], [0]),
    T.Q5_1: (24, [(4, 24)], [], [0, 2]),
    T.Q8_0: (34, [], [(2, 34)], [0]),
    T.Q4_K: (144, [(4, 144)], [], [0, 2]),
    T.Q6_K: (210, [(0, 192)], [(192, 208)], [208]),
}


@pytest.mark.parametrize("source", list(EXTREME_LAYOUT), ids=lambda t: t.name)
@pytest.mark.parametrize("int8_value", [127, -128])
def test_regrouped_kernels_hold_the_largest_sums_without_overflow(source, int8_value):
    # Without VNNI the integer dots add maddubs's int16 pair sums as int16 (8 of 4-bit
    # values, 4 of 5-bit, 2 of 6-bit) before widening: every weight at its largest value
    # times activations at +-127 is their worst case, which an int16 too many would wrap.
    block, ones, int8s, f16s = EXTREME_LAYOUT[source]
    cols, rows = 256, 16
    raw = np.zeros((rows, cols // (256 if source in (T.Q4_K, T.Q6_K) else 32), block), np.uint8)
    for a, b in ones:
        raw[..., a:b] = 0xFF
    for a, b in int8s:
        raw[..., a:b] = np.uint8(int8_value & 0xFF)
    for offset in f16s:
        raw[..., offset : offset + 2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    blocks = torch.from_numpy(raw.reshape(rows, -1).copy())
    grouped, qtype = ggml_kernels().ggml_repack(blocks, int(source), cols)
    weights = ggml_kernels().ggml_dequantize(blocks, int(source), cols).double()
    signs = torch.ones(6, cols, dtype=torch.float64)
    signs[1] = -1  # all one sign per row: every pair sum at its extreme
    signs[2, ::2] = -1
    signs[3:] = torch.randint(0, 2, (3, cols), generator=torch.Generator().manual_seed(1)) * 2 - 1
    for m in (1, 4, 6):  # the 1-row, 4-row and remainder tiles
        y = ggml_kernels().ggml_linear(signs[:m].float(), [grouped], [qtype]).double()
        reference = signs[:m] @ weights.T  # +-1 activations quantize exactly (to +-127)
        assert _relative_error(y, reference) < 1e-5, (m, y[:, 0], reference[:, 0])


def _gguf_linear(parts: list[tuple[T, int]], seed: int) -> tuple[Linear, torch.Tensor]:
    """A bf16 GGUF `Linear` of fused parts (type, rows) of 512 columns, and its float32
    weights as ggml dequantizes them."""
    rng = np.random.default_rng(seed)
    rows = sum(r for _, r in parts)
    linear = Linear(512, rows, bias=False, dtype=torch.bfloat16, device="cpu", quantization=GGUF)
    row, dense = 0, []
    for qtype, count in parts:
        blocks = random_blocks(qtype, count, 512, rng)
        linear.load(GGUFTensor(torch.from_numpy(blocks), qtype, (count, 512)), (row, count))
        dense.append(torch.from_numpy(quants.dequantize(blocks, qtype)))
        row += count
    linear.pack()
    return linear, torch.cat(dense)


@pytest.mark.parametrize(
    "parts",
    [[(T.Q5_K, 16), (T.Q5_0, 8)], [(T.Q4_1, 16), (T.Q5_1, 8)]],
    ids=["file layout", "Q4_1 and Q5_1 regrouped"],
)
def test_prefill_sized_calls_multiply_the_bf16_weights_with_torch(parts):
    # More rows than GGML_DOT_MAX_ROWS with bf16 activations, on blocks of which some stay
    # in their file's layout, or Q4_1/Q5_1 regrouped (the default model's file: decode and
    # verify rows take their kernel, prefill keeps the bf16 product): dequantized to bf16
    # for the call and torch's GEMM, which is exactly the bf16-dequantized model's product.
    linear, dense = _gguf_linear(parts, seed=5)
    regrouped = [
        qtype != int(t) for qtype, (t, _) in zip(linear.method.ggml[1], parts, strict=True)
    ]
    assert regrouped == ([True, True] if parts[0][0] == T.Q4_1 else [False, True])
    assert linear.kernel_max_rows == GGML_DOT_MAX_ROWS
    x = torch.randn(GGML_DOT_MAX_ROWS + 1, 512, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, dense.to(torch.bfloat16)))
    small = x[:GGML_DOT_MAX_ROWS]  # the int8 dot products: close, not equal
    assert not torch.equal(linear(small), torch.nn.functional.linear(small, dense.bfloat16()))
    assert _relative_error(linear(small), small.float() @ dense.T) < 0.015


def test_regrouped_blocks_take_their_int8_kernel_at_any_size():
    # Q4_0, Q5_0, Q8_0, Q4_K and Q6_K regrouped: their kernel beats dequantizing for a GEMM at
    # prefill sizes too, so every call takes it (close to the dense product, never equal).
    parts = [(T.Q4_K, 16), (T.Q6_K, 8), (T.Q4_0, 16), (T.Q8_0, 8)]
    linear, dense = _gguf_linear(parts, seed=6)
    assert linear.kernel_max_rows > 4096
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert not torch.equal(linear(x), torch.nn.functional.linear(x, dense.bfloat16()))
    assert _relative_error(linear(x), x.float() @ dense.T) < 0.015
    mixed, _ = _gguf_linear([(T.Q4_K, 16), (T.Q5_K, 8)], seed=7)  # one part not regrouped
    assert mixed.kernel_max_rows == GGML_DOT_MAX_ROWS


def test_a_fused_projection_multiplies_parts_of_different_types():
    # Q4_K_M files keep some v projections in Q6_K beside Q4_K q and k: one fused call.
    rng = np.random.default_rng(3)
    parts = [(T.Q4_K, 16), (T.Q6_K, 8), (T.Q8_0, 24)]
    blocks = [random_blocks(t, rows, 512, rng) for t, rows in parts]
    dense = torch.cat(
        [torch.from_numpy(quants.dequantize(b, t)) for b, (t, _) in zip(blocks, parts, strict=True)]
    )
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    y = ggml_kernels().ggml_linear(
        x, [torch.from_numpy(b) for b in blocks], [int(t) for t, _ in parts]
    )
    assert y.shape == (5, 48)
    assert _relative_error(y, x @ dense.T) < 0.015


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_calls_in_one_region_give_each_calls_own_bits(dtype):
    # A mixture of experts' step: each expert its own rows and weights (regrouped or not,
    # fused parts of different types), all in one parallel region (`ggml_linears`).
    kernels, rng = ggml_kernels(), np.random.default_rng(5)
    calls = []
    for rows, parts in [(1, [(T.Q4_K, 24)]), (3, [(T.Q6_K, 16), (T.Q8_0, 8)]),
                        (7, [(T.Q4_0, 40)]), (2, [(T.IQ4_XS, 8), (T.Q4_K, 16)])]:  # fmt: skip
        packed = [kernels.ggml_repack(torch.from_numpy(random_blocks(t, n, 512, rng)), int(t), 512)
                  for t, n in parts]  # fmt: skip
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
        calls.append((x, [b for b, _ in packed], [t for _, t in packed]))
    together = kernels.ggml_linears(*(list(part) for part in zip(*calls, strict=True)))
    for (x, blocks, types), y in zip(calls, together, strict=True):
        assert torch.equal(y, kernels.ggml_linear(x, blocks, types))


def test_linear_refuses_a_type_it_does_not_multiply():
    blocks = torch.from_numpy(random_blocks(UNSERVED, 4, 256, np.random.default_rng(0)))
    with pytest.raises(RuntimeError, match="type"):
        ggml_kernels().ggml_linear(torch.randn(1, 256), [blocks], [int(UNSERVED)])


# -- a model whose projections mix every format --------------------------------------------


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    return write_mixed_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf")


def test_a_mixed_gguf_serves_from_its_blocks_as_its_dequantized_weights(mixed_gguf, tmp_path):
    native = LLM(model=str(mixed_gguf), cache_dir=str(tmp_path), num_blocks=64)
    summary = native.engine.core.compute_summary
    for name in {t.name for layer in MIXED_LAYERS for t in layer.values()} - {UNSERVED.name}:
        assert f"{name} x" in summary, (name, summary)
    # The one format with no kernel is served dequantized, and the start-up line says so.
    assert f"(dequantized {UNSERVED.name}) x1" in summary and "embedding Q4_0" in summary
    assert isinstance(native.engine.core.model.embed_blocks.blocks, torch.Tensor)
    # The tied head multiplies a regrouped copy; the embedding reads the file's blocks.
    assert native.engine.core.model.head_ggml[1] != [int(T.Q4_0)]

    exact = LLM(model=str(mixed_gguf), cache_dir=str(tmp_path), num_blocks=64, dtype="float32")
    assert "projections float32 x" in exact.engine.core.compute_summary
    ids = native.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    got = torch.cat([logits for logits, _ in text_logits(native.engine, ids)])
    reference = torch.cat([logits for logits, _ in text_logits(exact.engine, ids)])
    # 1.9% measured: int8-activation rounding through 4 layers; a wrong scale or a
    # misplaced block gives errors of order 100%.
    assert _relative_error(got, reference) < 0.03

    outs = native.generate(["Once upon a time"] * 3, SamplingParams(max_tokens=8, temperature=0))
    assert len({tuple(o.token_ids) for o in outs}) == 1 and len(outs[0].token_ids) == 8
    assert_all_blocks_free(native)


def test_gguf_tensor_dequantize_falls_back_to_numpy_for_other_types():
    blocks = random_blocks(UNSERVED, 3, 256, np.random.default_rng(1))
    tensor = GGUFTensor(torch.from_numpy(blocks), UNSERVED, (3, 256))
    assert not tensor.native
    assert _exact(tensor.dequantize().numpy(), quants.dequantize(blocks, UNSERVED))


def test_released_file_pages_read_back_as_the_file_and_copies_are_never_released():
    # A repacked weight gives its file pages back (MADV_DONTNEED): they are the file's and
    # come back from it if touched. A copy (llama's permuted q/k rows) is anonymous memory,
    # which the same call would zero, so it must never be released.
    from engine.gguf_weights import read_tensors

    tensors = [t for _, t in read_tensors(default_gguf_path()) if isinstance(t, GGUFTensor)]
    mapped = max((t for t in tensors if t.mapped), key=lambda t: t.blocks.numel())
    before = mapped.blocks.clone()
    mapped.release()
    assert torch.equal(mapped.blocks, before)
    copy = mapped.select_rows(torch.arange(mapped.shape[0]))
    assert not copy.mapped
    kept = copy.blocks.clone()
    copy.release()
    assert torch.equal(copy.blocks, kept)
