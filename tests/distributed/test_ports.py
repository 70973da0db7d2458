"""Listener ports are chosen below the ephemeral range, where outgoing connections never land."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tessera import ports


def test_the_range_start_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t60999\n")
    assert ports.ephemeral_range_start(path) == 40000
    path.write_text("garbage\n")
    assert ports.ephemeral_range_start(path) == ports.LINUX_EPHEMERAL_START
    assert ports.ephemeral_range_start(tmp_path / "missing") == ports.LINUX_EPHEMERAL_START


def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_bound() -> None:
    start = ports.ephemeral_range_start()
    chosen = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST_PORT <= port < start for port in chosen)
    assert len(chosen) > 1  # random picks: two listeners rarely get the same one
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", chosen.pop()))


def test_a_port_in_use_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Only two candidates below the range: the one in use, and the one after it.
        monkeypatch.setattr(ports, "LOWEST_PORT", port)
        monkeypatch.setattr(ports, "ATTEMPTS", 1)
        monkeypatch.setattr(ports, "ephemeral_range_start", lambda: port + 2)
        picks = {ports.free_port() for _ in range(30)}
    assert port not in picks


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range_start", lambda: ports.LOWEST_PORT + 10)
    port = ports.free_port()
    assert port >= ports.LOWEST_PORT + 10  # from the kernel's own range
