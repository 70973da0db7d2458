"""Kubernetes resource quantities (2Gi, 512Mi, 1e9, 250m), parsed without overflow.

`float("1e400")` is infinite and `10 ** 999999999` takes minutes: a quantity from a user's
spec is parsed as a Decimal (exponents stay symbolic) and bounded before any conversion,
so an absurd value is a clear error naming the field, never a crash in the reconciler.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

MAX_INT64 = 2**63 - 1
MAX_LENGTH = 64  # longer strings are rejected before parsing: nothing real needs more
# Kubernetes' quantity grammar (sign, number, one suffix: binary SI, decimal SI or an exponent),
# also the CRD's pattern for quantity fields (Go's RE2 reads it as Python does).
QUANTITY_PATTERN = r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$"
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(value: str | int | float) -> Decimal:
    """The exact value of a quantity; ValueError when it is not one, negative, or beyond int64."""
    text = str(value).strip() if not isinstance(value, bool) else ""
    if len(text) > MAX_LENGTH:
        raise ValueError(f"a quantity of {len(text)} characters (at most {MAX_LENGTH})")
    match = _QUANTITY_RE.fullmatch(text)
    if not match:
        raise ValueError(f"not a resource quantity (e.g. 2Gi, 512Mi, 1e9, 500m): {value!r}")
    number, suffix = match.groups()
    try:
        if suffix is None:
            result = Decimal(number)
        elif suffix[0] in "eE":
            result = Decimal(number + suffix)  # the exponent stays symbolic: no huge power is built
        elif suffix in _BINARY:
            result = Decimal(number) * (2 ** _BINARY[suffix])
        else:
            result = Decimal(number).scaleb(_DECIMAL[suffix])
    except InvalidOperation as exc:  # an exponent beyond what Decimal holds
        raise ValueError(f"{value!r} is beyond the largest quantity Kubernetes holds (2^63-1)") from exc
    if not result.is_finite() or result < 0:
        raise ValueError(f"must be a finite, non-negative quantity, got {value!r}")
    if result > MAX_INT64:
        raise ValueError(f"{value!r} is beyond the largest quantity Kubernetes holds (2^63-1)")
    return result


def quantity_to_bytes(value: str | int | float) -> int:
    """Whole bytes (rounded down) of a memory quantity."""
    return int(parse_quantity(value))
