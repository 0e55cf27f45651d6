"""bench/spec_ab.py's smoke run: a tiny model, every workload it is used on, one and two
streams, and several draft caps."""

from __future__ import annotations

import re
from pathlib import Path

from bench.spec_ab import main
from tests.engine.tiny_models import make_tiny_model_dir


def test_spec_ab_reports_each_engines_rounds_and_the_ratio(tmp_path: Path, capsys) -> None:
    model = str(make_tiny_model_dir(tmp_path / "tiny"))
    argv = ["--model", model, "--rounds", "2", "--num-requests", "2", "--max-tokens", "3", "--prefix-len", "32",
            "--streams", "1,2", "--workload", "unique,shared-prefix,copy-edit",
            "--num-speculative-tokens", "3,7"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [line for line in lines if " streams " in line]
    assert [line.split(":")[0] for line in heads] == [
        f"{w} streams {s}" for w in ("unique", "shared-prefix", "copy-edit") for s in (1, 2)
    ]
    ratios = [line for line in lines if "on/off median" in line]
    assert [line.split()[1] for line in ratios] == ["k=3", "k=7"] * 6
    for line in heads + ratios:
        # Two counted rounds per engine (the warm-up is not), every rate positive.
        rates = [float(x) for x in re.findall(r"\[([^\]]*)\]", line)[0].split(", ")]
        assert len(rates) == 2 and min(rates) > 0
