"""The /dashboard page in a real headless chromium, against a live server under a small
shared-prefix load: what it shows and draws must be what the server reports.

Never skipped: `make test` installs chromium where it is missing (see the Makefile). The
load's requests are held still while the numbers are compared: a "frozen" engine step
does nothing (the engine thread still serves the snapshots), so the page, /dashboard/state
and /metrics can be held to the same counts at the same moment.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import pytest

from tests.server.conftest import RunningServer, make_engine, running_server, wait_until
from tests.server.headless_chromium import Page, find_chromium, headless_page
from tests.server.test_dashboard import API_KEY, AUTH, block_gauges, state

NUM_BLOCKS = 192
NUM_REQUESTS = 4
# About 3 blocks of 16 tokens; markup in it must show as text, never as elements.
SHARED = "System: you are a careful assistant. <b>Answer</b> in one line & cite. " * 2
STEP_DELAY_S = 0.005  # the load's requests live for seconds, not milliseconds
STATE_CHARS = {"free": "f", "cached": "c", "in_use": "u"}  # as /dashboard/state sends them

# What the page shows in its counters.
SHOWN_COUNTS = """(() => Object.fromEntries(["free", "cached", "in_use"].map(
    (s) => [s, Number(document.getElementById("count-" + s).textContent)])))()"""

# Each block's cell read back from the canvas at its center, mapped to a state by the
# legend's colors: per state, how many cells show it, and how many differ from the state
# the page was given (window.dashboardState).
DRAWN_CELLS = """(() => {
  const canvas = document.getElementById("pool");
  const cell = Number(canvas.dataset.cell), cols = Number(canvas.dataset.cols);
  const states = window.dashboardState.block_states;
  const dpr = canvas.width / (cols * cell);
  const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  const byColor = {};
  for (const [state, color] of Object.entries(window.DASHBOARD_COLORS)) {
    byColor[color.toLowerCase()] = state;
  }
  const drawn = {};
  let wrong = 0;
  for (let b = 0; b < states.length; b++) {
    const x = Math.floor(((b % cols) * cell + cell / 2 - 0.5) * dpr);
    const y = Math.floor((Math.floor(b / cols) * cell + cell / 2 - 0.5) * dpr);
    const i = (y * canvas.width + x) * 4;
    const hex = "#" + [0, 1, 2].map((k) => pixels[i + k].toString(16).padStart(2, "0")).join("");
    const state = pixels[i + 3] === 255 ? byColor[hex] || hex : "blank";
    drawn[state] = (drawn[state] || 0) + 1;
    if (state !== states[b]) wrong++;
  }
  return { drawn, wrong };
})()"""

FIRST_PREFIX_ROW = """(() => {
  const row = document.querySelector("#prefixes tr");
  return row ? Array.from(row.cells, (td) => td.textContent) : null;
})()"""


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.fail("no chromium on PATH: `make test` installs it (see the Makefile); "
                    "or set CHROMIUM to a Chromium or Chrome binary")  # fmt: skip
    return path


@contextlib.contextmanager
def freezable_server(tiny_model_dir) -> Iterator[tuple[RunningServer, threading.Event]]:
    engine = make_engine(tiny_model_dir, num_blocks=NUM_BLOCKS)
    real_step = engine.core.step
    frozen = threading.Event()

    def step():
        time.sleep(STEP_DELAY_S)
        return [] if frozen.is_set() else real_step()

    engine.core.step = step
    with running_server(engine, api_key=API_KEY) as server:
        yield server, frozen


def wait_for_update_after(page: Page, moment: float) -> dict:
    """The state the page shows once it has drawn a snapshot taken after `moment`."""
    return page.wait_for(
        f"window.dashboardState && window.dashboardState.taken_at > {moment}"
        " && window.dashboardState",
        what="the page did not show a newer snapshot",
    )


def assert_page_shows(page: Page, server: RunningServer, shown: dict) -> dict:
    """The page's counters, its drawing and the server agree with the state it shows."""
    counts = shown["blocks"]
    assert page.evaluate(SHOWN_COUNTS) == counts
    assert sum(counts.values()) == NUM_BLOCKS
    cells = page.evaluate(DRAWN_CELLS)
    assert cells["wrong"] == 0, cells
    assert cells["drawn"] == {STATE_CHARS[s]: n for s, n in counts.items() if n}
    # The pool holds still (frozen steps, or idle): the server says the same now.
    assert state(server)["blocks"] == counts
    assert block_gauges(server) == {**counts, "total": NUM_BLOCKS}
    return cells["drawn"]


def test_the_page_draws_the_pool_the_server_reports(tiny_model_dir, chromium):
    with (
        freezable_server(tiny_model_dir) as (server, frozen),
        headless_page(chromium, window=(1100, 800)) as page,
        contextlib.ExitStack() as load,
    ):
        page.navigate(f"{server.url}/dashboard#key={API_KEY}")
        fresh = page.wait_for("window.dashboardState", what="the page never drew a state")
        assert page.evaluate("document.getElementById('plan').textContent") == fresh["plan"]
        assert fresh["speculation"] is None
        assert page.evaluate("document.getElementById('speculation').textContent") == "off"
        assert page.evaluate("location.hash") == ""  # the key left the address bar
        assert_page_shows(page, server, fresh)
        assert fresh["blocks"]["free"] == NUM_BLOCKS

        # The load: requests sharing a prefix, each streaming until its first token.
        http = server.http(headers=AUTH)
        held = []  # the streams' line iterators: one dropped would close its response
        for i in range(NUM_REQUESTS):
            body = {"prompt": f"{SHARED}Question {i}: what is {i} + {i}?", "max_tokens": 600,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            response = load.enter_context(http.stream("POST", "/v1/completions", json=body))
            held.append(lines := response.iter_lines())
            assert next(line for line in lines if line.startswith("data: "))
        frozen.set()
        # A snapshot taken after this moment comes after the last step that ran.
        busy = wait_for_update_after(page, time.time())
        assert busy["requests"] == {"running": NUM_REQUESTS, "waiting": 0}
        drawn = assert_page_shows(page, server, busy)
        assert {"u", "f"} <= set(drawn)  # cells of at least two states
        rank, first_block, blocks, requests, text = page.evaluate(FIRST_PREFIX_ROW)
        top = busy["prefixes"][0]
        assert (rank, first_block, blocks, requests) == (
            "1",
            str(top["first_block"]),
            str(top["blocks"]),
            str(NUM_REQUESTS),
        )
        # The shared prefix's first block, as text: markup shown, never made elements.
        assert SHARED.startswith(top["text"]) and "<b>Answer</b>" in top["text"]
        assert text == json.dumps(top["text"])
        assert page.evaluate("document.querySelectorAll('#prefixes b').length") == 0

        # The load ends (the clients leave): its blocks stay cached.
        frozen.clear()
        load.close()
        wait_until(server.all_blocks_free, 30, "the aborted requests kept their blocks")
        idle = wait_for_update_after(page, time.time())
        assert idle["requests"] == {"running": 0, "waiting": 0}
        drawn = assert_page_shows(page, server, idle)
        assert set(drawn) == {"c", "f"}
        assert page.evaluate(FIRST_PREFIX_ROW)[3:] == ["0", json.dumps(top["text"])]
