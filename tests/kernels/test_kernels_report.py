"""`tessera kernels`: the kernel build and every recorded GEMM verdict, as the selection recorded
them; `--forget` deletes this cache's verdicts (the next load measures again), never the prebuilt
cache's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera import cli, host, kernels
from tessera.kernels import gemm_selection
from tessera.models.layers.activation import silu_and_mul


def report_json(capsys: pytest.CaptureFixture[str]) -> dict:
    assert cli.main(["kernels", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_selection_key_reads_back_as_what_it_was_measured_for() -> None:
    weight = torch.empty(96, 80, dtype=torch.bfloat16)
    fields = gemm_selection.parse_selection_key(gemm_selection.selection_key(weight, (8, 64), swiglu=True))
    assert (fields.dtype, fields.out_features, fields.in_features) == ("bfloat16", 96, 80)
    assert fields.threads == torch.get_num_threads() and fields.rows == (8, 64) and fields.swiglu
    assert fields.candidates == tuple(backend.name for backend in gemm_selection.candidates(weight))
    plain = gemm_selection.parse_selection_key(gemm_selection.selection_key(weight, (8,)))
    assert not plain.swiglu and plain.rows == (8,)
    with pytest.raises(ValueError, match="not a GEMM selection key"):
        gemm_selection.parse_selection_key("float32:96x80:rows=8")


def test_the_report_lists_every_recorded_verdict_with_its_scores(
    selection_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    linear = torch.randn(96, 80)
    gate_up = torch.randn(128, 80)
    chosen = gemm_selection.selected_backend(linear, (8, 64))
    chosen_swiglu = gemm_selection.selected_backend(gate_up, (8, 64), swiglu=silu_and_mul)

    report = report_json(capsys)
    assert report["cpu_model"] == host.cpu_model() and report["build_key"] == kernels.build_key()
    assert report["build"] in {"built", "prebuilt", "disabled"}  # the selection above loaded the build
    assert report["backends"]["float32"] == [b.name for b in gemm_selection.candidates(linear)]
    by_shape = {(v["out_features"], v["layer"]): v for v in report["verdicts"]}
    assert set(by_shape) == {(96, "linear"), (128, "swiglu")}
    recorded = json.loads(selection_file.read_text())
    for (out_features, layer), backend in (((96, "linear"), chosen), ((128, "swiglu"), chosen_swiglu)):
        verdict = by_shape[(out_features, layer)]
        assert (
            verdict["backend"] == backend and verdict["rows"] == [8, 64] and verdict["source"] == "this cache"
        )
        assert verdict["scores"] == recorded[verdict["key"]]["scores"]
        assert min(verdict["scores"].values()) >= 1.0
        assert verdict["all_candidates"] is True

    assert cli.main(["kernels"]) == 0
    text = capsys.readouterr().out
    assert "GEMM verdicts  2 in" in text and " *" not in text
    linear_row = next(
        line.split() for line in text.splitlines() if line.split()[:3] == ["float32", "96x80", "linear"]
    )
    assert linear_row[3:6] == [str(torch.get_num_threads()), "8,64", chosen]


def test_forget_deletes_this_caches_verdicts_and_keeps_the_prebuilt_ones(
    selection_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gemm_selection.selected_backend(torch.randn(96, 80), (8,))
    prebuilt_weight = torch.randn(64, 80)
    prebuilt_key = gemm_selection.selection_key(prebuilt_weight, (8,))
    prebuilt = gemm_selection.prebuilt_selection_path()
    prebuilt.parent.mkdir(parents=True)
    prebuilt.write_text(json.dumps({prebuilt_key: {"backend": "aten", "scores": {"aten": 1.0}}}))

    assert cli.main(["kernels", "--forget"]) == 0
    assert "deleted 1 GEMM verdicts" in capsys.readouterr().out
    assert not selection_file.exists() and prebuilt.exists()
    verdicts = report_json(capsys)["verdicts"]
    assert [(v["out_features"], v["source"], v["backend"]) for v in verdicts] == [(64, "prebuilt", "aten")]
    # A weight whose verdict was forgotten is measured and recorded again on its next load.
    gemm_selection.selected_backend(torch.randn(96, 80), (8,))
    assert len(json.loads(selection_file.read_text())) == 1


def test_the_command_reports_an_empty_cache_without_building_anything(tmp_path: Path) -> None:
    """A fresh cache: the report says the kernels are not built yet, and building them is left to
    the first model load (a minute's compile is no part of a status command)."""
    environment = {
        **os.environ,
        "TESSERA_CACHE": str(tmp_path),
        "TESSERA_PREBUILT_CACHE": str(tmp_path / "none"),
    }
    result = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "kernels"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "kernel build   not built: " + str(tmp_path) in result.stdout
    assert "GEMM verdicts  none yet" in result.stdout
    assert not any(path.suffix == ".so" for path in tmp_path.rglob("*"))


def test_a_verdict_measured_among_fewer_backends_is_marked(
    selection_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process with the native kernels off measures among fewer backends and keeps verdicts of
    its own under their own key: listed beside this build's, and marked."""
    key = gemm_selection.selection_key(torch.empty(96, 80), (8,))
    fewer = key.partition(":candidates=")[0] + ":candidates=aten"
    selection_file.write_text(json.dumps({fewer: {"backend": "aten", "scores": {"aten": 1.0}}}))
    assert len(gemm_selection.candidates(torch.empty(96, 80))) > 1  # oneDNN at least, in every x86 torch
    [verdict] = report_json(capsys)["verdicts"]
    assert verdict["backend"] == "aten" and verdict["all_candidates"] is False
    assert cli.main(["kernels"]) == 0
    text = capsys.readouterr().out
    assert "aten *" in text and "* measured among fewer backends" in text
