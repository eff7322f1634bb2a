"""Model loading (local SwiGLU checkpoints, bundled tiny pair) and KV-cached stepping."""

from steerspec.models.backends import as_cached, cached_lm
from steerspec.models.checkpoints import BUNDLED_NAMES, bundled_models, resolve_model_dir
from steerspec.models.kv import CachedLM, FastCachedLM, StepOutput
from steerspec.models.loading import (
    context_length,
    eos_token_ids,
    kv_bytes_per_token,
    load_model,
    load_tokenizer,
    parameter_count,
)

__all__ = [
    "BUNDLED_NAMES",
    "CachedLM",
    "FastCachedLM",
    "cached_lm",
    "StepOutput",
    "as_cached",
    "bundled_models",
    "context_length",
    "eos_token_ids",
    "kv_bytes_per_token",
    "load_model",
    "load_tokenizer",
    "parameter_count",
    "resolve_model_dir",
]
