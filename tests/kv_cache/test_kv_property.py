"""Random interleavings of the scheduler's calls on a small pool with a tiny
vocabulary (so prefixes collide), checked against the manager's invariants
and a shadow model of what each block holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_cache import KVCacheManager

VOCAB = st.integers(min_value=0, max_value=2)
TENANTS = st.sampled_from([(), ("tenant-b",)])


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    extra_keys: tuple = ()
    num_computed_tokens: int = 0
    running: bool = False


@dataclass
class Sim:
    mgr: KVCacheManager
    block_size: int
    live: dict[str, Req] = field(default_factory=dict)
    # block id -> what its KV stands for once full: (extra_keys, tokens up to its end)
    content: dict[int, tuple] = field(default_factory=dict)
    next_id: int = 0

    def key(self, req: Req, index: int) -> tuple:
        return (req.extra_keys, tuple(req.all_token_ids[: (index + 1) * self.block_size]))

    def snapshot(self) -> tuple:
        pool = self.mgr.block_pool
        return (
            self.mgr.free_block_ids(),
            {rid: self.mgr.get_block_ids(rid) for rid in self.live},
            [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks],
            {h: b.block_id for h, b in pool.cached_hash_to_block.items()},
        )

    def expected_hit_blocks(self, req: Req) -> int:
        """The longest cached prefix per the shadow model, capped below the prompt."""
        cached = {
            self.content[b.block_id] for b in self.mgr.block_pool.cached_hash_to_block.values()
        }
        count = 0
        while count < (len(req.all_token_ids) - 1) // self.block_size and (
            self.key(req, count) in cached
        ):
            count += 1
        return count

    def allocate(self, req: Req, num_new: int, hits: list) -> bool:
        num_hit_tokens = len(hits) * self.block_size
        num_tokens = req.num_computed_tokens + num_hit_tokens + num_new
        num_held = len(self.mgr.get_block_ids(req.request_id))
        # Hits nobody holds sit in the free queue, so they use up free blocks too.
        needed = max(-(-num_tokens // self.block_size) - num_held - len(hits), 0)
        needed += sum(1 for block in hits if block.ref_cnt == 0)
        fits = needed <= self.mgr.num_free_blocks
        before = None if fits else self.snapshot()
        new_blocks = self.mgr.allocate_slots(req, num_new, hits)
        assert (new_blocks is not None) == fits, f"needed {needed}, got {new_blocks}"
        if new_blocks is None:
            assert self.snapshot() == before, "a failed allocate_slots changed state"
            return False
        req.num_computed_tokens += num_hit_tokens + num_new
        req.running = True
        table = self.mgr.get_blocks(req.request_id)
        assert len(table) * self.block_size >= req.num_computed_tokens
        # The "model" writes the now computed full blocks (hits already hold them).
        for index in range(len(hits), req.num_computed_tokens // self.block_size):
            self.content[table[index].block_id] = self.key(req, index)
        return True

    def schedule(self, req: Req, chunk: int, token: int) -> None:
        if not req.running:
            hits, num_hit_tokens = self.mgr.get_computed_blocks(req)
            assert num_hit_tokens == len(hits) * self.block_size < len(req.all_token_ids)
            if self.mgr.enable_caching:
                assert len(hits) == self.expected_hit_blocks(req)
            for index, block in enumerate(hits):
                assert self.content[block.block_id] == self.key(req, index), "wrong cache hit"
            num_new = min(chunk, len(req.all_token_ids) - num_hit_tokens)
            self.allocate(req, num_new, hits)
        else:
            if req.num_computed_tokens == len(req.all_token_ids):
                req.all_token_ids.append(token)  # decode: the sampled token
            num_new = min(chunk, len(req.all_token_ids) - req.num_computed_tokens)
            if not self.allocate(req, num_new, []):
                self.preempt(req)  # as the scheduler would when it is the newest

    def preempt(self, req: Req) -> None:
        self.mgr.free(req)
        req.num_computed_tokens = 0
        req.running = False

    def finish(self, req: Req) -> None:
        self.mgr.free(req)
        del self.live[req.request_id]


# Weighted so the pool often runs short (allocation failures, evictions and
# re-admissions of preempted requests over their own freed, cached blocks).
OPS = st.sampled_from(["add"] * 3 + ["schedule"] * 6 + ["finish", "preempt", "reset"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_blocks=st.integers(12, 24),
    block_size=st.integers(2, 4),
    algo=st.sampled_from(["builtin", "sha256"]),
    enable_caching=st.sampled_from([True, True, True, False]),
)
def test_random_interleavings_keep_invariants(
    data: st.DataObject, num_blocks: int, block_size: int, algo: str, enable_caching: bool
) -> None:
    mgr = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, hash_algo=algo)
    sim = Sim(mgr, block_size)
    for _ in range(data.draw(st.integers(1, 80), label="num_ops")):
        op = data.draw(OPS, label="op")
        if op == "add" or not sim.live:
            prompt = data.draw(st.lists(VOCAB, min_size=1, max_size=8 * block_size + 1))
            req = Req(f"r{sim.next_id}", prompt, data.draw(TENANTS))
            sim.next_id += 1
            sim.live[req.request_id] = req
        else:
            req = sim.live[data.draw(st.sampled_from(sorted(sim.live)), label="request")]
            if op == "schedule":
                chunk = data.draw(st.integers(1, 3 * block_size), label="chunk")
                sim.schedule(req, chunk, data.draw(VOCAB, label="token"))
            elif op == "finish":
                sim.finish(req)
            elif op == "preempt":
                sim.preempt(req)
            else:
                all_free = mgr.num_free_blocks == num_blocks
                assert mgr.reset_prefix_cache() == all_free
                if all_free:
                    assert mgr.cached_block_ids() == set()
        mgr.check_invariants()
    for req in list(sim.live.values()):
        sim.finish(req)
    mgr.check_invariants()
    assert mgr.num_free_blocks == num_blocks
    assert len(mgr.free_block_ids()) == num_blocks
