"""`pagedserve bench soak`: the plan it sends, and a bounded soak against a real server.

The bounded soak starts `python -m server` on 127.0.0.1 over the tiny random model and
sends 200 requests (every malformed kind included) faster than a batch of 8 serves them;
it must end with no 5xx, no transport error, no request or KV block left behind, nothing
logged as an error and a clean exit on SIGTERM. Speed is never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import soak
from bench.soak import MALFORMED_KINDS, ServerOptions, SoakConfig, plan_requests

REPO = Path(__file__).resolve().parents[2]


def test_the_plan_is_seeded_and_mixes_everything():
    cfg = SoakConfig(num_requests=400, seed=3)
    plan = plan_requests(cfg, "m")
    assert plan == plan_requests(cfg, "m")
    assert plan != plan_requests(SoakConfig(num_requests=400, seed=4), "m")
    malformed = [p for p in plan if p.malformed]
    assert 5 <= len(malformed) <= 40  # about 5%
    assert {p.kind for p in malformed} == set(MALFORMED_KINDS)
    good = [p for p in plan if not p.malformed]
    assert {p.kind for p in good} == {"completion", "chat"}
    streams = [p for p in good if p.stream]
    leaving = [p for p in streams if p.leave_after_events]
    assert 0.1 < len(leaving) / len(streams) < 0.3  # about 20%
    assert any(p.leave_after_s for p in good if not p.stream)
    bodies = [json.loads(p.body) for p in good]
    assert any(b.get("n", 1) > 1 for b in bodies)
    # every prompt starts with one of the shared prefixes
    prefixes = soak.shared_prefixes(cfg)
    for b in bodies:
        text = b["messages"][0]["content"] if "messages" in b else b["prompt"]
        assert any(text.startswith(p) for p in prefixes)


def test_malformed_bodies_are_what_their_kind_says():
    plan = [p for p in plan_requests(SoakConfig(num_requests=400), "m") if p.malformed]
    by_kind = {p.kind: p for p in plan}
    with pytest.raises(ValueError):
        json.loads(by_kind["invalid-json"].body)
    surrogate = json.loads(by_kind["lone-surrogate"].body)  # valid JSON text ...
    text = json.dumps(surrogate, ensure_ascii=False)
    with pytest.raises(UnicodeEncodeError):  # ... that no UTF-8 string can hold
        text.encode("utf-8")
    fan_out = json.loads(by_kind["huge-fan-out"].body)
    assert fan_out["n"] * len(fan_out["prompt"]) >= 100_000
    assert json.loads(by_kind["negative-max-tokens"].body)["max_tokens"] < 0
    assert json.loads(by_kind["unknown-model"].body)["model"] != "m"


def test_soak_is_registered_without_importing_the_load_generator():
    check = (
        "import sys\n"
        "from server.cli import build_parser\n"
        "a = build_parser().parse_args(['bench', 'soak', '--num-requests', '5', '--rate', '0',"
        " '--malformed-kinds', 'invalid-json,huge-fan-out'])\n"
        "assert a.bench_command == 'soak' and a.num_requests == 5 and a.rate == 0\n"
        "assert a.malformed_kinds == ['invalid-json', 'huge-fan-out'] and a.concurrency == 256\n"
        "heavy = ('bench.soak', 'bench.loadgen', 'httpx', 'torch')\n"
        "print(','.join(m for m in heavy if m in sys.modules) or 'clean')\n"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clean"


@pytest.mark.timeout(300)
def test_a_bounded_soak_leaves_nothing_behind(tiny_model_dir: Path, tmp_path: Path):
    cfg = SoakConfig(
        num_requests=200,
        rate=100.0,  # far more than a batch of 8 serves: the queue limit answers 503
        concurrency=64,
        max_tokens=8,
        prefix_words=100,
        seed=0,
        timeout_s=30.0,
        settle_timeout_s=30.0,
    )
    server = ServerOptions(
        model=str(tiny_model_dir),
        max_waiting_requests=4,
        max_num_seqs=8,
        dtype="float32",
        extra_args=("--num-blocks", "512"),
        log=tmp_path / "server.log",
        startup_timeout_s=120.0,
        stop_timeout_s=30.0,
    )
    summary = soak.run_soak(cfg, server)
    report = soak.format_summary(summary)
    out, after = summary["outcomes"], summary["after"]

    assert out["5xx"] == 0, report
    assert out["transport"] == 0, report
    assert summary["malformed_accepted"] == 0, report
    assert (after["running"], after["waiting"], after["kv_cache_usage"]) == (0, 0, 0), report
    assert after["health"] == 200, report
    assert summary["server"]["errors_logged"] == 0, report
    assert summary["server"]["exit_code"] == soak.CLEAN_EXIT_CODE, report
    assert summary["passed"], report
    # the mix really happened: answers, clients that left, refused malformed requests
    assert out["ok"] > 0 and out["aborted"] > 0 and out["4xx"] > 0, report
    assert set(MALFORMED_KINDS) <= set(summary["by_kind"]), report
    assert sum(out.values()) == 200
