"""PNG plots of load runs (matplotlib, the optional `bench` extra, imported only here)."""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'pagedserve[bench]' (or matplotlib)"
        ) from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(series: Mapping[str, Sequence[float]], path: Path, title: str) -> Path:
    """One step curve per label: the fraction of requests whose TTFT is at most x."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, ttfts in series.items():
        xs = sorted(t * 1000.0 for t in ttfts)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
    ax.set_xscale("log")
    _plain_ticks(ax.xaxis)
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_sweep(
    records: Sequence[Mapping[str, Any]], path: Path, title: str, label_key: str = "server"
) -> Path:
    """Output tokens/s and TTFT p50 against concurrency, one line per `label_key` value."""
    plt = _pyplot()
    lines: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    levels = sorted({r["concurrency"] for r in records if r.get("concurrency")})
    for r in records:
        if r.get("concurrency") and r.get("requests", 1):  # a run that served nothing: no point
            lines[str(r.get(label_key, ""))].append(r)
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, rows in lines.items():
        rows = sorted(rows, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        tput.plot(xs, [r["output_throughput"] for r in rows], marker="o", label=label)
        ttft.plot(xs, [r["ttft_ms"]["p50"] or float("nan") for r in rows], marker="o", label=label)
    for ax, ylabel in ((tput, "output tokens/s"), (ttft, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.xaxis.set_minor_formatter(_null_formatter())
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ttft.set_yscale("log")
    _plain_ticks(ttft.yaxis)
    fig.suptitle(title)
    return _save(fig, plt, path)


def plot_rss(samples: Sequence[tuple[float, float]], path: Path, title: str) -> Path:
    """A server's RSS (MiB) against minutes since the load began."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([t / 60 for t, _ in samples], [r for _, r in samples], marker=".")
    ax.set_xlabel("minutes under load")
    ax.set_ylabel("server RSS (MiB)")
    top = max((r for _, r in samples), default=1.0)
    ax.set_ylim(0, top * 1.15)  # from zero, so a flat line looks flat
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    return _save(fig, plt, path)


def _plain_ticks(axis: Any) -> None:
    """Log-scale ticks at 1-2-5 steps as plain numbers (200, 500, 1000)."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(_null_formatter())


def _null_formatter() -> Any:
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_points(points: Sequence[Any], out_dir: Path, label_key: str) -> list[Path]:
    """A TTFT CDF per workload (one curve per label and concurrency), and per workload a
    throughput/TTFT-against-concurrency plot when more than one level was run."""
    written = []
    for workload in dict.fromkeys(p.record["workload"] for p in points):
        mine = [p for p in points if p.record["workload"] == workload]
        series = {
            f"{p.record.get(label_key, workload)} c={p.record['concurrency'] or 'inf'}": p.ttfts
            for p in mine
        }
        written.append(
            plot_ttft_cdf(series, out_dir / f"ttft_cdf_{workload}.png", f"TTFT CDF: {workload}")
        )
        if len({p.record["concurrency"] for p in mine}) > 1:
            records = [p.record for p in mine]
            path = out_dir / f"sweep_{workload}.png"
            written.append(plot_sweep(records, path, f"{workload}", label_key=label_key))
    for path in written:
        print(f"# wrote {path}", file=sys.stderr)
    return written
