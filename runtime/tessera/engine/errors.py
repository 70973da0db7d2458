"""Errors that end a single request (the engine and every other request keep going)."""

from __future__ import annotations


class RequestFailedError(RuntimeError):
    """This request failed inside the server (not the client's fault); it was aborted.

    The message is safe to show the client: no traceback, no file path.
    """


class ServerShuttingDownError(RuntimeError):
    """The server is stopping and could not finish this request within its grace period."""
