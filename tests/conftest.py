"""Set for the whole test session before anything imports Triton.

Triton reads TRITON_INTERPRET when it decorates a kernel, including its own language library
(``triton.language``) when it is first imported, by whichever test or library does that first.
No test runs on a GPU, so every Triton kernel the tests launch runs on CPU tensors under the
interpreter: the switch is on from the start, for this process and the processes it starts.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
