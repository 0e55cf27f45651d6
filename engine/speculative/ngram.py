"""N-gram drafting (prompt lookup): propose the tokens that followed the most recent earlier
occurrence of the request's last n tokens, in its prompt or its output so far.

Answers that copy from their prompt (an edited file, a quoted document, an agent's repeated
step) or repeat themselves are full of such matches; other text rarely has one, and then
nothing is proposed and nothing is spent. The search is a C-speed `bytearray.rfind` over
the request's tokens packed 4 bytes each (a match must fall on a token boundary), kept per
request and extended by the new tokens only: memory is 4 bytes per token of the request,
freed with it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from scheduler import Request

TOKEN_BYTES = 4


class TokenHistory:
    """A request's tokens, packed for searching."""

    __slots__ = ("_buf", "_num_tokens")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._num_tokens = 0

    def sync(self, token_ids: Sequence[int]) -> None:
        """Append what token_ids gained since the last call (they only ever grow)."""
        if len(token_ids) > self._num_tokens:
            self._buf += array("I", token_ids[self._num_tokens :]).tobytes()
            self._num_tokens = len(token_ids)

    def propose(self, min_n: int, max_n: int, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n tokens,
        trying the longest n first; [] when no suffix of min_n..max_n tokens recurs."""
        buf, num = self._buf, self._num_tokens
        for n in range(min(max_n, num - 1), min_n - 1, -1):
            pattern = bytes(buf[(num - n) * TOKEN_BYTES :])
            # An occurrence that ends at least one token before the suffix itself ends.
            end = (num - 1) * TOKEN_BYTES
            while (pos := buf.rfind(pattern, 0, end)) >= 0:
                if pos % TOKEN_BYTES == 0:
                    start = pos + n * TOKEN_BYTES
                    follow = buf[start : start + k * TOKEN_BYTES]
                    return array("I", bytes(follow)).tolist()
                end = pos + len(pattern) - 1  # misaligned: look further left
        return []


class NgramDrafter:
    """Prompt lookup over the request's prompt and output: suffixes of max_n down to min_n
    tokens (the longest match is the likeliest to continue the same way)."""

    def __init__(self, min_n: int = 2, max_n: int = 6) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request: Request, k: int) -> list[int]:
        return self._history(request).propose(self.min_n, self.max_n, k)

    def finished(self, request: Request) -> None:
        """A request ended: prompt lookup keeps nothing of it."""

    @staticmethod
    def _history(request: Request) -> TokenHistory:
        """The request's tokens, packed and brought up to date (kept on its RequestSpec)."""
        spec = request.spec
        if spec.drafter_state is None:
            spec.drafter_state = TokenHistory()
        spec.drafter_state.sync(request.all_token_ids)
        return spec.drafter_state
