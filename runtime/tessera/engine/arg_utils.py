"""Command-line flags for the engine, generated from EngineConfig so every entry point shares them.

Flag names follow vLLM where one exists (`--max-num-seqs`, `--enable-prefix-caching` /
`--no-enable-prefix-caching`, `--tensor-parallel-size` / `-tp`, ...). The model is a
positional argument added by each command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tessera.config import EngineConfig
from tessera.topology import LAYOUT_ENV, layout_from_env

# Short aliases users of vLLM and of DESIGN.md (`tessera serve MODEL --tp 2 --pp 2`) type.
_ALIASES: dict[str, list[str]] = {
    "tensor_parallel_size": ["-tp", "--tp"],
    "pipeline_parallel_size": ["-pp", "--pp"],
}
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2}
_SIZE_UNITS |= {"mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512MiB', '2GB', '1.5GiB'."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def base_type(annotation: Any) -> Any:
    """`int | None` -> int; leaves Literal and list types as they are (the operator's flags use it too)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _leaf_fields(model: type[BaseModel] = EngineConfig) -> list[tuple[str, FieldInfo]]:
    """The configuration's flag-carrying fields: nested models (the parallel layout) are flattened."""
    leaves: list[tuple[str, FieldInfo]] = []
    for name, field in model.model_fields.items():
        kind = base_type(field.annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            leaves += _leaf_fields(kind)
        else:
            leaves.append((name, field))
    return leaves


def _default_of(field: FieldInfo) -> Any:
    return None if field.default_factory is not None else field.default


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ("model", "seed")) -> None:
    """Add the engine flags. `seed` is left out by default: `tessera generate` uses --seed for sampling."""
    group = parser.add_argument_group("engine")
    for name, field in _leaf_fields():
        if name in exclude:
            continue
        flags = ["--" + name.replace("_", "-"), *_ALIASES.get(name, [])]
        kind = base_type(field.annotation)
        help_text = field.description or ""
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(kind))
        elif name == "kv_cache_memory":
            kwargs["type"] = parse_size
            kwargs["help"] = help_text + " (bytes, or with a unit: 512MiB, 2GiB)"
        elif typing.get_origin(kind) is dict:
            kwargs["type"] = _json_object
        elif typing.get_origin(kind) is list:
            kwargs["type"] = _int_list
            kwargs["help"] = help_text + " (comma-separated)"
        elif kind in (int, float, str):
            kwargs["type"] = kind
        kwargs["help"] = f"{kwargs['help']} (default: {_default_of(field)})".strip()
        group.add_argument(*flags, **kwargs)


def engine_config_from_args(
    args: argparse.Namespace, model: str | None = None, environ: Mapping[str, str] = os.environ
) -> EngineConfig:
    """An EngineConfig from parsed flags; unset flags keep EngineConfig's defaults.

    In a pod the parallel layout comes from the topology environment the operator wrote
    (TESSERA_TP_SIZE, ...); a flag that says otherwise is an error, not a silent override.
    """
    values = {name: getattr(args, name) for name, _ in _leaf_fields() if hasattr(args, name)}
    if model is not None:
        values["model"] = model
    layout = layout_from_env(environ)
    if layout is not None:
        for name, value in layout.model_dump().items():
            if name in values and values[name] != value:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} {values[name]} contradicts the topology environment ({LAYOUT_ENV[name]})"
                )
            values[name] = value
    return EngineConfig(**values)


def engine_cli_args(values: dict[str, Any]) -> list[str]:
    """The flags that reproduce ``values`` (EngineConfig leaf field -> value), from the same definitions.

    The operator builds rank pod commands with this, so a flag renamed here cannot drift there.
    """
    fields = dict(_leaf_fields())
    args: list[str] = []
    for name, value in values.items():
        if name not in fields:
            raise KeyError(f"{name!r} is not an engine setting")
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            args += [flag, ",".join(str(v) for v in value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args
