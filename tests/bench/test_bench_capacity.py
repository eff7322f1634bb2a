"""`steerspec bench capacity`: many sessions sharing one verifier, through real service processes; its math."""

from __future__ import annotations

import json

import pytest

from steerspec.bench import capacity
from steerspec.cli import main
from steerspec.errors import UsageError


@pytest.mark.slow
def test_capacity_smoke_on_the_tiny_pair(tmp_path, capsys):
    """Two concurrencies, two modes, one repeat, real `steerspec serve` processes: every cell is measured,
    compared with the verifier alone at the same load, and the JSON, table and PNG say so."""
    out, png = tmp_path / "capacity.json", tmp_path / "capacity.png"
    code = main(["bench", "capacity", "--verifier", "verifier", "--drafter", "pretrained", "--concurrency", "1,2",
                 "--modes", "verifier,k2", "--rtt-ms", "0", "--placements", "edge", "--repeats", "1",
                 "--cell-s", "2", "--max-new-tokens", "8", "--out", str(out), "--png", str(png)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["machine"]["cpu"] and report["command"].startswith("steerspec bench capacity")
    assert "--mode-list" not in report["command"] and "--arrival-rate" not in report["command"]
    assert len(report["cells"]) == 4 and all(c["generations"] >= 1 and c["errors"] == 0 for c in report["cells"])
    rows = {(r["load"], r["mode"]): r for r in report["summary"]}
    assert set(rows) == {(1, "verifier"), (2, "verifier"), (1, "k2"), (2, "k2")}
    assert all(r["goodput"] > 0 and r["tpot_ms_p99"] > 0 and r["ttft_ms_p50"] > 0 for r in rows.values())
    assert rows[(2, "k2")]["over_verifier_alone"] > 0 and rows[(1, "verifier")]["tau"] == 1.0
    assert rows[(1, "k2")]["verifier_rows_per_pass"] > rows[(1, "verifier")]["verifier_rows_per_pass"]
    assert 0 < rows[(1, "verifier")]["verifier_busy"] <= 1 and rows[(1, "k2")]["drafter_busy"] > 0
    assert {s["mode"] for s in report["slo"]} == {"verifier", "k2"}
    assert len(report["model"]) == 4 and all(m["predicted_goodput"] > 0 for m in report["model"])
    printed = capsys.readouterr().out
    assert "goodput tok/s, edge placement, RTT 0 ms" in printed and "SLO edge RTT 0" in printed
    assert png.stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--modes", "k2"], "must include verifier"),
    (["--modes", "verifier,warp9"], "unknown mode 'warp9'"),
    (["--placements", "cloud"], "--placements"),
    (["--concurrency", "0"], "--concurrency"),
    (["--rtt-ms", "fast"], "--rtt-ms"),
])
def test_bad_options_exit_2_with_one_line(argv, message, capsys):
    assert main(["bench", "capacity", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_modes_are_the_sdk_requests_they_name():
    assert capacity.mode_request("verifier") == {"mode": "autoregressive"}
    assert capacity.mode_request("k4") == {"k": 4, "policy": "fixed"}
    assert capacity.mode_request("tree") == {"tree": "default"}
    assert capacity.mode_request("tree=0,1,00") == {"tree": "0,1,00"}
    assert capacity.mode_request("default") == {}
    assert capacity.mode_request("tree+ahead") == {"tree": "default", "draft_ahead": "on"}
    assert capacity.mode_request("default+ahead") == {"draft_ahead": "on"}
    assert capacity.mode_request("k4+ahead16") == {"k": 4, "policy": "fixed", "draft_ahead": "on", "ahead_outcomes": 16}
    with pytest.raises(UsageError, match="verifier alone"):
        capacity.mode_request("verifier+ahead")


def test_placements_split_the_cores():
    assert capacity.placement_cpus("edge", [0, 1]) == {"verifier": [0], "drafter": [1], "edge": [1]}
    assert capacity.placement_cpus("colocated", [0, 1]) == {"verifier": [0], "drafter": [0], "edge": [1]}
    assert capacity.placement_cpus("edge", [3, 0, 1, 2]) == {"verifier": [0, 1], "drafter": [2, 3], "edge": [2, 3]}
    assert capacity.placement_cpus("colocated", [0]) == {"verifier": [0], "drafter": [0], "edge": [0]}


def _cell(load, mode, goodput, tpot99, rows=1.0, pass_ms=10.0, tau=1.0, draft=0.0, placement="edge", rtt=0.0):
    return {"placement": placement, "rtt_ms": rtt, "load": load, "mode": mode, "goodput": goodput, "errors": 0,
            "tpot_ms_p50": tpot99 / 2, "tpot_ms_p99": tpot99, "ttft_ms_p50": 1.0, "ttft_ms_p99": 2.0, "tau": tau,
            "verifier_rows_per_pass": rows, "verifier_pass_ms": pass_ms, "verifier_busy": 0.5, "drafter_busy": 0.1,
            "draft_ms_per_block": draft}


def test_summary_slo_and_model():
    cells = [_cell(1, "verifier", 50, 40, rows=1, pass_ms=20), _cell(1, "verifier", 54, 44, rows=1, pass_ms=20),
             _cell(4, "verifier", 150, 60, rows=4, pass_ms=26), _cell(1, "k2", 80, 30, rows=3, pass_ms=24, tau=2,
                                                                       draft=5),
             _cell(4, "k2", 120, 90, rows=12, pass_ms=42, tau=2, draft=5)]
    summary = capacity.summarize(cells)
    rows = {(r["load"], r["mode"]): r for r in summary}
    assert rows[(1, "verifier")]["goodput"] == 52 and rows[(1, "verifier")]["goodput_spread"] == pytest.approx(2.828, 1e-3)
    assert rows[(4, "k2")]["over_verifier_alone"] == pytest.approx(0.8)
    served = {s["mode"]: s["served_within_slo"] for s in capacity.slo(summary, factor=2.0)}  # bound 2 × 21 ms
    assert served == {"verifier": 1, "k2": 1}
    a, b = capacity.fit_pass_cost(cells)
    assert b == pytest.approx(2.0, rel=1e-6) and a == pytest.approx(18.0, rel=1e-6)  # 18 + 2 · rows
    predicted = {(m["load"], m["mode"]): m for m in capacity.model(summary, cells, closed_loop=True)}
    # k2 at 4 clients: own path 0 + 5 + c(3) = 29 ms; the verifier's share c(12) = 42 ms: 4 · 2 / 42 ms
    assert predicted[(4, "k2")]["predicted_goodput"] == pytest.approx(4 * 2 / 0.042, rel=1e-3)
    assert predicted[(4, "k2")]["edge_over_colocated_predicted"] == pytest.approx(1 + 4 * 5 / 42, rel=1e-3)
