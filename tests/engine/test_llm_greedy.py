"""Greedy tokens of the engine equal transformers' greedy generate, under every scheduling stress."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from tessera import LLM, SamplingParams
from tessera.generation_config import eos_token_ids
from tessera.wire.messages import SchedulerStats
from tests.engine.reference import hf_greedy

SHARED_PREFIX = (
    "You are a careful assistant. Answer briefly and precisely, and say so when you do not know. "
    "The following question comes from a user of the Tessera project: "
)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "Write a haiku about autumn leaves.",
    "What does a compiler do?",
    "Explain photosynthesis in one sentence.",
    "Which planet is the largest in our solar system?",
]
OTHER_PROMPTS = [
    "Once upon a time",
    "The quick brown fox",
    "In 1969, astronauts",
    "def fibonacci(n):",
    "The three laws of thermodynamics state that energy can neither be created nor destroyed, that",
    "List of fruits: apple, banana,",
    "Kubernetes is",
    "A short poem about the sea:\n",
]


def prompts_of_varied_lengths() -> list[str]:
    return [SHARED_PREFIX + q for q in QUESTIONS] + OTHER_PROMPTS


class StatsRecorder:
    """Sums the engine's per-step statistics while the LLM runs."""

    def __init__(self, llm: LLM) -> None:
        self.preemptions = 0
        self.prefix_hits = 0
        self.max_running = 0
        original = llm.engine.step

        def step():
            outputs = original()
            stats: SchedulerStats = outputs.scheduler_stats
            self.preemptions += stats.num_preemptions
            self.prefix_hits += stats.prefix_cache_hits
            self.max_running = max(self.max_running, stats.num_running_reqs)
            return outputs

        llm.engine.step = step  # type: ignore[method-assign]


def check_greedy_matches_reference(model_dir: Path, max_new_tokens: int, num_kv_blocks: int) -> None:
    prompts = prompts_of_varied_lengths()
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_num_batched_tokens=64,  # forces chunked prefill of the longer prompts
        num_kv_blocks=num_kv_blocks,  # small enough to force preemption
        block_size=16,
        max_model_len=256,
        enable_prefix_caching=True,
    )
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer(p).input_ids for p in prompts]
    eos = eos_token_ids(model_dir) or tokenizer.eos_token_id
    expected = hf_greedy(model_dir, prompt_ids, max_new_tokens, eos)

    recorder = StatsRecorder(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert recorder.preemptions > 0, "the KV budget was meant to force preemption"
    assert recorder.prefix_hits > 0, "the shared prefix was meant to hit the prefix cache"
    assert recorder.max_running > 1, "requests were meant to run concurrently"
    assert llm.engine.scheduler.kv.usage == 0.0

    # The same prompts again: whole prompts now hit the cache, and the tokens stay the same.
    recorder.prefix_hits = 0
    again = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert recorder.prefix_hits > 0
    assert llm.engine.scheduler.kv.usage == 0.0
    # Text is the tokenizer's decode of the tokens.
    for output in again:
        completion = output.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_tiny_llama_greedy_equals_transformers(tiny_llama_dir: Path):
    check_greedy_matches_reference(tiny_llama_dir, max_new_tokens=20, num_kv_blocks=30)


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers(smollm2_dir: Path):
    check_greedy_matches_reference(smollm2_dir, max_new_tokens=24, num_kv_blocks=16)


@pytest.mark.slow
def test_smollm2_answers_through_chat_template(smollm2_dir: Path):
    """LLM.chat is transformers' apply_chat_template then greedy generate, token for token."""
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=512, num_kv_blocks=64)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text
    templated = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert out[0].prompt_token_ids == templated["input_ids"]
    expected = hf_greedy(smollm2_dir, [out[0].prompt_token_ids], 24, eos_token_ids(smollm2_dir))
    assert out[0].outputs[0].token_ids == expected[0]


def test_llm_chat_reads_messages_as_the_server_does_and_generate_names_a_bad_prompt(tiny_llama_dir: Path):
    """Content parts are joined as the chat endpoint joins them (vLLM's LLM.chat does too), not
    handed to the template as a list; a prompt that is neither text nor a dict says what it must be."""
    with LLM(str(tiny_llama_dir), max_model_len=128, num_threads=1) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=3)
        parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
        as_parts = llm.chat([{"role": "user", "content": parts}], greedy)[0]
        as_text = llm.chat([{"role": "user", "content": "hi\nthere"}], greedy)[0]
        assert as_parts.prompt_token_ids == as_text.prompt_token_ids
        assert as_parts.outputs[0].token_ids == as_text.outputs[0].token_ids
        with pytest.raises(ValueError, match="image_url"):
            llm.chat(
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy
            )
        for bad in ([1, 2, 3], [[1, 2, 3]]):
            with pytest.raises(TypeError, match="prompt_token_ids"):
                llm.generate(bad, greedy)


def test_abort_mid_flight_frees_every_block(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, max_model_len=128)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    llm._add_requests([llm._input(f"request number {i} " * (i + 1), params) for i in range(6)])
    for _ in range(3):
        llm.engine.step()
    assert llm.engine.scheduler.kv.usage > 0
    llm.engine.abort_requests(llm.output_processor.abort_requests([str(i) for i in range(6)]))
    assert llm.engine.scheduler.kv.usage == 0.0
    assert not llm.engine.has_unfinished_requests()


def test_reset_prefix_cache_makes_the_same_prompts_compute_again(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, max_model_len=128)
    recorder = StatsRecorder(llm)
    prompts = [SHARED_PREFIX + q for q in QUESTIONS[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    recorder.prefix_hits = 0
    llm.generate(prompts, params)
    assert recorder.prefix_hits > 0  # whole prompts are cached

    assert llm.reset_prefix_cache()
    recorder.prefix_hits = 0
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]
    assert recorder.prefix_hits == 0, "a reset cache must hold no block of an earlier prompt"
    assert again == first[:1]


def test_a_cache_salt_keeps_prompts_from_other_salts_out_of_the_prefix_cache(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, max_model_len=128)
    recorder = StatsRecorder(llm)
    prompt = SHARED_PREFIX + QUESTIONS[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(salt: str | None) -> tuple[list[int], int]:
        recorder.prefix_hits = 0
        item = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        return list(llm.generate(item, params)[0].outputs[0].token_ids), recorder.prefix_hits

    first, _ = run("tenant-a")
    assert run("tenant-b") == (first, 0)
    assert run(None) == (first, 0)
    same_salt, hits = run("tenant-a")
    assert same_salt == first and hits > 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": prompt, "cache_salt": ""}, params)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_seed_and_top_k(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=8, max_model_len=128)
    prompt = "The weather today is"
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    rng = random.Random(0)
    others = [f"Filler prompt {rng.random()}" for _ in range(7)]
    batch_params = [
        SamplingParams(temperature=1.0, max_tokens=rng.randint(4, 20), ignore_eos=True) for _ in others
    ]
    batch = llm.generate([*others[:3], prompt, *others[3:]], [*batch_params[:3], seeded, *batch_params[3:]])
    assert batch[3].outputs[0].token_ids == alone

    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    top1 = llm.generate([prompt], SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids

    n3 = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    assert sorted(c.index for c in n3[0].outputs) == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in n3[0].outputs}) > 1  # distinct derived seeds


def test_a_seeded_request_samples_the_same_tokens_when_preempted(tiny_llama_dir: Path):
    """Preemption drops a request's state in the runner, but not its generator: resuming from the
    seed again would replay draws already used."""
    prompt = "The history of the Roman empire"
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=60, ignore_eos=True)
    roomy = LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=8, max_model_len=128)
    alone = roomy.generate([prompt], seeded)[0].outputs[0].token_ids
    tight = LLM(
        str(tiny_llama_dir), num_kv_blocks=24, block_size=8, max_model_len=128, enable_prefix_caching=False
    )
    recorder = StatsRecorder(tight)
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    others = ["Once upon a time", "def add(a, b):", "Paris is"]
    batch = tight.generate([*others, prompt], [greedy] * 3 + [seeded])
    assert recorder.preemptions > 0, "the KV budget was meant to force preemption"
    assert batch[-1].outputs[0].token_ids == alone


def test_seeded_requests_sample_the_same_tokens_when_preempted_with_a_sample_in_flight(tiny_llama_dir: Path):
    """With batches in flight (as pipeline stages keep them), a request preempted while its next
    token is being sampled loses that sample; the draw it took must be undone as well."""
    prompts = ["Once upon a time", "def add(a, b):", "Paris is", "The history of", "In 1999 the", "x = 1"]
    params = [
        SamplingParams(temperature=1.0, top_k=50, seed=100 + i, max_tokens=40, ignore_eos=True)
        for i in range(len(prompts))
    ]
    with LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=8, max_model_len=128) as roomy:
        expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    with LLM(
        str(tiny_llama_dir),
        num_kv_blocks=20,
        block_size=8,
        max_model_len=128,
        max_batches_in_flight=2,
        enable_prefix_caching=False,
    ) as tight:
        discarded: list[str] = []
        schedule = tight.engine.scheduler.schedule

        def recording_schedule():
            output = schedule()
            discarded.extend(output.discarded_sample_ids)
            return output

        tight.engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
        got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert discarded, "the KV budget was meant to preempt a request with its sample in flight"
    assert got == expected


def test_logprobs_and_stop_strings(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=8, max_model_len=128)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 6
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in entry
        ranked = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank is not None)
        assert [r for r, _ in ranked][:3] == [1, 2, 3]
        assert entry[token_id].rank == 1  # greedy picks the most likely token
    # A stop string cut from the greedy text ends the output right before it.
    full = (
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    assert len(full) > 9
    early, late = full[3:6], full[6:9]
    for stops in ([early], [late, early]):  # the earliest match ends it, whatever the list's order
        cut = llm.generate(
            ["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stops)
        )[0].outputs[0]
        assert cut.text == full[: full.index(early)]
        assert cut.finish_reason == "stop" and cut.stop_reason == early
    kept = llm.generate(
        ["Hello"],
        SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, stop=[late], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.text == full[: full.index(late) + len(late)]
    assert llm.engine.scheduler.kv.usage == 0.0


def test_min_tokens_holds_off_a_stop_token(tiny_llama_dir: Path):
    """The stop token is masked out of the first min_tokens samples: greedy picks another one."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=8, max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    stop_id = llm.generate(["Hello"], greedy)[0].outputs[0].token_ids[0]
    held = llm.generate(["Hello"], replace(greedy, stop_token_ids=[stop_id], min_tokens=4))[0].outputs[0]
    assert len(held.token_ids) >= 4 and stop_id not in held.token_ids[:4]


def test_a_cached_block_is_reused_only_after_the_same_tokens(tiny_llama_dir: Path):
    """A block's key covers every token before it: tokens Y cached after X are not Y at the start."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, max_model_len=128)
    recorder = StatsRecorder(llm)
    rng = random.Random(0)
    x, y, z = ([rng.randrange(3, 500) for _ in range(16)] for _ in range(3))  # two blocks each
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens_of(ids: list[int]) -> list[int]:
        return llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids

    expected = tokens_of(y + z)  # computed from nothing
    assert llm.reset_prefix_cache()
    tokens_of(x + y)  # caches Y's blocks behind X
    recorder.prefix_hits = 0
    assert tokens_of(y + z) == expected and recorder.prefix_hits == 0
    assert tokens_of(y + z) == expected and recorder.prefix_hits > 0  # its own blocks do hit


def test_a_stop_token_ends_the_output_without_its_text_and_min_tokens_holds_off_stop_strings(
    tiny_llama_dir: Path,
):
    """vLLM's rules: the token that stopped the output (EOS or one of stop_token_ids) stays in the
    token ids but adds no text unless include_stop_str_in_output; no stop ends it before min_tokens."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=8, max_model_len=128)
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate(["Hello"], greedy)[0].outputs[0].token_ids
    stop_id = full[3]
    first = full.index(stop_id)  # the first time the stop token comes
    for include in (False, True):
        params = replace(greedy, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        completion = llm.generate(["Hello"], params)[0].outputs[0]
        assert completion.token_ids == full[: first + 1] and completion.finish_reason == "stop"
        text_ids = completion.token_ids if include else completion.token_ids[:-1]
        assert completion.text == tokenizer.decode(text_ids, skip_special_tokens=True)
    # A stop string found in the first token's text ends nothing while min_tokens holds it off.
    first_text = llm.generate(["Hello"], replace(greedy, max_tokens=1))[0].outputs[0].text
    assert first_text.strip()
    held = replace(greedy, stop=[first_text.strip()], min_tokens=5, max_tokens=5)
    assert llm.generate(["Hello"], held)[0].outputs[0].token_ids == full[:5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": -5}, "top_k must be"),
        ({"max_tokens": 0}, "max_tokens must be"),
        ({"n": 0}, "n must be"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"logprobs": 50}, "logprobs must be in"),
        (
            {"seed": 2**70},
            "seed must be in",
        ),  # a generator's seed is 64 bits: refused here, not by the runner
        ({"seed": 2**64 - 1, "n": 2}, "seed must be in"),  # the second sample's derived seed would not fit
        ({"seed": -(2**63) - 1}, "seed must be in"),
        # NaN passes `x < 0` and `x <= 0` checks as if in range; the offline API has no schema in front.
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
        ({"top_p": float("nan")}, "top_p must be a finite number"),
        ({"min_tokens": 2.5}, "min_tokens must be an integer"),
        ({"logprobs": True}, "logprobs must be an integer"),
        ({"logit_bias": {5: 101.0}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must be non-negative integers"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_over_long_prompt_is_rejected(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=8, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["word " * 200], SamplingParams(max_tokens=4))
