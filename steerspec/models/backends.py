"""Which KV-cached wrapper a model runs in: `cached_lm(model, backend)` picks among kv.py's and graphed.py's."""

from __future__ import annotations

import os

from steerspec.models.graphed import GraphedLM
from steerspec.models.kv import CachedLM, FastCachedLM

BACKENDS = ("auto", "fast", "hf", "graphed")


def cached_lm(model, backend: str = "auto") -> CachedLM:
    """A KV-cached wrapper: `fast` (lean forward, growing cache), `graphed` (a slot of a shared
    static cache, CUDA graphs on a GPU: steerspec/models/graphed.py), `hf` (transformers forward,
    DynamicCache) or `auto` (graphed on CUDA, fast on a CPU, when the architecture qualifies;
    STEERSPEC_GRAPHED=0 keeps auto at fast)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
    if backend == "graphed" or (backend == "auto" and model.device.type == "cuda"
                                and os.environ.get("STEERSPEC_GRAPHED", "1") != "0" and FastCachedLM.supports(model)):
        if not FastCachedLM.supports(model):
            raise ValueError(f"the graphed backend does not support {type(model).__name__}")
        return GraphedLM(model)
    if backend == "fast" or (backend == "auto" and FastCachedLM.supports(model)):
        if not FastCachedLM.supports(model):
            raise ValueError(f"the fast backend does not support {type(model).__name__}")
        return FastCachedLM(model)
    return CachedLM(model)


def as_cached(model_or_cached, backend: str = "auto") -> CachedLM:
    """Wrap a model in a cached LM, or pass a CachedLM through."""
    return model_or_cached if isinstance(model_or_cached, CachedLM) else cached_lm(model_or_cached, backend)
