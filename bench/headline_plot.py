"""The README's plot of pagedserve against llama-server, drawn from the README's own table
(its "How fast" section: the latest measured figures, copied from bench/README.md with
their date, CPU and command), so the plot and the table cannot disagree.

    .venv/bin/python -m bench.headline_plot          # writes docs/pagedserve-vs-llama-server.png

Needs matplotlib (the `bench` extra). Nothing is measured here.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
OUT = REPO / "docs" / "pagedserve-vs-llama-server.png"
SECTION = "## How fast"


Row = tuple[str, int, float, float, str]


def headline_rows(text: str) -> list[Row]:
    """(file, concurrency, pagedserve out tok/s, llama-server out tok/s, the ratio as the
    table gives it) per table row of the README's "How fast" section."""
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and re.fullmatch(r"\d+", cells[1]):
            ratio = cells[4].strip("*")
            rows.append((cells[0], int(cells[1]), float(cells[2]), float(cells[3]), ratio))
    return rows


def draw(rows: list[Row], out: Path, caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{name}\n{conc} stream{'s' if conc > 1 else ''}" for name, conc, *_ in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    ours = ax.bar([x - 0.2 for x in xs], [r[2] for r in rows], 0.4, label="pagedserve")
    ax.bar([x + 0.2 for x in xs], [r[3] for r in rows], 0.4, label="llama-server")
    for bar, row in zip(ours, rows, strict=True):
        ax.annotate(row[4], (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)  # fmt: skip
    ax.set_ylim(0, max(max(r[2], r[3]) for r in rows) * 1.15)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M GGUF, shared-prefix workload", fontsize=10)
    ax.legend(frameon=False)
    fig.text(0.01, 0.01, caption, fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.headline_plot", description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    rows = headline_rows(text)
    if not rows:
        parser.error(f"no table rows under {SECTION!r} in {README}")
    date_cpu = re.search(r"^(\d{4}-\d\d-\d\d, [^(]+?) \(", text.split(SECTION, 1)[1], re.M)
    draw(rows, args.out, date_cpu.group(1) if date_cpu else "")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
