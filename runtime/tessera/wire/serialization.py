"""msgpack encoding of the wire messages: compact, no pickle, and safe against hostile input.

Only registered dataclasses cross a process boundary; each is packed as a msgpack extension
holding [type name, field values in declaration order]. Decoding rebuilds it through its
constructor, so SamplingParams re-validates on arrival.

Decoding never recurses: msgpack's C unpacker keeps its own stack, extensions are unpacked
one level at a time by an explicit work list, and nesting deeper than MAX_DEPTH or a message
larger than ``max_bytes`` is refused. Every way a message can be malformed raises DecodeError,
which receivers count as a protocol error instead of dying.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from tessera.sampling_params import SamplingParams
from tessera.wire.messages import (
    EngineCoreHeartbeat,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    PromptLogprobs,
    SchedulerStats,
    TokenLogprobs,
)
from tessera.wire.sched_output import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput

_EXT_DATACLASS = 1
# Containers and messages nest a few levels in practice; anything deeper is an attack or a bug.
MAX_DEPTH = 32
# Far above any real message (a 1M-token prompt packs into ~5 MB), far below memory trouble.
DEFAULT_MAX_BYTES = 64 << 20

_REGISTRY: dict[str, type] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}


class DecodeError(ValueError):
    """A message that is not a well-formed encoding of builtins and registered types."""


def register(*classes: type) -> None:
    """Allow these dataclasses on the wire (by class name, so names must be unique)."""
    for cls in classes:
        existing = _REGISTRY.get(cls.__name__)
        if existing is not None and existing is not cls:
            raise ValueError(f"two wire types named {cls.__name__}")
        _REGISTRY[cls.__name__] = cls
        _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.init)


register(
    EngineCoreRequest,
    SamplingParams,
    TokenLogprobs,
    PromptLogprobs,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
    EngineCoreHeartbeat,
    # The engine core's steps, broadcast to worker ranks, and what the output rank returns.
    SchedulerOutput,
    ScheduledRequest,
    NewRequestData,
    ModelRunnerOutput,
)


def _default(obj: Any) -> msgpack.ExtType:
    fields = _FIELDS.get(type(obj))
    if fields is None:
        raise TypeError(f"cannot serialize {type(obj).__qualname__}: not a registered wire type")
    body = [type(obj).__name__, [getattr(obj, name) for name in fields]]
    return msgpack.ExtType(_EXT_DATACLASS, msgpack.packb(body, default=_default, use_bin_type=True))


def encode(obj: Any) -> bytes:
    """Serialize builtins and registered wire types (nested freely)."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes | memoryview, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """The object ``encode`` made; DecodeError for anything else, however malformed."""
    if len(data) > max_bytes:
        raise DecodeError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return _materialize(_unpack_flat(data))
    except DecodeError:
        raise
    except Exception as error:  # msgpack and constructors raise many types; all mean "malformed"
        raise DecodeError(f"malformed message ({type(error).__name__}: {error})") from error


class _RawExt:
    """An extension not unpacked yet: the unpacker's hook returns it instead of recursing."""

    __slots__ = ("code", "data")
    __hash__ = None  # type: ignore[assignment]  # never a map key

    def __init__(self, code: int, data: bytes) -> None:
        self.code = code
        self.data = data


@dataclasses.dataclass
class _Pending:
    """A registered type whose field values are still being decoded."""

    cls: type
    values: list[Any]


def _unpack_flat(data: bytes | memoryview) -> Any:
    return msgpack.unpackb(data, ext_hook=_RawExt, raw=False, strict_map_key=False)


def _expand(ext: _RawExt) -> _Pending:
    if ext.code != _EXT_DATACLASS:
        raise DecodeError(f"unknown msgpack extension type {ext.code}")
    body = _unpack_flat(ext.data)
    if not (isinstance(body, list) and len(body) == 2 and isinstance(body[1], list)):
        raise DecodeError("malformed wire type: expected [name, [fields]]")
    name, values = body
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise DecodeError(f"unknown engine message type {name!r}")
    if len(values) > len(_FIELDS[cls]):
        raise DecodeError(f"{name} has {len(_FIELDS[cls])} fields, got {len(values)}")
    return _Pending(cls, values)


def _materialize(root: Any) -> Any:
    """Expand extensions breadth by depth with a work list, then build them children first."""
    box = [root]
    built: list[tuple[list[Any] | dict[Any, Any], Any, _Pending]] = []
    work: list[tuple[list[Any] | dict[Any, Any], int]] = [(box, 0)]
    while work:
        container, depth = work.pop()
        if depth > MAX_DEPTH:
            raise DecodeError(f"message nested deeper than {MAX_DEPTH} levels")
        entries = list(container.items()) if isinstance(container, dict) else enumerate(container)
        for key, value in entries:
            kind = type(value)
            if kind is _RawExt:
                pending = _expand(value)
                container[key] = pending
                built.append((container, key, pending))
                work.append((pending.values, depth + 1))
            elif kind is list or kind is dict:
                work.append((value, depth + 1))
    # A type is always found after the one that holds it, so reversed order builds inner ones first.
    for container, key, pending in reversed(built):
        container[key] = pending.cls(*pending.values)
    return box[0]
