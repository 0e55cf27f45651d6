"""No module of the project is over 500 lines: a file that grows past it holds more than
one concept, and is split along its seams (a concept per file, named after it), not cut
anywhere. There is no allowlist: the last files over the limit were split in issue 41."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "scheduler", "kv_cache", "bench")
MAX_LINES = 500


def line_counts() -> dict[str, int]:
    """Lines of every Python file of PACKAGES, by path from the repository's root."""
    counts = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                with path.open("rb") as f:
                    counts[str(path.relative_to(REPO))] = sum(1 for _ in f)
    return counts


def test_no_module_is_over_the_limit() -> None:
    counts = line_counts()
    assert "server/app.py" in counts  # the walk found the project
    over = {path: n for path, n in counts.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split each along a seam):\n" + "\n".join(
        f"  {path}: {n}" for path, n in sorted(over.items())
    )
