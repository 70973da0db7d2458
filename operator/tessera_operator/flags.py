"""`tessera-operator`'s settings flags, generated from config.py's fields (as the runtime's
engine flags are from its EngineConfig): `--<field-name>` unless the field names its `flag`,
help from the description, type, choices and default from the field (the default as the
environment left it)."""

from __future__ import annotations

import argparse
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tessera_operator.config import OperatorConfig, PodPolicy, base_type, extra, from_text


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return value


def parsed_with(field: FieldInfo) -> typing.Callable[[str], Any]:
    """The flag's `type`: the field's own parsing of text, its errors said as argparse's."""

    def parse(text: str) -> Any:
        try:
            return from_text(field, text)
        except ValueError as exc:  # json's errors are ValueErrors too
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse


def flag_options(field: FieldInfo, default: Any) -> dict[str, Any]:
    """argparse's options for one field: its kind decides the action, type and metavar."""
    kind = base_type(field.annotation)
    origin = typing.get_origin(kind)
    options: dict[str, Any] = {"default": default, "help": field.description or None}
    if "metavar" in extra(field):
        options["metavar"] = extra(field)["metavar"]
    if kind is bool:
        options["action"] = "store_true"
    elif origin is list:  # repeatable; the environment's list applies when none is given
        options.update(action="append", default=[])
    elif origin is typing.Literal:
        options["choices"] = typing.get_args(kind)
    elif kind in (int, float):
        positive = extra(field).get("positive")
        options["type"] = (positive_int if kind is int else positive_float) if positive else kind
    elif origin in (frozenset, dict):
        options["type"] = parsed_with(field)
        options.setdefault("metavar", "A,B" if origin is frozenset else "JSON")
    return options


def add_model_flags(
    parser: argparse.ArgumentParser,
    model: BaseModel,
    groups: dict[str, Any],
    scope: Any = None,
) -> None:
    """One flag per field of `model` (nested models recursed into, each its own group)."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            title = (type(value).__doc__ or name).strip()
            add_model_flags(parser, value, {**groups, "": parser.add_argument_group(title)})
            continue
        more = extra(field)
        flags = [more.get("flag") or "--" + name.replace("_", "-"), *more.get("aliases", [])]
        if "short" in more:
            flags.insert(0, more["short"])
        group_title = more.get("group", "")
        if group_title not in groups:
            groups[group_title] = parser.add_argument_group(group_title)
        target = scope if (scope is not None and more.get("scoped")) else groups[group_title]
        target.add_argument(*flags, dest=name, **flag_options(field, value))


def add_config_flags(parser: argparse.ArgumentParser, config: OperatorConfig, scope: Any = None) -> None:
    """The flags of every OperatorConfig field; `scope` (a mutually exclusive group) takes the
    namespaces' flag beside --all-namespaces."""
    add_model_flags(parser, config, {"": parser}, scope)


def config_from_args(args: argparse.Namespace, config: OperatorConfig) -> dict[str, Any]:
    """The parsed settings as OperatorConfig's fields (the pod policy as its model)."""
    values = {name: getattr(args, name) for name in type(config).model_fields if hasattr(args, name)}
    policy = {name: getattr(args, name) for name in PodPolicy.model_fields}
    values["pod_policy"] = PodPolicy(**policy)
    return values
