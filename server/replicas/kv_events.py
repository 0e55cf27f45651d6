"""A replica's prefix-cache block events, kept for the router to read.

The engine thread appends each `BlockStored` / `BlockRemoved` / `AllBlocksCleared` as it
happens (the KV cache manager's listener); Ray Serve calls the replica's
`record_routing_stats` on its own schedule (about every second) and hands the result to
every router of the deployment. Several routers (one per ingress replica) read the same
log, so reading consumes nothing: each event carries a sequence number and a router
applies the ones past the last it saw. The log keeps the newest `max_events`; a router
that fell further behind than that (a poll missed for a long time) starts over from the
window it gets (`RouterView.apply`).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kv_cache import AllBlocksCleared, BlockRemoved, BlockStored

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
# 4096 events of 32-byte hashes: ~150 KB per poll at most; a CPU replica stores or evicts
# far fewer blocks than that per second.
DEFAULT_MAX_EVENTS = 4096


class KVEventLog:
    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self._events: deque[tuple[int, str, bytes]] = deque(maxlen=max_events)
        self._seq = 0
        self._lock = threading.Lock()

    def __call__(self, event: Any) -> None:
        """The KV cache manager's listener (engine thread)."""
        if isinstance(event, BlockStored):
            kind, block_hash = STORED, event.block_hash
        elif isinstance(event, BlockRemoved):
            kind, block_hash = REMOVED, event.block_hash
        elif isinstance(event, AllBlocksCleared):
            kind, block_hash = CLEARED, b""
        else:
            return
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, kind, block_hash))

    def window(self) -> dict[str, Any]:
        """The events still kept, oldest first, with the sequence number of the newest."""
        with self._lock:
            return {"last_seq": self._seq, "events": list(self._events)}


@dataclass
class RouterView:
    """What one router knows a replica caches, from that replica's event log."""

    blocks: set[bytes] = field(default_factory=set)
    last_seq: int = 0

    def apply(self, window: dict[str, Any]) -> None:
        events = window.get("events") or []
        if window.get("last_seq", 0) < self.last_seq:  # the replica restarted: a new log
            self.blocks.clear()
            self.last_seq = 0
        if events and events[0][0] > self.last_seq + 1:  # fell behind the window: start over
            self.blocks.clear()
        for seq, kind, block_hash in events:
            if seq <= self.last_seq:
                continue
            if kind == STORED:
                self.blocks.add(block_hash)
            elif kind == REMOVED:
                self.blocks.discard(block_hash)
            else:
                self.blocks.clear()
        self.last_seq = max(self.last_seq, window.get("last_seq", 0))
