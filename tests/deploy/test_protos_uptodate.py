"""The committed gRPC stubs in steerspec/v1/ are exactly what scripts/gen_protos.py generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_regenerating_the_stubs_changes_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fresh_dir = tmp_path / "steerspec" / "v1"
    committed_dir = ROOT / "steerspec" / "v1"
    fresh = {p.name: p.read_bytes() for p in fresh_dir.iterdir() if p.is_file()}
    committed = {p.name: p.read_bytes() for p in committed_dir.iterdir() if p.is_file()}
    protos = sorted(p.stem for p in (ROOT / "proto" / "steerspec" / "v1").glob("*.proto"))
    expected = {"__init__.py"} | {f"{n}_pb2{s}" for n in protos for s in (".py", ".pyi", "_grpc.py")}
    assert set(fresh) == expected
    assert set(committed) == expected, "steerspec/v1/ holds files the generator does not make (or lacks some)"
    stale = sorted(name for name in expected if fresh[name] != committed[name])
    assert not stale, f"stale stubs {stale}: run `python scripts/gen_protos.py` and commit the result"
