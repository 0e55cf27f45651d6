"""The second tier's file: entries come back after a reopen, LRU within its slots, a file
for another identity starts empty, and a torn or killed write is dropped, never served."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from kv_cache.host_tier import HEADER_BYTES, HostTier

BLOCK = 1000


def block(i: int) -> tuple[bytes, bytes]:
    """(key, data) where the key is the data's own sha256: any data a get returns can be
    checked against the key it came under."""
    data = random.Random(i).randbytes(BLOCK)
    return hashlib.sha256(data).digest(), data


def tier(path, slots: int = 4, identity: str = "model-a") -> HostTier:
    return HostTier(path, HEADER_BYTES + slots * (BLOCK + 36), BLOCK, identity)


def test_blocks_come_back_after_a_reopen_and_lru_decides_what_stays(tmp_path):
    path = tmp_path / "tier.bin"
    t = tier(path)
    for i in range(4):
        t.put(*block(i))
    assert t.get(block(0)[0]) == block(0)[1]  # 0 is now the most recently used
    t.put(*block(4))  # evicts 1, the least recently used
    assert block(1)[0] not in t and len(t) == 4
    t.close()
    again = tier(path)
    assert again.reopened_entries == 4
    for i in (0, 2, 3, 4):
        assert again.get(block(i)[0]) == block(i)[1]
    assert again.get(block(1)[0]) is None


def test_a_file_for_another_model_or_size_starts_empty(tmp_path):
    path = tmp_path / "tier.bin"
    t = tier(path)
    t.put(*block(0))
    t.close()
    for changed in ({"identity": "model-b"}, {"slots": 8}):
        other = tier(path, **changed)
        assert len(other) == 0
        other.close()


def test_a_torn_entry_is_dropped_not_served(tmp_path):
    path = tmp_path / "tier.bin"
    t = tier(path)
    for i in range(3):
        t.put(*block(i))
    t.close()
    with open(path, "r+b") as f:  # flip one byte of the second slot's data
        f.seek(HEADER_BYTES + (BLOCK + 36) + 36 + 500)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = tier(path)
    assert again.get(block(1)[0]) is None and again.dropped == 1
    assert block(1)[0] not in again
    assert again.get(block(0)[0]) == block(0)[1] and again.get(block(2)[0]) == block(2)[1]


def test_one_process_at_a_time_holds_a_file(tmp_path):
    first = tier(tmp_path / "tier.bin")
    code = (
        "import sys; from kv_cache.host_tier import HostTier, HEADER_BYTES\n"
        "try:\n    HostTier(sys.argv[1], HEADER_BYTES + 4 * 1036, 1000, 'model-a')\n"
        "except ValueError as e:\n    print(e)"
    )
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tier.bin")],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "in use by another process" in other.stdout
    first.close()
    tier(tmp_path / "tier.bin").close()  # free again once closed


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(tmp_path / "t.bin", HEADER_BYTES + 10, BLOCK, "m")
    t = tier(tmp_path / "t.bin")
    with pytest.raises(ValueError, match="blocks are"):
        t.put(block(0)[0], b"short")
    with pytest.raises(ValueError, match="keys are"):
        t.put(b"k", block(0)[1])


WRITER = """
import random, sys, hashlib
from kv_cache.host_tier import HostTier, HEADER_BYTES
t = HostTier(sys.argv[1], HEADER_BYTES + 16 * (1000 + 36), 1000, "model-a")
print("ready", flush=True)
i = 0
while True:
    data = random.Random(i).randbytes(1000)
    t.put(hashlib.sha256(data).digest(), data)
    i += 1
"""


@pytest.mark.parametrize("seed", range(3))
def test_a_writer_killed_at_random_never_leaves_a_wrong_block(tmp_path, seed):
    path, delays = tmp_path / "tier.bin", random.Random(seed)
    for _ in range(4):  # several kills into the same file, each at its own moment
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delays.uniform(0.01, 0.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t = HostTier(path, HEADER_BYTES + 16 * (BLOCK + 36), BLOCK, "model-a")
        keys = t.keys()
        served = {key: t.get(key) for key in keys}
        for key, data in served.items():
            assert data is None or hashlib.sha256(data).digest() == key
        assert sum(data is None for data in served.values()) <= 1  # at most the torn one
        assert len(keys) >= 1
        t.close()


# A writer that SIGKILLs itself right after the N-th store into the file of its second put
# (a put makes 4: the key zeroed, the data, the checksum, the key): every point a kill can
# land between a put's stores, which a kill at a random time hits only by chance.
KILLED_MID_PUT = """
import os, signal, sys
from kv_cache.host_tier import HEADER_BYTES, HostTier
from tests.kv_cache.test_host_tier import block, tier

class KillAfter:
    def __init__(self, mm, stores):
        self.mm, self.stores = mm, stores
    def __setitem__(self, index, value):
        self.mm[index] = value
        self.mm.flush()
        self.stores -= 1
        if self.stores == 0:
            os.kill(os.getpid(), signal.SIGKILL)

t = tier(sys.argv[1])
t.put(*block(0))
t._mm = KillAfter(t._mm, int(sys.argv[2]))
t.put(*block(1))
"""


@pytest.mark.parametrize("stores", [1, 2, 3, 4])
def test_a_writer_killed_between_any_two_stores_of_a_put_leaves_no_wrong_block(tmp_path, stores):
    path = tmp_path / "tier.bin"
    run = subprocess.run([sys.executable, "-c", KILLED_MID_PUT, str(path), str(stores)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == -signal.SIGKILL, run.stderr
    again = tier(path)
    assert again.get(block(0)[0]) == block(0)[1]  # the put before the kill, whole
    # Killed before its key landed, the second put is not there at all; after it, whole.
    assert again.get(block(1)[0]) == (block(1)[1] if stores == 4 else None)
    assert again.dropped == 0 and len(again) == (2 if stores == 4 else 1)
