"""steerspec.serving.grpc_env: the CLI selects grpc's iomgr TCP before grpc is imported, unless told not to."""

from __future__ import annotations

import subprocess
import sys

from steerspec.serving import grpc_env
import pytest


def test_tuned_env_defaults_and_respects_the_users_choice():
    assert grpc_env.tuned_env({}) == {"GRPC_EXPERIMENTS": "-event_engine_client,-event_engine_listener"}
    assert grpc_env.tuned_env({"GRPC_EXPERIMENTS": "event_engine_client"}) == {}
    assert grpc_env.tuned_env({"GRPC_EXPERIMENTS": ""}) == {}
    assert grpc_env.tuned_env({"STEERSPEC_GRPC_TCP": "event_engine"}) == {}
    env = {"PATH": "/bin"}
    grpc_env.apply(env)
    assert env == {"PATH": "/bin", "GRPC_EXPERIMENTS": grpc_env.LEGACY_TCP_EXPERIMENTS}
    kept = {"GRPC_EXPERIMENTS": "x"}
    assert grpc_env.apply(kept) is False and kept == {"GRPC_EXPERIMENTS": "x"}


SPY = r"""
import builtins, os, sys
os.environ.pop("GRPC_EXPERIMENTS", None)
seen = []
real = builtins.__import__
def spy(name, *args, **kwargs):
    if (name == "grpc" or name.startswith("grpc.")) and not seen:
        seen.append(os.environ.get("GRPC_EXPERIMENTS"))
    return real(name, *args, **kwargs)
builtins.__import__ = spy
from steerspec.cli import main
assert "grpc" not in sys.modules, "importing the CLI must not import grpc"
code = main(["trace", "summarize", "/nonexistent/trace.jsonl"])
import grpc  # noqa: F401  (whatever the command imported, grpc is loaded now)
print(repr(seen[0]), code)
"""


@pytest.mark.slow
def test_the_cli_sets_the_transport_before_grpc_is_first_imported():
    env = {k: v for k, v in __import__("os").environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run([sys.executable, "-c", SPY], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    value, code = out.stdout.split()
    assert value == repr(grpc_env.LEGACY_TCP_EXPERIMENTS) and code == "2"


def test_bench_hop_measures_both_transports_in_their_own_processes(tmp_path, capsys):
    import json

    from steerspec.bench.hop import child_env
    from steerspec.cli import main

    assert "GRPC_EXPERIMENTS" not in child_env("event_engine")
    assert child_env("iomgr")["GRPC_EXPERIMENTS"] == grpc_env.LEGACY_TCP_EXPERIMENTS
    out = tmp_path / "hop.json"
    assert main(["bench", "hop", "--idle-ms", "0,2", "--messages", "5", "--repeats", "1",
                 "--payload-bytes", "100", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["idle_ms"] for r in report["rows"]] == [0.0, 2.0]
    for row in report["rows"]:
        for transport in ("event_engine", "iomgr"):
            assert 0 < row[transport]["median_us"] <= row[transport]["p90_us"] < 1e6
    assert "iomgr" in capsys.readouterr().out
    for flags in (["--idle-ms", "x"], ["--idle-ms", "-1"], ["--messages", "0"], ["--out", "/no/such/dir/h.json"]):
        assert main(["bench", "hop", *flags]) == 2
        assert capsys.readouterr().err.count("\n") == 1
