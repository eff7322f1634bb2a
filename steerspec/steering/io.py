"""Steering weights inside a drafter checkpoint directory.

A steered drafter directory is a plain transformers checkpoint (config.json, model.safetensors,
tokenizer files) plus two files:
- `steering.safetensors`: `head.*` (W_hml, run by the verifier) and `drafter.*` (W_s);
- `steering.json`: the shapes and the verifier layers the head reads.
Weights are stored in fp16 and loaded as float32 unless a dtype is given.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Tuple, Union

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from steerspec.models.checkpoints import resolve_model_dir
from steerspec.steering.drafter import DrafterSteering
from steerspec.steering.verifier_head import SteeringHead

WEIGHTS_FILE = "steering.safetensors"
CONFIG_FILE = "steering.json"
FORMAT = "steerspec-sd2/1"
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens")

PathLike = Union[str, Path]


@dataclass
class SteeringConfig:
    """What a steering checkpoint is shaped for."""

    verifier_hidden_size: int
    verifier_layers: Tuple[int, int, int]
    drafter_layers: int
    intermediate_size: int
    verifier_num_layers: Optional[int] = None
    verifier: Optional[str] = None
    format: str = FORMAT
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = asdict(self)
        out["verifier_layers"] = list(self.verifier_layers)
        return out

    @classmethod
    def from_json(cls, data: dict) -> "SteeringConfig":
        if data.get("format") != FORMAT:
            raise ValueError(f"unknown steering format {data.get('format')!r} (expected {FORMAT!r})")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        known["verifier_layers"] = tuple(int(i) for i in known["verifier_layers"])
        return cls(**known)


@dataclass
class SteeringWeights:
    """A loaded steering checkpoint: config, verifier head W_hml and drafter W_s."""

    config: SteeringConfig
    head: SteeringHead
    drafter: DrafterSteering


def has_steering(directory: PathLike) -> bool:
    """True when `directory` holds steering weights (an SD² drafter checkpoint)."""
    d = Path(directory)
    return (d / WEIGHTS_FILE).is_file() and (d / CONFIG_FILE).is_file()


def steering_dir(drafter) -> Optional[str]:
    """The drafter's checkpoint directory when it carries SD² steering weights, else None."""
    path = resolve_model_dir(str(drafter))
    return str(path) if has_steering(path) else None


def save_steering(
    directory: PathLike,
    head: SteeringHead,
    steering: DrafterSteering,
    *,
    verifier_num_layers: Optional[int] = None,
    verifier: Optional[str] = None,
    extra: Optional[dict] = None,
    dtype: torch.dtype = torch.float16,
) -> SteeringConfig:
    """Write `steering.safetensors` + `steering.json` into `directory` (created if needed)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    config = SteeringConfig(
        verifier_hidden_size=head.hidden_size,
        verifier_layers=tuple(head.layers),
        drafter_layers=steering.num_layers,
        intermediate_size=steering.intermediate_size,
        verifier_num_layers=verifier_num_layers,
        verifier=verifier,
        extra=dict(extra or {}),
    )
    if steering.steer_dim != head.hidden_size:
        raise ValueError(f"W_s reads {steering.steer_dim}-d vectors but W_hml makes {head.hidden_size}-d ones")
    tensors = {f"head.{k}": v for k, v in head.state_dict().items()}
    tensors.update({f"drafter.{k}": v for k, v in steering.state_dict().items()})
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(d / WEIGHTS_FILE), metadata={"format": FORMAT})
    (d / CONFIG_FILE).write_text(json.dumps(config.to_json(), indent=2) + "\n")
    return config


def load_steering_config(directory: PathLike) -> SteeringConfig:
    return SteeringConfig.from_json(json.loads((Path(directory) / CONFIG_FILE).read_text()))


def load_steering(directory: PathLike, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu") -> SteeringWeights:
    """Load the head and W_s saved by `save_steering`."""
    d = Path(directory)
    if not has_steering(d):
        raise FileNotFoundError(f"{d} has no {WEIGHTS_FILE} + {CONFIG_FILE}: not an SD² drafter checkpoint")
    config = load_steering_config(d)
    tensors = load_file(str(d / WEIGHTS_FILE))
    head = SteeringHead(config.verifier_hidden_size, config.verifier_layers)
    drafter = DrafterSteering(config.verifier_hidden_size, config.drafter_layers, config.intermediate_size)
    head.load_state_dict({k[len("head."):]: v for k, v in tensors.items() if k.startswith("head.")})
    drafter.load_state_dict({k[len("drafter."):]: v for k, v in tensors.items() if k.startswith("drafter.")})
    head.to(device=device, dtype=dtype).eval()
    drafter.to(device=device, dtype=dtype).eval()
    head.checkpoint = drafter.checkpoint = str(d.resolve())  # what the services' model identity fingerprints
    return SteeringWeights(config=config, head=head, drafter=drafter)


def load_steering_head(directory: PathLike, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu") -> SteeringHead:
    """Only W_hml (what the verifier service needs)."""
    return load_steering(directory, dtype=dtype, device=device).head


def copy_tokenizer(src: PathLike, dst: PathLike) -> None:
    """Copy tokenizer files from one checkpoint directory to another."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name.startswith(TOKENIZER_PREFIXES):
            shutil.copy2(f, dst / f.name)


def save_drafter_checkpoint(
    directory: PathLike,
    model: nn.Module,
    *,
    tokenizer_from: Optional[PathLike] = None,
    head: Optional[SteeringHead] = None,
    steering: Optional[DrafterSteering] = None,
    verifier_num_layers: Optional[int] = None,
    verifier: Optional[str] = None,
    extra: Optional[dict] = None,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """A transformers checkpoint of `model` stored in `dtype`, + tokenizer, + steering weights if given."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stored = copy.deepcopy(model).to(dtype)
    stored.save_pretrained(str(d), safe_serialization=True)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, d)
    if (head is None) != (steering is None):
        raise ValueError("save both the steering head and W_s, or neither")
    if head is not None:
        save_steering(d, head, steering, verifier_num_layers=verifier_num_layers, verifier=verifier, extra=extra,
                      dtype=dtype)
    return d
