"""The Python examples of the docs await every registry call: a registry's methods are
coroutines, and docs/scheduler.md's ``local_prefix_hit=registry.lookup(...)`` passed a
coroutine where a list of ``(block, version)`` pairs goes (``decide`` then failed with a
TypeError).  The examples hold placeholders (``...``), so they are parsed, not run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvwire.consistency import Registry

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The registry methods that are coroutines (watch() is not).
ASYNC_CALLS = {
    name for name in ("begin", "commit", "renew", "release", "lookup", "invalidate", "invalidate_many",
                      "check", "check_many", "superseded", "publish", "close")
    if hasattr(Registry, name)
}
REGISTRY_NAMES = {"reg", "registry"}
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _registry_calls(source: str) -> tuple[int, list[int]]:
    """(how many registry calls ``source`` makes, the lines of those not awaited)."""
    tree = compile(source, "<doc>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    awaited = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Await)}
    calls = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr in ASYNC_CALLS
        and isinstance(node.func.value, ast.Name) and node.func.value.id in REGISTRY_NAMES
    ]
    return len(calls), [call.lineno for call in calls if id(call) not in awaited]


def test_the_checker_finds_a_call_not_awaited() -> None:
    assert _registry_calls("x = await reg.lookup(blocks)\n") == (1, [])
    assert _registry_calls("state = S(\n    hit=registry.lookup(...),\n)\n") == (1, [2])


def test_every_registry_call_in_the_docs_examples_is_awaited() -> None:
    checked: dict[str, int] = {}
    unawaited: list[str] = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            try:
                count, lines = _registry_calls(match.group(1))
            except SyntaxError:
                continue  # a fragment that is not a whole program makes no registry call here
            checked[path.name] = checked.get(path.name, 0) + count
            start = text.count("\n", 0, match.start(1)) + 1
            unawaited += [f"{path.relative_to(ROOT)}:{start + line - 1}" for line in lines]
    assert checked.get("scheduler.md", 0) >= 1 and checked.get("consistency.md", 0) >= 10
    assert unawaited == []
