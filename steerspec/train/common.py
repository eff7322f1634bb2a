"""Training helpers shared by the project's trainers (base pretraining, distillation, SD²).

AdamW with decoupled weight decay on matrices only, linear warm-up + cosine decay, gradient
clipping, resumable checkpoints (model, optimizer, step, RNG states) and Hugging Face export with
fp16 storage that loads as float32 by default.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

CHECKPOINT_NAME = "checkpoint.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer_meta.json")


def add_device_argument(parser) -> None:
    """--device: where a trainer computes (the CPU by default; `cuda` where a GPU exists)."""
    parser.add_argument("--device", default="cpu", help="where training computes: cpu | cuda | cuda:N | auto "
                                                        "(default: cpu)")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.1,
    betas=(0.9, 0.95),
    extra_params: Iterable[nn.Parameter] = (),
) -> torch.optim.AdamW:
    """AdamW; weight decay on >= 2-D weights only (not on norms or biases)."""
    params = [p for p in model.parameters() if p.requires_grad] + [p for p in extra_params if p.requires_grad]
    seen, decay, no_decay = set(), [], []
    for p in params:
        if id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)


def lr_at(step: int, total_steps: int, base_lr: float, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up to base_lr over warmup_steps, then cosine decay to min_ratio * base_lr."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return base_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad(model_or_params, max_norm: float) -> float:
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    return float(torch.nn.utils.clip_grad_norm_(list(params), max_norm))


def save_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    generator: Optional[torch.Generator] = None,
    extra: Optional[Dict[str, Any]] = None,
) -> None:
    """Write everything needed to resume, atomically (tmp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
        "generator": generator.get_state() if generator is not None else None,
        "extra": extra or {},
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    generator: Optional[torch.Generator] = None,
) -> Dict[str, Any]:
    """Restore a checkpoint written by save_checkpoint; returns {"step", "extra"}."""
    state = torch.load(Path(path), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])
    random.setstate(state["python_rng"])
    if generator is not None and state.get("generator") is not None:
        generator.set_state(state["generator"])
    return {"step": int(state["step"]), "extra": state.get("extra", {})}


def progress(total: int, initial: int = 0, desc: str = "train"):
    """A tqdm bar that stays readable in log files (updates at most every 5 s)."""
    return tqdm(total=total, initial=initial, desc=desc, mininterval=5.0, dynamic_ncols=True)


def export_hf(model: nn.Module, out: Path, tokenizer_dir: Optional[Path] = None) -> None:
    """Save `model` as a Hugging Face checkpoint: fp16 safetensors, config dtype float32.

    The config says float32 so `from_pretrained(dir)` computes in float32 by default; the
    fp16 storage halves the package size.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to(torch.float16)
    for param in half.parameters():  # safetensors writes contiguous tensors only (see use_input_major_weights)
        param.data = param.data.contiguous()
    half.save_pretrained(str(out), safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen_path = out / "generation_config.json"
    if gen_path.exists():
        gen_path.unlink()
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists():
                shutil.copyfile(src, out / name)


def param_count(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

