"""The verifier service's synchronous settings: where its passes compute and its --prefill-chunk flag (kept apart
from test_verifier_service.py, whose module-wide asyncio mark is for coroutine tests only)."""

from __future__ import annotations

import pytest
import torch

from verifier_service.server import VerifierConfig


def test_inline_compute_follows_the_models_device(monkeypatch):
    """CPU models compute inline, GPU models on a compute thread; the environment variable overrides."""
    from types import SimpleNamespace

    from steerspec.serving.compute import INLINE_ENV, inline_compute

    cpu, gpu = SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(device=SimpleNamespace(type="cuda"))
    monkeypatch.delenv(INLINE_ENV, raising=False)
    assert inline_compute(cpu) and not inline_compute(gpu)
    monkeypatch.setenv(INLINE_ENV, "0")
    assert not inline_compute(cpu)
    monkeypatch.setenv(INLINE_ENV, "1")
    assert inline_compute(gpu)


def test_serve_verifier_prefill_chunk_flag():
    """--prefill-chunk defaults to the config's 512 and refuses a negative count in one line."""
    import argparse

    from steerspec.errors import UsageError
    from verifier_service import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args([]).prefill_chunk == VerifierConfig().prefill_chunk == 512
    assert parser.parse_args(["--prefill-chunk", "0"]).prefill_chunk == 0
    with pytest.raises(UsageError, match="--prefill-chunk"):
        cli.run(parser.parse_args(["--prefill-chunk", "-1"]))
