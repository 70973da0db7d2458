"""Unit tests: msgpack round trips of the engine messages, the shared engine flags, request conversion."""

from __future__ import annotations

import argparse

import msgpack
import pytest

from tessera.engine.arg_utils import add_engine_args, engine_config_from_args, parse_size
from tessera.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from tessera.generation_config import SamplingDefaults
from tessera.sampling_params import InvalidParameterError, SamplingParams
from tessera.wire import serialization
from tessera.wire.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    TokenLogprobs,
)

NO_DEFAULTS = SamplingDefaults()


def test_messages_round_trip_through_msgpack() -> None:
    request = EngineCoreRequest(
        request_id="1_abc",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(n=1, temperature=0.5, stop=["\n"], seed=2**63 - 1, logprobs=3),
        eos_token_id=None,
        arrival_time=123.5,
    )
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [5], [TokenLogprobs(-0.1, [5, 7], [-0.1, -2.0])], "stop", "\n", 16),
            EngineCoreOutput("b", []),
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25, prefix_cache_hits=16),
        timestamp=1.5,
    )
    for message in (request, outputs, ["x", "y"], None):
        assert serialization.decode(serialization.encode(message)) == message


def test_unregistered_types_are_refused_both_ways() -> None:
    class Evil:
        pass

    with pytest.raises(TypeError):
        serialization.encode(Evil())
    forged = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Evil", []])))
    with pytest.raises(ValueError, match="unknown engine message"):
        serialization.decode(forged)


def test_decoding_revalidates_sampling_params() -> None:
    bad = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["SamplingParams", [1, -3.0]], use_bin_type=True)))
    with pytest.raises(ValueError, match="temperature"):
        serialization.decode(bad)


def test_engine_flags_mirror_vllm_and_fill_engine_config() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_args(parser, exclude=("model",))
    args = parser.parse_args(
        [
            "m",
            "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512",
            "--block-size", "32",
            "--kv-cache-memory", "64MiB",
            "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--dtype", "float32",
            "--max-model-len", "256",
            "-tp", "2",
            "--seed", "3",
        ]
    )  # fmt: skip
    config = engine_config_from_args(args, args.model)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (8, 512, 32)
    assert config.kv_cache_memory == 64 * 1024**2
    assert not config.enable_prefix_caching and not config.enable_chunked_prefill
    assert (config.dtype, config.max_model_len, config.parallel.tensor_parallel_size, config.seed) == (
        "float32",
        256,
        2,
        3,
    )
    # Unset flags keep EngineConfig's defaults.
    defaults = engine_config_from_args(parser.parse_args(["m"]), "m")
    assert defaults.enable_prefix_caching and defaults.max_num_seqs == 128


def test_parse_size() -> None:
    assert parse_size("1024") == 1024
    assert parse_size("1.5GiB") == 3 * 1024**3 // 2
    assert parse_size("2GB") == 2 * 10**9
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_openai_requests_become_sampling_params() -> None:
    completion = CompletionRequest(prompt=[1, 2, 3], max_tokens=7, stop="x", seed=4, logprobs=2, top_k=-1)
    params = completion.to_sampling_params(NO_DEFAULTS)
    assert (params.max_tokens, params.stop, params.seed, params.logprobs, params.top_k) == (7, ["x"], 4, 2, 0)
    assert params.temperature == 1.0
    assert completion.prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    chat = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}
        ],
        max_tokens=5,
        max_completion_tokens=9,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
    )
    params = chat.to_sampling_params(100, NO_DEFAULTS)
    assert (params.max_tokens, params.logprobs, params.greedy) == (9, 3, True)
    assert chat.chat_messages() == [{"role": "user", "content": "hi\nthere"}]
    named = ChatCompletionRequest(messages=[{"role": "user", "name": "bob", "content": "hi"}])
    assert named.chat_messages() == [{"role": "user", "content": "hi", "name": "bob"}]  # the template's
    assert (
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
        .to_sampling_params(50, NO_DEFAULTS)
        .max_tokens
        == 50
    )


def test_a_models_sampling_defaults_fill_what_a_request_leaves_unset() -> None:
    """vLLM's ``--generation-config auto``: the model's defaults under the request's own values,
    and its max_new_tokens caps max_tokens whoever set it."""
    model = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_tokens=8)
    unset = CompletionRequest(prompt="x").to_sampling_params(model)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty) == (
        0.6,
        0.9,
        20,
        0.0,
        1.1,
    )
    assert unset.max_tokens == 8  # the completions default of 16, capped
    chosen = CompletionRequest(prompt="x", temperature=0, top_p=1.0, top_k=-1, max_tokens=4)
    params = chosen.to_sampling_params(model)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 1.0, 0, 4)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=100)
    assert chat.to_sampling_params(500, model).max_tokens == 8
    assert chat.to_sampling_params(500, NO_DEFAULTS).max_tokens == 100


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_an_empty_api_key_refuses_to_start_rather_than_serve_an_open_api(
    how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tessera.entrypoints.api_server import main

    argv = ["no-model-needed", "--port", "0"]
    if how == "flag":
        argv += ["--api-key", ""]
    else:
        monkeypatch.setenv("TESSERA_API_KEY", "  ")
    with pytest.raises(SystemExit) as exited:
        main(argv)  # before any model is loaded
    assert exited.value.code == 2 and "set but empty" in caplog.text


def test_the_api_key_is_stripped_and_an_unset_one_leaves_the_api_open() -> None:
    from tessera.entrypoints.api_server import api_key_of

    assert api_key_of(None, {"TESSERA_API_KEY": "secret\n"}) == "secret"  # a Secret made from a file
    assert api_key_of(" flag ", {"TESSERA_API_KEY": "env"}) == "flag"
    assert api_key_of(None, {}) is None


def test_max_n_cannot_be_raised_past_the_schemas_ceiling() -> None:
    from tessera.entrypoints.serve_args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--max-n", "500"])
    assert parser.parse_args(["m", "--max-n", "4"]).max_n == 4


def test_tool_call_history_reaches_the_template_with_its_arguments_as_an_object() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "6*7"}'}}
    chat = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "What is 6*7?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ]
    )
    _, assistant, tool = chat.chat_messages()
    assert assistant["tool_calls"] == [{**call, "function": {"name": "calc", "arguments": {"expr": "6*7"}}}]
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    broken = {**call, "function": {"name": "calc", "arguments": "{not json"}}
    with pytest.raises(InvalidParameterError) as refused:
        ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [broken]}]).chat_messages()
    assert refused.value.param == "messages[0].tool_calls[0]"
