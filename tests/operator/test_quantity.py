import pytest

from tessera_operator.quantity import MAX_INT64, parse_quantity, quantity_to_bytes


@pytest.mark.parametrize(
    ("text", "value"),
    [("2Gi", 2 * 2**30), ("1.5Gi", 3 * 2**29), ("1e9", 10**9), ("2G", 2 * 10**9), ("250m", 0), (3, 3)],
)
def test_quantities_convert_to_whole_bytes(text: str | int, value: int) -> None:
    assert quantity_to_bytes(text) == value


@pytest.mark.parametrize(
    "text",
    ["1e400", "1e99999999999999999999", "9" * 30, "8Ei", "-1", "inf", "nan", "1e3x", "", "9" * 100, 1e300],
)
def test_overflowing_or_malformed_quantities_are_errors_not_crashes(text: str | float) -> None:
    # float("1e400") is inf and 10**99999999999999999999 never finishes: both must be plain errors.
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_the_largest_int64_is_still_a_quantity() -> None:
    assert quantity_to_bytes(str(MAX_INT64)) == MAX_INT64
