"""Sizes that keep the package readable, checked on the source with ``ast``.

* no function or method of ``torchtitan/`` has a body over :data:`MAX_FUNCTION_LINES` lines
  (counted from its first statement after the docstring to its end: a long keyword-only
  signature with Meta's names, or a docstring, is not logic to follow);
* a module of ``torchtitan/`` (the core and its tools) over :data:`LONG_MODULE_LINES` lines is
  listed in :data:`LONG_MODULES` with the reason it stays one file (and only such modules are).

A function that grows past the limit is split into named steps; a module is split where it has
two jobs, not where it crosses a line count, so its length is a prompt to look, not a cap. The
checks themselves are tested on small synthetic sources.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
LONG_MODULE_LINES = 800
# Modules over LONG_MODULE_LINES, each with why it is still one job: path -> reason.
LONG_MODULES: dict[str, str] = {}


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


def test_long_modules_are_listed_with_their_reason():
    long = {str(p.relative_to(REPO)): n for p in modules()
            if (n := len(p.read_text().splitlines())) > LONG_MODULE_LINES}
    unexplained = [f"{p} ({n} lines)" for p, n in long.items() if p not in LONG_MODULES]
    assert unexplained == [], (
        f"over {LONG_MODULE_LINES} lines: split these where they have two jobs, or list them in "
        f"LONG_MODULES with the reason they are one: {unexplained}")
    stale = sorted(set(LONG_MODULES) - set(long))
    assert stale == [], f"LONG_MODULES lists modules no longer that long: {stale}"


def test_the_function_check_counts_the_body_only():
    statements = "".join(f"x{i} = {i}\n" for i in range(5))
    doc = '"""' + "\n" * 10 + '"""\n'
    source = (f"def f(\n    a,\n    b,\n):\n{textwrap.indent(doc + statements, '    ')}\n"
              f"class C:\n    def g(self):\n{textwrap.indent(statements, '        ')}")
    assert long_functions(source, "m.py", limit=5) == []
    assert long_functions(source, "m.py", limit=4) == ["m.py:1 f (5 lines)", "m.py:23 g (5 lines)"]
