"""A token's own bytes, for the `bytes` of OpenAI's chat logprobs: a character that several
tokens share (an emoji, most CJK) decodes to U+FFFD token by token, but its tokens' bytes
joined are the character's UTF-8 again, which is what clients join them for.
"""

from __future__ import annotations

import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_SPACE_PIECE = "\u2581"  # SentencePiece's word boundary, a space in the text


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) spelling of each byte as one printable character, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    alphabet = {chr(byte): byte for byte in printable}
    shifted = (byte for byte in range(256) if byte not in alphabet.values())
    alphabet.update({chr(256 + index): byte for index, byte in enumerate(shifted)})
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


class TokenBytes:
    """Bytes by token id for one tokenizer, each computed once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        spelled = str(decoder)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_fallback = "ByteFallback" in spelled
        self._known: dict[int, list[int]] = {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        """The token's bytes; ``text`` (its decoded text) when its vocabulary entry says nothing
        more (special tokens, tokenizers of other kinds)."""
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = list(self._bytes_of(token_id) or text.encode("utf-8"))
        return known

    def _bytes_of(self, token_id: int) -> bytes | None:
        if token_id in self.tokenizer.all_special_ids:
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if self.byte_level:
            if any(char not in _BYTE_LEVEL for char in piece):
                return None
            return bytes(_BYTE_LEVEL[char] for char in piece)
        if self.byte_fallback:
            match = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace(_SPACE_PIECE, " ").encode()
        return None
