"""The state group: layers that keep a fixed-size state per request instead of a token
history (Gated DeltaNet in Qwen3.5 and Qwen3-Next; Mamba-style layers).

A request's state after token t sums every token before it, so it cannot be paged by
token: a running request owns one *live* slot (a state for each of the group's layers)
that each step overwrites. Prefix caching keeps *snapshots*: copies of the state at a
block boundary, each cached under the hash of the prefix it ends (the same chain of block
hashes the KV groups use, under this group's own key). A request whose prompt starts with
a snapshotted prefix copies that snapshot into its live slot and prefills the rest.

Slots come from a `BlockPool` of their own, with the blocks' accounting: a live slot is
held while its request runs (admission waits or preempts when none is free, as for
blocks); a snapshot is held by the request that writes it until its next step, when the
step that writes it has run: only then is it cached (a lookup in the same step must not
copy a state not yet written) and put in the free queue, which LRU evicts
least-recently-used first and a hit revives. Snapshots are taken

- every `snapshot_interval` blocks of the sequence (prompt or output: a long chat keeps
  them as it grows), and
- at the last block boundary before the prompt's last token: the longest hit a repeat of
  the same prompt can have (a hit leaves the last token to compute, for its logits), and
  where the next turn of a conversation, which extends this prompt, resumes at the least.

vLLM's prefix caching for Mamba layers ("align" mode) keeps a state per block-sized
step; SGLang's MambaRadixCache keeps one per radix node; llama.cpp's context checkpoints
keep a few per slot, for that slot alone. Here snapshots are shared by every request
through the hash chain, taken at a chosen spacing rather than every block, and evicted by
the same LRU rule as the KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_cache.block import BlockHash, KVCacheBlock
from kv_cache.block_pool import BlockPool
from kv_cache.hashing import get_block_hasher
from kv_cache.host_tier import HostTier
from kv_cache.request_state import RequestLike
from kv_cache.stats import StateSlots
from kv_cache.tier_link import TierLink

# The group key a state snapshot's hash carries, apart from any KV group's.
STATE_GROUP_KEY = (("state_group", 0),)


@dataclass(frozen=True)
class StateGroup:
    """The recurrent layers of a model and the pool their states come from."""

    layers: tuple[int, ...]  # the model's layer indices that keep a state
    num_slots: int  # states in the pool: live ones and snapshots
    snapshot_interval: int = 16  # blocks between snapshots


@dataclass(frozen=True, slots=True)
class StateStep:
    """What one step does with a request's state (the model runner's instructions)."""

    slot: int  # the request's live slot, read and written by the step
    # Before the step: None keeps the slot as the last step left it; ZERO clears it (a
    # request starting from its first token); another slot is a snapshot to copy in.
    source: int | None
    # During the step: (tokens into the sequence, slot): write the state after that many
    # tokens (a block boundary inside this step's tokens) into the slot.
    saves: tuple[tuple[int, int], ...] = ()


ZERO = -1


class _RequestSlots:
    __slots__ = ("live", "source", "pending", "rollback", "hashes", "extra", "num_saved_to",
                 "shared_end")  # fmt: skip

    def __init__(self, extra: object) -> None:
        self.live: KVCacheBlock | None = None
        self.source: int | None = None  # the next step's StateStep.source
        # The slots held until the request's next step: a hit's snapshot to copy in (end
        # None) and the snapshots the step writes (each with the tokens it ends at).
        self.pending: list[tuple[KVCacheBlock, int | None]] = []
        # A speculative step's states after its last known token and after each draft but
        # the last, (tokens, slot): `trim` keeps the one the accepted drafts end at.
        self.rollback: list[tuple[int, KVCacheBlock]] = []
        self.hashes: list[BlockHash] = []  # the sequence's block hashes, under STATE_GROUP_KEY
        self.extra = extra
        self.num_saved_to = 0  # tokens up to which snapshots were planned
        # The end of the prompt's prefix the KV cache holds beyond the state's hit: another
        # request shares it, so a snapshot there serves the next one whole.
        self.shared_end = 0


class StateCacheManager:
    """One state group's slots; speaks the KV groups' manager interface where the hybrid
    manager (kv_cache/hybrid.py) calls it, and `take_step` for the runner."""

    window = None  # (read by the hybrid manager's group summaries)

    def __init__(
        self,
        group: StateGroup,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "builtin",
        tier: HostTier | None = None,
    ) -> None:
        """`tier`: the snapshots' second tier (a file of its own: a snapshot is the size
        of many KV blocks): what the pool evicts goes there, a lookup continues there."""
        if group.num_slots < 1:
            raise ValueError(f"a state group needs at least one slot, got {group.num_slots}")
        if group.snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be >= 1 block, got {group.snapshot_interval}")
        self.group = group
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.tier = tier
        self.tier_link = TierLink(tier, None) if tier is not None else None
        listener = self.tier_link.on_pool_event if self.tier_link is not None else None
        self.pool = BlockPool(group.num_slots, enable_caching, listener)
        self._hasher = get_block_hasher(hash_algo)
        self._requests: dict[str, _RequestSlots] = {}
        self._steps: dict[str, StateStep] = {}  # the last allocation's, by request
        # Snapshots planned and not yet written, by hash: a request whose prefix one of
        # them ends is admitted a step later, to resume from it (`waits_for_snapshot`).
        self._planned: dict[BlockHash, int] = {}

    # -- counts ---------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_slots(self) -> int:
        return len(self.pool.free_block_queue)

    @property
    def num_slots_in_use(self) -> int:
        return self.pool.num_blocks - len(self.pool.free_block_queue)

    def slot_counts(self) -> StateSlots:
        counts = self.pool.block_counts()
        return StateSlots(counts.free, counts.cached, counts.in_use)

    # -- prefix hits ----------------------------------------------------------------------

    def _state(self, req: RequestLike) -> _RequestSlots:
        state = self._requests.get(req.request_id)
        if state is None:
            extra = self._hasher.prepare_extra(req.extra_keys + STATE_GROUP_KEY)
            state = self._requests[req.request_id] = _RequestSlots(extra)
        return state

    def _hashes(self, state: _RequestSlots, token_ids: list[int], num_full: int) -> list[BlockHash]:
        if len(state.hashes) < num_full:
            self._hasher.extend(state.hashes, token_ids, self.block_size, state.extra, num_full)
        return state.hashes

    def get_computed_blocks(
        self, req: RequestLike, max_blocks: int | None = None
    ) -> tuple[list[KVCacheBlock | None], int]:
        """The longest prefix of at most `max_blocks` blocks (and short of the last token)
        that ends at a snapshot: None for each of its blocks but the last, which is the
        snapshot's slot (brought back from the tier into a free slot where only the tier
        holds it)."""
        if not self.enable_caching:
            return [], 0
        token_ids = req.all_token_ids
        limit = (len(token_ids) - 1) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        state = self._state(req)
        hashes = self._hashes(state, token_ids, limit)
        lookup = self.pool.cached_hash_to_block.get
        link = self.tier_link
        for end in range(limit, 0, -1):
            snapshot = lookup(hashes[end - 1])
            if snapshot is None and link is not None:
                snapshot = link.bring_back(self.pool, hashes, end - 1)
            if snapshot is not None:
                return [None] * (end - 1) + [snapshot], end * self.block_size
        return [], 0

    def note_shared_prefix(self, req: RequestLike, num_blocks: int) -> None:
        """The KV groups hold `num_blocks` of the prompt's blocks: a snapshot at their end
        (if past the state's own hit) serves the next request that shares them."""
        self._state(req).shared_end = num_blocks * self.block_size

    def waits_for_snapshot(self, req: RequestLike, num_hit_blocks: int) -> bool:
        """Whether a request past a hit of `num_hit_blocks` would resume from a longer one
        that another request's step is writing now (several requests sharing a new prefix
        arrive together: the first computes it, the others hit it a step later)."""
        if not self._planned:
            return False
        state = self._state(req)
        limit = (len(req.all_token_ids) - 1) // self.block_size
        hashes = self._hashes(state, req.all_token_ids, limit)
        return any(h in self._planned for h in hashes[num_hit_blocks:limit])

    # -- allocation -----------------------------------------------------------------------

    def num_blocks_needed(
        self, req: RequestLike, num_new_tokens: int, hits: list[KVCacheBlock | None] = ()
    ) -> int:
        """Free slots `allocate_new` needs: a live one for a request without, and a free
        hit revived. Snapshots are taken where slots are left (`allocate_new`): a request
        never waits, nor preempts another, for one."""
        state = self._requests.get(req.request_id)
        needed = 0 if state is not None and state.live is not None else 1
        if hits and hits[-1] is not None and hits[-1].ref_cnt == 0:
            needed += 1
        start = req.num_computed_tokens + len(hits) * self.block_size
        return needed + self._num_drafts(req, start, num_new_tokens)

    @staticmethod
    def _num_drafts(req: RequestLike, start: int, num_new_tokens: int) -> int:
        """The draft tokens (past all_token_ids) a speculative step computes."""
        return max(start + num_new_tokens - len(req.all_token_ids), 0)

    def take_hits(self, req: RequestLike, hits: list[KVCacheBlock | None]) -> None:
        """Hold a hit's snapshot until the step that copies it has run."""
        state = self._state(req)
        self._release_pending(state)
        if hits:
            snapshot = hits[-1]
            assert snapshot is not None
            self.pool.touch([snapshot])
            state.pending.append((snapshot, None))
            state.source = snapshot.block_id
            state.num_saved_to = len(hits) * self.block_size

    def allocate_new(
        self, req: RequestLike, num_new_tokens: int, num_hits: int = 0
    ) -> list[KVCacheBlock]:
        """A live slot if the request has none, and a cached slot for each snapshot the
        step's tokens reach; records the step's `StateStep`."""
        state = self._state(req)
        if num_hits == 0:
            self._release_pending(state)
        new: list[KVCacheBlock] = []
        if state.live is None:
            (state.live,) = self.pool.get_new_blocks(1)
            new.append(state.live)
            if state.source is None:
                state.source = ZERO
        start = req.num_computed_tokens + num_hits * self.block_size
        saves = []
        ends = self._snapshot_ends(req, state, start, start + num_new_tokens)
        ends = ends[len(ends) - min(len(ends), self.num_free_slots) :]  # the longest first
        if ends:
            for end in ends:
                (slot,) = self.pool.get_new_blocks(1)
                state.pending.append((slot, end))
                self._plan(state.hashes[end // self.block_size - 1], +1)
                new.append(slot)
                saves.append((end, slot.block_id))
            state.num_saved_to = ends[-1]
        drafts = self._num_drafts(req, start, num_new_tokens)
        if drafts:  # rejected drafts roll back to one of these (`trim`)
            for end in range(start + 1, start + 1 + drafts):
                (slot,) = self.pool.get_new_blocks(1)
                state.rollback.append((end, slot))
                new.append(slot)
                saves.append((end, slot.block_id))
            saves.sort()
        self._steps[req.request_id] = StateStep(state.live.block_id, state.source, tuple(saves))
        state.source = None
        return new

    def _snapshot_ends(
        self, req: RequestLike, state: _RequestSlots, start: int, end: int
    ) -> list[int]:
        """The block boundaries in (start, end] to snapshot: each interval-th one and the
        prompt's last before its last token; only boundaries of known tokens, not yet
        planned, not already cached."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        every = self.group.snapshot_interval * bs
        known = len(req.all_token_ids)
        last = min(end, known) // bs * bs
        first = max(start, state.num_saved_to)
        ends = set(range((first // every + 1) * every, last + 1, every))
        prompt_end = (req.num_prompt_tokens - 1) // bs * bs
        ends.update(e for e in (prompt_end, state.shared_end) if first < e <= last)
        ends = sorted(ends)
        if not ends:
            return ends
        hashes = self._hashes(state, req.all_token_ids, ends[-1] // bs)
        cached = self.pool.cached_hash_to_block
        return [e for e in ends if hashes[e // bs - 1] not in cached]

    def _release_pending(self, state: _RequestSlots) -> None:
        """The request's last step has run: the snapshots it wrote are cached (found by
        lookups from now on, not before they hold their state), and they and the hit it
        copied from go to the free queue."""
        self._drop_rollback(state)
        if not state.pending:
            return
        bs = self.block_size
        # The slot the coming step copies from stays held until the step after it.
        going = [(slot, end) for slot, end in state.pending if slot.block_id != state.source]
        for slot, end in going:
            if end is not None:  # (a snapshot another request cached first stays a copy)
                index = end // bs - 1
                self._plan(state.hashes[index], -1)
                self.pool.cache_full_blocks([slot.block_id] * (index + 1), state.hashes,
                                            index, index + 1)  # fmt: skip
        self.pool.free_blocks([slot for slot, _ in going])
        state.pending = [entry for entry in state.pending if entry not in going]

    def _plan(self, block_hash: BlockHash, change: int) -> None:
        left = self._planned.get(block_hash, 0) + change
        if left:
            self._planned[block_hash] = left
        else:
            del self._planned[block_hash]

    def _drop_rollback(self, state: _RequestSlots, keep: KVCacheBlock | None = None) -> None:
        """Give back a speculative step's rollback slots but `keep` (never cached: to the
        free queue's head, the next to be taken)."""
        self.pool.free_unwritten([slot for _, slot in state.rollback if slot is not keep])
        state.rollback = []

    def take_step(self, request_id: str) -> StateStep | None:
        """The request's `StateStep` from its last allocation (the scheduler hands it to
        the runner with the step)."""
        return self._steps.pop(request_id, None)

    # -- leaving ----------------------------------------------------------------------------

    def free(self, req: RequestLike | str) -> None:
        request_id = req if isinstance(req, str) else req.request_id
        state = self._requests.pop(request_id, None)
        self._steps.pop(request_id, None)
        if state is None:
            return
        self._release_pending(state)
        if state.live is not None:
            self.pool.free_blocks([state.live])

    def uncache_unwritten(self, request_id: str, num_written_tokens: int) -> None:
        """The step that was to write the request's pending snapshots failed: those past
        `num_written_tokens` hold nothing, so they leave the cache."""
        state = self._requests.get(request_id)
        if state is None:
            return
        kept, unwritten = [], []
        for slot, end in state.pending:
            written = end is None or end <= num_written_tokens
            (kept if written else unwritten).append((slot, end))
        state.pending = kept
        for _, end in unwritten:
            self._plan(state.hashes[end // self.block_size - 1], -1)
        self.pool.free_blocks([slot for slot, _ in unwritten])
        self._drop_rollback(state)
        state.num_saved_to = min(state.num_saved_to, num_written_tokens)

    def trim(self, req: RequestLike) -> int:
        """After a speculative step: the request's state is the one after its accepted
        drafts (req.num_computed_tokens): the live slot when every draft was kept, else
        the rollback slot that holds it, copied in before the next step. Returns 0 (no
        KV block is freed here)."""
        state = self._requests.get(req.request_id)
        if state is None or not state.rollback:
            return 0
        kept = next((slot for end, slot in state.rollback if end == req.num_computed_tokens), None)
        self._drop_rollback(state, kept)
        if kept is not None:
            state.pending.append((kept, None))  # held until the next step has copied it
            state.source = kept.block_id
        return 0

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        return 0  # its slots are not KV blocks: `_check_fits` counts blocks only

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for state in self._requests.values():
            held = [slot for slot, _ in state.pending] + [slot for _, slot in state.rollback]
            for slot in ([state.live] if state.live is not None else []) + held:
                holders[slot.block_id] += 1
        for block, n in zip(self.pool.blocks, holders, strict=True):
            if block.ref_cnt != n:
                raise AssertionError(f"state slot {block.block_id} has ref_cnt {block.ref_cnt} "
                                     f"but {n} holders")  # fmt: skip
