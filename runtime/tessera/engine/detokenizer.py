"""Incremental detokenization with stop strings, one per generated sequence."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tessera.sampling_params import SamplingParams

if TYPE_CHECKING:  # only a type: transformers takes seconds to import, so it loads with the tokenizer
    from transformers import PreTrainedTokenizerBase

# Prompt tokens that prime the stream, so the first output token decodes with its context
# (e.g. a leading space that a standalone decode would drop).
PRIMING_TOKENS = 4


def decode(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], skip_special_tokens: bool = False
) -> str:
    return str(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.rust_tokenizer: Tokenizer | None = getattr(tokenizer, "_tokenizer", None)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.output_text = ""
        self.stop_checked_len = 0  # text no stop string may end in: checked, or inside min_tokens
        self.token_ids: list[int] = []
        self.num_decoded_tokens = 0  # tokens whose text has been emitted by the stream
        self.num_text_tokens = 0  # tokens that have text: all but a stop token left out (as vLLM)
        if self.rust_tokenizer is not None:
            self.stream: DecodeStream | None = DecodeStream(
                ids=self._priming_ids(prompt_token_ids), skip_special_tokens=self.skip_special_tokens
            )
        else:
            self.stream = None

    def _priming_ids(self, prompt_token_ids: list[int]) -> list[int]:
        """The last prompt tokens before a whole character's end: a prompt of token ids may stop
        inside a character, whose bytes would otherwise come out with the first output token."""
        end = len(prompt_token_ids)
        for _ in range(4):  # a UTF-8 character has at most 4 bytes
            window = prompt_token_ids[max(0, end - PRIMING_TOKENS) : end]
            if not window or not decode(self.tokenizer, window, self.skip_special_tokens).endswith("\ufffd"):
                break
            end -= 1
        return prompt_token_ids[max(0, end - PRIMING_TOKENS) : end]

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; returns the stop string if one now appears (the text is cut there).

        ``stop_terminated``: the last token is the EOS or a stop token id, whose text is left out
        unless ``include_stop_str_in_output`` (as vLLM does).
        """
        self.token_ids.extend(new_token_ids)
        with_text = new_token_ids[:-1] if stop_terminated and not self.include_stop else new_token_ids
        self.num_text_tokens += len(with_text)
        if self.stream is not None and self.rust_tokenizer is not None:
            for token_id in with_text:
                piece = self.stream.step(self.rust_tokenizer, token_id)
                if piece:
                    self.output_text += piece
                    self.num_decoded_tokens = self.num_text_tokens
        else:  # slow tokenizers: decode the whole output again
            text_ids = self.token_ids[: self.num_text_tokens]
            self.output_text = decode(self.tokenizer, text_ids, self.skip_special_tokens)
        if len(self.token_ids) <= self.min_tokens:
            # No stop string ends within min_tokens' text, now or later (vLLM's rule).
            self.stop_checked_len = len(self.output_text)
            return None
        return self._check_stop_strings()

    def flush(self) -> None:
        """At the end, emit what the stream still holds (an incomplete UTF-8 sequence) as decode would."""
        if self.stream is not None and self.num_decoded_tokens < self.num_text_tokens:
            pending = self.token_ids[self.num_decoded_tokens : self.num_text_tokens]
            self.output_text += decode(self.tokenizer, pending, self.skip_special_tokens)
            self.num_decoded_tokens = self.num_text_tokens

    def _check_stop_strings(self) -> str | None:
        """The stop string that ends first in the new text (of two ending together, the first
        listed), as appending one character at a time would find it: the cut does not depend on
        how the text was split into tokens."""
        checked, self.stop_checked_len = self.stop_checked_len, len(self.output_text)
        found: tuple[int, str] | None = None  # (end, stop)
        for stop in self.stop:
            index = self.output_text.find(stop, max(0, checked - len(stop) + 1))
            if index != -1 and (found is None or index + len(stop) < found[0]):
                found = (index + len(stop), stop)
        if found is None:
            return None
        end, stop = found
        self.output_text = self.output_text[: end if self.include_stop else end - len(stop)]
        return stop

    def text_to_send(self, sent_len: int, finished: bool) -> str:
        """New text since sent_len, holding back a tail that might still become a stop string."""
        end = len(self.output_text)
        if not finished and self.stop and not self.include_stop:
            end = max(sent_len, end - self.max_stop_len + 1)
        return self.output_text[sent_len:end]
