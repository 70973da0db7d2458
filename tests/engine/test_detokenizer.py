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


def stopped_text(tokenizer, pieces: list[str], **params) -> tuple[str, str | None]:
    """The text and stop string after feeding ``pieces``' tokens, one piece per update."""
    sampling = SamplingParams(max_tokens=64, **params)
    detokenizer = IncrementalDetokenizer(
        tokenizer, tokenizer.encode("hi", add_special_tokens=False), sampling
    )
    for piece in pieces:
        stop = detokenizer.update(tokenizer.encode(piece, add_special_tokens=False))
        if stop is not None:
            return detokenizer.output_text, stop
    return detokenizer.output_text, None


def test_a_stop_string_generated_within_min_tokens_never_ends_the_output() -> None:
    tokenizer = make_tokenizer()
    # "ab" is complete after two of min_tokens=3 tokens: it must not cut the text later, with or
    # without a longer stop string beside it (which once widened the later search back over it).
    for stop in (["ab"], ["ab", "zzzzzz"]):
        assert stopped_text(tokenizer, ["x", "a", "b", "c", "d"], stop=stop, min_tokens=3) == ("xabcd", None)
    # One that ends after min_tokens still does, even when it began within them.
    assert stopped_text(tokenizer, ["x", "a", "b", "cd"], stop=["bcd"], min_tokens=3) == ("xa", "bcd")


def test_overlapping_stop_strings_cut_where_the_text_says_not_where_tokens_split_it() -> None:
    tokenizer = make_tokenizer()
    # "p" completes before "upon" does: the first stop string to end wins, whatever the tokens.
    for pieces in ([" upon"], [" ", "u", "p", "on"], [" up", "on"]):
        assert stopped_text(tokenizer, pieces, stop=["upon", "p"]) == (" u", "p")
    # Two that end at the same character: the first listed.
    assert stopped_text(tokenizer, [" upon"], stop=["on", "upon"]) == (" up", "on")
    assert stopped_text(tokenizer, [" upon"], stop=["upon", "on"]) == (" ", "upon")
