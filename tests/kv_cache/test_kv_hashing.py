from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kv_cache import KVCacheManager, get_block_hasher, hash_block_tokens, hash_request_tokens

ALGOS = ["builtin", "sha256"]
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    extra_keys: tuple = field(default_factory=tuple)


def run_python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


@pytest.mark.parametrize("algo", ALGOS)
def test_parent_chaining(algo: str) -> None:
    block = [5, 6, 7, 8]
    under_a = hash_request_tokens(algo, [1, 2, 3, 4, *block], 4)[1]
    under_b = hash_request_tokens(algo, [1, 2, 3, 9, *block], 4)[1]
    assert under_a != under_b
    # The chain: block 1's hash is its tokens hashed under block 0's hash.
    parent = hash_block_tokens(algo, None, [1, 2, 3, 4])
    assert hash_block_tokens(algo, parent, block) == under_a


@pytest.mark.parametrize("algo", ALGOS)
def test_extra_keys_separate_equal_blocks(algo: str) -> None:
    tokens = [1, 2, 3, 4]
    assert hash_request_tokens(algo, tokens, 4, ("tenant-a",)) != hash_request_tokens(
        algo, tokens, 4, ("tenant-b",)
    )
    assert hash_request_tokens(algo, tokens, 4, ("tenant-a",)) == hash_request_tokens(
        algo, tokens, 4, ("tenant-a",)
    )


@pytest.mark.parametrize("algo", ALGOS)
def test_only_full_blocks_are_hashed(algo: str) -> None:
    assert len(hash_request_tokens(algo, list(range(11)), 4)) == 2
    assert hash_request_tokens(algo, [1, 2, 3], 4) == []


def test_sha256_extra_keys_do_not_depend_on_object_sharing() -> None:
    # Equal values must hash equally whether or not they are the same object
    # (plain pickle would memoize the shared one differently).
    shared = "".join(["x"] * 20)
    same_object = (shared, shared)
    equal_objects = (shared, "".join(["x"] * 20))
    assert pickle.dumps(same_object, protocol=5) != pickle.dumps(equal_objects, protocol=5)
    one = hash_request_tokens("sha256", [1, 2], 2, same_object)
    two = hash_request_tokens("sha256", [1, 2], 2, equal_objects)
    assert one == two


def test_unknown_algo_is_refused() -> None:
    with pytest.raises(ValueError, match="hash_algo"):
        get_block_hasher("md5")
    with pytest.raises(ValueError, match="hash_algo"):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo="md5")


HASH_IN_CHILD = (
    "from kv_cache import hash_request_tokens as h;"
    "print([x.hex() if isinstance(x, bytes) else x"
    " for x in h({algo!r}, list(range(100, 140)), 8, ('salt', 3))])"
)


def test_sha256_is_identical_across_processes() -> None:
    here = str(
        [x.hex() for x in hash_request_tokens("sha256", list(range(100, 140)), 8, ("salt", 3))]
    )
    assert run_python(HASH_IN_CHILD.format(algo="sha256")) == here
    assert run_python(HASH_IN_CHILD.format(algo="sha256")) == here


def test_builtin_root_is_random_per_process() -> None:
    # Token ids and an int salt hash the same in every process, so only the
    # random root can make these differ (equal with probability ~2**-64).
    code = HASH_IN_CHILD.format(algo="builtin").replace("'salt', ", "")
    assert run_python(code) != run_python(code)


@pytest.mark.parametrize("algo", ALGOS)
def test_cache_salt_tenants_never_share_blocks(algo: str) -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, hash_algo=algo)
    prompt = list(range(13))
    first = Req("a", list(prompt), extra_keys=("tenant-a",))
    hits, _ = mgr.get_computed_blocks(first)
    mgr.allocate_slots(first, len(prompt), hits)
    other_tenant = Req("b", list(prompt), extra_keys=("tenant-b",))
    assert mgr.get_computed_blocks(other_tenant) == ([], 0)
    same_tenant = Req("c", list(prompt), extra_keys=("tenant-a",))
    hits, num_hit_tokens = mgr.get_computed_blocks(same_tenant)
    assert num_hit_tokens == 12
    assert tuple(b.block_id for b in hits) == mgr.get_block_ids("a")[:3]


@pytest.mark.parametrize("algo", ALGOS)
def test_partial_blocks_are_never_cached(algo: str) -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, hash_algo=algo)
    req = Req("a", list(range(6)))
    mgr.allocate_slots(req, 6)
    assert mgr.get_block_ids("a") == (0, 1)
    assert mgr.cached_block_ids() == {0}
    assert mgr.block_pool.blocks[1].block_hash is None
    # A request sharing 6 tokens hits only the full block.
    assert mgr.get_computed_blocks(Req("b", list(range(6)) + [50, 51]))[1] == 4


@pytest.mark.parametrize("algo", ALGOS)
def test_missing_or_list_extra_keys_are_normalized(algo: str) -> None:
    tokens = [1, 2, 3, 4]
    assert hash_request_tokens(algo, tokens, 2, None) == hash_request_tokens(algo, tokens, 2, ())
    assert hash_request_tokens(algo, tokens, 2, ["s", 1]) == hash_request_tokens(
        algo, tokens, 2, ("s", 1)
    )
