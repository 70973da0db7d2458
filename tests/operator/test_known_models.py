import re
from pathlib import Path

import pytest

from tessera_operator.admission.families import FAMILY_PARALLELISM
from tessera_operator.admission.known_models import KNOWN_MODELS, ModelShape, known_model

ROOT = Path(__file__).resolve().parents[2]


def test_mixture_of_experts_shapes_split_their_experts_by_the_layout() -> None:
    """Without expertParallel every routed expert's MLP splits over the ranks; with it each expert
    goes whole to one rank, so the expert count must divide instead."""
    shape = ModelShape(4, 8, 8, None, 64, 4096, "mixtral", 6, 90)
    assert shape.tensor_split_problem(4) == (
        "each expert's 90 MLP columns do not split over 4 ranks "
        "(spec.parallelism.expertParallel keeps every expert whole on one rank instead)"
    )
    assert shape.tensor_split_problem(4, expert_parallel=True) == (
        "6 experts do not split over 4 ranks under expertParallel"
    )
    assert shape.tensor_split_problem(2, expert_parallel=True) is None
    assert shape.tensor_split_problem(2) is None  # 90 columns split over 2 without EP
    shared = ModelShape(4, 8, 8, 100, 64, 4096, "qwen2_moe", 8, 96)
    assert shared.tensor_split_problem(8, expert_parallel=True) == (
        "the shared expert's 100 columns do not split over 8 ranks"
    )


@pytest.mark.parametrize(
    ("family", "experts", "width"),
    [("qwen3", 8, 96), ("qwen3_moe", 0, None), ("qwen3_moe", 8, None), ("gpt2", 0, None)],
)
def test_a_shape_whose_experts_contradict_its_family_is_refused(
    family: str, experts: int, width: int | None
) -> None:
    with pytest.raises(ValueError, match="family"):
        ModelShape(4, 8, 8, 128, 64, 4096, family, experts, width)


def test_sources_match_by_name_or_last_path_component() -> None:
    for source in ("mistralai/Mixtral-8x7B-v0.1", "/models/mixtral-8x7b-v0.1", "Mixtral-8x7B-v0.1/"):
        assert known_model(source) is KNOWN_MODELS["mixtral-8x7b-v0.1"]
    assert known_model("google/gemma-3-1b-it") is not None and known_model("gemma-3") is None
    assert known_model("org/qwen3-0.6b.gguf") is KNOWN_MODELS["qwen3-0.6b"]


def test_the_docs_table_is_the_family_table() -> None:
    """docs/architecture.md's "family: TP / PP / SP / EP" table says what FAMILY_PARALLELISM does."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| [^|]+\|((?: [^|]+ \|){4})$", text, flags=re.MULTILINE)
    documented = {
        family: frozenset(
            kind
            for kind, cell in zip(("TP", "PP", "SP", "EP"), cells.strip(" |").split("|"), strict=True)
            if "yes" in cell
        )
        for family, cells in rows
    }
    assert documented == FAMILY_PARALLELISM
