"""steerspec.grpc_env: the CLI selects grpc's iomgr TCP before grpc is imported, unless told not to."""

from __future__ import annotations

import subprocess
import sys

from steerspec import grpc_env


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


def test_the_cli_sets_the_transport_before_grpc_is_first_imported():
    env = {k: v for k, v in __import__("os").environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run([sys.executable, "-c", SPY], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    value, code = out.stdout.split()
    assert value == repr(grpc_env.LEGACY_TCP_EXPERIMENTS) and code == "2"
