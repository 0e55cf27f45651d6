"""Read the Dockerfile and .dockerignore the way Docker does, for the tests that mirror them.

Only what this repo's Dockerfile uses is supported: line continuations, comments, ARG and ENV
with NAME=value pairs, COPY, RUN in shell form, exec-form ENTRYPOINT and HEALTHCHECK CMD.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
INSTALL_SCRIPT = "docker/install.sh"  # its path in the build context


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case, e.g. "RUN"
    args: str  # everything after the keyword, continuation lines joined
    line: int  # where it starts (1-based)


def parse_dockerfile(text: str) -> list[Instruction]:
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):  # comments may sit inside a continuation too
            continue
        if not parts:
            start = number
        continued = line.endswith("\\")
        parts.append(line[:-1].strip() if continued else line)
        if not continued:
            keyword, _, args = " ".join(parts).partition(" ")
            instructions.append(Instruction(keyword.upper(), args.strip(), start))
            parts = []
    assert not parts, "the Dockerfile ends inside a line continuation"
    return instructions


def load_dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


def named(instructions: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in instructions if i.keyword == keyword]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def _pairs(args: str) -> dict[str, str]:
    pairs = {}
    for word in shlex.split(args):
        name, sep, value = word.partition("=")
        pairs[name] = value if sep else ""
    return pairs


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults: dict[str, str] = {}
    for i in named(instructions, "ARG"):
        defaults.update(_pairs(i.args))
    return defaults


def env_vars(instructions: list[Instruction]) -> dict[str, str]:
    """ENV values as written (`$PATH` and `${PATH}` references are left to `expand`)."""
    env: dict[str, str] = {}
    for i in named(instructions, "ENV"):
        env.update(_pairs(i.args))
    return env


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


@dataclass(frozen=True)
class Copy:
    sources: list[str]
    dest: str


def copies(instructions: list[Instruction]) -> list[Copy]:
    result = []
    for i in named(instructions, "COPY"):
        words = [w for w in shlex.split(i.args) if not w.startswith("--")]
        result.append(Copy(words[:-1], words[-1]))
    return result


def run_commands(instructions: list[Instruction]) -> list[list[str]]:
    """Every command of every RUN, split at `&&`, as argv lists, in build order."""
    commands = []
    for i in named(instructions, "RUN"):
        for part in i.args.split("&&"):
            commands.append(shlex.split(part))
    return commands


def install_script_dest(instructions: list[Instruction]) -> str:
    """Where the Dockerfile copies docker/install.sh in the image."""
    for copy in copies(instructions):
        if INSTALL_SCRIPT in copy.sources:
            name = Path(INSTALL_SCRIPT).name
            return copy.dest + name if copy.dest.endswith("/") else copy.dest
    raise AssertionError(f"the Dockerfile does not COPY {INSTALL_SCRIPT}")


def install_steps(instructions: list[Instruction], script_dest: str) -> list[list[str]]:
    """The arguments of each `sh <script_dest> ...` command, in build order."""
    return [argv[2:] for argv in run_commands(instructions) if argv[:2] == ["sh", script_dest]]


# -- .dockerignore -----------------------------------------------------------------------------


@dataclass(frozen=True)
class IgnoreRule:
    text: str
    negated: bool
    regex: re.Pattern[str]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Go filepath.Match plus Docker's `**` (any number of directories)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith(("!", "^")) else body) + "]")
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def parse_dockerignore(text: str) -> list[IgnoreRule]:
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line[1:].strip() if negated else line).lstrip("/")
        rules.append(IgnoreRule(pattern, negated, _pattern_regex(pattern)))
    return rules


def is_excluded(path: str, rules: list[IgnoreRule]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for rule in rules:
        if any(rule.regex.fullmatch(c) for c in candidates):
            excluded = not rule.negated
    return excluded


def context_files(root: Path, rules: list[IgnoreRule]) -> list[str]:
    """The files `docker build root` sends, relative to root (posix paths), sorted."""
    negations = [r.text for r in rules if r.negated]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        # Skip excluded directories no `!` pattern reaches into (as Docker does): .venv etc.
        dirnames[:] = [
            d
            for d in dirnames
            if not is_excluded(prefix + d, rules)
            or any(n.startswith(prefix + d + "/") for n in negations)
        ]
        files += [prefix + f for f in filenames if not is_excluded(prefix + f, rules)]
    return sorted(files)


def repo_context() -> list[str]:
    return context_files(REPO, parse_dockerignore(DOCKERIGNORE.read_text(encoding="utf-8")))


def copy_context(dest: Path) -> list[str]:
    """Copy the repo's build context into dest, as `COPY . dest` does; the files copied."""
    files = repo_context()
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    return files
