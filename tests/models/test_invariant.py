"""Batch invariance: each row of a verify pass (any size, any tree, any sessions packed beside it) gets bit for bit the
logits one-token decoding gives it, in float32 and bfloat16 (steerspec/models/invariant_ops.py, invariant_pass.py)."""

from __future__ import annotations

import json

import pytest
import torch

from steerspec.errors import UsageError
from steerspec.models import load_model
from steerspec.models.invariant_ops import KEY_BLOCK, QUERY_ROWS, block_attention, bucket_linear, key_layout
from steerspec.models.invariant_pass import InvariantPlan, invariant_plan, set_invariant
from steerspec.models.kernel_path import apply_invariance, check_mode
from steerspec.models.kv import FastCachedLM
from steerspec.models.layouts import native_bf16

from invariance_helpers import packed_differences, verify_pass_differences, with_invariance

DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not native_bf16(), reason="bfloat16 is emulated on this CPU (slow, and not the path invariance is for)"))]


@pytest.fixture(scope="module", params=DTYPES)
def tiny(request):
    model = load_model("verifier", dtype=request.param)
    set_invariant(model, InvariantPlan())
    return model


def test_every_pass_size_equals_one_token_decoding(tiny):
    assert verify_pass_differences(tiny, seed=1) == 0


@pytest.mark.parametrize("sessions", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_packed_sessions_equal_one_token_decoding(tiny, sessions):
    assert packed_differences(tiny, sessions, seed=sessions, longest=80 if sessions == 2 else 40) == 0


def test_a_tree_pass_equals_decoding_its_paths(tiny):
    assert packed_differences(tiny, 1, seed=5) == 0 and packed_differences(tiny, 2, seed=6) == 0


@pytest.mark.parametrize("rows", [1, 16])
def test_any_row_bucket_is_invariant(tiny, rows):
    previous = with_invariance(tiny, InvariantPlan(rows=rows))
    try:
        assert verify_pass_differences(tiny, seed=2, rows=(1, 3, 5, 17)) == 0
    finally:
        with_invariance(tiny, previous)


def test_without_invariance_the_difference_is_detected(tiny):
    """The check has teeth: the ordinary passes (GEMV for one row, GEMM for several) differ on this CPU."""
    previous = with_invariance(tiny, None)
    try:
        assert verify_pass_differences(tiny, seed=1) > 0
    finally:
        with_invariance(tiny, previous)


def test_invariant_logits_stay_close_to_the_ordinary_ones(tiny):
    ids = list(range(5, 60))
    plain = FastCachedLM(tiny)
    previous = with_invariance(tiny, None)
    try:
        want = plain.extend(ids).logits.float()
    finally:
        with_invariance(tiny, previous)
    got = FastCachedLM(tiny).extend(ids).logits.float()
    tol = 1e-4 if tiny.dtype == torch.float32 else 0.1
    assert torch.allclose(got, want, atol=tol, rtol=0)


def test_hidden_states_and_logits_to_keep(tiny):
    ids = list(range(7, 40))
    a = FastCachedLM(tiny)
    out = a.extend(ids, hidden_layers=[0, 3, tiny.config.num_hidden_layers])
    b = FastCachedLM(tiny)
    kept = b.extend(ids, logits_to_keep=1)
    assert out.hidden.shape == (3, len(ids), tiny.config.hidden_size)
    assert torch.equal(kept.logits[0], out.logits[-1])


def test_bucket_linear_rows_do_not_depend_on_their_neighbours():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    x = torch.randn(21, 64, generator=gen)
    full = bucket_linear(x, w, None, 8)
    for i in (0, 7, 8, 20):
        assert torch.equal(bucket_linear(x[i:i + 1], w, None, 8)[0], full[i])


def test_block_attention_matches_sdpa_and_is_invariant():
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, hd, start, n = 6, 2, 16, 45, 7
    keys = torch.randn(kv_heads, 96, hd, generator=gen)
    values = torch.randn(kv_heads, 96, hd, generator=gen)
    q = torch.randn(n, heads, hd, generator=gen)
    layout = key_layout(start, None, n, heads // kv_heads, QUERY_ROWS, KEY_BLOCK, q.device)
    out = block_attention(q, keys, values, layout, 0.25)
    mask = torch.ones(n, start + n, dtype=torch.bool).tril_(start)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None, :, : start + n], values[None, :, : start + n], attn_mask=mask, scale=0.25,
        enable_gqa=True)[0].transpose(0, 1)
    assert torch.allclose(out, want, atol=1e-5)
    for i in range(n):
        one = key_layout(start + i, None, 1, heads // kv_heads, QUERY_ROWS, KEY_BLOCK, q.device)
        assert torch.equal(block_attention(q[i:i + 1], keys, values, one, 0.25)[0], out[i])


def test_modes_and_the_refusal_off_the_cpu(monkeypatch):
    with pytest.raises(UsageError, match="use one of"):
        check_mode("sometimes")
    model = load_model("verifier")
    assert apply_invariance(model, "off") is None and invariant_plan(model) is None
    assert apply_invariance(model, "auto") is None  # its float32 invariant passes cost more here: ordinary
    monkeypatch.setenv("STEERSPEC_INVARIANT_ROWS", "4")
    assert apply_invariance(model, "on") == InvariantPlan(rows=4)
    monkeypatch.setenv("STEERSPEC_INVARIANT", "off")
    assert apply_invariance(model, "on") is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_invariance_is_refused_on_a_gpu():
    model = load_model("verifier", device="cuda")
    with pytest.raises(UsageError, match="CPU only"):
        apply_invariance(model, "on")
    assert apply_invariance(model, "auto") is None


@pytest.fixture(scope="module", params=DTYPES)
def smollm2(request):
    from steerspec.models import smollm2 as real

    if not real.available():
        pytest.skip("the smollm2 verifier is not installed")
    model = load_model("smollm2", dtype=request.param)
    set_invariant(model, InvariantPlan())
    return model


@pytest.mark.real_pair
@pytest.mark.slow
def test_smollm2_verify_passes_equal_one_token_decoding(smollm2):
    assert verify_pass_differences(smollm2, seed=3, rows=(1, 2, 5, 9, 17, 65), length=96) == 0
    assert packed_differences(smollm2, 2, seed=4) == 0


def test_a_cache_made_before_invariance_was_set_reads_the_same_weights(tiny):
    """Invariance set after a FastCachedLM was made: its passes read the same copies as a new one's, bit for bit."""
    previous = with_invariance(tiny, None)
    try:
        early = FastCachedLM(tiny)
    finally:
        with_invariance(tiny, previous)
    ids = list(range(3, 30))
    assert torch.equal(early.extend(ids).logits, FastCachedLM(tiny).extend(ids).logits)


def test_the_machine_verdict_is_timed_once_and_cached(tmp_path, monkeypatch):
    """`auto` times the paths once per machine, model, dtype and threads; the next load reads the cache."""
    from steerspec.models import kernel_path

    monkeypatch.setenv("STEERSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("STEERSPEC_INVARIANT", raising=False)
    model = load_model("verifier")
    first = kernel_path.machine_verdict(model)
    assert set(first) == {"invariant", "rows", "ms"} and first["rows"] in kernel_path.ROW_BUCKETS
    assert (tmp_path / kernel_path.CACHE_FILE).is_file()
    monkeypatch.setattr(kernel_path, "time_paths", lambda *a, **k: pytest.fail("timed again"))
    assert kernel_path.machine_verdict(model) == first
    cached = {**first, "invariant": True, "rows": 4}
    bf16 = load_model("verifier", dtype="bfloat16")
    (tmp_path / kernel_path.CACHE_FILE).write_text(json.dumps({kernel_path.cache_key(bf16): cached}))
    assert kernel_path.apply_invariance(bf16, "auto") == InvariantPlan(rows=4)


def test_a_path_shaped_tree_runs_the_chain_layout_and_equals_it(tiny):
    """A tree that is a path (each node the child of the one before) is verified as a chain: no gathered keys, and
    the logits equal the chain pass's bit for bit (both equal one-token decoding)."""
    from steerspec.models.invariant_pass import is_chain

    gen = torch.Generator().manual_seed(9)
    prefix = torch.randint(0, int(tiny.config.vocab_size), (45,), generator=gen).tolist()
    feed = torch.randint(0, int(tiny.config.vocab_size), (5,), generator=gen).tolist()
    start, n = len(prefix), len(feed)
    visible = torch.cat([torch.ones(n, start, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril_()], dim=1)
    positions = torch.arange(start, start + n)
    assert is_chain(start, positions, visible)
    assert not is_chain(start, positions - 1, visible) and not is_chain(start, positions, visible.tril(start - 1))
    chain, tree = FastCachedLM(tiny), FastCachedLM(tiny)
    chain.extend(prefix)
    tree.extend(prefix)
    assert torch.equal(chain.extend(feed).logits, tree.extend_tree(feed, positions, visible).logits)
