"""Hypothesis fuzz of hostile completions and chat bodies against the live server.

Each body is a valid request (values drawn within the model's real limits: its vocabulary,
its context length) with up to two fields replaced by hostile values: token ids, stop ids,
logit_bias keys, n and prompt lists at and past those limits (negative, huge, 2**31-1,
2**63, floats, strings), nested lists and objects, or any JSON at all. No body may get a
5xx (nor a server_error event in a stream); the server stays healthy and afterwards answers
a normal request. (test_fuzz.py fuzzes the OpenAPI schema.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving.checks import assert_still_serving
from tests.serving.server import MODEL_NAME, ServerProcess

EXAMPLES_PER_ENDPOINT = 100
EDGE_INTS = [-(2**63), -(2**31), -1, 0, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64]

# Anything JSON can hold, a few levels deep.
anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def limits_of(server: ServerProcess, model_dir: Path) -> tuple[int, int]:
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    models = httpx.get(f"{server.base_url}/v1/models", headers=server.headers).json()
    return vocab_size, int(models["data"][0]["max_model_len"])


class Fields:
    """Valid and hostile values of every field, from the model's vocabulary and context length."""

    def __init__(self, vocab_size: int, max_model_len: int) -> None:
        self.valid_id = st.integers(0, vocab_size - 1)
        past_vocab = st.sampled_from([vocab_size, vocab_size + 1, 2**31 - 1, *EDGE_INTS])
        self.hostile_id = st.one_of(past_vocab, st.floats(), st.text(max_size=3), anything)
        self.valid_ids = st.lists(self.valid_id, min_size=1, max_size=20)
        # Real ids with one past the vocabulary among them, or with one that is not an id at all.
        self.hostile_ids = st.one_of(
            st.tuples(st.lists(self.valid_id, max_size=3), past_vocab).map(lambda t: [*t[0], t[1]]),
            st.tuples(st.lists(self.valid_id, max_size=3), self.hostile_id).map(lambda t: [*t[0], t[1]]),
        )
        self.too_long_ids = st.lists(self.valid_id, min_size=max_model_len, max_size=max_model_len + 2)
        self.vocab_size, self.max_model_len = vocab_size, max_model_len

    def valid_sampling(self) -> dict[str, st.SearchStrategy[Any]]:
        return {
            "max_tokens": st.integers(1, 6),
            "min_tokens": st.just(1),  # stop ids are checked at every step below min_tokens
            "n": st.integers(1, 3),
            "stop_token_ids": st.lists(self.valid_id, max_size=4),
            "stop": st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=3),
            "seed": st.integers(-(2**63) + 1, 2**63 - 1),
            "temperature": st.floats(0, 2),
            "top_k": st.integers(-1, self.vocab_size + 10),
            "top_p": st.floats(0.01, 1),
            "ignore_eos": st.booleans(),
            "stream": st.booleans(),
            "stream_options": st.just({"include_usage": True}),
            "user": st.text(max_size=20),
        }

    def hostile_sampling(self) -> dict[str, st.SearchStrategy[Any]]:
        hostile_int = st.sampled_from(EDGE_INTS) | st.floats() | st.text(max_size=3) | anything
        return {
            "stop_token_ids": self.hostile_ids | anything,
            "logit_bias": st.dictionaries(self.hostile_id.map(str), st.floats(), min_size=1, max_size=3)
            | anything,
            "n": st.sampled_from([0, 129, 2**31 - 1, 2**63]) | hostile_int,
            "max_tokens": st.sampled_from([self.max_model_len, 2**31 - 1]) | hostile_int,
            "min_tokens": st.sampled_from([self.max_model_len, 2**31 - 1]) | hostile_int,
            "seed": hostile_int,
            "top_k": hostile_int,
            "temperature": st.floats() | anything,
            "stop": st.lists(st.text(max_size=3), min_size=65, max_size=70) | anything,
            "stream_options": anything,
        }


# Fields that carry token ids (or prompts) are mutated most often: that is where the bugs were.
TOKEN_FIELDS = ("prompt", "stop_token_ids", "logit_bias", "messages")


@st.composite
def mutated(
    draw: st.DrawFn, required: dict[str, Any], valid: dict[str, Any], hostile: dict[str, Any]
) -> dict[str, Any]:
    """A valid body with one field (rarely two) made hostile."""
    body = {"model": MODEL_NAME, **draw(st.fixed_dictionaries(required, optional=valid))}
    weighted = sorted(hostile) + [key for key in TOKEN_FIELDS if key in hostile] * 3
    keys = {draw(st.sampled_from(weighted))}
    if draw(st.integers(0, 4)) == 0:
        keys.add(draw(st.sampled_from(weighted)))
    for key in sorted(keys):
        body[key] = draw(hostile[key])
    return body


def completion_bodies(fields: Fields) -> st.SearchStrategy[dict[str, Any]]:
    text = st.text(min_size=1, max_size=30)
    prompt = (
        text
        | st.lists(text, min_size=1, max_size=3)
        | fields.valid_ids
        | st.lists(fields.valid_ids, min_size=1, max_size=3)
    )
    valid = fields.valid_sampling() | {"logprobs": st.integers(0, 3), "echo": st.booleans()}
    hostile_prompt = st.one_of(
        st.just([]),
        st.just([[]]),
        fields.hostile_ids,
        st.lists(fields.hostile_ids, min_size=1, max_size=2),
        fields.too_long_ids,
        st.lists(st.just("hi"), min_size=129, max_size=300),
        anything,
    )
    hostile_logprobs = st.sampled_from([21, fields.vocab_size + 1, *EDGE_INTS]) | anything
    hostile = fields.hostile_sampling() | {"prompt": hostile_prompt, "logprobs": hostile_logprobs}
    return mutated(
        {"prompt": prompt}, valid, hostile | {"echo": anything, "best_of": anything, "suffix": anything}
    )


def chat_bodies(fields: Fields) -> st.SearchStrategy[dict[str, Any]]:
    part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})
    role = st.sampled_from(["system", "user", "assistant"])
    content = st.text(max_size=30) | st.lists(part, min_size=1, max_size=3)
    message = st.fixed_dictionaries(
        {"role": role, "content": content}, optional={"name": st.text(max_size=8)}
    )
    messages = st.lists(message, min_size=1, max_size=4)
    hostile_message = st.fixed_dictionaries(
        {"role": role | anything, "content": content | anything}, optional={"name": anything}
    )
    valid = fields.valid_sampling() | {"logprobs": st.booleans()}
    hostile = fields.hostile_sampling() | {
        "messages": st.lists(hostile_message, max_size=3) | anything,
        "top_logprobs": st.sampled_from([21, *EDGE_INTS]) | anything,
        "max_completion_tokens": st.sampled_from(EDGE_INTS) | anything,
        "tools": anything,
    }
    return mutated({"messages": messages}, valid, hostile)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_bodies_never_cause_a_server_error(
    server: ServerProcess, tiny_llama_dir: Path, path: str
) -> None:
    fields = Fields(*limits_of(server, tiny_llama_dir))
    bodies = completion_bodies(fields) if path == "/v1/completions" else chat_bodies(fields)
    http = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60)

    @given(body=bodies)
    @settings(max_examples=EXAMPLES_PER_ENDPOINT, deadline=None, suppress_health_check=list(HealthCheck))
    def no_server_error(body: dict[str, Any]) -> None:
        response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        text = response.text  # streams too: an error event inside a 200 counts
        assert response.status_code < 500, f"{body!r} -> {response.status_code}: {text[:500]}"
        assert '"type":"server_error"' not in text.replace(" ", ""), f"{body!r} -> {text[:500]}"
        if response.status_code >= 400:
            assert "error" in response.json()
        assert http.get("/health").status_code == 200, f"unhealthy after {body!r}"

    with http:
        no_server_error()
    assert_still_serving(server)
