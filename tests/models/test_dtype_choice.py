"""`--dtype auto`: the verifier's dtype chosen on the machine among the exact paths, timed once and cached."""

import json

import pytest
import torch

from steerspec.errors import UsageError
from steerspec.models import dtype_choice, kernel_path, layouts
from steerspec.models.layouts import drafter_dtype
from steerspec.models.loading import load_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty kernel-path cache and no overrides."""
    monkeypatch.setenv("STEERSPEC_CACHE", str(tmp_path))
    for name in (dtype_choice.ENV, kernel_path.ENV, kernel_path.ROWS_ENV):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / kernel_path.CACHE_FILE


def test_explicit_dtypes_pass_and_bad_ones_are_refused(cache, monkeypatch):
    assert dtype_choice.resolve("bfloat16", "verifier") == "bfloat16"
    assert dtype_choice.resolve_path("bfloat16", "auto", "verifier") == ("bfloat16", "auto")
    with pytest.raises(UsageError, match="use one of"):
        dtype_choice.resolve("half", "verifier")
    monkeypatch.setenv(dtype_choice.ENV, "float16")
    assert dtype_choice.resolve("auto", "verifier") == "float16"
    monkeypatch.setenv(dtype_choice.ENV, "fp8")
    with pytest.raises(UsageError, match="STEERSPEC_DTYPE"):
        dtype_choice.resolve("auto", "verifier")


def test_without_native_bfloat16_auto_is_float32_untimed(cache, monkeypatch):
    monkeypatch.setattr(layouts, "native_bf16", lambda: False)
    monkeypatch.setattr(dtype_choice, "time_dtypes", lambda *a, **k: pytest.fail("timed"))
    assert dtype_choice.resolve_path("auto", "auto", "verifier") == ("float32", "auto")
    assert drafter_dtype("auto", "auto") == "float32" and drafter_dtype(None, "auto") == "float32"


def test_auto_times_the_exact_paths_once_and_reads_the_cache(cache, monkeypatch):
    monkeypatch.setattr(layouts, "native_bf16", lambda: True)
    first = dtype_choice.resolve("auto", "verifier", threads=1)
    entries = json.loads(cache.read_text())
    (key, verdict), = [(k, v) for k, v in entries.items() if k.startswith("dtype|")]
    assert "threads=1" in key and verdict["dtype"] == first
    assert set(verdict["ms"]) == {"float32", "bfloat16"}  # ordinary bfloat16 is no candidate: it is not exact
    assert set(verdict["ms"]["bfloat16"]) == {str(n) for n in dtype_choice.TIMED_ROWS}
    assert verdict["rows"] in kernel_path.ROW_BUCKETS
    monkeypatch.setattr(dtype_choice, "time_dtypes", lambda *a, **k: pytest.fail("timed again"))
    assert dtype_choice.resolve("auto", "verifier", threads=1) == first
    assert drafter_dtype("auto", "auto") == "bfloat16"  # a drafter on a native CPU computes in bfloat16 either way


def test_bfloat16_chosen_by_auto_runs_invariant(cache, monkeypatch):
    """Chosen for its invariant path, bfloat16 keeps it: `auto` (or unset) invariance becomes on; `off` is honoured."""
    monkeypatch.setattr(layouts, "native_bf16", lambda: True)
    key = dtype_choice._key("verifier", None)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({key: {"dtype": "bfloat16", "ms": {}, "rows": 8}}))
    assert dtype_choice.resolve_path("auto", "auto", "verifier") == ("bfloat16", "on")
    assert dtype_choice.resolve_path("auto", None, "verifier") == ("bfloat16", "on")
    assert dtype_choice.resolve_path("auto", "off", "verifier") == ("bfloat16", "off")
    monkeypatch.setenv(kernel_path.ROWS_ENV, "8")  # the invariant row bucket, untimed
    dtype, invariant = dtype_choice.resolve_path("auto", "auto", "verifier")
    model = load_model("verifier", dtype=dtype)
    assert kernel_path.apply_invariance(model, invariant).rows == 8 and next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(UsageError, match="unknown dtype"):  # load_model takes a resolved dtype only
        load_model("verifier", dtype="auto")
