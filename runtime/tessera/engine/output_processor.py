"""Engine outputs in, RequestOutputs out: detokenization, stop strings, logprobs, n>1 aggregation.

Shared by the offline LLM and the serving AsyncLLM, so both produce the same text.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tessera.engine.detokenizer import IncrementalDetokenizer, decode
from tessera.engine.errors import RequestFailedError
from tessera.outputs import CompletionOutput, Logprob, RequestOutput
from tessera.sampling_params import SamplingParams
from tessera.wire.messages import (
    FINISH_ERROR,
    FINISH_STOP,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    TokenLogprobs,
)

if TYPE_CHECKING:  # only a type: transformers takes seconds to import, so it loads with the tokenizer
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MAX_ERROR_MESSAGE_CHARS = 300


class RequestOutputKind(enum.Enum):
    CUMULATIVE = enum.auto()  # every output carries everything so far
    DELTA = enum.auto()  # every output carries only what is new (streaming)
    FINAL_ONLY = enum.auto()  # one output, when the request finishes


@dataclass
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer
    num_logprobs: int | None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text_len: int = 0
    sent_num_tokens: int = 0
    finish_sent: bool = False


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    sequences: dict[str, _Sequence]  # child request id -> its sequence
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences.values())


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # child ids the engine core must stop (a stop string or a failure ended them)
    # Parent requests that failed in this step, with the error each caller gets; they are forgotten.
    failed: dict[str, RequestFailedError] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}
        self.child_to_parent: dict[str, str] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_requests: list[EngineCoreRequest],
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    ) -> None:
        # Children of n > 1 are named after their parent ("0_x"): no id may stand for two requests.
        taken = [
            rid
            for rid in {request_id, *(c.request_id for c in child_requests)}
            if rid in self.requests or rid in self.child_to_parent
        ]
        if taken:
            raise ValueError(f"request id {sorted(taken)[0]!r} is already in use")
        sequences = {
            child.request_id: _Sequence(
                index=index,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.sampling_params),
                num_logprobs=params.logprobs,
            )
            for index, child in enumerate(child_requests)
        }
        self.requests[request_id] = _Request(request_id, prompt, prompt_token_ids, output_kind, sequences)
        for child_id in sequences:
            self.child_to_parent[child_id] = request_id

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget these parent requests; returns their child ids for the engine core to abort."""
        children: list[str] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._forget(request)
                children.extend(request.sequences)
        return children

    def process_outputs(self, engine_outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Per request, so a failure here (or one the engine core reports) ends that request alone."""
        updated: dict[str, _Request] = {}
        result = ProcessedOutputs([], [])
        for output in engine_outputs.outputs:
            parent_id = self.child_to_parent.get(output.request_id)
            if parent_id is None:
                continue  # aborted or failed meanwhile
            request = self.requests[parent_id]
            try:
                if self._update(request, output, result.reqs_to_abort):
                    updated[parent_id] = request
            except Exception as exc:
                updated.pop(parent_id, None)
                self._fail(request, exc, result)
        for request in updated.values():
            try:
                request_output = self._output_of(request)
            except Exception as exc:
                self._fail(request, exc, result)
                continue
            if request_output is not None:
                result.request_outputs.append(request_output)
        return result

    def _update(self, request: _Request, output: EngineCoreOutput, reqs_to_abort: list[str]) -> bool:
        """Apply one child's new tokens; False when that child had already finished."""
        sequence = request.sequences[output.request_id]
        if sequence.finish_reason is not None:
            return False
        if output.finish_reason == FINISH_ERROR:
            detail = (output.error or "unknown error").splitlines()[0]
            raise RequestFailedError(f"the engine failed this request: {detail[:MAX_ERROR_MESSAGE_CHARS]}")
        request.num_cached_tokens = output.num_cached_tokens
        stop_string = sequence.detokenizer.update(
            output.new_token_ids, stop_terminated=output.finish_reason == FINISH_STOP
        )
        if output.new_logprobs is not None and sequence.num_logprobs is not None:
            self._append_logprobs(sequence, output.new_token_ids, output.new_logprobs)
        if output.prompt_logprobs is not None:
            chunk = output.prompt_logprobs
            scored = request.prompt_token_ids[
                chunk.first_position : chunk.first_position + len(chunk.entries)
            ]
            request.prompt_logprobs = [None] + [
                self._logprob_entry(token_id, entry, len(entry.top_token_ids))
                for token_id, entry in zip(scored, chunk.entries, strict=True)
            ]
        if stop_string is not None:
            sequence.finish_reason, sequence.stop_reason = FINISH_STOP, stop_string
            if output.finish_reason is None:
                reqs_to_abort.append(output.request_id)
        elif output.finish_reason is not None:
            sequence.detokenizer.flush()
            sequence.finish_reason, sequence.stop_reason = output.finish_reason, output.stop_reason
        return True

    def _output_of(self, request: _Request) -> RequestOutput | None:
        finished = request.finished
        if request.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        output = self._make_output(request, finished)
        if finished:
            self._forget(request)
        return output

    def _fail(self, request: _Request, exc: Exception, result: ProcessedOutputs) -> None:
        if isinstance(exc, RequestFailedError):
            error = exc
            logger.error("request %s failed: %s", request.request_id, exc)
        else:
            logger.exception("processing the output of request %s failed", request.request_id)
            error = RequestFailedError(
                f"internal error while processing this request's output ({type(exc).__name__})"
            )
        self._forget(request)
        result.failed[request.request_id] = error
        result.reqs_to_abort.extend(
            child_id for child_id, seq in request.sequences.items() if seq.finish_reason is None
        )

    def _forget(self, request: _Request) -> None:
        self.requests.pop(request.request_id, None)
        for child_id in request.sequences:
            self.child_to_parent.pop(child_id, None)

    def _append_logprobs(
        self, sequence: _Sequence, token_ids: list[int], logprobs: list[TokenLogprobs]
    ) -> None:
        count = sequence.num_logprobs or 0
        for token_id, token_logprobs in zip(token_ids, logprobs, strict=False):
            sequence.logprobs.append(self._logprob_entry(token_id, token_logprobs, count))
            sequence.cumulative_logprob += token_logprobs.logprob

    def _logprob_entry(self, token_id: int, token_logprobs: TokenLogprobs, count: int) -> dict[int, Logprob]:
        """The `count` most likely tokens and `token_id` itself, with its rank in the vocabulary."""
        entry: dict[int, Logprob] = {}
        top_ids = token_logprobs.top_token_ids[:count]
        for rank, (top_id, top_lp) in enumerate(
            zip(top_ids, token_logprobs.top_logprobs[:count], strict=True)
        ):
            entry[top_id] = Logprob(top_lp, rank + 1, decode(self.tokenizer, [top_id]))
        if token_id not in entry:
            entry[token_id] = Logprob(
                token_logprobs.logprob, token_logprobs.rank or None, decode(self.tokenizer, [token_id])
            )
        return entry

    def _make_output(self, request: _Request, finished: bool) -> RequestOutput:
        delta = request.kind == RequestOutputKind.DELTA
        completions = []
        for sequence in request.sequences.values():
            detok = sequence.detokenizer
            seq_finished = sequence.finish_reason is not None
            if delta:
                text = detok.text_to_send(sequence.sent_text_len, seq_finished)
                token_ids = detok.token_ids[sequence.sent_num_tokens :]
                logprobs = (
                    sequence.logprobs[sequence.sent_num_tokens :]
                    if sequence.num_logprobs is not None
                    else None
                )
                if not text and not token_ids and (not seq_finished or sequence.finish_sent):
                    continue
                sequence.sent_text_len += len(text)
                sequence.sent_num_tokens = len(detok.token_ids)
                sequence.finish_sent = seq_finished
            else:
                text = detok.output_text
                token_ids = list(detok.token_ids)
                logprobs = list(sequence.logprobs) if sequence.num_logprobs is not None else None
            completions.append(
                CompletionOutput(
                    index=sequence.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=sequence.cumulative_logprob
                    if sequence.num_logprobs is not None
                    else None,
                    logprobs=logprobs,
                    finish_reason=sequence.finish_reason,
                    stop_reason=sequence.stop_reason,
                )
            )
        prompt_logprobs = request.prompt_logprobs
        if delta and request.prompt_logprobs_sent:
            prompt_logprobs = None
        request.prompt_logprobs_sent = request.prompt_logprobs_sent or prompt_logprobs is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )
