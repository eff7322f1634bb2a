"""The SPRINTER classifier head: a small MLP on drafter features giving P(token acceptable).

Stored beside its drafter as `<drafter_dir>/sprinter/` (head.safetensors + head.json + MODEL_CARD.md)
unless a directory is named explicitly; a drafter without a head cannot run SPRINTER.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from steerspec.errors import UsageError
from steerspec.models.checkpoints import model_dir_of
from steerspec.models.draft_temperature import of_dir

HEAD_DIRNAME = "sprinter"
WEIGHTS = "head.safetensors"
META = "head.json"


class SprinterHead(nn.Module):
    """LayerNorm → Linear(F, H) → GELU → Linear(H, 1); `forward` returns logits, `prob` P(acceptable)."""

    def __init__(self, feature_dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.feature_dim, self.hidden = int(feature_dim), int(hidden)
        self.norm = nn.LayerNorm(self.feature_dim)
        self.fc1 = nn.Linear(self.feature_dim, self.hidden)
        self.fc2 = nn.Linear(self.hidden, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(features)))).squeeze(-1)

    @torch.inference_mode()
    def prob(self, features: Tensor) -> Tensor:
        """P(acceptable) per feature row."""
        return torch.sigmoid(self(features.to(self.fc1.weight.dtype)))


def head_dir_for(drafter_dir: Union[str, Path]) -> Path:
    """Where a drafter's head lives by default: <its directory>/sprinter (a bundled name resolved)."""
    return model_dir_of(drafter_dir) / HEAD_DIRNAME


def save_head(head: SprinterHead, out: Union[str, Path], meta: Dict[str, Any]) -> Path:
    """Write the head's weights (fp32 safetensors) and its metadata JSON into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()}, str(out / WEIGHTS))
    full = dict(meta, feature_dim=head.feature_dim, hidden=head.hidden)
    (out / META).write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")
    return out


def load_head(path: Union[str, Path], device: Union[str, torch.device] = "cpu") -> "LoadedHead":
    """Load a head directory; UsageError (one line) when it is absent or malformed."""
    path = Path(path)
    if not (path / WEIGHTS).is_file() or not (path / META).is_file():
        raise UsageError(f"no SPRINTER head in {path} (expected {WEIGHTS} and {META}); train one with "
                         f"`steerspec train sprinter --drafter DIR`")
    meta = json.loads((path / META).read_text())
    head = SprinterHead(meta["feature_dim"], meta["hidden"])
    head.load_state_dict(load_file(str(path / WEIGHTS)))
    head.eval().to(device)
    return LoadedHead(head=head, meta=meta, path=path)


class LoadedHead:
    """A head with its metadata (training λ, threshold, held-out metrics, the pair it was trained on)."""

    def __init__(self, head: SprinterHead, meta: Dict[str, Any], path: Optional[Path] = None) -> None:
        self.head, self.meta, self.path = head, meta, path

    @property
    def lam(self) -> float:
        return float(self.meta.get("lambda", 1.0))

    @property
    def default_threshold(self) -> float:
        return float(self.meta.get("threshold", 0.5))


def resolve_head(drafter_dir: Union[str, Path], head: Optional[Union[str, Path]] = None,
                 device: Union[str, torch.device] = "cpu") -> LoadedHead:
    """The explicit head directory, or the drafter's own; UsageError naming the drafter when none."""
    if head is not None:
        return _check_temperature(load_head(head, device), drafter_dir)
    path = head_dir_for(drafter_dir)
    if not (path / WEIGHTS).is_file():
        raise UsageError(f"sprinter needs a classifier head for the drafter {drafter_dir} and it has none "
                         f"({path}); train one with `steerspec train sprinter --drafter {drafter_dir}` "
                         f"or pass --sprinter-head DIR")
    return _check_temperature(load_head(path, device), drafter_dir)


def _check_temperature(loaded: LoadedHead, drafter_dir: Union[str, Path]) -> LoadedHead:
    """UsageError unless the head was trained on the drafter's q as calibrated now (its features hold q(x)
    and H(q), which a draft temperature changes): a head from before a calibration would misjudge tokens."""
    want, have = of_dir(drafter_dir) or 1.0, float(loaded.meta.get("draft_temperature") or 1.0)
    if abs(want - have) > 1e-9:
        raise UsageError(f"the SPRINTER head {loaded.path} was trained on the drafter at draft temperature {have:g}, "
                         f"but {drafter_dir} is calibrated at {want:g}; retrain it with "
                         f"`steerspec train sprinter --drafter {drafter_dir}`")
    return loaded
