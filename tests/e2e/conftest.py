"""Each e2e test's outcome on its item, so fixtures can tell a failed test from a passed one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report
