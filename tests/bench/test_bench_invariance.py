"""`steerspec bench invariance` and `bench engine --compare-invariance` on the tiny pair: they run, say which CPU,
and find the invariant passes bit-identical (and the outputs equal) where the ordinary ones need not be."""

from __future__ import annotations

import json

import pytest

from steerspec.cli import main


def test_bench_invariance_reports_bit_identical_passes(tmp_path, capsys):
    out = tmp_path / "inv.json"
    assert main(["bench", "invariance", "--verifier", "verifier", "--rows", "1,5", "--buckets", "8",
                 "--dtypes", "float32", "--repeats", "1", "--prompt-tokens", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["machine"]["cpu"] and report["dtypes"]["float32"]["bit_identical"] == {"invariant R=8": True}
    assert [r["rows"] for r in report["dtypes"]["float32"]["table"]] == [1, 5]
    assert "bit-identical to one-token decoding" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_engine_compares_invariance_in_one_run(tmp_path):
    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--prompts", "1", "--max-new-tokens", "6", "--ks", "2", "--no-assisted",
                 "--no-hf-out-major", "--invariant", "on", "--compare-invariance", "--threads", "1",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    methods = {r["method"]: r for r in report["results"]}
    assert methods["speculative k=2"]["same_tokens_as_verifier"] and "speculative k=2 (invariance off)" in methods
    assert report["invariant"]["rows"] >= 1 and "speculative k=2" in report["summary"][
        "speedup_vs_verifier_alone_invariance_off"]


def test_compare_invariance_without_it_exits_2(capsys):
    code = main(["bench", "engine", "--prompts", "1", "--max-new-tokens", "2", "--ks", "1", "--no-assisted",
                 "--invariant", "off", "--compare-invariance", "--out", "/dev/null"])
    assert code == 2 and "--invariant on" in capsys.readouterr().err
