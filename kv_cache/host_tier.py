"""The prefix cache's second tier: full blocks evicted from the pool, kept in a memory-mapped
file and brought back on a hit instead of being recomputed; the file outlives the process,
so a restarted server starts warm.

The tier stores bytes under a block's chained hash (sha256, so the same prefix gives the
same key in every process; a tenant's cache salt is part of the chain, so one tenant's key
never names another's block). What the bytes are (every layer's K and V rows of one block)
is the engine's business; the file's header names the model and layout they belong to
(`identity`), and a file made for anything else is started afresh.

File layout: a 4 KiB header (magic, version, identity digest, slot size, slot count), then
`num_slots` slots of ``[key (32 bytes) | crc32 of key and data (4 bytes) | data]``. A slot
is rewritten by zeroing its key, writing the data, then the checksum and the key: a
process killed half-way leaves a slot whose key is zero or whose checksum fails, and such
a slot is dropped when it is read, never served. The checksum is checked when an entry is
read, so one read of the data serves both. (No fsync: a killed process loses nothing the
kernel holds; a power cut may lose recent writes, which the checksums then catch.)

Eviction within the tier is least recently used; `get` and `put` count as use.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

MAGIC = b"PSKVTIER"
VERSION = 1
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sI32sQQ")  # magic, version, identity digest, slot bytes, slots
_SLOT = struct.Struct("<32sI")  # key, crc32(key + data)
KEY_BYTES = 32
_EMPTY = bytes(KEY_BYTES)


class HostTier:
    def __init__(self, path: str | os.PathLike, capacity_bytes: int, block_bytes: int,
                 identity: str) -> None:  # fmt: skip
        """A tier of up to `capacity_bytes` (file size) holding blocks of `block_bytes`;
        reopens the file at `path` when it was made for the same identity and layout."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        self.block_bytes = block_bytes
        self.slot_bytes = _SLOT.size + block_bytes
        self.num_slots = (capacity_bytes - HEADER_BYTES) // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"a KV tier of {capacity_bytes} bytes holds no block of {block_bytes} bytes"
            )
        self.path = Path(path)
        digest = hashlib.sha256(identity.encode()).digest()
        header = _HEADER.pack(MAGIC, VERSION, digest, self.slot_bytes, self.num_slots)
        size = HEADER_BYTES + self.num_slots * self.slot_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # One process per file: another's writes would move entries under our index.
            # The lock lives as long as the descriptor, which `close` (or exit) releases.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(f"the KV tier file {self.path} is in use by another process") from None
        fresh = os.pread(fd, _HEADER.size, 0) != header or os.fstat(fd).st_size != size
        if fresh:  # another model, layout or size, or a new file: start empty
            os.ftruncate(fd, 0)
            os.ftruncate(fd, size)  # zero-filled: every slot empty
        self._fd = fd
        self._mm = mmap.mmap(fd, size)
        if fresh:
            self._mm[: _HEADER.size] = header
        # key -> slot, least recently used first; slots not in it are free.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._free: list[int] = []
        if fresh:
            self._free = list(reversed(range(self.num_slots)))  # pop() hands out low slots first
            self.reopened_entries = 0
        else:
            self.reopened_entries = self._scan()
        self.dropped = 0  # entries whose checksum failed when read

    def _scan(self) -> int:
        """Index the keys the file holds (their data is checked when read)."""
        for slot in range(self.num_slots):
            at = HEADER_BYTES + slot * self.slot_bytes
            key = bytes(self._mm[at : at + KEY_BYTES])
            if key == _EMPTY or key in self._index:
                self._free.append(slot)
            else:
                self._index[key] = slot
        self._free.reverse()  # pop() hands out low slots first
        return len(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[bytes]:
        """The keys held, least recently used first."""
        return list(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def get(self, key: bytes) -> bytes | None:
        """The block stored under key (a copy), or None: absent, or torn (then dropped)."""
        slot = self._index.get(key)
        if slot is None:
            return None
        at = HEADER_BYTES + slot * self.slot_bytes
        stored_key, crc = _SLOT.unpack_from(self._mm, at)
        data = self._mm[at + _SLOT.size : at + self.slot_bytes]
        if stored_key != key or zlib.crc32(data, zlib.crc32(key)) != crc:
            self._drop(key, slot)
            return None
        self._index.move_to_end(key)
        return data

    def put(self, key: bytes, data: bytes | memoryview) -> None:
        """Store a block under key (a key already held is only marked used)."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"keys are {KEY_BYTES} bytes (sha256), got {len(key)}")
        if len(data) != self.block_bytes:
            raise ValueError(f"blocks are {self.block_bytes} bytes, got {len(data)}")
        if key in self._index:
            self._index.move_to_end(key)
            return
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._index.popitem(last=False)
        at = HEADER_BYTES + slot * self.slot_bytes
        mm = self._mm
        mm[at : at + KEY_BYTES] = _EMPTY  # invalid until the checksum and key land
        mm[at + _SLOT.size : at + self.slot_bytes] = data
        mm[at + KEY_BYTES : at + _SLOT.size] = struct.pack("<I", zlib.crc32(data, zlib.crc32(key)))
        mm[at : at + KEY_BYTES] = key
        self._index[key] = slot

    def _drop(self, key: bytes, slot: int) -> None:
        del self._index[key]
        at = HEADER_BYTES + slot * self.slot_bytes
        self._mm[at : at + KEY_BYTES] = _EMPTY
        self._free.append(slot)
        self.dropped += 1

    def close(self) -> None:
        if not self._mm.closed:
            self._mm.flush()
            self._mm.close()
            os.close(self._fd)
