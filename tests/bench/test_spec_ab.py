"""bench/spec_ab.py's smoke run: a tiny model, both workloads, one and two streams."""

from __future__ import annotations

import re
from pathlib import Path

from bench.spec_ab import main
from tests.engine.tiny_models import make_tiny_model_dir


def test_spec_ab_reports_each_engines_rounds_and_the_ratio(tmp_path: Path, capsys) -> None:
    model = str(make_tiny_model_dir(tmp_path / "tiny"))
    argv = ["--model", model, "--rounds", "2", "--num-requests", "2", "--max-tokens", "3", "--prefix-len", "32",
            "--streams", "1,2"]  # fmt: skip
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "on/off median" in line]
    assert [line.split(":")[0] for line in lines] == [
        "unique streams 1", "unique streams 2",
        "shared-prefix streams 1", "shared-prefix streams 2",
    ]  # fmt: skip
    for line in lines:
        # Two counted rounds per engine (the warm-up is not), every rate positive.
        rates = [float(x) for x in re.findall(r"\[([^\]]*)\]", line)[0].split(", ")]
        assert len(rates) == 2 and min(rates) > 0
