"""Sizes that keep the package readable, checked on the source with ``ast``.

* no function or method of ``torchtitan/`` has a body over :data:`MAX_FUNCTION_LINES` lines
  (counted from its first statement after the docstring to its end: a long keyword-only
  signature with Meta's names, or a docstring, is not logic to follow);
* no module of ``torchtitan/`` (the core and its tools) is over :data:`MAX_FILE_LINES` lines.

A function that grows past the limit is split into named steps; a module, where it has two
jobs. The checks themselves are tested on small synthetic sources.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line."""
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def long_functions(source: str, where: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > limit:
            out.append(f"{where}:{node.lineno} {node.name} ({body_lines(node)} lines)")
    return out


def modules() -> list[Path]:
    return sorted((REPO / "torchtitan").rglob("*.py"))


def test_no_function_is_longer_than_the_limit():
    found = [f for p in modules() for f in long_functions(p.read_text(), str(p.relative_to(REPO)))]
    assert found == [], f"split these into named steps (<= {MAX_FUNCTION_LINES} lines): {found}"


def test_no_module_is_longer_than_the_limit():
    found = [f"{p.relative_to(REPO)} ({n} lines)" for p in modules()
             if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert found == [], f"split these where they have two jobs (<= {MAX_FILE_LINES} lines): {found}"


def test_the_function_check_counts_the_body_only():
    statements = "".join(f"x{i} = {i}\n" for i in range(5))
    doc = '"""' + "\n" * 10 + '"""\n'
    source = (f"def f(\n    a,\n    b,\n):\n{textwrap.indent(doc + statements, '    ')}\n"
              f"class C:\n    def g(self):\n{textwrap.indent(statements, '        ')}")
    assert long_functions(source, "m.py", limit=5) == []
    assert long_functions(source, "m.py", limit=4) == ["m.py:1 f (5 lines)", "m.py:23 g (5 lines)"]
