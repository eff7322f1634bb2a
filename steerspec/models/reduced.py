"""A small Llama drafter built from a verifier, with a reduced draft vocabulary (FR-Spec style).

The drafter keeps a few decoder layers of its own (initialised from chosen verifier layers) and
reads the verifier's token embeddings at load time: its input embedding is the verifier's full
table and its head is the verifier's rows for the N most frequent tokens (`support`). The head
scatters those N logits into a full-vocabulary row with MASKED_LOGIT elsewhere, so q is a full
distribution over the verifier's vocabulary that is exactly 0 outside the support: speculative
sampling stays exact. The saved file holds only the drafter's own parameters and its support.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Sequence, Union

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.nn import functional as F

from steerspec.models import draft_temperature
from steerspec.models.checkpoints import resolve_model_dir

REDUCED_KEY = "steerspec_reduced"
WEIGHTS_NAME = "drafter.safetensors"
MASKED_LOGIT = -1e9  # softmax gives exactly 0; finite so isfinite checks and temperature scaling hold


def masked_logit(dtype: torch.dtype) -> float:
    """MASKED_LOGIT where `dtype` holds it, else half its most negative value (float16: −32752, where −1e9 used to
    make `--dtype float16` fail): still exactly 0 after softmax (sampling scales by temperature in float32)."""
    return max(MASKED_LOGIT, torch.finfo(dtype).min / 2)


class ReducedHead(nn.Module):
    """Logits for `support` tokens (rows of the verifier's embedding), scattered into the full vocabulary."""

    def __init__(self, rows: Tensor, support: Tensor, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(rows, requires_grad=False)
        self.bias = None
        self.register_buffer("support", support.to(torch.long), persistent=False)
        column = torch.full((int(vocab_size),), -1, dtype=torch.long)
        column[self.support] = torch.arange(self.support.numel())
        self.register_buffer("column", column, persistent=False)  # token id -> its logit's column, −1 off the support
        self.vocab_size = int(vocab_size)

    def reduced(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [..., N] logits over the support only (what training uses)."""
        return F.linear(hidden, self.weight)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.scatter(self.reduced(hidden))

    def scatter(self, small: Tensor) -> Tensor:
        """[..., N] support logits -> [..., V] full-vocabulary logits, MASKED_LOGIT off the support."""
        out = small.new_full(small.shape[:-1] + (self.vocab_size,), masked_logit(small.dtype))
        out.index_copy_(-1, self.support, small)
        return out


def is_reduced_dir(path: Union[str, Path]) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and REDUCED_KEY in json.loads(config.read_text())


def verifier_embedding(verifier_dir: Path) -> Tensor:
    """The verifier's input-embedding table, read from its safetensors without loading the model."""
    for file in sorted(Path(verifier_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            if "model.embed_tokens.weight" in handle.keys():
                return handle.get_tensor("model.embed_tokens.weight")
    raise FileNotFoundError(f"no model.embed_tokens.weight in {verifier_dir}")


def drafter_config(verifier_config: Dict, layers: int, support_size: int, verifier: str, init_layers: Sequence[int]):
    """The drafter's Llama config: the verifier's with `layers` layers and an untied reduced head."""
    # lazy: transformers takes seconds to import
    from transformers import LlamaConfig

    data = {k: v for k, v in verifier_config.items() if k not in ("quantization_config", "_model_name_or_path")}
    data.update(num_hidden_layers=int(layers), tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    data[REDUCED_KEY] = {"verifier": verifier, "support_size": int(support_size), "init_layers": list(init_layers),
                         "shared_from_verifier": ["model.embed_tokens.weight", "lm_head rows = embedding[support]"]}
    return LlamaConfig.from_dict(data)


def assemble(config, embedding: Tensor, support: Tensor, own_state: Optional[Dict[str, Tensor]] = None,
             dtype: torch.dtype = torch.float32):
    """A LlamaForCausalLM with the verifier's embedding, a ReducedHead and (optionally) its own weights."""
    # lazy: transformers takes seconds to import
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # buffers recomputed off meta
    model.model.embed_tokens.weight = nn.Parameter(embedding.to(dtype), requires_grad=False)
    model.lm_head = ReducedHead(embedding[support].to(dtype).clone(), support, config.vocab_size)
    if own_state is not None:
        missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in own_state.items()}, strict=False)
        missing = [k for k in missing if k not in ("model.embed_tokens.weight", "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"drafter weights do not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.to(dtype)


def own_state_dict(model) -> Dict[str, Tensor]:
    """The drafter's own parameters (decoder layers, final norm), not the verifier's shared tables."""
    return {k: v for k, v in model.state_dict().items()
            if k not in ("model.embed_tokens.weight", "lm_head.weight") and "rotary" not in k}


def init_from_verifier(verifier_dir: Path, verifier_name: str, support: Tensor, init_layers: Sequence[int]):
    """A fresh drafter: layers copied from the verifier's `init_layers`, its final norm, its embedding."""
    verifier_dir = Path(verifier_dir)
    vconfig = json.loads((verifier_dir / "config.json").read_text())
    config = drafter_config(vconfig, len(init_layers), int(support.numel()), verifier_name, init_layers)
    state: Dict[str, Tensor] = {}
    for file in sorted(verifier_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    own = {"model.norm.weight": state["model.norm.weight"]}
    for new, old in enumerate(init_layers):
        prefix = f"model.layers.{old}."
        own.update({f"model.layers.{new}." + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    return assemble(config, state["model.embed_tokens.weight"], support, own)


def save_drafter(model, out: Path, dtype: torch.dtype = torch.float16, card: Optional[str] = None) -> Path:
    """Write config.json + drafter.safetensors (own params in `dtype`, the support as int32)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in own_state_dict(model).items()}
    tensors["support"] = model.lm_head.support.to(torch.int32).contiguous()
    save_file(tensors, str(out / WEIGHTS_NAME))
    config = model.config.to_dict()
    config["dtype"] = "float32"
    config["_name_or_path"] = ""  # where it was loaded from on the machine that trained it: not shipped
    config.pop(draft_temperature.CONFIG_KEY, None)  # calibrated for the weights it was read from, not these
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    if card:
        (out / "MODEL_CARD.md").write_text(card)
    return out


def load_reduced(path: Path, dtype: torch.dtype = torch.float32, verifier_dir: Optional[Path] = None):
    """Load a reduced drafter directory, reading the shared tables from its verifier."""
    # lazy: transformers takes seconds to import
    from transformers import GenerationConfig, LlamaConfig

    path = Path(path)
    data = json.loads((path / "config.json").read_text())
    if verifier_dir is None:
        verifier_dir = resolve_model_dir(data[REDUCED_KEY]["verifier"])
    tensors = load_file(str(path / WEIGHTS_NAME))
    support = tensors.pop("support").to(torch.long)
    model = assemble(LlamaConfig.from_dict(data), verifier_embedding(verifier_dir), support, tensors, dtype)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    model.config.name_or_path = model.name_or_path = str(path)  # as from_pretrained sets them: heads are found beside it
    return model


def freeze_shared(model) -> None:
    """Keep the tables a reduced drafter reads from its verifier frozen (no-op for other models):
    they are not saved with it, so training them would be lost."""
    if isinstance(getattr(model, "lm_head", None), ReducedHead):
        model.model.embed_tokens.weight.requires_grad_(False)
        model.lm_head.weight.requires_grad_(False)
