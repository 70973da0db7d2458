"""msgpack encoding of the engine messages: compact, and no pickle of arbitrary objects.

Only the dataclasses registered here cross the process boundary; each is packed as a
msgpack extension holding [type name, field values in declaration order]. Decoding
rebuilds it through its constructor, so SamplingParams re-validates on arrival.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from tessera.core.sched_output import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from tessera.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    TokenLogprobs,
)
from tessera.sampling_params import SamplingParams

_EXT_DATACLASS = 1
_REGISTRY: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        EngineCoreRequest,
        SamplingParams,
        TokenLogprobs,
        EngineCoreOutput,
        EngineCoreOutputs,
        SchedulerStats,
        # The engine core's steps, broadcast to worker ranks, and what the output rank returns.
        SchedulerOutput,
        ScheduledRequest,
        NewRequestData,
        ModelRunnerOutput,
    )
}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls) if f.init) for cls in _REGISTRY.values()
}


def _default(obj: Any) -> msgpack.ExtType:
    fields = _FIELDS.get(type(obj))
    if fields is None:
        raise TypeError(f"cannot serialize {type(obj).__qualname__}: not a registered engine message")
    body = [type(obj).__name__, [getattr(obj, name) for name in fields]]
    return msgpack.ExtType(_EXT_DATACLASS, msgpack.packb(body, default=_default, use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_DATACLASS:
        raise ValueError(f"unknown msgpack extension type {code}")
    name, values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown engine message type {name!r}")
    return cls(*values)


def encode(obj: Any) -> bytes:
    """Serialize builtins and registered engine messages (nested freely)."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes | memoryview) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
