"""The offline API, shaped like vLLM's: ``LLM(model, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from tqdm import tqdm

from tessera.config import EngineConfig
from tessera.engine.core import EngineCore
from tessera.engine.output_processor import OutputProcessor
from tessera.engine.processor import InputProcessor
from tessera.entrypoints.protocol import ChatMessage, template_messages
from tessera.outputs import RequestOutput
from tessera.sampling_params import SamplingParams

# A prompt is text, or a dict with "prompt" (text) or "prompt_token_ids", and optionally
# "cache_salt" (vLLM's TextPrompt / TokensPrompt).
Prompt: TypeAlias = str | dict[str, Any]
ChatMessages: TypeAlias = list[dict[str, Any]]


@dataclass
class _Input:
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = EngineCore(self.config)
        # Rank processes and their IPC folder go with this object (or at interpreter exit), and
        # with a constructor that fails from here on.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        try:
            self.input_processor = InputProcessor.from_model_dir(
                self.engine.model_dir, self.engine.max_model_len, self.config
            )
        except BaseException:
            self._finalizer()
            raise
        self.output_processor = OutputProcessor(self.input_processor.tokenizer)
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine (its rank processes, for a parallel layout); idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.input_processor.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (vLLM's ``LLM.reset_prefix_cache``): a benchmark that
        runs the same prompts again measures computing them, not finding them. False while
        requests still hold blocks."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams samples with (vLLM's): the model's defaults from its
        generation_config.json (``generation_config``, ``override_generation_config``) over the
        engine's."""
        return SamplingParams(**self.input_processor.sampling_defaults.set_fields())

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the prompts' order."""
        prompt_list: list[Prompt] = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_for(sampling_params, len(prompt_list))
        inputs = [
            self._input(prompt, params) for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        return self._run(self._add_requests(inputs), use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params_list = self._params_for(sampling_params, len(conversations))
        inputs = []
        for conversation, params in zip(conversations, params_list, strict=True):
            # As the server reads them: content parts joined, tool calls' arguments parsed.
            parsed = template_messages([ChatMessage.model_validate(message) for message in conversation])
            text = self.input_processor.render_chat(parsed, add_generation_prompt)
            inputs.append(_Input(text, self.input_processor.tokenize(text, add_special_tokens=False), params))
        return self._run(self._add_requests(inputs), use_tqdm)

    # -- internals ------------------------------------------------------------------------------
    def _params_for(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {count} prompts")
        return list(sampling_params)

    def _input(self, prompt: Prompt, params: SamplingParams) -> _Input:
        if isinstance(prompt, str):
            return _Input(prompt, self.input_processor.tokenize(prompt), params)
        if not isinstance(prompt, dict):
            raise TypeError(
                f"a prompt is a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}"
                " (token ids go as {'prompt_token_ids': [...]})"
            )
        salt = prompt.get("cache_salt")
        if "prompt_token_ids" in prompt:
            token_ids = self.input_processor.tokenize(list(prompt["prompt_token_ids"]))
            return _Input(prompt.get("prompt"), token_ids, params, salt)
        if "prompt" in prompt:
            return _Input(prompt["prompt"], self.input_processor.tokenize(prompt["prompt"]), params, salt)
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")

    def _add_requests(self, inputs: Sequence[_Input]) -> list[str]:
        """Check every prompt, then add them all: a bad one fails the call and leaves none behind."""
        checked = []
        for item in inputs:
            self.input_processor.check_request(item.params, item.cache_salt)
            request_id = str(next(self._request_counter))
            children = self.input_processor.process(
                request_id, item.token_ids, item.params, cache_salt=item.cache_salt
            )
            checked.append((request_id, item.text, item.token_ids, item.params, children))
        added: list[str] = []
        try:
            for request_id, prompt, token_ids, params, children in checked:
                self.output_processor.add_request(request_id, prompt, token_ids, params, children)
                added.append(request_id)
                for child in children:
                    self.engine.add_request(child)
        except BaseException:
            self._abort(added)
            raise
        return added

    def _abort(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(self.output_processor.abort_requests(request_ids))

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(finished) < len(request_ids):
                processed = self.output_processor.process_outputs(self.engine.step())
                if processed.reqs_to_abort:
                    self.engine.abort_requests(processed.reqs_to_abort)
                for error in processed.failed.values():
                    raise error
                for output in processed.request_outputs:
                    if output.request_id in wanted:
                        finished[output.request_id] = output
                        progress.update(1)
        except BaseException:
            self._abort(request_ids)  # leave the engine clean for the next call (e.g. after Ctrl-C)
            raise
        finally:
            progress.close()
        return [finished[request_id] for request_id in request_ids]
