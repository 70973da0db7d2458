"""`python -m tests.serving.faulty_frontend serve ...`: `tessera serve` with a detokenizer fault.

A request whose stop strings include FAIL_MARKER makes its detokenizer raise on the first
token, as a bug in output processing would; every other request is untouched. The error
text holds a file path, which must never reach the client.
"""

from __future__ import annotations

import sys
from typing import Any

from tessera.cli import main
from tessera.engine.detokenizer import IncrementalDetokenizer

FAIL_MARKER = "<<injected-detokenizer-fault>>"
SECRET_DETAIL = "/srv/secret/detokenizer.py line 42"

_original_update = IncrementalDetokenizer.update


def _failing_update(self: IncrementalDetokenizer, new_token_ids: list[int], **kwargs: Any) -> Any:
    if FAIL_MARKER in self.stop:
        raise RuntimeError(f"injected fault at {SECRET_DETAIL}")
    return _original_update(self, new_token_ids, **kwargs)


if __name__ == "__main__":
    IncrementalDetokenizer.update = _failing_update  # type: ignore[method-assign]
    sys.exit(main())
