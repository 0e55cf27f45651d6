"""Block hashes: a chain over full blocks of token ids.

hash(block i) = H(hash(block i-1), tuple(token ids of block i), extra_keys)

The parent hash makes a block's hash stand for its whole prefix, so equal
hashes mean equal KV. `extra_keys` carries whatever else changes the KV for
the same tokens (a tenant's cache salt, an adapter id, ...). Only full blocks
are hashed.

Two algorithms:
- "builtin": Python's `hash` of the tuple; fast. The root parent is random per
  process, so nobody outside can predict hashes (and aim collisions at them).
- "sha256": SHA-256 of a fixed byte encoding; identical across processes and
  machines, and collision-resistant for multi-tenant use.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import struct
from collections.abc import Hashable

from kv_cache.block import BlockHash

HASH_ALGOS = ("builtin", "sha256")

# Drawn once per process: see the module docstring.
_BUILTIN_ROOT: int = int.from_bytes(os.urandom(8), "little")
# Fixed, so sha256 hashes agree everywhere.
_SHA256_ROOT: bytes = hashlib.sha256(b"pagedserve/kv_cache/root").digest()


class BlockHasher:
    """Hashes full blocks; `extend` is the only per-step entry point."""

    name = ""
    root: BlockHash = 0

    def prepare_extra(self, extra_keys: Hashable | None) -> object:
        """The per-request form of extra_keys, computed once per request."""
        raise NotImplementedError

    def hash_block(self, parent: BlockHash, token_ids: list[int], extra: object) -> BlockHash:
        raise NotImplementedError

    def extend(
        self,
        hashes: list[BlockHash],
        token_ids: list[int],
        block_size: int,
        extra: object,
        num_blocks: int,
    ) -> None:
        """Append the hashes of blocks len(hashes)..num_blocks-1 (all full).

        Subclasses inline hash_block here: this loop is the whole cost of
        prefix caching.
        """
        raise NotImplementedError


class BuiltinBlockHasher(BlockHasher):
    name = "builtin"

    def __init__(self) -> None:
        self.root = _BUILTIN_ROOT

    def prepare_extra(self, extra_keys: Hashable | None) -> object:
        return _normalize_extra(extra_keys)

    def hash_block(self, parent: BlockHash, token_ids: list[int], extra: object) -> BlockHash:
        return hash((parent, tuple(token_ids), extra))

    def extend(
        self,
        hashes: list[BlockHash],
        token_ids: list[int],
        block_size: int,
        extra: object,
        num_blocks: int,
    ) -> None:
        parent = hashes[-1] if hashes else self.root
        append = hashes.append
        for start in range(len(hashes) * block_size, num_blocks * block_size, block_size):
            parent = hash((parent, tuple(token_ids[start : start + block_size]), extra))
            append(parent)


class Sha256BlockHasher(BlockHasher):
    """SHA-256 over parent (32 bytes) + block length and token ids as
    little-endian int64 + a canonical pickle of extra_keys."""

    name = "sha256"

    def __init__(self) -> None:
        self.root = _SHA256_ROOT
        self._structs: dict[int, struct.Struct] = {}

    def prepare_extra(self, extra_keys: Hashable | None) -> object:
        return canonical_bytes(_normalize_extra(extra_keys))

    def _struct(self, n: int) -> struct.Struct:
        packer = self._structs.get(n)
        if packer is None:
            packer = self._structs[n] = struct.Struct(f"<I{n}q")
        return packer

    def hash_block(self, parent: BlockHash, token_ids: list[int], extra: object) -> BlockHash:
        assert isinstance(parent, bytes) and isinstance(extra, bytes)
        n = len(token_ids)
        return hashlib.sha256(parent + self._struct(n).pack(n, *token_ids) + extra).digest()

    def extend(
        self,
        hashes: list[BlockHash],
        token_ids: list[int],
        block_size: int,
        extra: object,
        num_blocks: int,
    ) -> None:
        assert isinstance(extra, bytes)
        parent = hashes[-1] if hashes else self.root
        pack = self._struct(block_size).pack
        sha256 = hashlib.sha256
        append = hashes.append
        for start in range(len(hashes) * block_size, num_blocks * block_size, block_size):
            parent = sha256(
                parent + pack(block_size, *token_ids[start : start + block_size]) + extra
            ).digest()
            append(parent)


def _normalize_extra(extra_keys: Hashable | None) -> Hashable:
    """None means no extra keys; a list is forgiven (it would not hash)."""
    if extra_keys is None:
        return ()
    return tuple(extra_keys) if isinstance(extra_keys, list) else extra_keys


def canonical_bytes(obj: object) -> bytes:
    """Pickle (protocol 5) without the memo, so equal values give equal bytes
    whether or not they share objects (plain pickle.dumps would not)."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=5)
    pickler.fast = True  # no memo: see above
    pickler.dump(obj)
    return buf.getvalue()


def get_block_hasher(algo: str) -> BlockHasher:
    if algo == "builtin":
        return BuiltinBlockHasher()
    if algo == "sha256":
        return Sha256BlockHasher()
    raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {algo!r}")


def hash_block_tokens(
    algo: str,
    parent: BlockHash | None,
    token_ids: list[int],
    extra_keys: Hashable | None = None,
) -> BlockHash:
    """One block's hash; parent None means the first block of a sequence."""
    hasher = get_block_hasher(algo)
    root = hasher.root if parent is None else parent
    return hasher.hash_block(root, list(token_ids), hasher.prepare_extra(extra_keys))


def hash_request_tokens(
    algo: str,
    token_ids: list[int],
    block_size: int,
    extra_keys: Hashable | None = None,
) -> list[BlockHash]:
    """The hashes of all full blocks of a token sequence."""
    hasher = get_block_hasher(algo)
    hashes: list[BlockHash] = []
    hasher.extend(
        hashes,
        token_ids,
        block_size,
        hasher.prepare_extra(extra_keys),
        len(token_ids) // block_size,
    )
    return hashes
