"""`steerspec bench remote` end to end on a tiny pair: every mode, RTT and concurrency row, JSON and targets."""

from __future__ import annotations

import argparse
import json

import pytest

from steerspec.bench import remote
from steerspec.errors import UsageError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    remote.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.slow
def test_bench_remote_smoke(tiny_pair, tmp_path, capsys):
    verifier, drafter = tiny_pair
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    args = _args("--verifier", str(verifier), "--drafter", str(drafter), "--rtt-ms", "0,20", "--prompts", "1",
                 "--max-new-tokens", "6", "--concurrency", "1,2", "--concurrency-rtt-ms", "20", "--threads", "1",
                 "--out", str(out), "--plot", str(plot))
    assert remote.run(args) == 0
    report = json.loads(out.read_text())
    assert plot.stat().st_size > 0
    assert [r["rtt_ms"] for r in report["rows"]] == [0.0, 20.0]
    import os

    from steerspec.serving.grpc_env import tuned_env

    # the transport this run used: conftest selects iomgr as the CLI does, unless the environment chose
    assert report["machine"]["grpc_experiments"] == os.environ.get("GRPC_EXPERIMENTS", "")
    assert tuned_env() == {}  # conftest has applied the selection already
    for row in report["rows"]:
        ar, sd = row["autoregressive"], row["speculative"]
        assert 1 <= ar["generated_tokens"] <= 6 and 1 <= sd["generated_tokens"] <= 6
        assert ar["block_efficiency"] == 1.0
        assert sd["tokens_per_s"] > 0 and row["speedup"] > 0
        assert set(sd["stage_ms"]) == set(remote.STAGES)
        assert sd["bytes_up"] > ar["bytes_up"] > 0
    slow = report["rows"][1]
    assert slow["autoregressive"]["stage_ms"]["network"] >= 19.0  # the emulated link is on that hop
    assert set(slow["concurrency"]) == {"1", "2"} and slow["concurrency_ratio"] > 0
    assert set(slow["verifier_concurrency"]) == {"1", "2"}  # the verifier alone at the same load
    assert all(slow["concurrency"][n]["over_verifier_alone"] > 0 for n in ("1", "2"))
    assert slow["paired_speedup"]["speculative"]["n"] == 1 and slow["paired_speedup"]["speculative"]["mean"] > 0
    assert len(slow["speculative"]["per_prompt_tokens_per_s"]) == len(slow["autoregressive"]["per_prompt_tokens_per_s"]) == 1
    assert "concurrency" not in report["rows"][0]
    assert report["engine"]["tokens_per_s"] > 0
    assert report["config"]["device"] == "cpu" and report["config"]["dtype"] == "float32"
    command = report["command"]  # the run's own options, enough to repeat it
    assert command.startswith("steerspec bench remote ") and f"--verifier {verifier}" in command
    assert "--rtt-ms 0,20" in command and "--concurrency-rtt-ms 20" in command and "--threads 1" in command
    assert "rtt-list" not in command and "verifier-dir" not in command  # nothing the run derived itself
    assert report["machine"]["gpu"] is None
    assert set(report["targets"]) == {"overhead_median_ms", "bytes_up_per_block", "concurrency_ratio_at_50ms"}
    table = capsys.readouterr().out
    assert "speculative" in table and "autoregressive" in table and "engine" in table


def test_bench_remote_block_and_tree_rows(tiny_pair, tmp_path, capsys):
    """--block with --tree: the chain by block verification, the tree by recursive rejection sampling and by
    traversal verification, each a row with its speedup over the verifier alone."""
    verifier, drafter = tiny_pair
    out = tmp_path / "bench.json"
    args = _args("--verifier", str(verifier), "--drafter", str(drafter), "--rtt-ms", "0", "--prompts", "1",
                 "--max-new-tokens", "8", "--concurrency", "1", "--threads", "1", "--k", "3", "--tree", "0,1,00",
                 "--block", "--no-engine", "--out", str(out))
    assert remote.run(args) == 0
    row = json.loads(out.read_text())["rows"][0]
    for key in ("block", "tree", "tree_block"):
        assert 1 <= row[key]["generated_tokens"] <= 8 and row[f"{key}_speedup"] > 0, key
    table = capsys.readouterr().out
    assert "block verify" in table and "traversal verify" in table


def test_bench_remote_steers_an_sd2_drafter(tmp_path):
    """An SD² drafter is measured steered: the verifier sends g with every result (bytes down), and the
    in-process engine row, steered too, commits what the services commit (greedy)."""
    out = tmp_path / "bench.json"
    args = _args("--verifier", "verifier", "--drafter", "sd2", "--rtt-ms", "0", "--prompts", "1",
                 "--max-new-tokens", "8", "--concurrency", "1", "--threads", "1", "--temperature", "0",
                 "--out", str(out))
    assert remote.run(args) == 0
    report = json.loads(out.read_text())
    row = report["rows"][0]
    assert report["config"]["steering"] is True
    assert row["speculative"]["bytes_down"] > row["autoregressive"]["bytes_down"] + 100  # g on the wire
    assert row["speculative"]["block_efficiency"] == report["engine"]["block_efficiency"]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_bench_remote_ray_deployment(ray_cluster, tiny_pair, tmp_path):
    """--deployment ray: the launcher's Ray actors on the session's Ray, re-linked per RTT; per-block stages
    read back from the coordinator's trace."""
    verifier, drafter = tiny_pair
    out = tmp_path / "bench.json"
    args = _args("--verifier", str(verifier), "--drafter", str(drafter), "--rtt-ms", "0,20", "--prompts", "1",
                 "--max-new-tokens", "6", "--concurrency", "1", "--threads", "1", "--no-engine",
                 "--deployment", "ray", "--out", str(out))
    assert remote.run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["rtt_ms"] for r in rows] == [0.0, 20.0]
    for row in rows:
        assert row["speculative"]["tokens_per_s"] > 0 and row["autoregressive"]["block_efficiency"] == 1.0
    assert rows[0]["autoregressive"]["stage_ms"]["network"] < 19.0
    assert rows[1]["autoregressive"]["stage_ms"]["network"] >= 19.0  # set_link reached the coordinator actor


@pytest.mark.parametrize("flag,value", [("--rtt-ms", "a,b"), ("--rtt-ms", "-5"), ("--concurrency", "0"),
                                        ("--prompts", "0"), ("--k", "65"), ("--out", "/nonexistent/dir/x.json")])
def test_bench_remote_bad_flags_are_usage_errors(flag, value):
    with pytest.raises(UsageError):
        remote.run(_args(flag, value))


@pytest.mark.parametrize("bench", ["remote", "sd2"])
@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:99"])
def test_bench_device_errors_are_one_line_exit_2(bench, device, capsys):
    """A device that is unknown or not on this machine ends the bench before any model loads."""
    import torch

    from steerspec.cli import main

    if device == "cuda:99" and torch.cuda.device_count() > 99:
        pytest.skip("this machine has a CUDA device 99")
    assert main(["bench", bench, "--device", device]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and device in err[0] and "cuda" in err[0]


def test_modes_interleave_prompt_by_prompt_and_speedups_pair_per_prompt():
    """Each prompt runs every mode before the next prompt (order reversed on odd prompts), with the prompt's own
    seed; the paired speedup is the per-prompt ratio's mean and standard error."""
    import asyncio
    import types

    calls = []

    class FakeCluster:
        steering = False

        async def generate(self, prompt, **kw):
            calls.append((prompt[0], kw["mode"], kw["tree"], kw["seed"]))
            return types.SimpleNamespace(generated=8, wall_s=1.0 if kw["mode"] == "autoregressive" else 0.5)

    args = _args("--prompts", "3", "--seed", "5")
    modes = [("autoregressive", "autoregressive", "", "exact"), ("speculative", "speculative", "", "exact"),
             ("tree", "speculative", "0,1", "exact")]
    runs = asyncio.run(remote._interleaved(FakeCluster(), [[10], [11], [12]], args, modes))
    assert [c[:3] for c in calls] == [(10, "autoregressive", ""), (10, "speculative", ""), (10, "speculative", "0,1"),
                                      (11, "speculative", "0,1"), (11, "speculative", ""), (11, "autoregressive", ""),
                                      (12, "autoregressive", ""), (12, "speculative", ""), (12, "speculative", "0,1")]
    assert {c[0]: c[3] for c in calls} == {10: 5, 11: 6, 12: 7}
    alone = remote.per_prompt_rates(runs["autoregressive"])
    assert alone == [8.0, 8.0, 8.0]
    assert remote.paired_speedup(remote.per_prompt_rates(runs["tree"]), alone) == {"mean": 2.0, "se": 0.0, "n": 3}
    slow = [types.SimpleNamespace(generated=8, wall_s=w) for w in (0.5, 0.25, 1.0)]
    paired = remote.paired_speedup(remote.per_prompt_rates(slow), alone)
    assert paired["n"] == 3 and paired["mean"] == round((2 + 4 + 1) / 3, 3) and paired["se"] > 0
    assert remote.paired_speedup([], []) is None
