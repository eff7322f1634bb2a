"""Trained heads for draft-length policies: SpecDec++'s rejection head and Pacer's pre-verification layer.

Both read the drafter's final hidden states (what its LM head reads). A head file is a torch
checkpoint {"kind", "hidden_size", "config", "state_dict", "meta"}; `load_head` refuses a head
whose kind or hidden size does not match.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from steerspec.models.checkpoints import model_dir_of

HEADS_DIR = "policy_heads"


class SpecDecHead(nn.Module):
    """SpecDec++: hidden [.., D] -> logit of P(this draft is rejected | all earlier ones accepted)."""

    def __init__(self, hidden_size: int, width: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, width), nn.SiLU(),
                                 nn.Linear(width, 1))

    def forward(self, hidden: Tensor) -> Tensor:
        return self.net(hidden).squeeze(-1)


class PacerLayer(nn.Module):
    """Pacer's pre-verification layer: one causal transformer layer over [context; h_i + e_i].

    `context` [B, C, D] are hidden states of earlier accepted tokens (no position embedding);
    `drafts` [B, N, D] with draft positions `positions` [N] (0-based). Returns acceptance logits [B, N].
    """

    def __init__(self, hidden_size: int, heads: int = 4, ff: int = 256, max_positions: int = 64) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.position = nn.Embedding(max_positions, hidden_size)
        nn.init.normal_(self.position.weight, std=0.02)
        self.layer = nn.TransformerEncoderLayer(hidden_size, heads, ff, dropout=0.0, batch_first=True,
                                                norm_first=True)
        self.out = nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, 1))

    def forward(self, context: Tensor, drafts: Tensor, positions: Tensor) -> Tensor:
        n = drafts.shape[1]
        x = torch.cat([context, drafts + self.position(positions.clamp_max(self.max_positions - 1))], dim=1)
        total = x.shape[1]
        mask = torch.triu(torch.full((total, total), float("-inf"), device=x.device), diagonal=1)
        y = self.layer(x, src_mask=mask)
        return self.out(y[:, total - n:]).squeeze(-1)


KINDS = {"specdecpp": SpecDecHead, "pacer": PacerLayer}


def head_path(kind: str, drafter_dir: Optional[str]) -> Path:
    """Where a drafter's head of this kind lives: <drafter_dir>/policy_heads/<kind>.safetensors (a bundled
    drafter's name resolved to its directory)."""
    if not drafter_dir:
        raise FileNotFoundError(f"{kind} needs a trained head: give head=PATH or a drafter directory "
                                f"(train one with `steerspec train {kind}`)")
    return model_dir_of(drafter_dir) / HEADS_DIR / f"{kind}.safetensors"


def save_head(path: os.PathLike, kind: str, module: nn.Module, config: Dict[str, Any], meta: Dict[str, Any]) -> None:
    """Write a head as safetensors (fp16 weights, small; kind, config and meta in its JSON header)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).cpu().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(path), metadata={"kind": kind, "hidden_size": str(int(config["hidden_size"])),
                                          "config": json.dumps(config), "meta": json.dumps(meta)})


def build_head(kind: str, config: Dict[str, Any]) -> nn.Module:
    """A fresh head of `kind` from its config (hidden_size plus the kind's sizes)."""
    return KINDS[kind](**config)


def load_head(kind: str, path: os.PathLike, hidden_size: Optional[int], device: str = "cpu") -> nn.Module:
    """Load a head; refuse a missing file, another kind, or a hidden size other than the drafter's."""
    return load_head_and_meta(kind, path, hidden_size, device)[0]


def load_head_and_meta(kind: str, path: os.PathLike, hidden_size: Optional[int],
                       device: str = "cpu") -> Tuple[nn.Module, Dict[str, Any]]:
    """`load_head` plus the `meta` the head was saved with (training report, Pacer's tuned defaults)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {kind} head at {path}; train one with `steerspec train {kind} "
                                f"--drafter DIR` or give head=PATH")

    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
            state = {k: handle.get_tensor(k) for k in handle.keys()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a {kind} head (safetensors): {exc}") from None
    blob = {"kind": header.get("kind"), "hidden_size": header.get("hidden_size", 0),
            "config": json.loads(header.get("config", "{}")), "state_dict": state}
    if blob.get("kind") != kind:
        raise ValueError(f"{path} is a {blob.get('kind')!r} head, not {kind!r}")
    if hidden_size is not None and int(blob["hidden_size"]) != int(hidden_size):
        raise ValueError(f"the {kind} head at {path} was trained for hidden size {blob['hidden_size']}, "
                         f"the drafter has {hidden_size}: train one for this drafter")
    module = build_head(kind, blob["config"])
    module.load_state_dict({k: v.float() for k, v in blob["state_dict"].items()})
    return module.to(device).eval(), json.loads(header.get("meta", "{}"))


def context_hidden_size(context: Any) -> Optional[int]:
    """The drafter's hidden size from a PolicyContext (None when unknown)."""
    if context is None:
        return None
    if getattr(context, "hidden_size", None):
        return int(context.hidden_size)
    drafter = getattr(context, "drafter", None)
    size = getattr(drafter, "hidden_size", None)
    return int(size) if size else None
