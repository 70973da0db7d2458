"""The sampler against hand computations and its sampling guarantees (fixed seeds: deterministic)."""

from __future__ import annotations

import pytest
import torch

from tessera.sampling_params import SamplingParams
from tessera.worker.sampler import Sampler, SamplingMetadata, apply_penalties, logprobs_of

VOCAB = 1000


def metadata(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    blocked: dict[int, list[int]] | None = None,
) -> SamplingMetadata:
    return SamplingMetadata.from_params(
        params,
        output_token_ids=outputs if outputs is not None else [[] for _ in params],
        prompt_token_ids=prompts,
        generators=generators or {},
        blocked_token_ids=blocked or {},
    )


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> torch.Tensor:
    return Sampler()(logits, metadata(params, **kwargs)).sampled_token_ids


def test_greedy_is_argmax_and_skips_unused_features() -> None:
    logits = random_logits(8)
    meta = metadata([SamplingParams(temperature=0.0, max_tokens=4)] * 8)
    assert meta.all_greedy and not meta.all_random
    assert meta.top_k is meta.top_p is meta.min_p is None
    assert meta.no_penalties and meta.max_num_logprobs is None
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.top_token_ids is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_on_low_precision_logits_is_greedy_on_their_fp32_copy(dtype: torch.dtype) -> None:
    """All-greedy batches skip the fp32 copy: widening is exact, so the choices (ties too) are the same."""
    logits = random_logits(16).to(dtype)
    logits[3, [10, 20]] = logits[3].max() + 1  # a tie
    params = [SamplingParams(temperature=0.0)] * 16
    assert torch.equal(sample(logits, params), sample(logits.float(), params))
    assert torch.equal(sample(logits, params), logits.float().max(dim=-1).indices)
    # With a feature that needs fp32 (a penalty), still the fp32 path's answer.
    penalised = [SamplingParams(temperature=0.0, presence_penalty=0.5)] * 16
    assert torch.equal(sample(logits, penalised), sample(logits.float(), penalised))


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(16, seed=1)
    torch.manual_seed(0)
    top1 = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 16)
    greedy = sample(logits, [SamplingParams(temperature=0.0)] * 16)
    assert torch.equal(top1, greedy)
    assert torch.equal(greedy, logits.argmax(dim=-1))


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    logits = random_logits(6, seed=2)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    meta = metadata(params)
    assert not meta.all_greedy and not meta.all_random
    torch.manual_seed(0)
    sampled = Sampler()(logits, meta).sampled_token_ids
    assert torch.equal(sampled[::2], logits[::2].argmax(dim=-1))


def test_seeded_row_same_tokens_alone_and_in_any_batch() -> None:
    mine = SamplingParams(temperature=0.9, top_k=50, seed=1234)
    others = [
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.05, seed=7),
        SamplingParams(temperature=1.0, top_k=3, top_p=0.5),
    ]
    steps = 12
    alone_gen = torch.Generator().manual_seed(mine.seed or 0)
    batch_gen = torch.Generator().manual_seed(mine.seed or 0)
    other_gen = torch.Generator().manual_seed(7)
    torch.manual_seed(99)
    alone, in_batch = [], []
    for step in range(steps):
        row_logits = random_logits(1, seed=100 + step)
        alone.append(int(sample(row_logits, [mine], generators={0: alone_gen})[0]))

        # The seeded row sits at position 2 among rows that use every other feature.
        batch_logits = torch.cat(
            [random_logits(2, seed=500 + step), row_logits, random_logits(4, seed=900 + step)]
        )
        params = [*others[:2], mine, *others[2:], SamplingParams(temperature=1.0, top_k=1)]
        generators = {2: batch_gen, 4: other_gen}
        in_batch.append(int(sample(batch_logits, params, generators=generators)[2]))
    assert alone == in_batch
    assert len(set(alone)) > 1  # really sampled, not argmax every step


def test_different_seeds_give_different_streams() -> None:
    logits = random_logits(1, seed=3, scale=0.5).expand(40, VOCAB).contiguous()
    params = SamplingParams(temperature=1.0)
    runs = []
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        runs.append([int(sample(logits[:1], [params], generators={0: gen})[0]) for _ in range(40)])
    assert runs[0] != runs[1]


def test_small_temperature_approaches_greedy() -> None:
    logits = random_logits(64, seed=4)
    best = logits.argmax(dim=-1)
    logits[torch.arange(64), best] += 0.2  # a clear winner: exp(-0.2 / 1e-3) is nothing
    torch.manual_seed(0)
    cold = sample(logits, [SamplingParams(temperature=1e-3)] * 64)
    assert torch.equal(cold, best)
    warm = sample(logits, [SamplingParams(temperature=1.0)] * 64)
    assert not torch.equal(warm, best)


DRAWS = 4000


def many_draws(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    torch.manual_seed(0)
    return sample(row_logits.expand(DRAWS, -1).contiguous(), [params] * DRAWS)


def test_top_k_restricts_support() -> None:
    logits = random_logits(1, seed=5, scale=0.3)
    allowed = set(logits[0].topk(5).indices.tolist())
    drawn = set(many_draws(logits, SamplingParams(temperature=1.0, top_k=5)).tolist())
    assert drawn == allowed  # inside the set, and (with flat logits) all of it reached


def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p, by hand."""
    values, order = probs.sort(descending=True)
    kept, mass = [], 0.0
    for value, token in zip(values.tolist(), order.tolist(), strict=True):
        kept.append(token)
        mass += value
        if mass >= top_p:
            break
    return set(kept)


def test_top_p_restricts_support() -> None:
    logits = random_logits(1, seed=6, vocab=50, scale=1.5)
    allowed = nucleus(logits[0].softmax(-1), 0.6)
    drawn = set(many_draws(logits, SamplingParams(temperature=1.0, top_p=0.6)).tolist())
    assert drawn <= allowed
    assert len(drawn) > 1


def test_top_k_and_top_p_together() -> None:
    logits = random_logits(1, seed=7, vocab=50, scale=0.5)
    top10 = logits[0].topk(10)
    renormalised = torch.full((50,), 0.0)
    renormalised[top10.indices] = top10.values.softmax(-1)
    allowed = nucleus(renormalised, 0.5) & set(top10.indices.tolist())
    drawn = set(many_draws(logits, SamplingParams(temperature=1.0, top_k=10, top_p=0.5)).tolist())
    assert drawn <= allowed
    assert len(drawn) > 1


def test_min_p_restricts_support() -> None:
    logits = random_logits(1, seed=8, vocab=50, scale=1.5)
    probs = logits[0].softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    drawn = set(many_draws(logits, SamplingParams(temperature=1.0, min_p=0.2)).tolist())
    assert drawn <= allowed
    assert len(drawn) > 1


def test_a_tokens_rank_counts_the_whole_vocabulary_not_the_top_k_asked_for() -> None:
    raw = torch.tensor([[-1.0, -3.0, -0.5, -2.0, -3.0], [-1.0, -3.0, -0.5, -2.0, -3.0]])
    _, top_ids, _, ranks = logprobs_of(raw, torch.tensor([1, 2]), 1)
    assert top_ids.tolist() == [[2], [2]]
    assert ranks.tolist() == [5, 1]  # ties count as at least as likely, as vLLM's rank does


def test_min_p_comes_before_top_p_as_in_vllm() -> None:
    # p = 0.5, 0.3, then twenty of 0.01: min-p 0.5 keeps tokens 0 and 1 (0.625 and 0.375 after
    # renormalising), and top-p 0.6 of those token 0 alone. Top-p first would keep tokens 0 and 1
    # (0.5 + 0.3 reach 0.6), and min-p then both.
    probs = torch.tensor([[0.5, 0.3] + [0.01] * 20])
    drawn = set(many_draws(probs.log(), SamplingParams(temperature=1.0, top_p=0.6, min_p=0.5)).tolist())
    assert drawn == {0}


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0, -1.0, 0.0]] * 2)
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # a row without penalties in the same batch stays untouched
    ]
    meta = metadata(params, outputs=[[2, 2, 3], [2, 3]], prompts=[[0, 4], [0, 1]])
    penalised = apply_penalties(logits, meta)
    # repetition on seen {0, 2, 3, 4}: positive / 2, negative * 2;
    # then token 2 (twice in output): -0.25*2 - 0.5; token 3 (once): -0.25 - 0.5.
    expected = torch.tensor([0.5, -2.0, 0.25 - 0.5 - 0.5, 1.5 - 0.25 - 0.5, -2.0, 0.0])
    torch.testing.assert_close(penalised[0], expected)
    torch.testing.assert_close(penalised[1], logits[1])


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    plain = sample(logits, [SamplingParams(temperature=0.0)], outputs=[[1, 1]])
    penalised = sample(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.1)], outputs=[[1, 1]])
    assert (int(plain[0]), int(penalised[0])) == (1, 2)


def test_repetition_penalty_needs_prompt_ids() -> None:
    with pytest.raises(ValueError, match="prompt token ids"):
        metadata([SamplingParams(repetition_penalty=1.2)])


def test_blocked_tokens_never_sampled() -> None:
    logits = random_logits(1, seed=9, vocab=20, scale=0.5)
    top3 = logits[0].topk(3).indices.tolist()
    greedy = sample(logits, [SamplingParams(temperature=0.0)], blocked={0: top3[:1]})
    assert int(greedy[0]) == top3[1]

    torch.manual_seed(0)
    batch = logits.expand(DRAWS, -1).contiguous()
    blocked = {row: top3 for row in range(DRAWS)}
    drawn = set(sample(batch, [SamplingParams(temperature=1.0)] * DRAWS, blocked=blocked).tolist())
    assert not drawn & set(top3)
    assert len(drawn) > 5


def test_logit_bias_moves_each_rows_own_tokens_and_leaves_the_logprobs_raw() -> None:
    logits = random_logits(3, seed=4, vocab=20)
    order = logits.argsort(dim=-1, descending=True)
    worst, best = int(order[0, -1]), int(order[2, 0])
    params = [
        SamplingParams(temperature=0.0, logit_bias={worst: 100.0}),  # the least likely token wins
        SamplingParams(temperature=0.0),  # untouched
        SamplingParams(temperature=0.0, logit_bias={best: -100.0}, logprobs=1),  # the best one loses
    ]
    out = Sampler()(logits, metadata(params))
    assert out.sampled_token_ids.tolist() == [worst, int(order[1, 0]), int(order[2, 1])]
    raw = logits.log_softmax(-1)
    assert out.logprobs is not None and torch.allclose(out.logprobs[2], raw[2, order[2, 1]])
    # A bias shifts a logit, so a small one only reorders near-ties: sampled at temperature 1,
    # the -100 token never comes.
    batch = logits[2:].expand(DRAWS, -1).contiguous()
    drawn = sample(batch, [SamplingParams(temperature=1.0, logit_bias={best: -100.0})] * DRAWS)
    assert best not in drawn.tolist()


def test_allowed_token_ids_are_the_only_tokens_a_row_may_take() -> None:
    logits = random_logits(2, seed=5, vocab=20)
    order = logits[0].argsort(descending=True).tolist()
    allowed = [order[-1], order[-3]]  # two unlikely tokens: greedy takes the likelier of them
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed), SamplingParams(temperature=0.0)]
    assert sample(logits, params).tolist() == [order[-3], int(logits[1].argmax())]
    batch = logits[:1].expand(DRAWS, -1).contiguous()
    drawn = sample(batch, [SamplingParams(temperature=1.0, allowed_token_ids=allowed)] * DRAWS)
    assert set(drawn.tolist()) == set(allowed)


def test_logprobs_are_raw_log_softmax_with_sorted_top_tokens() -> None:
    logits = random_logits(4, seed=10)
    params = [
        SamplingParams(temperature=0.5, logprobs=3, presence_penalty=1.0),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    torch.manual_seed(0)
    out = Sampler()(logits, metadata(params, outputs=[[1, 2], [], [3], []]))
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None and out.top_token_ids is not None
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.sampled_token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_token_ids.shape == (4, 5) and out.top_token_ids.dtype == torch.int64
    expected = raw.topk(5, dim=-1)
    assert torch.equal(out.top_token_ids, expected.indices)
    torch.testing.assert_close(out.top_logprobs, expected.values)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of chi-square with 3 degrees of freedom.
CHI2_3DOF_999 = 16.27


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_empirical_distribution_matches(temperature: float) -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    draws = 20000
    torch.manual_seed(0)
    logits = probs.log().expand(draws, -1).contiguous()
    drawn = sample(logits, [SamplingParams(temperature=temperature)] * draws)
    counts = torch.bincount(drawn, minlength=4).float()
    tempered = probs.pow(1.0 / temperature)
    assert chi_square(counts, tempered / tempered.sum()) < CHI2_3DOF_999


def test_seeded_rows_follow_the_distribution() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    draws = 5000
    generators = {row: torch.Generator().manual_seed(row) for row in range(draws)}
    logits = probs.log().expand(draws, -1).contiguous()
    drawn = sample(logits, [SamplingParams(temperature=1.0, seed=0)] * draws, generators=generators)
    counts = torch.bincount(drawn, minlength=4).float()
    assert chi_square(counts, probs) < CHI2_3DOF_999


def test_seeds_that_differ_only_above_32_bits_draw_differently_and_small_seeds_are_kept() -> None:
    from tessera.worker.model_runner import generator_seed

    cpu = torch.device("cpu")
    assert [generator_seed(s, cpu) for s in (0, 5, 2**32 - 1)] == [0, 5, 2**32 - 1]

    def draws(seed: int) -> list[float]:
        return torch.rand(4, generator=torch.Generator().manual_seed(generator_seed(seed, cpu))).tolist()

    assert draws(1) != draws(2**32 + 1)  # torch's CPU generator alone keeps only the low 32 bits
    assert draws(2**40) != draws(2**41)
    # A request's n choices take seed, seed + 1, ...: distinct streams from any seed, negative too
    # (seed=-1 is many clients' "random"); and -k is not k - 1 in disguise.
    for first in (-(2**63), -3, -1, 0, 2**32 - 2, 2**63 - 128):
        assert len({generator_seed(first + i, cpu) for i in range(128)}) == 128
    assert generator_seed(-1, cpu) != generator_seed(0, cpu)
    assert generator_seed(-5, cpu) != generator_seed(4, cpu)
