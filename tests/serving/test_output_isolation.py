"""A failure in one request's output processing (or one the engine core reports) ends that request alone."""

from __future__ import annotations

from typing import Any

import pytest

from tessera.engine.detokenizer import IncrementalDetokenizer
from tessera.engine.errors import RequestFailedError
from tessera.engine.output_processor import FINISH_ERROR, OutputProcessor, RequestOutputKind
from tessera.engine.processor import InputProcessor
from tessera.sampling_params import SamplingParams
from tessera.wire.messages import FINISH_LENGTH, EngineCoreOutput, EngineCoreOutputs
from tests.fixtures.models import make_tokenizer

FAIL_STOP = "<fail>"


@pytest.fixture(scope="module")
def processors() -> tuple[InputProcessor, Any]:
    tokenizer = make_tokenizer()
    return InputProcessor(tokenizer, max_model_len=64), tokenizer


def add(
    processor: OutputProcessor, inputs: InputProcessor, request_id: str, params: SamplingParams
) -> list[str]:
    children = inputs.process(request_id, [1, 2, 3], params)
    processor.add_request(request_id, None, [1, 2, 3], params, children, RequestOutputKind.DELTA)
    return [child.request_id for child in children]


def test_a_failing_detokenizer_fails_its_request_only(
    processors: tuple[InputProcessor, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs, tokenizer = processors
    original = IncrementalDetokenizer.update

    def update(self: IncrementalDetokenizer, token_ids: list[int], **kwargs: Any) -> Any:
        if FAIL_STOP in self.stop:
            raise RuntimeError("boom at /some/file.py")
        return original(self, token_ids, **kwargs)

    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    processor = OutputProcessor(tokenizer)
    good = add(processor, inputs, "good", SamplingParams(max_tokens=4))
    bad = add(processor, inputs, "bad", SamplingParams(n=2, max_tokens=4, stop=[FAIL_STOP]))
    step = [EngineCoreOutput(child, [40]) for child in good + bad]
    result = processor.process_outputs(EngineCoreOutputs(step))

    assert [o.request_id for o in result.request_outputs] == ["good"]
    assert set(result.failed) == {"bad"}
    assert "/some/file.py" not in str(result.failed["bad"])
    assert sorted(result.reqs_to_abort) == sorted(bad)  # both samples stop in the engine core
    finish = processor.process_outputs(
        EngineCoreOutputs([EngineCoreOutput(good[0], [41], finish_reason=FINISH_LENGTH)])
    )
    assert finish.request_outputs[0].finished and not processor.has_unfinished_requests()


def test_an_engine_reported_error_fails_the_whole_parent(processors: tuple[InputProcessor, Any]) -> None:
    inputs, tokenizer = processors
    processor = OutputProcessor(tokenizer)
    children = add(processor, inputs, "req", SamplingParams(n=2, max_tokens=4))
    other = add(processor, inputs, "other", SamplingParams(max_tokens=4))
    failed = EngineCoreOutput(children[0], [], finish_reason=FINISH_ERROR)
    failed.error = "index out of range\nTraceback (most recent call last): ..."  # type: ignore[attr-defined]
    result = processor.process_outputs(
        EngineCoreOutputs([failed, EngineCoreOutput(children[1], [40]), EngineCoreOutput(other[0], [40])])
    )
    assert isinstance(result.failed["req"], RequestFailedError)
    assert "index out of range" in str(result.failed["req"]) and "Traceback" not in str(result.failed["req"])
    assert [o.request_id for o in result.request_outputs] == ["other"]
    assert children[1] in result.reqs_to_abort


def test_no_request_id_may_name_another_requests_child(processors: tuple[InputProcessor, Any]) -> None:
    inputs, tokenizer = processors
    processor = OutputProcessor(tokenizer)
    assert add(processor, inputs, "x", SamplingParams(n=2, max_tokens=4)) == ["0_x", "1_x"]
    with pytest.raises(ValueError, match="'0_x' is already in use"):
        add(processor, inputs, "0_x", SamplingParams(max_tokens=4))
    add(processor, inputs, "0_z", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="'0_z' is already in use"):  # its first child's name
        add(processor, inputs, "z", SamplingParams(n=2, max_tokens=4))
    assert processor.child_to_parent == {"0_x": "x", "1_x": "x", "0_z": "0_z"}
