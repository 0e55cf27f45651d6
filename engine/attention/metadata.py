"""What attention needs to know about one step's flat batch of requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.state_cache import StateMetadata


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flat batch of B requests and T tokens.

    Request ``r``'s new tokens sit at positions ``seq_lens[r] - query_lens[r] ..
    seq_lens[r] - 1`` and attend to every key up to their own position. Requests may come
    in any order; putting decodes (query length 1) first lets the fast backend take
    them as a slice instead of an index gather.
    """

    # [T] int64: the flat cache slot (block_id * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length after this step (computed + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    # The same on the host (int64): a backend's per-step planning reads it without a sync.
    block_tables_host: np.ndarray = field(repr=False, compare=False)
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    query_lens: list[int]
    seq_lens_list: list[int]
    query_start_loc_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_decodes: int  # requests with query length 1 (anywhere in the batch)
    # A hybrid model's other KV cache groups (kv_cache/groups.py): the same step over each
    # group's block tables (its own slots), in group order; () for a model of one group.
    group_metas: tuple[AttentionMetadata, ...] = field(default=(), repr=False, compare=False)
    # A model with recurrent layers: the step's state instructions (engine/state_cache.py).
    states: StateMetadata | None = field(default=None, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    def for_group(self, group: int) -> AttentionMetadata:
        """The step as KV cache group `group`'s layers see it: this one for group 0, and
        for every group when no other group's was built (a caller whose scratch cache gives
        each layer its own tensor and one table, as the memory profile and perplexity do)."""
        return self.group_metas[group - 1] if group and self.group_metas else self

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_list[-1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Build the step's metadata; positions and slots are computed vectorised in numpy.

        Each token's slot is looked up in its request's ``block_tables`` row.
        """
        num_reqs = len(query_lens)
        if not (len(seq_lens) == len(block_tables) == num_reqs):
            raise ValueError(
                "query_lens, seq_lens and block_tables must have one entry per request"
            )
        q_lens = np.asarray(query_lens, dtype=np.int64)
        s_lens = np.asarray(seq_lens, dtype=np.int64)
        if num_reqs and (q_lens.min() < 1 or (s_lens < q_lens).any()):
            raise ValueError("each request needs query_len >= 1 and seq_len >= query_len")
        q_start = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=q_start[1:])
        num_tokens = int(q_start[-1])

        max_blocks = max((len(t) for t in block_tables), default=0)
        table = np.zeros((num_reqs, max(max_blocks, 1)), dtype=np.int64)
        for r, row in enumerate(block_tables):
            table[r, : len(row)] = row

        # Token t of request r: offset within the request's new tokens, then position.
        req_of_token = np.repeat(np.arange(num_reqs), q_lens)
        offset = np.arange(num_tokens) - q_start[:-1][req_of_token]
        positions = (s_lens - q_lens)[req_of_token] + offset
        if (
            num_reqs
            and ((s_lens + block_size - 1) // block_size > [len(t) for t in block_tables]).any()
        ):
            raise ValueError("a block table is too short for its request's seq_len")
        blocks = table[req_of_token, positions // block_size]
        slots = blocks * block_size + positions % block_size

        def to_dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(a).to(device=device, dtype=dtype)

        return cls(
            slot_mapping=to_dev(slots, torch.int64),
            query_start_loc=to_dev(q_start, torch.int32),
            seq_lens=to_dev(s_lens, torch.int32),
            block_tables=to_dev(table, torch.int32),
            block_tables_host=table,
            positions=to_dev(positions, torch.int64),
            query_lens=[int(x) for x in query_lens],
            seq_lens_list=[int(x) for x in seq_lens],
            query_start_loc_list=q_start.tolist(),
            max_query_len=int(q_lens.max()) if num_reqs else 0,
            max_seq_len=int(s_lens.max()) if num_reqs else 0,
            block_size=block_size,
            num_decodes=int((q_lens == 1).sum()),
        )
