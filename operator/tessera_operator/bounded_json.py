"""How deep and how large a decoded JSON value is, measured without recursion.

The CRD keeps what a spec passes into pods (affinity, volumes, tolerations, ...) free-form: the
API server stores any depth there (up to its own decoder's 10000 levels), while Python's
recursive walks (`json.dumps`, `copy.deepcopy`, pydantic's dumps, hashing a spec) fail past about
a thousand levels, some far sooner. `excess` walks a value with an explicit stack, so even a
value 100000 levels deep is measured in constant Python stack, and it stops at the first level or
byte over its caps: a huge value costs no more than the caps allow.
"""

from __future__ import annotations

import json
from typing import Any

# JSON punctuation around an element: `"key":` plus `,` for objects, `,` for arrays.
_OBJECT_OVERHEAD, _ITEM_OVERHEAD, _CONTAINER = 2, 1, 2


def _scalar_size(value: Any) -> int:
    if value is None or value is True:
        return 4
    if value is False:
        return 5
    if isinstance(value, str):
        return len(json.dumps(value))  # escapes included (a str is not recursed into)
    return len(repr(value))  # int, float


def excess(value: Any, max_depth: int, max_bytes: int) -> tuple[str, list[str | int]] | None:
    """None when `value` nests at most `max_depth` containers deep (a bare `{}` or `[]` is 1) and
    its compact JSON takes at most `max_bytes` (`json.dumps(..., separators=(",", ":"))`, counted
    with at most a byte per container more);
    otherwise ("depth" | "size", the path to where the cap was crossed)."""
    size = 0
    # (container, its path, its depth); an explicit stack instead of recursion.
    stack: list[tuple[Any, list[str | int], int]] = []

    def push(item: Any, path: list[str | int], depth: int) -> str | None:
        nonlocal size
        if isinstance(item, dict | list):
            if depth > max_depth:
                return "depth"
            size += _CONTAINER
            stack.append((item, path, depth))
        else:
            size += _scalar_size(item)
        return "size" if size > max_bytes else None

    problem = push(value, [], 1)
    if problem:
        return problem, []
    while stack:
        container, path, depth = stack.pop()
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, item in items:
            if isinstance(container, dict):
                size += _scalar_size(str(key)) + _OBJECT_OVERHEAD
            else:
                size += _ITEM_OVERHEAD
            problem = push(item, [*path, key], depth + 1)
            if problem:
                return problem, [*path, key]
    return None


def describe(path: list[str | int], limit: int = 6) -> str:
    """A path as kubectl spells a field (`.a[0].b`), its first `limit` steps, then `...`."""
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[:limit])
    return text + ("..." if len(path) > limit else "")


def depth_problem(value: Any, max_depth: int) -> str | None:
    """Where `value` first nests deeper than `max_depth` (a path), or None."""
    found = excess(value, max_depth, max_bytes=2**62)
    return describe(found[1]) if found else None
