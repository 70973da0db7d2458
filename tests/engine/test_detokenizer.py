"""Incremental detokenization: the text of the generated tokens, as a whole decode gives it."""

from __future__ import annotations

from tessera.engine.detokenizer import IncrementalDetokenizer
from tessera.sampling_params import SamplingParams
from tests.fixtures.models import make_tokenizer


def streamed_text(tokenizer, prompt: list[int], generated: list[int]) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(max_tokens=len(generated)))
    for token_id in generated:
        detokenizer.update([token_id])
    detokenizer.flush()
    return detokenizer.output_text


def test_a_prompt_that_ends_inside_a_character_lends_none_of_its_bytes_to_the_output() -> None:
    tokenizer = make_tokenizer()
    ids = tokenizer.encode("cde日本x", add_special_tokens=False)
    # Cut inside a multi-byte character: prompt and output each hold some of its bytes.
    cuts = [i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i])]
    assert cuts, "the tokenizer splits no character into several tokens"
    for cut in cuts:
        prompt, generated = ids[:cut], ids[cut:]
        assert streamed_text(tokenizer, prompt, generated) == tokenizer.decode(generated)
    # A prompt on a character boundary still primes the first token (its leading space).
    prompt, generated = (
        tokenizer.encode("hello", add_special_tokens=False),
        tokenizer.encode(" world", add_special_tokens=False),
    )
    assert streamed_text(tokenizer, prompt, generated) == " world"
