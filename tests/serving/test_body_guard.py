"""json_depth: nesting of a raw JSON body, counted without parsing it."""

from __future__ import annotations

import json

import pytest

from tessera.entrypoints.body_guard import json_depth


@pytest.mark.parametrize(
    "value",
    [
        1,
        "text",
        [],
        {"a": [1, {"b": [[2]]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
        {"tricky": '[[[{{ "quoted" \\ ]]] \\" [', "after": [[1]]},
        ["\\", ["\\\\"], [['"[']]],
    ],
)
def test_depth_matches_the_parsed_value(value: object) -> None:
    def depth(v: object) -> int:
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

    assert json_depth(json.dumps(value).encode()) == depth(value)


def test_deep_nesting_is_measured_in_linear_time() -> None:
    assert json_depth(b"[" * 1_000_000 + b"]" * 1_000_000) == 1_000_000
    assert json_depth(b'"' + b'\\"' * 1_000_000) == 0  # an unterminated string of escaped quotes
