"""Bad input is always a 4xx in OpenAI's error format, never a 500 (live server)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.serving.checks import assert_openai_error
from tests.serving.server import MODEL_NAME, ServerProcess

USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
        ("/v1/completions", {"prompt": 42}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [999999]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 5},
            None,
        ),
        # More than the context leaves (--max-model-len 128): refused, never silently cut short.
        ("/v1/completions", {"prompt": "hi", "max_tokens": 200}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 500}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        # What the server cannot do is refused, never ignored.
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"prompt": "hi", "return_token_ids": True}, "return_token_ids"),
        (
            "/v1/completions",
            {"prompt": "hi", "spaces_between_special_tokens": False},
            "spaces_between_special_tokens",
        ),
        ("/v1/completions", {"prompt": "hi", "truncation_side": "right"}, "truncation_side"),
        ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
        # vLLM's structured-output and token-constraint extras: refused, not ignored.
        ("/v1/chat/completions", {"messages": USER, "guided_json": {"type": "object"}}, "guided_json"),
        ("/v1/completions", {"prompt": "hi", "guided_choice": ["yes", "no"]}, "guided_choice"),
        ("/v1/completions", {"prompt": "hi", "guided_regex": "[0-9]+"}, "guided_regex"),
        (
            "/v1/chat/completions",
            {"messages": USER, "structured_outputs": {"json": {}}},
            "structured_outputs",
        ),
        ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {"prompt": "hi", "bad_words": ["no"]}, "bad_words"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1}, "prompt_logprobs"),
        # vLLM's other extras: beam search, priorities, chat template control.
        ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"prompt": "hi", "length_penalty": 0.5}, "length_penalty"),
        ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, "prompt"),  # nothing left
        ("/v1/chat/completions", {"messages": USER, "priority": 1}, "priority"),
        ("/v1/chat/completions", {"messages": USER, "echo": True}, "echo"),
        (
            "/v1/chat/completions",
            {"messages": USER, "continue_final_message": True},
            "continue_final_message",
        ),
        ("/v1/chat/completions", {"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
    ],
)
def test_invalid_parameters_are_400(
    server: ServerProcess, path: str, body: dict[str, Any], param: str | None
) -> None:
    response = httpx.post(
        f"{server.base_url}{path}", json={"model": MODEL_NAME, **body}, headers=server.headers
    )
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)


def test_over_long_prompt_is_400(server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once upon a time " * 200}  # far over --max-model-len 128
    error = assert_openai_error(
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers), 400
    )
    assert "context length" in error["message"] and error["code"] == "context_length_exceeded"
    body = {"model": MODEL_NAME, "messages": USER, "max_completion_tokens": 500}
    error = assert_openai_error(
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers), 400
    )
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_completion_tokens"


def test_extras_that_ask_for_nothing_pass_and_text_parts_join_by_line(server: ServerProcess) -> None:
    def prompt_tokens(content: Any, **extras: Any) -> int:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        response = httpx.post(
            f"{server.base_url}/v1/chat/completions", json={**body, **extras}, headers=server.headers
        )
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens"])

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    harmless = {"echo": False, "use_beam_search": False, "length_penalty": 1.0, "priority": 0}
    harmless |= {"chat_template_kwargs": {}, "documents": []}  # empty: asks for nothing, as null
    assert prompt_tokens(parts, **harmless) == prompt_tokens("Hello\nthere") != prompt_tokens("Hellothere")
    # An assistant's refusal (an SDK replays it) and the Responses API's parts are text too.
    refusal = [{"type": "refusal", "refusal": "Hello"}, {"type": "output_text", "text": "there"}]
    assert prompt_tokens(refusal) == prompt_tokens("Hello\nthere")


def test_malformed_json_is_400(server: ServerProcess) -> None:
    headers = {**server.headers, "content-type": "application/json"}
    response = httpx.post(
        f"{server.base_url}/v1/completions", content=b'{"model": "tiny", "prompt": ', headers=headers
    )
    assert_openai_error(response, 400)


def test_unknown_model_is_404(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert info.value.status_code == 404
    assert "no-such-model" in info.value.message


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_missing_or_wrong_api_key_is_401(server: ServerProcess, key: str | None) -> None:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL_NAME, "prompt": "hi"}
    error = assert_openai_error(
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers), 401
    )
    assert server.api_key not in error["message"]
    # The openai client refuses to send no key at all: it gets a wrong one.
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key or "not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_the_key_is_checked_before_the_body_and_its_scheme_in_any_case(server: ServerProcess) -> None:
    url = f"{server.base_url}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    assert (
        httpx.post(url, json=body, headers={"Authorization": f"bearer {server.api_key}"}).status_code == 200
    )
    # Over the 8 MiB body limit, without a key: 401, decided before the body is read.
    oversized = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
    assert_openai_error(httpx.post(url, content=oversized, headers={"content-type": "application/json"}), 401)


def test_health_and_metrics_need_no_key(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.head(f"{server.base_url}/health").status_code == 200  # load balancers probe with HEAD
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def test_unknown_route_is_openai_404(server: ServerProcess) -> None:
    assert_openai_error(httpx.get(f"{server.base_url}/v1/nothing-here", headers=server.headers), 404)


def test_answers_name_the_alias_the_client_asked_for() -> None:
    from tessera.entrypoints.serving_common import ServingContext
    from tessera.sampling_params import RequestRefused as APIError

    ctx = ServingContext(engine=None, served_model_names=["alpha", "beta"])  # type: ignore[arg-type]
    assert (ctx.check_model("beta"), ctx.check_model("alpha"), ctx.check_model(None)) == (
        "beta",
        "alpha",
        "alpha",
    )
    with pytest.raises(APIError) as unknown:
        ctx.check_model("gamma")
    assert unknown.value.status == 404 and unknown.value.param == "model"


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("body", "prompt", "str"), "prompt"),
        (("body", "prompt", "list[constrained-int]", 1), "prompt[1]"),
        (
            ("body", "messages", 0, "content", "list[ContentPart]", 0, "ContentPart", "type"),
            "messages[0].content[0].type",
        ),
        (("body",), None),
    ],
)
def test_an_invalid_field_is_named_as_the_request_spells_it(loc: tuple[Any, ...], param: str | None) -> None:
    from tessera.entrypoints.api_server import param_of

    assert param_of(loc) == param


def test_only_an_allowed_web_origin_gets_cors_answers_and_the_key_is_still_needed(
    server: ServerProcess,
) -> None:
    from tests.serving.conftest import ALLOWED_ORIGIN

    url = f"{server.base_url}/v1/chat/completions"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(url, headers={"Origin": ALLOWED_ORIGIN, **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    refused = httpx.options(url, headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in refused.headers
    keyless = httpx.post(url, json={"messages": USER}, headers={"Origin": ALLOWED_ORIGIN})
    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
