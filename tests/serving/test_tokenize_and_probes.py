"""vLLM's side doors of the OpenAI server: /tokenize, /detokenize, /version, /ping; and a body
that is not JSON refused by its media type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.serving.checks import assert_openai_error
from tests.serving.server import MODEL_NAME, ServerProcess

LONG_PROMPT = "Once upon a time " * 200  # far past the shared server's 128-token context


def post(server: ServerProcess, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=server.headers, timeout=30)


def test_tokenize_counts_any_prompt_as_the_model_does_and_detokenize_reverses_it(
    server: ServerProcess, tiny_llama_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    answer = post(
        server, "/tokenize", {"model": MODEL_NAME, "prompt": LONG_PROMPT, "return_token_strs": True}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = tokenizer(LONG_PROMPT).input_ids
    assert body["tokens"] == expected and body["count"] == len(expected) > body["max_model_len"] == 128
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    back = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": expected[1:]})  # without BOS
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(expected[1:])}
    plain = post(server, "/tokenize", {"prompt": "hi", "add_special_tokens": False}).json()
    assert (
        plain["tokens"] == tokenizer("hi", add_special_tokens=False).input_ids and plain["token_strs"] is None
    )


def test_tokenize_renders_a_conversation_through_the_chat_template(
    server: ServerProcess, tiny_llama_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    body = post(server, "/tokenize", {"messages": messages}).json()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    # OpenAI's deprecated function-result role renders as the template says (vLLM takes it too).
    replayed = [*messages, {"role": "function", "name": "f", "content": "42"}]
    body = post(server, "/tokenize", {"messages": replayed, "add_generation_prompt": False}).json()
    text = tokenizer.apply_chat_template(replayed, tokenize=False, add_generation_prompt=False)
    assert body["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    # A null `messages` is no messages: the prompt form.
    assert post(server, "/tokenize", {"prompt": "hi", "messages": None}).json()["count"] > 0


@pytest.mark.parametrize(
    ("extra", "value"),
    [
        ("continue_final_message", True),
        ("chat_template", "{{ messages }}"),
        ("chat_template_kwargs", {"enable_thinking": True}),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ],
)
def test_tokenize_refuses_template_extras_it_would_not_apply(
    server: ServerProcess, extra: str, value: Any
) -> None:
    """As /v1/chat/completions does: a count of another prompt than the one asked about is wrong."""
    body = {"messages": [{"role": "user", "content": "hi"}], extra: value}
    error = assert_openai_error(post(server, "/tokenize", body), 400)
    assert error["param"] == extra


def test_tokenize_refuses_bad_input_by_name_and_needs_the_key(server: ServerProcess) -> None:
    error = assert_openai_error(post(server, "/detokenize", {"tokens": [1, 10**6]}), 400)
    assert error["param"] == "tokens"
    assert_openai_error(post(server, "/tokenize", {"model": "no-such-model", "prompt": "hi"}), 404)
    assert_openai_error(post(server, "/tokenize", {}), 400)
    # A conversation's mistake is named as the chat form's, not as the prompt form's missing prompt.
    for messages, param in (([{"role": "bogus", "content": "hi"}], "messages[0]"), ([], "messages")):
        error = assert_openai_error(post(server, "/tokenize", {"messages": messages}), 400)
        assert error["param"].startswith(param) and "prompt" not in error["message"], error
    for path in ("/tokenize", "/detokenize"):
        assert_openai_error(httpx.post(f"{server.base_url}{path}", json={"prompt": "hi", "tokens": [1]}), 401)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_json_is_415_naming_the_media_type(
    server: ServerProcess, content_type: str | None
) -> None:
    headers = dict(server.headers)
    if content_type is not None:
        headers["content-type"] = content_type
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'
    response = httpx.post(f"{server.base_url}/v1/completions", content=body, headers=headers)
    error = assert_openai_error(response, 415)
    assert "application/json" in error["message"]
    charset = {**server.headers, "content-type": "application/json; charset=utf-8"}
    assert httpx.post(f"{server.base_url}/v1/completions", content=body, headers=charset).status_code == 200


def test_version_and_ping_answer_without_a_key(server: ServerProcess) -> None:
    from tessera import __version__

    assert httpx.get(f"{server.base_url}/version").json() == {"version": __version__}
    assert httpx.get(f"{server.base_url}/ping").status_code == 200
    assert httpx.post(f"{server.base_url}/ping").status_code == 200
