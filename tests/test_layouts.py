"""Out-major weight copies for passes of 2–3 rows (steerspec/models/layouts.py): same logits as the
model's own input-major weights, one copy per model shared by its sequences, remade when a weight
changes, and off when STEERSPEC_OUT_MAJOR_ROWS is empty."""

from __future__ import annotations

import pytest
import torch

from steerspec.models import load_model
from steerspec.models.kv import FastCachedLM
from steerspec.models.layouts import CACHE_ATTR, ENV, is_input_major, out_major_rows

PROMPT = list(range(3, 30))


@pytest.fixture()
def verifier(tiny_pair):
    return load_model(tiny_pair[0])  # CPU layout: linear weights stored input-major


def _logits(lm: FastCachedLM, feed):
    lm.reset()
    lm.extend(PROMPT)
    return lm.extend(feed).logits


def test_rows_come_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert out_major_rows() == {2, 3}
    monkeypatch.setenv(ENV, "2, 5")
    assert out_major_rows() == {2, 5}
    monkeypatch.setenv(ENV, "")
    assert out_major_rows() == frozenset()
    for bad in ("two", "0,2"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            out_major_rows()


def test_two_and_three_rows_use_the_copies_with_the_same_logits(verifier, monkeypatch):
    monkeypatch.setenv(ENV, "")
    plain = FastCachedLM(verifier)
    monkeypatch.delenv(ENV)
    fast = FastCachedLM(verifier)
    assert is_input_major(fast._plans[0][3][0])
    for rows in (1, 4):
        assert fast.plans_for(rows)[0] is fast._plans
    plans, head = fast.plans_for(3)
    assert plans[0][3][0].is_contiguous() and head[0].is_contiguous()
    torch.testing.assert_close(plans[0][3][0], fast._plans[0][3][0], atol=0, rtol=0)
    for feed in ([5], [5, 6], [5, 6, 7], [5, 6, 7, 8]):
        torch.testing.assert_close(_logits(fast, feed), _logits(plain, feed), atol=1e-4, rtol=1e-4)


def test_sequences_share_one_copy_per_model_and_a_changed_weight_is_copied_again(verifier):
    first, second = FastCachedLM(verifier), FastCachedLM(verifier)
    assert first.plans_for(2)[0][0][10][0] is second.plans_for(2)[0][0][10][0]
    assert len(verifier.__dict__[CACHE_ATTR]) == sum(1 for p in verifier.parameters() if is_input_major(p))
    before = _logits(first, [5, 6])
    up = verifier.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        up.mul_(3.0)  # an in-place update: the copy must follow it
    after = _logits(first, [5, 6])
    assert not torch.allclose(before, after, atol=1e-3)
    torch.testing.assert_close(first.plans_for(2)[0][0][10][0], up, atol=0, rtol=0)
    torch.testing.assert_close(after, _logits(FastCachedLM(verifier), [5, 6]), atol=1e-5, rtol=1e-5)


def test_batched_verification_of_two_rows_matches_row_by_row(verifier):
    from steerspec.models.batched import packed_extend

    lms = [FastCachedLM(verifier), FastCachedLM(verifier)]
    refs = [FastCachedLM(verifier), FastCachedLM(verifier)]
    for lm, ref, prompt in zip(lms, refs, (PROMPT, PROMPT[:11])):
        lm.extend(prompt)
        ref.extend(prompt)
    outs = packed_extend(lms, [[7], [9, 4]])  # 3 rows in all: the out-major copies
    for out, ref, feed in zip(outs, refs, ([7], [9, 4])):
        torch.testing.assert_close(out.logits, ref.extend(feed).logits, atol=1e-4, rtol=1e-4)


def test_bench_layouts_prints_both_layouts_and_the_rows_to_use(tiny_pair, tmp_path, capsys):
    import json

    from steerspec.cli import main

    out = tmp_path / "layouts.json"
    assert main(["bench", "layouts", "--verifier", str(tiny_pair[0]), "--rows", "1,3", "--repeats", "2",
                 "--prompt-tokens", "8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "input-major ms" in text and f"{ENV}=" in text
    report = json.loads(out.read_text())
    assert [r["rows"] for r in report["table"]] == [1, 3]
    assert all(len(report["samples"][name]["3"]) == 2 for name in ("input-major", "out-major"))
    assert main(["bench", "layouts", "--verifier", str(tiny_pair[0]), "--rows", "0"]) == 2
    assert "--rows" in capsys.readouterr().err
