"""`steerspec bench overlap`: teacher-forced draft acceptance on the bundled pair, and its math."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from steerspec.bench import overlap
from steerspec.errors import UsageError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    overlap.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_overlaps_of_p_with_itself_and_with_a_disjoint_q():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0, 0.0]])
    same = overlap.overlaps(p, p, top_k=2)
    assert same["full"].item() == pytest.approx(1.0) and same["kl"].item() == pytest.approx(0.0, abs=1e-6)
    assert same["top_k"].item() == pytest.approx(0.5 + 0.3)  # renormalised: 0.625 / 0.375 on the top 2
    # spread tail: 0.5 and 0.3 kept, 0.2 spread over the 4 unlisted ids (0.05 each, min with p's 0.2)
    assert same["top_k_tail"].item() == pytest.approx(0.5 + 0.3 + 0.05, abs=1e-3)
    q = torch.tensor([[0.0, 0.0, 0.0, 0.5, 0.5, 0.0]])
    assert overlap.overlaps(p, q, top_k=2)["full"].item() == 0.0


def test_bench_overlap_on_the_bundled_pair(tmp_path, capsys):
    out = tmp_path / "overlap.json"
    args = _args("--drafters", "verifier,pretrained,sd2", "--limit", "2", "--max-new-tokens", "6",
                 "--out", str(out))
    assert overlap.run(args) == 0
    rows = json.loads(out.read_text())["results"]["indist"]
    assert set(rows) == {"verifier", "pretrained", "sd2"}
    mirror = rows["verifier"]  # the verifier as its own drafter: q = p
    assert mirror["full"] == pytest.approx(1.0, abs=1e-4) and mirror["kl"] == pytest.approx(0.0, abs=1e-4)
    assert mirror["top_k"] < 1.0 and mirror["top_k_tail"] < 1.0
    for row in rows.values():
        assert row["positions"] > 0
        assert all(0.0 < row[key] <= 1.0 for key in ("full", "top_k", "top_k_tail"))
    assert rows["sd2"]["full"] > rows["pretrained"]["full"]  # the trained drafter matches p better
    assert "top-K+tail" in capsys.readouterr().out


@pytest.mark.parametrize("flag,value", [("--limit", "-1"), ("--k", "0"), ("--draft-top-k", "0"),
                                        ("--max-new-tokens", "0"), ("--drafters", "/nonexistent/model"),
                                        ("--drafters", "sd2,sd2")])
def test_bench_overlap_bad_flags_are_usage_errors(flag, value):
    with pytest.raises(UsageError):
        overlap.run(_args(flag, value))
