"""Layer counts of models the operator can check a layer partition against (others are not checked)."""

from __future__ import annotations

# Keys are lower-case; a source matches by its full text or its last path component
# (so `/models/Llama-3.1-70B-Instruct` and `meta-llama/Llama-3.1-70B-Instruct` both match).
NUM_LAYERS: dict[str, int] = {
    "smollm2": 30,
    "smollm2-135m": 30,
    "smollm2-135m-instruct": 30,
    "smollm2-360m-instruct": 32,
    "llama-3.1-8b-instruct": 32,
    "llama-3.1-70b-instruct": 80,
    "llama-3.3-70b-instruct": 80,
    "meta-llama-3-70b-instruct": 80,
}


def known_num_layers(source: str) -> int | None:
    text = source.strip().lower().removesuffix("/")
    for candidate in (text, text.rsplit("/", 1)[-1], text.rsplit("/", 1)[-1].removesuffix(".gguf")):
        if candidate in NUM_LAYERS:
            return NUM_LAYERS[candidate]
    return None
