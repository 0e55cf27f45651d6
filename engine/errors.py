"""Errors the engine raises to its caller."""

from __future__ import annotations


class StepError(RuntimeError):
    """A step failed; the requests it was running are aborted and their blocks freed.

    `request_ids` are the requests that step scheduled: the caller fails exactly these
    (every other request is untouched and the engine can step again). The original
    exception is the `__cause__`.
    """

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause})")
        self.request_ids = request_ids


class ModelFileError(ValueError):
    """A model file or directory that cannot be served as it is: damaged, crafted or
    incomplete. The message is one line naming the file, the key or tensor, and the fault;
    `pagedserve serve` prints it and exits non-zero, with no traceback."""
