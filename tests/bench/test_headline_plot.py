"""The README's speed table, which bench/headline_plot.py draws: its rows parse, and each
row's ratio is its two tok/s figures' (to the rounding of the figures)."""

from __future__ import annotations

from bench.headline_plot import README, headline_rows


def test_the_readme_speed_table_parses_and_its_ratios_add_up() -> None:
    rows = headline_rows(README.read_text(encoding="utf-8"))
    assert len(rows) >= 2
    for name, concurrency, ours, theirs, ratio in rows:
        assert abs(ours / theirs - float(ratio.removesuffix("x"))) < 0.01, (name, concurrency)
