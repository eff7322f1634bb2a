"""Train a reduced smollm2 drafter on the code corpus: seeded, resumable, tqdm progress, file log.

The objective is next-token cross-entropy over the drafter's support (tokens outside it are
ignored: the drafter assigns them q = 0 by design), optionally only where a target mask is set
(distillation on the verifier's answers: prompt tokens give context, not targets). Only the drafter's own decoder layers and
final norm train; the embedding and head rows stay the verifier's. Checkpoints (own weights,
optimizer, step) are written atomically every `checkpoint_s` seconds and on exit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from steerspec.models.reduced import own_state_dict

CHECKPOINT = "checkpoint.pt"


@dataclass
class LoopConfig:
    steps: int = 500
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 5e-4
    min_lr_frac: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 1234
    checkpoint_s: float = 600.0


def lr_at(step: int, cfg: LoopConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_frac * lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def support_index(support: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary id -> position in the support, -100 (ignored) outside it."""
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[support] = torch.arange(support.numel())
    return index


def window_starts(size: int, step: int, cfg: LoopConfig) -> np.ndarray:
    """Deterministic window starts for `step` (same on resume)."""
    rng = np.random.default_rng([cfg.seed, step])
    return rng.integers(0, size - cfg.seq_len - 1, size=cfg.batch_size)


def batch_at(tokens: np.ndarray, step: int, cfg: LoopConfig) -> torch.Tensor:
    """A deterministic batch of windows for `step` (same on resume): [B, T+1] token ids."""
    starts = window_starts(tokens.size, step, cfg)
    return torch.from_numpy(np.stack([tokens[s: s + cfg.seq_len + 1].astype(np.int64) for s in starts]))


def mask_at(mask: np.ndarray, step: int, cfg: LoopConfig) -> torch.Tensor:
    """The target mask of `batch_at`'s windows: [B, T] bools, True where the next token is a target."""
    starts = window_starts(mask.size, step, cfg)
    return torch.from_numpy(np.stack([mask[s + 1: s + cfg.seq_len + 1].astype(bool) for s in starts]))


def reduced_loss(model, batch: torch.Tensor, index: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean cross-entropy over the support for next-token targets in `batch` ([B, T+1]), where `mask` ([B, T]) is set."""
    hidden = model.model(input_ids=batch[:, :-1]).last_hidden_state
    logits = model.lm_head.reduced(hidden)
    targets = index[batch[:, 1:]]
    if mask is not None:
        targets = targets.masked_fill(~mask, -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)


def _save(model, optimizer, step: int, cfg: LoopConfig, work: Path) -> None:
    state = {"own": own_state_dict(model), "optimizer": optimizer.state_dict(), "step": step, "config": asdict(cfg)}
    tmp = work / (CHECKPOINT + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, work / CHECKPOINT)


def train(model, tokens: np.ndarray, cfg: LoopConfig, work: Path, log: Optional[logging.Logger] = None,
          stop_file: Optional[Path] = None, target_mask: Optional[np.ndarray] = None) -> Dict[str, float]:
    """Run (or resume) training in `work`; returns the last step's figures. A `stop_file` ends it early.

    `target_mask` (same length as `tokens`) keeps only the targets at positions where it is true.
    """
    if target_mask is not None and target_mask.shape != tokens.shape:
        raise ValueError(f"target_mask has shape {target_mask.shape}, tokens {tokens.shape}")

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    log = log or logging.getLogger("steerspec.train.smollm2_loop")
    torch.manual_seed(cfg.seed)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("model.layers.") or name == "model.norm.weight")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    start = 0
    if (work / CHECKPOINT).is_file():
        state = torch.load(work / CHECKPOINT, map_location="cpu")
        model.load_state_dict(state["own"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        log.info("resumed at step %d", start)
    device = model.lm_head.weight.device
    index = support_index(model.lm_head.support.cpu(), model.config.vocab_size).to(device)
    model.train()
    last_save, figures = time.monotonic(), {}
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train", mininterval=5)
    step = start
    for step in bar:
        t0 = time.monotonic()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        mask = None if target_mask is None else mask_at(target_mask, step, cfg).to(device)
        loss = reduced_loss(model, batch_at(tokens, step, cfg).to(device), index, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        optimizer.step()
        dt = time.monotonic() - t0
        figures = {"step": step + 1, "loss": float(loss.detach()), "grad_norm": float(norm), "lr": lr_at(step, cfg),
                   "tokens_per_s": cfg.batch_size * cfg.seq_len / dt}
        bar.set_postfix(loss=f"{figures['loss']:.3f}", tps=f"{figures['tokens_per_s']:.0f}")
        log.info(json.dumps(figures))
        if time.monotonic() - last_save >= cfg.checkpoint_s:
            _save(model, optimizer, step + 1, cfg, work)
            last_save = time.monotonic()
        if stop_file is not None and Path(stop_file).exists():
            log.info("stop file seen at step %d", step + 1)
            step += 1
            break
    else:
        step = cfg.steps
    _save(model, optimizer, max(step, start), cfg, work)
    model.eval()
    return figures
