"""bench/gpu_step.py's smoke run on CPU: a tiny model, every mode at two batch sizes, and the
Triton attention figure (tests/conftest.py sets TRITON_INTERPRET=1, so Triton's kernels run
through its interpreter)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu_step import MODES, main
from tests.engine.tiny_models import make_tiny_model_dir


def test_gpu_step_smoke_on_cpu(tmp_path: Path, capsys) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "gpu_step.json"
    argv = ["--model", str(model), "--out", str(out), "--dtype", "float32", "--device", "cpu"]
    assert main([*argv, "--batch", "1,2", "--context", "32", "--steps", "2", "--rounds", "2"]) == 0

    result = json.loads(out.read_text())
    assert result["model"] == str(model) and result["dtype"] == "float32"
    steps = {(s["batch"], s["mode"]): s for s in result["steps"]}
    assert set(steps) == {(b, m) for b in (1, 2) for m in MODES}
    for step in steps.values():
        assert step["median_ms"] > 0
        assert step["graphs_captured"] is False  # CUDA graphs are captured on CUDA only
        assert step["x_floor"] is None
    assert [r["batch"] for r in result["ratios"]] == [1, 2]
    # No HBM on CPU, so no floor; the weights are still counted.
    assert result["hbm_gbps"] is None and result["floor_ms"] is None
    assert result["weight_bytes"] > 0
    attention = result["attention"]
    assert (attention["batch"], attention["context"]) == (2, 32)
    assert (attention["num_heads"], attention["num_kv_heads"], attention["head_dim"]) == (4, 2, 16)
    assert attention["ms"] > 0 and attention["gbps"] > 0
    assert attention["fraction_of_hbm"] is None

    printed = capsys.readouterr().out
    assert "batch 2 triton-graphs:" in printed and "triton decode attention" in printed
