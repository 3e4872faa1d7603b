"""Docs check, run by `make lint`. Exits 1 naming each problem:

- README.md is over 200 lines (it is a guide; the rest lives in docs/);
- a relative link in README.md or docs/*.md points at a file that does not exist (anchors are
  ignored, and so are links inside fenced code blocks);
- the module map of docs/architecture.md (its "## Module map" section) misses a module of
  the package or names one that does not exist. A module is named as the first cell of a
  table row, in backticks, by its dotted path relative to the package:
  `scheduler.kv_receiver` is vllm_qaic_connector/scheduler/kv_receiver.py; the proxy's
  modules go by their full name (`vllm_qaic_proxy.server`). Every *.py of both packages
  counts except __init__.py and __main__.py;
- the import-rules table of docs/architecture.md leaves out of a room's "never" column a
  module that an import contract in pyproject.toml forbids it;
- a docstring of the code (packages, testbed, tests, scripts, benchmarks, emulator) names a
  file of the repository (``tests/live/test_faults.py``, ``docs/failures.md``) that does not
  exist.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vllm_qaic_connector"
PROXY = ROOT / "vllm_qaic_proxy"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_README_LINES = 200
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?[^)]*\)")
MAP_ROW = re.compile(r"^\|\s*`([\w.]+)`")
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
CODE_DIRS = ("vllm_qaic_connector", "vllm_qaic_proxy", "testbed", "tests", "scripts",
             "benchmarks", "emulator")  # fmt: skip
REPO_PATH = re.compile(rf"(?<![\w/.])((?:{'|'.join(CODE_DIRS)}|docs)/[\w/.-]*\.(?:py|md|sh))")


def readme_length() -> list[str]:
    lines = len((ROOT / "README.md").read_text().splitlines())
    if lines > MAX_README_LINES:
        return [f"README.md has {lines} lines, more than {MAX_README_LINES}: move detail to docs/"]
    return []


def broken_links() -> list[str]:
    problems = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in LINK.findall(text):
            path = target.split("#", 1)[0]
            if not path or URL.match(target):
                continue  # an anchor in the same page, or a URL
            if not (page.parent / path).exists():
                problems.append(f"{page.relative_to(ROOT)}: link to {target}: no such file")
    return problems


def module_map() -> list[str]:
    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts)
        for root in (PACKAGE, ROOT)
        for p in (PACKAGE if root is PACKAGE else PROXY).rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    where = ARCHITECTURE.relative_to(ROOT)
    if not ARCHITECTURE.exists() or "\n## Module map" not in ARCHITECTURE.read_text():
        return [f"{where}: no '## Module map' section"]
    section = ARCHITECTURE.read_text().split("\n## Module map", 1)[1].split("\n## ", 1)[0]
    named = {m.group(1) for line in section.splitlines() if (m := MAP_ROW.match(line))}
    return [f"{where}: the module map lacks {m}" for m in sorted(modules - named)] + [
        f"{where}: the module map names {m}, which is not a module of either package"
        for m in sorted(named - modules)
    ]


def docstring_paths() -> list[str]:
    problems = []
    for source in sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                continue
            for path in REPO_PATH.findall(ast.get_docstring(node) or ""):
                if not (ROOT / path).exists():
                    where = f"{source.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}"
                    problems.append(f"{where}: the docstring names {path}: no such file")
    return problems


# What the table's "never" cells say, as the module names they cover.
HALVES = {"scheduler", "scheduler_side", "worker", "worker_side"}
NEVER_WORDS = {
    "either half": HALVES, "the worker half": {"worker", "worker_side"},
    "the scheduler half": {"scheduler", "scheduler_side"}, "a transport": {"transports"},
    "the connector": {"connector"}, "the proxy": {"vllm_qaic_proxy"}, "vllm": {"vllm"},
    "torch": {"torch"}, "numpy": {"numpy"}, "qaic/": {"qaic"},
}  # fmt: skip


def import_rules() -> list[str]:
    """Every contract's forbidden modules named in the "never" cell of each of its sources'
    rows ("any other room": every module of the connector package)."""
    section = ARCHITECTURE.read_text().split("\n## Import rules", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for room in re.findall(r"`([\w/]+)`", cells[0]):
                rows[room.rstrip("/")] = cells[2].lower()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    problems = []
    for contract in config["tool"]["importlinter"]["contracts"]:
        for source in contract.get("source_modules", []):  # a layers contract has none
            room = source.removeprefix("vllm_qaic_connector.")
            never = rows.get(room)
            if never is None:
                problems.append(f"docs/architecture.md: the import rules have no row for {room}")
                continue
            said = {m for words, mods in NEVER_WORDS.items() if words in never for m in mods}
            said |= {m.strip("`/") for m in re.findall(r"`[\w/]+`", never)}
            for forbidden in contract["forbidden_modules"]:
                name = forbidden.removeprefix("vllm_qaic_connector.")
                if name not in said and not (
                    "any other room" in never and forbidden.startswith("vllm_qaic_connector.")
                ):
                    problems.append(
                        f"docs/architecture.md: the import rules' row for {room} does not say "
                        f"it never imports {name} (contract: {contract['name']!r})"
                    )
    return problems


def main() -> int:
    problems = readme_length() + broken_links() + module_map() + docstring_paths()
    problems += import_rules()
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
