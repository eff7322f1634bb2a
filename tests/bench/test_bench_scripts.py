"""The in-process benchmark scripts (scripts/bench_block_verify.py, scripts/bench_trees_sampling.py): a malformed
--seeds / --ks / --trees list is one line on stderr and exit 2, before any model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.parametrize("script", ["bench_block_verify.py", "bench_trees_sampling.py"])
@pytest.mark.parametrize("argv, words", [(["--trees", "0,11"], "needs its parent 1"),
                                          (["--ks", "2,x"], "invalid literal"),
                                          (["--seeds", ""], "invalid literal")])
@pytest.mark.slow
def test_a_malformed_list_is_one_line_and_exit_2(script, argv, words):
    done = subprocess.run([sys.executable, str(SCRIPTS / script), "--verifier", "/nonexistent", *argv],
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and words in lines[0], done.stderr
