"""One scripted workload that exercises every attention path, checked against transformers.

Steps: several prompts prefilled together; decode steps; then mixed batches with decodes,
a fresh prefill, a chunked prefill whose first chunk is already cached, and a prefix-cache
hit whose first blocks belong to another sequence. Every new token's logits are recorded
and compared with transformers' full-sequence forward at the same position.
"""

from __future__ import annotations

import torch

from tests.models.paged_harness import PagedDriver


def run_scenario(model, vocab: int, seed: int = 0, block_size: int = 4) -> tuple[PagedDriver, list]:
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    driver = PagedDriver(model, block_size=block_size, seed=seed)
    records: list[tuple[str, str, int, torch.Tensor]] = []  # (phase, seq, position, logits)

    def step(phase: str, work: list[tuple[str, list[int]]]) -> None:
        starts = [len(driver.seqs[name].tokens) for name, _ in work]
        logits = driver.step(work)
        row = 0
        for (name, new), start in zip(work, starts, strict=True):
            for offset in range(len(new)):
                records.append((phase, name, start + offset, logits[row]))
                row += 1

    for name in "abc":
        driver.add(name)
    step("prefill batch", [("a", tokens(13)), ("b", tokens(6)), ("c", tokens(17))])
    for _ in range(3):
        step("decode", [("a", tokens(1)), ("b", tokens(1)), ("c", tokens(1))])

    driver.add("d")
    driver.add("e")
    e_tokens = tokens(14)
    step("mixed", [("a", tokens(1)), ("c", tokens(1)), ("d", tokens(9)), ("e", e_tokens[:5])])
    # f reuses a's first full blocks (a has 17 tokens by now): only its tail is computed.
    driver.add("f", share_prefix_with="a", shared_blocks=min(2, 17 // block_size))
    step(
        "mixed with cached context",
        [("a", tokens(1)), ("b", tokens(1)), ("d", tokens(1)), ("e", e_tokens[5:]), ("f", tokens(6))],
    )
    step("decode after mixed", [(name, tokens(1)) for name in "abcdef"])
    return driver, records


def reference_logits(hf_model, driver: PagedDriver) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        return {
            name: hf_model(torch.tensor([state.tokens])).logits[0].float()
            for name, state in driver.seqs.items()
        }


def compare(records: list, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Largest |ours - reference| per phase."""
    worst: dict[str, float] = {}
    for phase, name, position, logits in records:
        diff = (logits.float() - reference[name][position]).abs().max().item()
        worst[phase] = max(worst.get(phase, 0.0), diff)
    return worst


def run_many_decodes(model, vocab: int, seed: int = 1, block_size: int = 4) -> tuple[PagedDriver, list, int]:
    """24 sequences of very different lengths decoding together (decodes are grouped by length).

    Returns the driver, the records and how many decode groups the attention plan used.
    """
    from tessera.models.layers.attention import AttentionPlan, GatherWorkspace

    gen = torch.Generator().manual_seed(seed)
    driver = PagedDriver(model, num_blocks=256, block_size=block_size, seed=seed)
    records: list[tuple[str, str, int, torch.Tensor]] = []
    names = [f"s{i}" for i in range(24)]
    lengths = [1 + (i * 7) % 41 for i in range(24)]
    for start in range(0, 24, 6):
        work = [
            (n, torch.randint(3, vocab, (lengths[i],), generator=gen).tolist()) for i, n in enumerate(names)
        ]
        work = work[start : start + 6]
        positions = [len(driver.seqs[n].tokens) if n in driver.seqs else 0 for n, _ in work]
        logits = driver.step(work)
        row = 0
        for (name, new), first in zip(work, positions, strict=True):
            for offset in range(len(new)):
                records.append(("prefill", name, first + offset, logits[row]))
                row += 1
    groups = 0
    for _ in range(2):
        work = [(n, torch.randint(3, vocab, (1,), generator=gen).tolist()) for n in names]
        positions = [len(driver.seqs[n].tokens) for n in names]
        logits = driver.step(work)
        plan = AttentionPlan.build(driver.last_metadata, block_size, torch.device("cpu"), GatherWorkspace())
        groups = len(plan.decode_groups)
        for row, (name, first) in enumerate(zip(names, positions, strict=True)):
            records.append(("decode", name, first, logits[row]))
    return driver, records, groups
