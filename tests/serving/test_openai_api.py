"""The OpenAI-compatible API through the official `openai` client against a live `tessera serve`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.serving.server import MODEL_NAME, ServerProcess, metric_value


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


def test_models_lists_the_served_name_and_retrieves_it(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_and_its_stream_agree(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    stream = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


def test_a_stream_sends_chunks_as_tokens_come_while_a_stop_string_holds_all_text_back(
    client: openai.OpenAI,
) -> None:
    """vLLM's cadence, which inter-token latency is measured by: a chunk per step that generated
    tokens, with empty text while a possible stop string holds it back."""
    kwargs = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.0}
    kwargs |= {"stop": ["~" * 200], "extra_body": {"ignore_eos": True}}
    for stream in (
        client.completions.create(**kwargs, stream=True),
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=12,
            temperature=0.0,
            stop=["~" * 200],
            extra_body={"ignore_eos": True},
            stream=True,
        ),
    ):
        pieces = [c.choices[0] for c in stream if c.choices]
        texts = [p.text if hasattr(p, "text") else p.delta.content for p in pieces]
        assert len(pieces) > 2 and not any(texts[:-1]) and texts[-1]  # the text comes at the end


def test_streamed_text_offsets_match_the_whole_answer_while_a_stop_string_holds_text_back(
    client: openai.OpenAI,
) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.0}
    kwargs |= {"logprobs": 1, "stop": ["zz never"], "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(client.completions.create(**kwargs, stream=True))
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert whole is not None and whole.text_offset is not None and len(whole.text_offset) == 12
    assert [offset for lp in logprobs for offset in lp.text_offset or []] == whole.text_offset


def test_stream_ends_with_done(server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_chat_completion_and_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=10,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 10
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=10,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    # As OpenAI's: later deltas carry no role key at all (not "role": null).
    assert all("role" not in c.choices[0].delta.model_fields_set for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    # A stop string ends the stream's choice as it ends the whole response: with its stop_reason.
    stop = full.choices[0].message.content[2:5]
    stopped = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0.0, stream=True, stop=[stop]
    )
    last = [c for c in stopped if c.choices][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop


def test_n_seed_logprobs_and_stop(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL_NAME,
        "prompt": "The quick brown fox",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
    }
    first = client.completions.create(**kwargs, n=3, logprobs=2)
    again = client.completions.create(**kwargs, n=3, logprobs=2)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    for choice in first.choices:
        assert choice.logprobs is not None
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
        assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    # A stop string taken from the greedy output cuts it there.
    greedy = client.completions.create(
        model=MODEL_NAME,
        prompt="The quick brown fox",
        max_tokens=16,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    text = greedy.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        cut = client.completions.create(
            model=MODEL_NAME, prompt="The quick brown fox", max_tokens=16, temperature=0.0, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == text[: text.index(stop)]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        temperature=0.0,
    )
    content = reply.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 for t in content)
    # Greedy: the sampled token is the most likely one.
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) for t in content)


async def test_32_concurrent_streams_complete(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120
    )

    async def one(i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"Request number {i}:",
            max_tokens=16,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, tokens = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens

    results = await asyncio.gather(*(one(i) for i in range(32)))
    assert all(tokens == 16 for _, tokens in results)
    # Each streamed text equals the same prompt's non-streamed greedy text.
    for i in (0, 17, 31):
        full = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"Request number {i}:",
            max_tokens=16,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert results[i][0] == full.choices[0].text
    await client.close()


def test_greedy_equals_offline_llm(
    server: ServerProcess, client: openai.OpenAI, tiny_llama_dir: object
) -> None:
    from tessera.entrypoints.llm import LLM
    from tessera.sampling_params import SamplingParams

    prompts = ["Once upon a time", "def add(a, b):", "Tensor parallelism splits"]
    served = [
        client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=20, temperature=0.0).choices[0].text
        for p in prompts
    ]
    llm = LLM(str(tiny_llama_dir), max_model_len=128, num_threads=1)
    offline = [
        o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    ]
    llm.engine.shutdown()
    assert served == offline


@pytest.fixture(scope="module")
def long_context_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server whose requests may run for 1,000 tokens: with the CPU kernels the tiny model
    finishes 100 tokens before a client's disconnect can even be noticed."""
    log = tmp_path_factory.mktemp("long-context-server") / "server.log"
    proc = ServerProcess(tiny_llama_dir, "--max-model-len", "1024", log=log)
    yield proc
    proc.stop()


def test_disconnect_aborts_and_frees_kv_cache(long_context_server: ServerProcess) -> None:
    server = long_context_server

    def metrics() -> str:
        return httpx.get(f"{server.base_url}/metrics").text

    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
    }
    before = metrics()
    aborted_before = metric_value(before, "tessera:request_success_total", "abort") or 0
    tokens_before = metric_value(before, "tessera:generation_tokens_total") or 0
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers
    ) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: {") for line in received)
        usage = metric_value(metrics(), "tessera:kv_cache_usage_perc")
        assert usage is not None and usage > 0
    # The client is gone: the server must abort the request and free its blocks.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = metrics()
        aborted = metric_value(text, "tessera:request_success_total", "abort") or 0
        if aborted == aborted_before + 1 and metric_value(text, "tessera:kv_cache_usage_perc") == 0.0:
            break
        time.sleep(0.1)
    assert metric_value(text, "tessera:request_success_total", "abort") == aborted_before + 1
    assert metric_value(text, "tessera:kv_cache_usage_perc") == 0.0
    assert metric_value(text, "tessera:num_requests_running") == 0.0
    # It stopped well before the 1,000 tokens it asked for.
    assert (metric_value(text, "tessera:generation_tokens_total") or 0) - tokens_before < 1000


def test_metrics_names_mirror_vllm(server: ServerProcess, client: openai.OpenAI) -> None:
    before = (
        metric_value(httpx.get(f"{server.base_url}/metrics").text, "tessera:generation_tokens_total") or 0
    )
    client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket",
    ):
        assert f"tessera:{name}" in text, name
    assert metric_value(text, "tessera:generation_tokens_total") == before + 3


def test_cache_salt_shares_cached_prompts_only_within_a_salt(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    """vLLM's cache_salt: a prompt cached under one salt is no prefix-cache hit for another salt or
    for none, and is one for the same salt again."""
    prompt = f"A prompt of this test's own, {time.time_ns()}: " + "enough words to fill two blocks " * 3
    metrics_url = f"{server.base_url}/metrics"

    def counters() -> tuple[float, float]:
        text = httpx.get(metrics_url).text
        return tuple(  # type: ignore[return-value]
            metric_value(text, f"tessera:prefix_cache_{name}_total") or 0.0 for name in ("queries", "hits")
        )

    def hit_tokens(salt: str | None, chat: bool = False) -> float:
        queries, hits = counters()
        extra = {"cache_salt": salt} if salt is not None else {}
        if chat:
            messages = [{"role": "user", "content": prompt}]
            client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=1, extra_body=extra
            )  # type: ignore[arg-type]
        else:
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, extra_body=extra)
        deadline = time.monotonic() + 10
        while counters()[0] == queries and time.monotonic() < deadline:  # stats come with the outputs
            time.sleep(0.05)
        return counters()[1] - hits

    assert hit_tokens("tenant-a") == 0
    assert hit_tokens("tenant-b") == 0
    assert hit_tokens(None) == 0
    assert hit_tokens("tenant-a") >= 32
    assert hit_tokens("tenant-c", chat=True) == 0
    assert hit_tokens("tenant-c", chat=True) >= 32
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=1, extra_body={"cache_salt": ""}
        )
    assert "cache_salt" in str(refused.value)


def test_completions_max_tokens_null_means_as_many_as_fit_as_in_vllm(client: openai.OpenAI) -> None:
    """Left out: 16 (OpenAI's default); an explicit null (the SDK's max_tokens=None): the context's rest."""
    kwargs = {"model": MODEL_NAME, "prompt": "Once upon a time", "extra_body": {"ignore_eos": True}}
    left_out = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert left_out.usage is not None and left_out.usage.completion_tokens == 16
    unbounded = client.completions.create(max_tokens=None, **kwargs)  # type: ignore[call-overload]
    usage = unbounded.usage
    assert usage is not None and usage.prompt_tokens + usage.completion_tokens == 128  # --max-model-len
    assert unbounded.choices[0].finish_reason == "length"
    plain = client.completions.create(
        max_tokens=2,
        extra_body={"add_special_tokens": False},
        **{k: v for k, v in kwargs.items() if k != "extra_body"},
    )  # type: ignore[call-overload]
    assert plain.usage is not None and plain.usage.completion_tokens == 2  # vLLM's field, accepted


def test_null_means_the_default(client: openai.OpenAI) -> None:
    """The SDK sends None as null; OpenAI and vLLM read it as the default."""
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=2, n=None, echo=None, stream=None, temperature=None
    )
    assert len(completion.choices) == 1
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, n=None, logprobs=None
    )
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None


def test_echo_of_token_ids_is_their_text(client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompt_ids = list(tokenizer("Once upon a time", add_special_tokens=False)["input_ids"])
    prompt_text = tokenizer.decode(prompt_ids)
    assert prompt_text.startswith("Once upon")
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=prompt_ids, max_tokens=2, temperature=0, echo=True
    )
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=2, temperature=0)
    assert echoed.choices[0].text == prompt_text + plain.choices[0].text
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=prompt_ids, max_tokens=2, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    completion_tokens = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 4


def test_echo_with_logprobs_scores_the_prompt_too(client: openai.OpenAI) -> None:
    """What lm-eval-harness asks for: the prompt's tokens with their logprobs (the first has none),
    then the completion's; with max_tokens 0 the prompt alone."""
    prompt = "The quick brown fox jumps over"
    plain = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2
    )
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    assert plain.usage is not None and echoed.usage is not None
    num_prompt = echoed.usage.prompt_tokens
    choice, lp = echoed.choices[0], echoed.choices[0].logprobs
    assert choice.text == prompt + plain.choices[0].text and lp is not None and plain.choices[0].logprobs
    assert lp.token_logprobs is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == num_prompt + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top or {}) >= 2 for top in lp.top_logprobs[1:])
    assert lp.token_logprobs[num_prompt:] == plain.choices[0].logprobs.token_logprobs  # the completion's own
    assert lp.text_offset is not None and lp.text_offset[num_prompt] == len(prompt)

    scored = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    assert (
        scored.choices[0].text == prompt and scored.usage is not None and scored.usage.completion_tokens == 0
    )
    assert scored.choices[0].logprobs is not None
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:num_prompt]

    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True, stream=True
        )
    )
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    assert [x for c in streamed if c.logprobs for x in (c.logprobs.token_logprobs or [])] == lp.token_logprobs


def test_logit_bias_and_allowed_token_ids_steer_tokens_offline_and_served_alike(
    client: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    """logit_bias: +100 makes a token all but certain, -100 all but banned (OpenAI's words);
    allowed_token_ids (vLLM's): only those may come."""
    from tessera import LLM, SamplingParams

    prompt, greedy = "Once upon a time", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_llama_dir), max_model_len=128, num_threads=1) as llm:
        plain = llm.generate(prompt, greedy)[0].outputs[0]
        banned = {token: -100.0 for token in plain.token_ids}
        avoided = llm.generate(prompt, replace(greedy, logit_bias=banned))[0].outputs[0]
        forced_id = next(t for t in range(3, 400) if t not in banned)
        forced = llm.generate(prompt, replace(greedy, logit_bias={forced_id: 100.0}))[0].outputs[0]
        allowed = [forced_id, forced_id + 1]
        held = llm.generate(prompt, replace(greedy, allowed_token_ids=allowed))[0].outputs[0]
    assert not set(avoided.token_ids) & set(banned) and forced.token_ids == [forced_id] * 6
    assert set(held.token_ids) <= set(allowed)

    def served(bias: dict[int, float] | None = None, only: list[int] | None = None) -> str:
        answer = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=6,
            temperature=0.0,
            logit_bias={
                str(token): value for token, value in (bias or {}).items()
            },  # JSON's keys are strings
            extra_body={"ignore_eos": True, "allowed_token_ids": only},
        )
        return answer.choices[0].text

    assert served(banned) == avoided.text and served({forced_id: 100.0}) == forced.text
    assert served(only=allowed) == held.text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    client: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    """vLLM's left truncation: a prompt past the context is served from its last k tokens, as if
    only those had been sent (echoed as their text); -1 keeps as many as a prompt may have."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    long_prompt = "Once upon a time there was a tiny model. " * 40  # far past the 128-token context
    tail = tokenizer(long_prompt).input_ids[-20:]
    kwargs = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    truncated = client.completions.create(
        prompt=long_prompt,
        echo=True,
        **{**kwargs, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 20}},
    )
    direct = client.completions.create(prompt=tail, **kwargs)
    assert truncated.usage is not None and truncated.usage.prompt_tokens == 20
    assert truncated.choices[0].text == tokenizer.decode(tail) + direct.choices[0].text
    widest = client.completions.create(
        prompt=long_prompt, **{**kwargs, "max_tokens": 1, "extra_body": {"truncate_prompt_tokens": -1}}
    )
    assert widest.usage is not None and widest.usage.prompt_tokens == 127
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": long_prompt}],
        **{**kwargs, "extra_body": {"truncate_prompt_tokens": 5}},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(prompt="hi", **{**kwargs, "extra_body": {"truncate_prompt_tokens": -2}})
    assert "truncate_prompt_tokens" in str(refused.value)
