"""The Responses API's store: bounded by count (least recently used out first) and by age."""

from __future__ import annotations

from server import response_store
from server.response_store import ResponseStore


def _put(store: ResponseStore, response_id: str) -> None:
    store.put({"id": response_id}, [{"role": "user", "content": response_id}])


def test_the_least_recently_used_response_goes_first():
    store = ResponseStore(max_responses=2)
    _put(store, "a")
    _put(store, "b")
    assert store.get("a") is not None  # a is now the most recently used
    _put(store, "c")
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2


def test_an_expired_response_is_gone(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(response_store.time, "monotonic", lambda: now[0])
    store = ResponseStore(ttl_s=60)
    _put(store, "a")
    now[0] += 59
    assert store.get("a").conversation == [{"role": "user", "content": "a"}]
    now[0] += 2
    assert store.get("a") is None and len(store) == 0


def test_delete_says_whether_it_was_there():
    store = ResponseStore()
    _put(store, "a")
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
