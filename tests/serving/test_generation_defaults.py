"""A model's sampling defaults (generation_config.json), applied as vLLM applies them: loaded from
the model, another folder or nowhere, overridden by flag, and honoured by the server and `LLM`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tessera.engine.arg_utils import add_engine_args, engine_cli_args, engine_config_from_args
from tessera.generation_config import SamplingDefaults, load_sampling_defaults
from tests.serving.server import MODEL_NAME, ServerProcess

GREEDY_THREE = {"temperature": 0.0, "max_new_tokens": 3, "do_sample": True}  # do_sample: not vLLM's to apply


def folder_with(path: Path, config: dict[str, object]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_defaults_come_from_the_model_another_folder_or_nowhere(tmp_path: Path) -> None:
    model = folder_with(
        tmp_path / "model", {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "top_k": 20}
    )
    other = folder_with(tmp_path / "other", GREEDY_THREE)
    assert load_sampling_defaults(model) == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20)
    assert load_sampling_defaults(model, str(other)) == SamplingDefaults(temperature=0.0, max_tokens=3)
    assert load_sampling_defaults(model, "vllm") == SamplingDefaults()
    assert load_sampling_defaults(tmp_path / "no-file-here") == SamplingDefaults()
    overridden = load_sampling_defaults(model, overrides={"temperature": 0.2, "max_new_tokens": 7})
    assert overridden == SamplingDefaults(temperature=0.2, top_p=0.9, top_k=20, max_tokens=7)
    with pytest.raises(ValueError, match="does not exist"):
        load_sampling_defaults(model, str(tmp_path / "missing"))


def test_out_of_bounds_or_unknown_defaults_are_errors_that_name_them(tmp_path: Path) -> None:
    bad = folder_with(tmp_path / "bad", {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config.json holds invalid sampling defaults: top_p"):
        load_sampling_defaults(bad)
    with pytest.raises(ValueError, match=r"unknown sampling default.*temprature"):
        load_sampling_defaults(tmp_path, overrides={"temprature": 0.5})


def test_the_flags_parse_check_and_round_trip() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5, "top_k": 4}']
    config = engine_config_from_args(parser.parse_args(argv), model="m")
    assert (config.generation_config, config.override_generation_config) == (
        "vllm",
        {"temperature": 0.5, "top_k": 4},
    )
    settings = {"generation_config": "vllm", "override_generation_config": {"temperature": 0.5, "top_k": 4}}
    assert engine_config_from_args(parser.parse_args(engine_cli_args(settings)), model="m") == config
    with pytest.raises(SystemExit):  # argparse's error: not a JSON object
        parser.parse_args(["--override-generation-config", "[1]"])
    with pytest.raises(ValueError, match="temprature"):
        engine_config_from_args(parser.parse_args(["--override-generation-config", '{"temprature": 1}']), "m")


@pytest.fixture(scope="module")
def greedy_three_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = folder_with(tmp_path_factory.mktemp("generation-config"), GREEDY_THREE)
    log = tmp_path_factory.mktemp("defaults-server") / "server.log"
    proc = ServerProcess(
        tiny_llama_dir, "--max-model-len", "128", "--generation-config", str(folder), log=log
    )
    yield proc
    proc.stop()


def test_the_server_samples_unset_parameters_as_the_generation_config_says(
    greedy_three_server: ServerProcess,
) -> None:
    server = greedy_three_server
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=60
    )
    extra = {"ignore_eos": True}
    # Temperature 0 by default: two samples of random weights agree; 3 tokens however many were asked.
    both = client.completions.create(model=MODEL_NAME, prompt="Once upon", n=2, extra_body=extra)
    assert both.choices[0].text == both.choices[1].text
    assert both.usage is not None and both.usage.completion_tokens == 6
    capped = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=20, extra_body=extra)
    assert capped.usage is not None and capped.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], extra_body=extra
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    # More than the 128-token context asked, 3 to be generated: both endpoints judge the 3.
    for asked in ({"max_tokens": 200}, {"max_completion_tokens": 200}):
        capped_chat = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], extra_body=extra, **asked
        )
        assert capped_chat.usage is not None and capped_chat.usage.completion_tokens == 3
    long_asked = client.completions.create(
        model=MODEL_NAME, prompt="Once upon", max_tokens=200, extra_body=extra
    )
    assert long_asked.usage is not None and long_asked.usage.completion_tokens == 3
    # A request's own temperature wins: 8 samples at temperature 1 do not all agree.
    sampled = client.completions.create(
        model=MODEL_NAME, prompt="Once upon", n=8, temperature=1.0, extra_body=extra
    )
    assert len({c.text for c in sampled.choices}) > 1


def test_llm_without_sampling_params_uses_the_models_defaults(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from tessera import LLM, SamplingParams

    folder = folder_with(tmp_path / "greedy", GREEDY_THREE)
    with LLM(str(tiny_llama_dir), generation_config=str(folder), max_model_len=128, num_threads=1) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
        plain = llm.generate("Once upon")[0].outputs[0]
        greedy = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
        assert plain.token_ids == greedy.token_ids and len(plain.token_ids) == 3
