"""The state slots' tensors, and what one step does with them.

A recurrent layer (engine/models/linear_attention.py) keeps, per slot, a convolution state
``[conv_dim, kernel - 1]`` in the model dtype and a recurrent state ``[v_heads, k_dim,
v_dim]`` in float32 (as transformers keeps them). Slot ids come from the state group
(kv_cache/state_group.py): each running request's live slot, and the snapshots prefix
caching keeps. A step's `StateMetadata` says, per request, which slot it reads and writes,
which slot to copy into it first (a snapshot) or to clear (a new request), and which
snapshots to write at which of its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_cache.state_group import ZERO, StateStep

# One layer's slots: (conv states [S, C, K - 1], recurrent states [S, Hv, Dk, Dv]).
StateTensors = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StateShape:
    """One recurrent layer's state, per slot."""

    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    def slot_bytes(self, dtype_bytes: int) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * dtype_bytes
        return conv + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4


def allocate_state_cache(
    num_layers: int, num_slots: int, shape: StateShape, dtype: torch.dtype, device: torch.device
) -> list[StateTensors]:
    """Zeroed slots for each recurrent layer."""
    return [
        (
            torch.zeros(
                num_slots, shape.conv_dim, shape.conv_kernel - 1, dtype=dtype, device=device
            ),
            torch.zeros(
                num_slots,
                shape.num_v_heads,
                shape.head_k_dim,
                shape.head_v_dim,
                dtype=torch.float32,
                device=device,
            ),  # fmt: skip
        )
        for _ in range(num_layers)
    ]


@dataclass
class StateMetadata:
    """A step's state instructions, per request in the step's order. A request verifying
    k drafts is one request of 1 + k tokens here (a prefill of them, writing the states
    its drafts may roll back to), though attention runs it as 1 + k rows."""

    slots: list[int]  # each request's live slot
    # Before the step: (slot, source) copies, and slots to clear.
    copies: list[tuple[int, int]]
    zeros: list[int]
    # During the step: per request, (tokens into its query, snapshot slot) to write.
    saves: list[tuple[tuple[int, int], ...]]
    decode_rows: torch.Tensor  # [D] int64: the flat rows of the one-token requests
    decode_slots: torch.Tensor  # [D] int64: their live slots
    prefills: list[int]  # the requests of more than one token, by index
    query_start: list[int]  # [B + 1]: each request's first row (a verify's 1 + k together)

    @classmethod
    def build(
        cls,
        steps: Sequence[StateStep],
        num_computed: Sequence[int],
        query_lens: Sequence[int],
        device: torch.device,
    ) -> StateMetadata:
        slots = [s.slot for s in steps]
        copies = [(s.slot, s.source) for s in steps if s.source not in (None, ZERO)]
        zeros = [s.slot for s in steps if s.source == ZERO]
        saves = [
            tuple((end - start, slot) for end, slot in s.saves)
            for s, start in zip(steps, num_computed, strict=True)
        ]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        decodes = [r for r, q in enumerate(query_lens) if q == 1]
        return cls(
            slots=slots,
            copies=copies,
            zeros=zeros,
            saves=saves,
            decode_rows=torch.tensor([starts[r] for r in decodes], dtype=torch.long, device=device),
            decode_slots=torch.tensor([slots[r] for r in decodes], dtype=torch.long, device=device),
            prefills=[r for r, q in enumerate(query_lens) if q > 1],
            query_start=starts,
        )


def prepare_states(states: Sequence[StateTensors], meta: StateMetadata) -> None:
    """Before the step's first layer: snapshots copied into the slots that resume from them,
    new requests' slots cleared, in every recurrent layer."""
    if not meta.copies and not meta.zeros:
        return
    device = states[0][0].device
    dst = torch.tensor([d for d, _ in meta.copies], dtype=torch.long, device=device)
    src = torch.tensor([s for _, s in meta.copies], dtype=torch.long, device=device)
    zeros = torch.tensor(meta.zeros, dtype=torch.long, device=device)
    for tensors in states:
        for t in tensors:
            if meta.copies:
                t.index_copy_(0, dst, t.index_select(0, src))
            if meta.zeros:
                t.index_fill_(0, zeros, 0)
