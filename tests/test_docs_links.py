"""The docs lead somewhere: in README.md, docs/*.md, bench/README.md and its history every
relative link resolves to a file or directory of the repository (and its #anchor to a
heading of the page it names), every repository path named in backticks exists, and every
`python -m MODULE` of the project and `make TARGET` they show is one that exists. Read as
text: nothing runs."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "bench" / "README.md",
    REPO / "bench" / "results" / "history.md",
]
# Top-level entries a path in backticks may start with: the repository's own.
TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
MAKE = re.compile(r"make ([A-Za-z.][\w./-]*)")


def prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(page.read_text(encoding="utf-8")), re.M):
        base = slug(heading)
        name, n = base, 0
        while name in found:  # a repeated heading gets -1, -2...
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return frozenset(found)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    return broken


def named_paths(page: Path) -> list[str]:
    """The repository paths a page names in backticks (`engine/config.py`, `deploy/`)."""
    found = []
    for span in CODE_SPAN.findall(prose(page.read_text(encoding="utf-8"))):
        if REPO_PATH.fullmatch(span) and "/" in span and span.split("/")[0] in TOP:
            found.append(span)
    return found


@cache
def make_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    variables = dict(re.findall(r"^(\w+)\s*[:?]?=\s*(\S+)", text, re.M))
    targets = set()
    for name in re.findall(r"^([^\s#][^:=\n]*):(?!=)", text, re.M):
        for _ in range(3):  # $(STAMP) -> $(VENV)/.installed-stamp -> .venv/.installed-stamp
            name = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), ""), name)
        targets.update(name.split())
    return frozenset(targets)


def test_the_pages_are_found() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "reference.md", "architecture.md", "gguf.md"} <= names


def test_every_relative_link_resolves() -> None:
    broken = {str(p.relative_to(REPO)): broken_links(p) for p in PAGES}
    assert not {p: b for p, b in broken.items() if b}, broken


def test_every_path_named_in_backticks_exists() -> None:
    missing = [f"{page.relative_to(REPO)}: `{path}`" for page in PAGES
               for path in named_paths(page) if not (REPO / path).exists()]  # fmt: skip
    assert not missing, "\n".join(missing)


def test_every_project_module_and_make_target_shown_exists() -> None:
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for module in MODULE.findall(text):
            base = REPO / module.replace(".", "/")
            if module.split(".")[0] in TOP and not (
                base.with_suffix(".py").exists() or (base / "__main__.py").exists()
            ):
                missing.append(f"{page.name}: python -m {module}")
        for target in make_commands(text):
            if target not in make_targets():
                missing.append(f"{page.name}: make {target}")
    assert not missing, "\n".join(missing)


def make_commands(text: str) -> list[str]:
    """The targets of the `make` commands a page shows: a code span that is one, or a line
    of a code block that starts with one."""
    spans = [m.group(1) for s in CODE_SPAN.findall(prose(text)) if (m := MAKE.match(s))]
    lines = re.findall(r"^\s*make ([A-Za-z.][\w./-]*)", "\n".join(FENCE.findall(text)), re.M)
    return spans + lines
