"""The runtime's version, in a module of its own: the API server's /version reads it without
importing the root package (which sits above every layer)."""

from __future__ import annotations

__version__ = "0.1.0"
