"""The `bytes` of chat logprobs: each token's own bytes, so the tokens of one character join
into its UTF-8 again (token by token it decodes to U+FFFD)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tessera.engine.token_bytes import TokenBytes
from tessera.entrypoints.serving_chat import chat_logprobs
from tessera.outputs import CompletionOutput, Logprob
from tests.fixtures.models import make_tokenizer

TEXT = "héllo 😀 日本語 <|im_end|>"


def joined(token_bytes: TokenBytes, ids: list[int]) -> bytes:
    tokenizer = token_bytes.tokenizer
    return b"".join(bytes(token_bytes(i, tokenizer.decode([i]))) for i in ids)


def test_byte_level_tokens_join_into_the_texts_utf8(smollm2_dir: Path) -> None:
    for tokenizer in (AutoTokenizer.from_pretrained(str(smollm2_dir)), make_tokenizer()):
        token_bytes = TokenBytes(tokenizer)
        ids = tokenizer(TEXT, add_special_tokens=False).input_ids
        assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # the emoji is split
        assert joined(token_bytes, ids) == TEXT.encode()


def test_sentencepiece_byte_fallback_pieces_are_their_bytes() -> None:
    vocab = {"<unk>": 0, "\u2581the": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    token_bytes = TokenBytes(tokenizer)
    smile = [2 + b for b in "😀".encode()]
    assert joined(token_bytes, [1, *smile]) == " the😀".encode()


def test_chat_logprobs_carry_the_token_bytes(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = tokenizer("😀", add_special_tokens=False).input_ids
    entries = [{i: Logprob(-0.5, rank=1, decoded_token=tokenizer.decode([i]))} for i in ids]
    output = CompletionOutput(index=0, text="😀", token_ids=ids, logprobs=entries)
    content = chat_logprobs(output, 1, TokenBytes(tokenizer)).content  # type: ignore[union-attr]
    assert len(content) > 1 and b"".join(bytes(c.bytes) for c in content) == "😀".encode()
    assert all(bytes(c.top_logprobs[0].bytes) == bytes(c.bytes) for c in content)
