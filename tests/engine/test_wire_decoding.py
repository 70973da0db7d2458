"""The wire decoder refuses hostile input with DecodeError, never by crashing or recursing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from tessera.wire import serialization
from tessera.wire.messages import EngineCoreHeartbeat, TokenLogprobs


def nested_extensions(levels: int) -> bytes:
    inner = msgpack.packb(["TokenLogprobs", [0.0, [], []]])
    for _ in range(levels):
        inner = msgpack.packb(["TokenLogprobs", [msgpack.ExtType(1, inner), [], []]])
    return msgpack.packb(msgpack.ExtType(1, inner))


def test_deeply_nested_extensions_are_refused_without_crashing_the_process() -> None:
    # Used to recurse through msgpack's C unpacker and the ext hook until the process segfaulted.
    script = (
        "from tessera.wire import serialization\n"
        "from tests.engine.test_wire_decoding import nested_extensions\n"
        "try:\n"
        "    serialization.decode(nested_extensions(200))\n"
        "except serialization.DecodeError as error:\n"
        "    print('refused:', error)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=repo
    )
    assert result.returncode == 0, result.stderr
    assert "nested deeper than" in result.stdout


def test_nesting_limit_applies_to_plain_containers() -> None:
    deep: list[object] = []
    for _ in range(serialization.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(serialization.DecodeError, match="nested deeper"):
        serialization.decode(serialization.encode(deep))
    shallow: list[object] = []
    for _ in range(serialization.MAX_DEPTH - 1):
        shallow = [shallow]
    assert serialization.decode(serialization.encode(shallow)) == shallow


def test_messages_over_the_size_limit_are_refused() -> None:
    data = serialization.encode(list(range(1000)))
    with pytest.raises(serialization.DecodeError, match="exceeds the limit"):
        serialization.decode(data, max_bytes=len(data) - 1)
    assert serialization.decode(data, max_bytes=len(data)) == list(range(1000))


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # a byte msgpack never uses
        b"\x92\x01",  # truncated array
        msgpack.packb(msgpack.ExtType(7, b"")),  # unknown extension
        msgpack.packb(msgpack.ExtType(1, b"\xc1")),  # garbage inside an extension
        msgpack.packb(msgpack.ExtType(1, msgpack.packb("TokenLogprobs"))),  # not [name, fields]
        msgpack.packb(msgpack.ExtType(1, msgpack.packb(["TokenLogprobs", [1, 2, 3, 4, 5]]))),  # too many
        msgpack.packb(msgpack.ExtType(1, msgpack.packb(["TokenLogprobs", []]))),  # too few
        msgpack.packb({msgpack.ExtType(1, b""): 1}),  # an extension as a map key
    ],
)
def test_malformed_messages_raise_decode_error(data: bytes) -> None:
    with pytest.raises(serialization.DecodeError):
        serialization.decode(data)


def test_registered_types_nest_inside_containers() -> None:
    message = {"beats": [EngineCoreHeartbeat(True, 0.5, 2)], "lp": [[TokenLogprobs(-1.0, [3], [-1.0])]]}
    assert serialization.decode(serialization.encode(message)) == message
