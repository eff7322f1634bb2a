"""`steerspec bench step`: every row measured on a small pair (CPU: eager floor), bad flags."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from steerspec.bench import step
from steerspec.errors import UsageError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_step_rows_and_json(tiny_pair, tmp_path, capsys):
    out = tmp_path / "step.json"
    verifier, drafter = tiny_pair
    args = _args("--verifier", str(verifier), "--drafter", str(drafter), "--iters", "3", "--warmup", "1",
                 "--prefix", "16", "--k", "4", "--profile", "1", "--out", str(out))
    assert step.run(args) == 0
    report = json.loads(out.read_text())
    (entry,) = report["dtypes"]
    rows = entry["rows"]
    assert entry["dtype"] == "float32" and entry["floor"] == "eager"
    assert set(rows) == {"drafter_step", "verifier_extend", "verifier_step", "draft_block", "verify_block"}
    for name in ("drafter_step", "verifier_extend", "verifier_step"):
        assert rows[name]["fast"]["median_ms"] > 0 and rows[name]["graphed"]["median_ms"] > 0
        assert rows[name]["floor"]["median_ms"] > 0 and rows[name]["vs_floor"] > 0
    for name in ("draft_block", "verify_block"):
        assert rows[name]["host"]["median_ms"] > 0 and rows[name]["device"]["median_ms"] > 0
    for path in ("host", "device"):
        assert entry["profile"][path]["blocks"] == 1 and entry["profile"][path]["wall_ms"] > 0
    assert entry["profile"]["host"]["multinomial"] > 0 and entry["profile"]["device"]["multinomial"] == 0
    assert "draft_block" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [("--dtypes", "float8"), ("--k", "0"), ("--iters", "0"), ("--device", "tpu")])
def test_bench_step_bad_flags_are_usage_errors(argv):
    with pytest.raises(UsageError):
        step.run(_args(*argv))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_step_on_cuda_with_the_compiled_floor(model_pair, tmp_path):
    out = tmp_path / "step.json"
    args = _args("--verifier", str(model_pair[0]), "--drafter", str(model_pair[1]), "--device", "cuda",
                 "--dtypes", "float32", "--iters", "5", "--warmup", "3", "--out", str(out))
    assert step.run(args) == 0
    for entry in json.loads(out.read_text())["dtypes"]:
        assert entry["floor"] == "compile"
        assert "median_ms" in entry["rows"]["drafter_step"]["floor"], entry["rows"]["drafter_step"]["floor"]
