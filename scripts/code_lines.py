"""The house's code budget: lines of code in both packages, without docstrings, comments or
blank lines (a statement over several lines counts each line it spans).

    python scripts/code_lines.py          # the total
    python scripts/code_lines.py 20       # the 20 biggest files, then the total
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

PACKAGES = ("vllm_qaic_connector", "vllm_qaic_proxy")
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}  # fmt: skip


def _docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0] if node.body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(path: Path) -> int:
    source = path.read_text()
    docstrings = _docstring_lines(ast.parse(source))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    rows = sorted(
        ((code_lines(p), str(p.relative_to(root))) for pkg in PACKAGES
         for p in sorted((root / pkg).rglob("*.py"))),
        reverse=True,
    )  # fmt: skip
    for lines, path in rows[: int(sys.argv[1]) if len(sys.argv) > 1 else 0]:
        print(f"{lines:5d} {path}")
    print(sum(lines for lines, _ in rows))


if __name__ == "__main__":
    main()
