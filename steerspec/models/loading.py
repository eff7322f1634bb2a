"""Load SwiGLU decoder checkpoints (Llama, Qwen2, Qwen3, Mistral) from local directories only.

Where a name points (bundled names, local directories; a hub id is refused) is `checkpoints.py`.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Union

import torch

from steerspec.errors import UsageError
from steerspec.models import draft_temperature, reduced
from steerspec.models.checkpoints import resolve_model_dir

SWIGLU_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_swiglu(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    model_type = config.get("model_type", "?")
    act = config.get("hidden_act", "silu")
    if model_type not in SWIGLU_MODEL_TYPES or act not in ("silu", "swish"):
        raise UsageError(f"unsupported architecture '{model_type}' (hidden_act={act}) in {path}: SteerSpec "
                         "loads SwiGLU decoders only (Llama, Qwen2, Qwen3, Mistral)")
    return config


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: Union[str, torch.device]) -> torch.device:
    """cpu | cuda | cuda:N | auto (cuda when available, else cpu)."""
    text = str(device)
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text != "cpu" and not (text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())):
        raise UsageError(f"unknown device '{text}': use cpu, cuda, cuda:N or auto")
    if text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"device '{text}' requested but CUDA is not available; use --device cpu")
        index = int(text[5:]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise UsageError(f"device '{text}' does not exist ({torch.cuda.device_count()} CUDA devices)")
    return torch.device(text)


def load_model(name_or_dir: Union[str, Path], dtype: Union[str, torch.dtype] = "float32",
               device: Union[str, torch.device] = "cpu", cpu_layout: bool = True, draft_temperature: bool = True):
    """Load a causal LM from a local directory or bundled name, in eval mode on `device`.

    On a CPU its linear weights are stored input-major (`use_input_major_weights`) unless
    `cpu_layout` is False (training that saves the model back should pass False). A drafter whose
    config carries a calibrated draft temperature (`models/draft_temperature.py`) has it folded into its
    head; `draft_temperature=False` gives the raw logits and drops the setting (training and calibration,
    whose output must be calibrated afresh)."""
    # lazy: transformers takes seconds to import
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    path = resolve_model_dir(name_or_dir)
    check_swiglu(path)

    if reduced.is_reduced_dir(path):
        model = reduced.load_reduced(path, dtype=torch_dtype).to(torch_device).eval()
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch_dtype)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot load model from {path}: {str(exc).splitlines()[0]}") from exc
        model.to(torch_device).eval()
        if model.generation_config.pad_token_id is None and model.generation_config.eos_token_id is not None:
            eos = model.generation_config.eos_token_id
            model.generation_config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    model.requires_grad_(False)
    _draft_temperature(model, path, draft_temperature)
    if cpu_layout:
        use_input_major_weights(model)
    return model


def _draft_temperature(model, path: Path, apply: bool) -> None:
    """Fold the config's calibrated draft temperature into the head, or (apply=False) drop the setting."""
    t = draft_temperature.configured(model.config)
    if t is None:
        return
    if not apply:
        draft_temperature.clear(model.config)
        return
    try:
        draft_temperature.apply(model, t)
    except ValueError as exc:
        raise UsageError(f"{path}/config.json: {exc} ({draft_temperature.CONFIG_KEY}); rerun "
                         "`steerspec train temperature` or remove the key") from None


def use_input_major_weights(model) -> int:
    """On a CPU, store every linear weight [out, in] transposed in memory (same shape and values).

    F.linear then hands BLAS an untransposed [in, out] matrix, which its small-batch kernels stream
    faster: measured on 2 cores, SmolLM2-135M's one-token step 53 -> 41 ms, a 5-token verify 69 -> 63
    ms, the 2-layer drafter's step 5.6 -> 3.8 ms. Tied embeddings follow their head (a lookup reads
    a strided row: negligible for decoding). Parameters keep their identity (`.data` is replaced), so
    ties, hooks and in-place updates still hold. Returns how many weights were changed."""
    changed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (isinstance(module, torch.nn.Linear) or isinstance(getattr(module, "support", None), torch.Tensor)):
            continue
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.device.type != "cpu":
            continue
        if weight.is_contiguous() and weight.shape[0] > 1 and weight.shape[1] > 1:
            weight.data = weight.data.t().contiguous().t()
            changed += 1
    return changed


def load_tokenizer(name_or_dir: Union[str, Path]):
    """The tokenizer saved beside a checkpoint (local files only)."""
    # lazy: transformers takes seconds to import
    from transformers import AutoTokenizer

    path = resolve_model_dir(name_or_dir)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load a tokenizer from {path}: {str(exc).splitlines()[0]}") from exc


def context_length(model) -> int:
    """The longest sequence the model was built for (max_position_embeddings)."""
    return int(getattr(model.config, "max_position_embeddings", 0) or 2048)


def eos_token_ids(model, tokenizer=None) -> tuple:
    """End-of-sequence ids from the generation config, else the tokenizer."""
    eos = model.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def cache_kwarg(model) -> str:
    """The name `model.forward` takes its KV cache by: `cache` from transformers 5.2x (where
    `past_key_values` warns and is removed in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V one token occupies across all layers."""
    cfg = model.config
    layers = int(cfg.num_hidden_layers)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    itemsize = next(model.parameters()).element_size()
    return 2 * layers * heads * head_dim * itemsize


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


SMALL_MODEL_PARAMS = 100_000_000


def apply_threads(threads: int, verifier) -> int:
    """Set torch's intra-op threads (0 = auto, see --threads); returns the count in use."""
    if threads < 0:
        raise UsageError(f"--threads must be >= 0 (0 = auto), got {threads}")
    if threads == 0 and verifier.device.type == "cpu" and parameter_count(verifier) < SMALL_MODEL_PARAMS:
        threads = 1
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
