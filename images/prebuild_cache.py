"""Bakes into $TESSERA_CACHE what every rank would otherwise build on its first start.

The model aliases' conversions (models/) and the CPU kernels (kernels/, keyed on the CPU's flags:
a node with other instruction sets compiles its own). The runtime image runs it at build time
with TESSERA_CACHE=/opt/tessera/cache, which the runtime reads as its prebuilt cache; `make demo`
runs it on the host, whose cache the node agent mounts there.
"""

from tessera.kernels import cpu_kernels
from tessera.models.registry import ALIASES, resolve_model

for alias in ALIASES:
    print(f"{alias}: {resolve_model(alias)}")
print(f"CPU kernels: {cpu_kernels() or 'unavailable (no compiler): ATen ops will be used'}")
