"""Model files from strangers: a damaged or crafted GGUF, safetensors file or model directory
gets one `ModelFileError` line naming the file and what is wrong, never a traceback out of a
reader's internals, a signal, an allocation the file does not back, or a cache entry.

The damage is what a download gone wrong or a crafted file holds: truncations in the header
and in the data, counts, lengths, dimensions, type ids and offsets past any limit (the
inputs of llama.cpp's loader advisories CVE-2025-53630, CVE-2026-27940, CVE-2026-33298), and
hyperparameters the weights contradict. A seeded fuzz of a small real GGUF closes it.
"""

from __future__ import annotations

import json
import random
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

from engine.errors import ModelFileError
from engine.gguf_file import GGUFFile
from engine.gguf_weights import read_tensors
from engine.loader import (
    default_gguf_path,
    iter_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model_dir,
)
from tests.engine.tiny_models import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[2]


# -- damaged copies of the default GGUF ----------------------------------------------------


def _table_entry(raw: bytes, name: str) -> int:
    """Where tensor ``name``'s entry continues after its name (its dimension count)."""
    encoded = name.encode()
    return raw.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def _value_at(raw: bytes, key: str) -> int:
    """Where metadata ``key``'s value starts (after its 4-byte type)."""
    return raw.index(key.encode()) + len(key) + 4


def _put(raw: bytes, at: int, fmt: str, value: int) -> bytes:
    out = bytearray(raw)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


Q = "blk.0.attn_q.weight"
# name -> (damage of the default file's bytes, what the one line must say)
GGUF_DAMAGE = {
    "truncated in its header": (lambda r: r[:1000], r"truncated: metadata key \d+ needs"),
    "truncated in its data": (
        lambda r: r[:-50_000],
        r"truncated: tensor blk\.\d+\.\w+\.weight needs [\d,]+ bytes at offset [\d,]+, "
        r"the file ends at 98,312,432",
    ),
    "a huge dimension count": (
        lambda r: _put(r, _table_entry(r, Q), "<I", 2**31),
        "tensor blk.0.attn_q.weight has 2,147,483,648 dimensions",
    ),
    "a dimension product past 64 bits": (
        lambda r: _put(r, _table_entry(r, Q) + 4, "<Q", 2**63 + 5),
        r"tensor blk.0.attn_q.weight has dimensions \[9223372036854775813, 576\]: their "
        "product overflows int64",
    ),
    "a tensor offset past the end": (
        lambda r: _put(r, _table_entry(r, Q) + 4 + 16 + 4, "<Q", 2**40),
        "truncated: tensor blk.0.attn_q.weight needs 207,360 bytes at offset",
    ),
    "an unknown type id": (
        lambda r: _put(r, _table_entry(r, Q) + 4 + 16, "<I", 999),
        "tensor blk.0.attn_q.weight has ggml type id 999",
    ),
    "a tensor count no file holds": (
        lambda r: _put(r, 8, "<Q", 2**62),
        "the tensor count: 4,611,686,018,427,387,904 entries",
    ),
    "a string longer than the file": (
        lambda r: _put(r, _value_at(r, "tokenizer.ggml.tokens") + 12, "<Q", 2**60),
        "truncated: string 0 of metadata key 'tokenizer.ggml.tokens' needs",
    ),
    "an array count no file holds": (
        lambda r: _put(r, _value_at(r, "tokenizer.ggml.tokens") + 4, "<Q", 2**60),
        "the array of metadata key 'tokenizer.ggml.tokens': 1,152,921,504,606,846,976",
    ),
    "version 1": (lambda r: _put(r, 4, "<I", 1), "GGUF version 1 is not supported"),
    "not a GGUF at all": (lambda r: b"<html>404</html>" * 8, "not a GGUF file"),
    "a block count the tensors contradict": (
        lambda r: _put(r, _value_at(r, "llama.block_count"), "<I", 10**9),
        "the config says 1,000,000,000 layers, the weights hold 30",
    ),
    "a context no server holds": (
        lambda r: _put(r, _value_at(r, "llama.context_length"), "<I", 2**31),
        "max_position_embeddings is 2,147,483,648, over the 16,777,216 positions",
    ),
}


@pytest.fixture(scope="module")
def default_bytes() -> bytes:
    return default_gguf_path().read_bytes()


@pytest.mark.parametrize("damage", GGUF_DAMAGE)
def test_a_damaged_gguf_is_one_line_naming_the_fault_and_caches_nothing(
    tmp_path, default_bytes, damage
):
    corrupt, message = GGUF_DAMAGE[damage]
    path = tmp_path / "downloaded.gguf"
    path.write_bytes(corrupt(default_bytes))
    cache = tmp_path / "cache"
    with pytest.raises(ModelFileError, match=message) as raised:
        load_hf_config(resolve_model_dir(path, cache))
    assert str(raised.value).startswith(f"{path}: ") and "\n" not in str(raised.value)
    assert not any((cache / "models").glob("downloaded-*")), "a cache entry was left"


def test_serve_on_a_damaged_gguf_exits_with_that_line_and_no_traceback(tmp_path, default_bytes):
    path = tmp_path / "model.gguf"
    path.write_bytes(default_bytes[: len(default_bytes) - 50_000])
    run = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(path),
         "--cache-dir", str(tmp_path / "cache"), "--port", "1"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert run.returncode > 0, run.returncode  # an exit status: not 0, not a signal
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pagedserve: error: {path}: truncated: tensor blk."), last


# -- damaged model directories and safetensors ----------------------------------------------


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _cut(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DIR_DAMAGE = {
    "config.json cut short": (
        lambda d: (d / "config.json").write_text('{"model_type": "llama", '),
        load_hf_config, "cannot read its config.json",
    ),
    "a config field of the wrong type": (
        lambda d: _edit_json(d / "config.json", num_hidden_layers="many"),
        load_hf_config, "cannot read its config.json .*num_hidden_layers",
    ),
    "a config the weights contradict": (
        lambda d: _edit_json(d / "config.json", num_hidden_layers=10**9),
        load_hf_config, "the config says 1,000,000,000 layers, the weights hold 2",
    ),
    "a vocabulary the embedding does not hold": (
        lambda d: _edit_json(d / "config.json", vocab_size=2**40),
        load_hf_config, r"model.embed_tokens.weight is \[49152, 64\], the config needs",
    ),
    "tokenizer.json cut short": (
        lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": {'),
        load_tokenizer, "cannot read its tokenizer",
    ),
    "safetensors cut short": (
        lambda d: _cut(d / "model.safetensors", 0.5),
        lambda d: list(iter_weights(d)), "model.safetensors: cannot read its tensors",
    ),
    "a shard index that is not JSON": (
        lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": '),
        load_hf_config, "model.safetensors.index.json: cannot read its weight map",
    ),
    "a shard index naming a file outside the model": (
        lambda d: (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}})),
        load_hf_config, "its weight map names a file outside",
    ),
    "a safetensors header length past the file": (
        lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}"),
        load_hf_config, "model.safetensors: cannot read its header",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("damage", DIR_DAMAGE)
def test_a_damaged_model_directory_is_one_line_naming_the_fault(tmp_path, tiny_dir, damage):
    import shutil

    corrupt, load, message = DIR_DAMAGE[damage]
    model = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    load_hf_config(model)  # whole, it loads
    corrupt(model)
    with pytest.raises(ModelFileError, match=message) as raised:
        load(model)
    assert str(raised.value).startswith(str(model)) and "\n" not in str(raised.value)


# -- a seeded fuzz of a small real GGUF ------------------------------------------------------


def write_small_gguf(path: Path) -> Path:
    """A real 2-layer llama GGUF of about 100 KB (short vocabulary arrays, quantized and
    float tensors), written by the gguf package: the fuzz's seed file."""
    rng = np.random.default_rng(0)
    hidden, ffn, vocab, layers = 64, 128, 96, 2
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"t{i}".encode() for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([1] * vocab)

    def quantized(name: str, rows: int, cols: int, qtype: T) -> None:
        dense = rng.standard_normal((rows, cols)).astype(np.float32)
        writer.add_tensor(name, quants.quantize(dense, qtype), raw_dtype=qtype)

    quantized("token_embd.weight", vocab, hidden, T.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for proj, rows, cols, qtype in (("attn_q", hidden, hidden, T.Q4_0),
                                        ("attn_k", hidden // 2, hidden, T.Q4_1),
                                        ("attn_v", hidden // 2, hidden, T.Q8_0),
                                        ("attn_output", hidden, hidden, T.Q5_0),
                                        ("ffn_gate", ffn, hidden, T.Q8_0),
                                        ("ffn_up", ffn, hidden, T.Q5_1),
                                        ("ffn_down", hidden, ffn, T.Q4_0)):  # fmt: skip
            quantized(f"blk.{i}.{proj}.weight", rows, cols, qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


EXTREMES = (0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1)


def mutate(seed: bytes, header_end: int, rng: random.Random) -> bytes:
    """One damage: a truncation, random bytes, or an extreme count in the header."""
    data = bytearray(seed)
    kind = rng.choice(("truncate", "bytes", "u32", "u64", "truncate"))
    if kind == "truncate":
        return bytes(data[: rng.randrange(len(data))])
    at = rng.randrange(4, header_end)
    if kind == "bytes":
        for i in range(rng.randint(1, 4)):
            data[min(at + i, len(data) - 1)] = rng.randrange(256)
    else:
        fmt, bits = ("<I", 32) if kind == "u32" else ("<Q", 64)
        value = rng.choice(EXTREMES) % 2**bits if rng.random() < 0.7 else rng.randrange(2**bits)
        struct.pack_into(fmt, data, min(at, len(data) - struct.calcsize(fmt)), value)
    return bytes(data)


def test_fuzzed_ggufs_either_load_within_the_file_or_fail_with_one_line(tmp_path):
    seed_path = write_small_gguf(tmp_path / "seed.gguf")
    seed = seed_path.read_bytes()
    whole = GGUFFile(seed_path)
    header_end = min(t.offset for t in whole.tensors)
    assert len(list(read_tensors(seed_path))) == 1 + 1 + 2 * 9  # the seed itself loads
    rng, path = random.Random(40), tmp_path / "fuzzed.gguf"
    outcomes = {"loaded": 0, "refused": 0}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    slowest = 0.0
    for _ in range(400):
        data = mutate(seed, header_end, rng)
        path.write_bytes(data)
        start = time.perf_counter()
        try:
            gguf = GGUFFile(path)
            tensors = list(read_tensors(path))
        except ModelFileError as exc:
            assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc)
            outcomes["refused"] += 1
        else:
            outcomes["loaded"] += 1
            assert all(t.offset + t.nbytes <= len(data) for t in gguf.tensors)
            assert len(tensors) <= len(gguf.tensors)
        slowest = max(slowest, time.perf_counter() - start)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    # Both outcomes occur (a fuzz that only ever refuses checks nothing about loading).
    assert outcomes["loaded"] >= 20 and outcomes["refused"] >= 200, outcomes
    assert slowest < 5.0, f"one file took {slowest:.1f} s"
    assert grown_mib < 256, f"peak memory grew {grown_mib:.0f} MiB"
