"""Distil the drafter on the verifier's synthetic answers (the SD² paper's "Distilled" baseline).

Loss: forward KL(p_V ‖ q_D) per token, summed over the vocabulary and averaged over answer tokens
(prompt positions carry no loss), with the verifier's logits computed on the fly (verifier
frozen), or read from the top-K cache `train synth --teacher-top-k` stored (the verifier is then
not loaded at all). A drafter with a reduced vocabulary is fitted on its support: tokens it
cannot propose carry no loss, so it learns p renormalised over its support. AdamW, linear warm-up + cosine decay, gradient clipping; seeded; resumable from
OUT/checkpoint.pt. This module also holds the training loop `steerspec train sd2` reuses with
steering switched on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shlex
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from steerspec.errors import UsageError
from steerspec.models import reduced
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.loading import load_model, resolve_device
from steerspec.models.reduced import MASKED_LOGIT, freeze_shared
from steerspec.steering.drafter import SteeringHooks
from steerspec.steering.io import save_drafter_checkpoint, save_steering
from steerspec.train import common
from steerspec.train.synth import SyntheticSet, load_synthetic

CHECKPOINT = "checkpoint.pt"
REPORT = "train_report.json"


# ----------------------------------------------------------------------------------- the model


class DrafterBundle(nn.Module):
    """What is trained: the drafter and, for SD², the steering head W_hml and W_s."""

    def __init__(self, drafter: nn.Module, head: Optional[nn.Module] = None, steering: Optional[nn.Module] = None):
        super().__init__()
        self.drafter = drafter
        self.head = head
        self.steering = steering

    @property
    def steered(self) -> bool:
        return self.head is not None


# ---------------------------------------------------------------------------------------- math


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


def forward_kl(p_logits: Tensor, q_logits: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Mean over masked positions of KL(p ‖ q) summed over q's support; also mean Σ min(p, q).

    Σ_v min(p, q) = 1 − TV(p, q) is the expected acceptance of a draft token from q under p. Tokens
    a reduced-vocabulary drafter masks out (q = 0) are left out of the KL, which would be infinite.
    """
    logp = F.log_softmax(p_logits.float(), dim=-1)
    logq = F.log_softmax(q_logits.float(), dim=-1)
    p = logp.exp()
    kl = (p * (logp - logq)).masked_fill(q_logits <= MASKED_LOGIT / 2, 0.0).sum(-1)
    with torch.no_grad():
        overlap = _masked_mean(torch.minimum(p, logq.exp()).sum(-1), mask)
    return _masked_mean(kl, mask), overlap


def top_k_kl(top_ids: Tensor, top_logp: Tensor, q_logits: Tensor, mask: Tensor,
             column: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """`forward_kl` with p known only on its top-K tokens (ids [B, T, K], log-probs [B, T, K]).

    The KL and Σ min(p, q) are summed over those K tokens (the rest of p's mass, a few percent on
    code, carries no loss); both equal `forward_kl`'s when K covers the vocabulary. `q_logits` may
    cover only a drafter's support, with `column[v]` the column of token v (−1: off the support).
    """
    ids = top_ids.long()
    if column is None:  # a full-vocabulary row: tokens a reduced drafter masks out are off its support
        cols = ids.masked_fill(q_logits.gather(-1, ids) <= MASKED_LOGIT / 2, -1)
    else:
        cols = column[ids]
    logq = F.log_softmax(q_logits.float(), dim=-1).gather(-1, cols.clamp(min=0))
    logp = top_logp.float()
    p = logp.exp()
    kl = (p * (logp - logq)).masked_fill(cols < 0, 0.0).sum(-1)
    logq = logq.masked_fill(cols < 0, -math.inf)
    with torch.no_grad():
        overlap = _masked_mean(torch.minimum(p, logq.exp()).sum(-1), mask)
    return _masked_mean(kl, mask), overlap


def pad_batch(sequences: List[Tensor], pad_id: int) -> Tuple[Tensor, Tensor]:
    """Right-pad to [B, T]; returns ids and lengths (causal models ignore what follows a row)."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    return ids, lengths


def answer_mask(prompt_lens: Tensor, lengths: Tensor, width: int) -> Tensor:
    """[B, T] True at positions p whose next token p+1 is an answer token (p in [P−1, n−2])."""
    pos = torch.arange(width, device=prompt_lens.device).unsqueeze(0)
    return (pos >= (prompt_lens.unsqueeze(1) - 1)) & (pos <= (lengths.unsqueeze(1) - 2))


def steering_sources(prompt_lens: Tensor, width: int, delta: int) -> Tuple[Tensor, Tensor]:
    """Which verifier position steers each drafter position, for a training offset δ.

    Drafter position p (predicting token p+1) uses the steering vector of verifier position
    p − δ — at inference the vector from position m−1 steers the drafts predicted at positions
    m−1+i, i ∈ [1, k]. The source is clamped to P−2, the last prefill position (the first block's
    vector), and −1 means "no verifier position" (a 1-token prompt: the head applied to zeros).
    Prompt positions (p < P−1) stay unsteered: returns (source [B, T], steered mask [B, T]).
    """
    pos = torch.arange(width, device=prompt_lens.device).unsqueeze(0)
    first = (prompt_lens - 2).unsqueeze(1)
    source = torch.maximum(pos - delta, first).clamp(min=-1)
    steered = pos >= (prompt_lens.unsqueeze(1) - 1)
    return source.expand(len(prompt_lens), width), steered.expand(len(prompt_lens), width)


def block_steering_sources(prompt_lens: Tensor, width: int, k: int, accept: float,
                           rng: random.Random) -> Tuple[Tensor, Tensor]:
    """Sources as decoding produces them: the answer is cut into blocks and every position of a
    block is steered by the vector of the position just before the block starts.

    A block keeps 1 + j positions, j the drafts accepted in it (j ≥ i with probability accept^i,
    capped so a block never exceeds k positions): the offsets inside a block are 1, 2, …, as at
    inference, and the context a position attends to was steered by its own block's older vector,
    also as at inference. The first block starts at P−1 with the prefill's vector (P−2); prompt
    positions stay unsteered. Returns (source [B, T], steered mask [B, T]) like `steering_sources`.
    """
    source, steered = steering_sources(prompt_lens, width, 1)
    source = source.clone()
    for row, plen in enumerate(prompt_lens.tolist()):
        start = plen - 1
        while start < width:
            size = 1
            while size < k and rng.random() < accept:
                size += 1
            source[row, start:start + size] = max(start - 1, -1)
            start += size
    return source, steered


def gather_steering(head, features: Tensor, source: Tensor) -> Tensor:
    """g [B, T, d_V] from the steering features [B, T, 3·d_V] at the `source` positions (−1 = zeros)."""
    with torch.no_grad():
        features = features.float()
        batch, width, dim = features.shape
        features = torch.cat([features, features.new_zeros(batch, 1, dim)], dim=1)
        index = torch.where(source < 0, torch.full_like(source, width), source)
        picked = features.gather(1, index.unsqueeze(-1).expand(batch, width, dim))
    return head(picked)


# ------------------------------------------------------------------------------------ training


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    steer_lr: Optional[float] = None
    warmup: Optional[int] = None
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    k: int = 8
    delta_decay: float = 1.0  # P(δ) ∝ delta_decay^(δ−1): 1 = uniform (the paper), < 1 favours early positions
    block_accept: Optional[float] = None  # set: offsets from simulated blocks (block_steering_sources)
    fixed_delta: Optional[int] = None  # set: this one offset for training and validation (0 = oracle)
    val_fraction: float = 0.05
    eval_every: int = 100
    save_every: int = 50
    bf16: bool = False
    max_minutes: float = 0.0
    stop_at: Optional[int] = None  # stop (checkpointed) at this step: an interruption, for tests
    steer: bool = False
    extra: Dict = field(default_factory=dict)


def _batch_indices(n: int, batch_size: int, step: int, seed: int) -> List[int]:
    """Sequence indices of training step `step` (a fresh permutation per epoch; stateless)."""
    per_epoch = max(1, n // batch_size)
    epoch, slot = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()
    return order[slot * batch_size : (slot + 1) * batch_size]


def delta_weights(k: int, decay: float) -> List[float]:
    """P(δ) for δ = 1..k, ∝ decay^(δ−1): uniform at decay 1 (the paper); a decay near the acceptance
    rate weights each offset by how much its acceptance moves τ (position δ counts only when the
    δ−1 drafts before it were accepted)."""
    weights = [decay ** i for i in range(k)]
    total = sum(weights)
    return [w / total for w in weights]


def _step_rng(seed: int, step: int) -> random.Random:
    """The random stream of training step `step`: stateless, so a resumed run draws the same."""
    return random.Random(seed * 104729 + step)


def _delta(step: int, seed: int, k: int, decay: float = 1.0) -> int:
    """The batch's offset δ ∈ [1, k] (one per batch, as in the authors' code)."""
    rng = _step_rng(seed, step)
    if decay == 1.0:
        return rng.randint(1, k)
    return rng.choices(range(1, k + 1), weights=delta_weights(k, decay))[0]


Sources = Callable[[Tensor, int], Tuple[Tensor, Tensor]]


def training_sources(step: int, cfg: TrainConfig) -> Sources:
    """How training step `step` picks steering sources: one offset δ for the batch (the paper), or
    simulated blocks with `--block-accept`, or one fixed offset; seeded by (seed, step) so a resumed
    run draws the same."""
    if cfg.fixed_delta is not None:
        return partial(steering_sources, delta=cfg.fixed_delta)
    if cfg.block_accept is None:
        return partial(steering_sources, delta=_delta(step, cfg.seed, cfg.k, cfg.delta_decay))
    return partial(block_steering_sources, k=cfg.k, accept=cfg.block_accept, rng=_step_rng(cfg.seed, step))


@dataclass
class Batch:
    """Right-padded rows [B, T] and, when the data caches the verifier, its outputs laid out on them:
    top-K ids/log-probs at the positions that predict answer tokens, steering taps [B, T, 3·d_V]."""

    ids: Tensor
    lengths: Tensor
    plens: Tensor
    top_ids: Optional[Tensor] = None
    top_logp: Optional[Tensor] = None
    features: Optional[Tensor] = None

    def to(self, device: torch.device) -> "Batch":
        """The same batch with every tensor on `device`."""
        moved = {name: None if value is None else value.to(device) for name, value in vars(self).items()}
        return Batch(**moved)


def make_batch(data: SyntheticSet, rows: List[int], pad_id: int, cached: bool = True) -> Batch:
    """The batch of `rows`; with `cached` (and a cache in `data`) the verifier's cached outputs too."""
    ids, lengths = pad_batch([data.sequences[i] for i in rows], pad_id)
    plens = torch.tensor([data.prompt_lens[i] for i in rows])
    batch = Batch(ids, lengths, plens)
    if not cached or data.teacher is None:
        return batch
    width, recs = ids.shape[1], [data.teacher[i] for i in rows]
    k = recs[0].top_ids.shape[1]
    batch.top_ids = torch.zeros(len(rows), width, k, dtype=torch.long)
    batch.top_logp = torch.zeros(len(rows), width, k)
    taps = recs[0].taps
    if taps is not None:
        batch.features = torch.zeros(len(rows), width, taps.shape[1] * taps.shape[2])
    for b, (rec, plen) in enumerate(zip(recs, plens.tolist())):
        n = rec.top_ids.shape[0]
        batch.top_ids[b, plen - 1 : plen - 1 + n] = rec.top_ids.long()
        batch.top_logp[b, plen - 1 : plen - 1 + n] = rec.top_logp.float()
        if batch.features is not None:
            flat = rec.taps.float().flatten(1)  # rows for positions P−2 .. P−2+n
            start = plen - 2
            batch.features[b, max(start, 0) : start + n + 1] = flat[max(0, -start):]
    return batch


def batch_loss(bundle: DrafterBundle, hooks, verifier, batch: Batch, sources: Sources,
               bf16: bool = False) -> Tuple[Tensor, Tensor]:
    """Forward KL on one batch (and the mean overlap Σ min(p, q)); steering when the bundle has it,
    with `sources(prompt_lens, width)` naming the verifier position that steers each position. The
    verifier runs only when the batch carries no cached outputs."""
    ids, plens = batch.ids, batch.plens
    width = ids.shape[1]
    mask = answer_mask(plens, batch.lengths, width)
    autocast = torch.autocast(ids.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    features = batch.features
    if batch.top_ids is None:
        with torch.no_grad(), autocast:
            vout = verifier(input_ids=ids, output_hidden_states=bundle.steered)
        if bundle.steered:
            features = bundle.head.gather(vout.hidden_states)
    if bundle.steered:
        source, steered = sources(plens, width)
        g = gather_steering(bundle.head, features, source)
        hooks.set_vector(g, steered)
    head = bundle.drafter.get_output_embeddings()
    on_support = batch.top_ids is not None and hasattr(head, "reduced")
    try:
        with autocast:
            if on_support:  # logits over the support only: the cached loss needs no full-vocabulary row
                hidden = bundle.drafter.model(input_ids=ids).last_hidden_state
                d_logits = head.reduced(hidden)
            else:
                d_logits = bundle.drafter(input_ids=ids).logits
    finally:
        if hooks is not None:
            hooks.clear()
    if batch.top_ids is None:
        return forward_kl(vout.logits, d_logits, mask)
    return top_k_kl(batch.top_ids, batch.top_logp, d_logits, mask, head.column if on_support else None)


def _device(bundle: DrafterBundle) -> torch.device:
    """Where the bundle computes (its drafter's embedding's device)."""
    return bundle.drafter.get_input_embeddings().weight.device


@torch.no_grad()
def evaluate(bundle: DrafterBundle, hooks, verifier, data: SyntheticSet, cfg: TrainConfig, pad_id: int,
             max_batches: int = 8) -> Dict[str, float]:
    """Validation KL and overlap; steered runs cycle δ through 1..k over the batches."""
    was = bundle.training
    bundle.eval()
    total_kl = total_ov = 0.0
    count = 0
    n = len(data)
    for b, start in enumerate(range(0, n, cfg.batch_size)):
        if b >= max_batches:
            break
        rows = list(range(start, min(n, start + cfg.batch_size)))
        delta = cfg.fixed_delta if cfg.fixed_delta is not None else (b % cfg.k) + 1
        kl, ov = batch_loss(bundle, hooks, verifier, make_batch(data, rows, pad_id).to(_device(bundle)),
                            partial(steering_sources, delta=delta), bf16=cfg.bf16)
        total_kl += float(kl)
        total_ov += float(ov)
        count += 1
    bundle.train(was)
    return {"val_kl": total_kl / max(1, count), "val_overlap": total_ov / max(1, count)}


def train(bundle: DrafterBundle, verifier, data: SyntheticSet, cfg: TrainConfig, out: Path, pad_id: int,
          resume: bool = True, log=print) -> Dict:
    """The whole loop: returns a report dict (losses, times); `out/checkpoint.pt` makes it resumable."""
    common.seed_everything(cfg.seed)
    if data.teacher is None and verifier is None:
        raise UsageError("the synthetic data caches no verifier outputs, so training needs the verifier")
    if data.teacher is not None and bundle.steered:
        if data.tap_layers is None or data.teacher[0].taps is None:
            raise UsageError("the synthetic data caches no steering taps: regenerate it with --teacher-top-k")
        if tuple(data.tap_layers) != tuple(bundle.head.layers):
            raise UsageError(f"the data cached verifier layers {list(data.tap_layers)} but the steering head reads "
                             f"{list(bundle.head.layers)}: pass --steer-layers {','.join(map(str, data.tap_layers))}")
    if verifier is not None:
        verifier.eval().requires_grad_(False)
    bundle.drafter.requires_grad_(True)
    freeze_shared(bundle.drafter)
    bundle.to(_device(bundle))  # W_hml and W_s join the drafter's device
    bundle.train()
    hooks = SteeringHooks(bundle.drafter, bundle.steering) if bundle.steered else None
    train_set, val_set = data.split(cfg.val_fraction, cfg.seed)
    if len(train_set) < 1:
        raise UsageError("the synthetic dataset is empty")
    warmup = cfg.warmup if cfg.warmup is not None else max(1, cfg.steps // 10)
    steer_params = list(bundle.head.parameters()) + list(bundle.steering.parameters()) if bundle.steered else []
    optimizer = common.make_optimizer(bundle.drafter, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    if steer_params:
        optimizer.add_param_group({"params": steer_params, "weight_decay": 0.0, "lr": cfg.steer_lr or cfg.lr})
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / CHECKPOINT
    step, history, elapsed_before, state = 0, [], 0.0, None
    if resume and ckpt.is_file():
        state = common.load_checkpoint(ckpt, bundle, optimizer)
        step = state["step"]
        history = state["extra"].get("history", [])
        elapsed_before = float(state["extra"].get("elapsed_s", 0.0))
        log(f"resumed from {ckpt} at step {step}")
    initial = state["extra"].get("initial") if state else None
    if initial is None:
        initial = evaluate(bundle, hooks, verifier, val_set, cfg, pad_id)
        log(f"initial: val_kl {initial['val_kl']:.4f}  val_overlap {initial['val_overlap']:.4f}")
    started = time.time()
    deadline = started + cfg.max_minutes * 60 if cfg.max_minutes > 0 else math.inf
    bar = common.progress(total=cfg.steps, initial=step, desc="sd2" if bundle.steered else "distill")
    ema = None
    stopped_early = False

    def save(at: int) -> None:
        common.save_checkpoint(ckpt, bundle, optimizer, at, extra={
            "history": history, "initial": initial, "elapsed_s": elapsed_before + time.time() - started,
            "total_steps": total, "fitted": fitted})

    total = int(state["extra"].get("total_steps", cfg.steps)) if state else cfg.steps
    fitted = bool(state and state["extra"].get("fitted"))
    fit_after = 10  # with --max-minutes: measure this many steps, then fit the schedule to the budget
    fit_from = (step, time.time())
    while step < total:
        if cfg.max_minutes > 0 and not fitted and step - fit_from[0] >= fit_after:
            per_step = (time.time() - fit_from[1]) / (step - fit_from[0])
            budget_steps = step + int((deadline - time.time()) / (per_step * 1.08))  # 8% for evals
            fitted = True
            if budget_steps < total:
                log(f"fitting the schedule to the time budget: {total} -> {budget_steps} steps ({per_step:.2f} s/step)")
                total = max(step + 1, budget_steps)
                bar.total = total
                bar.refresh()
        if cfg.stop_at is not None and step >= cfg.stop_at:
            stopped_early = True
            break
        if time.time() > deadline:
            stopped_early = True
            log(f"time budget of {cfg.max_minutes} min reached at step {step}")
            break
        scale = common.lr_at(step, total, 1.0, warmup)
        for group, base in zip(optimizer.param_groups, base_lrs):
            group["lr"] = base * scale
        rows = _batch_indices(len(train_set), cfg.batch_size, step, cfg.seed)
        batch = make_batch(train_set, rows, pad_id).to(_device(bundle))
        loss, overlap = batch_loss(bundle, hooks, verifier, batch, training_sources(step, cfg), cfg.bf16)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = common.clip_grad([p for g in optimizer.param_groups for p in g["params"]], cfg.grad_clip)
        optimizer.step()
        step += 1
        value = float(loss.detach())
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        history.append({"step": step, "loss": round(value, 5), "overlap": round(float(overlap), 5), "grad_norm": round(gnorm, 4)})
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.4f}", ov=f"{float(overlap):.3f}")
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            ev = evaluate(bundle, hooks, verifier, val_set, cfg, pad_id)
            history[-1].update(ev)
            log(f"step {step}: train_kl(ema) {ema:.4f}  val_kl {ev['val_kl']:.4f}  val_overlap {ev['val_overlap']:.4f}")
        if cfg.save_every and step % cfg.save_every == 0:
            save(step)
    bar.close()
    final = evaluate(bundle, hooks, verifier, val_set, cfg, pad_id)
    save(step)
    if hooks is not None:
        hooks.remove()
    bundle.eval()
    train_seconds = elapsed_before + time.time() - started
    tail = [h["loss"] for h in history[-20:]]
    return {
        "steps_done": step, "steps_planned": cfg.steps, "steps_scheduled": total, "stopped_early": stopped_early,
        "train_seconds": round(train_seconds, 1), "device": str(_device(bundle)),
        "initial": initial, "final": final,
        "train_kl_first": history[0]["loss"] if history else None,
        "train_kl_last20": round(sum(tail) / len(tail), 5) if tail else None,
        "train_sequences": len(train_set), "val_sequences": len(val_set),
        "train_answer_tokens": train_set.response_tokens(),
        "config": asdict(cfg), "history": history,
    }


# ---------------------------------------------------------------------------------------- CLI


def add_common_arguments(parser: argparse.ArgumentParser, default_out: str) -> None:
    parser.add_argument("--data", required=True, type=Path, help="dataset dir from `steerspec train synth`")
    parser.add_argument("--out", type=Path, default=Path(default_out), help="output drafter checkpoint directory")
    parser.add_argument("--verifier", default="verifier", help="verifier checkpoint dir or bundled name (frozen)")
    parser.add_argument("--drafter", default="pretrained", help="initial drafter checkpoint dir or bundled name")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (drafter)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 10%% of steps)")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--grad-clip", type=float, default=0.5)
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (CPU with avx512_bf16/AMX)")
    parser.add_argument("--max-minutes", type=float, default=0.0, help="stop (and export) after this long; 0 = no limit")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    common.add_device_argument(parser)
    parser.add_argument("--no-resume", action="store_true", help="ignore OUT/checkpoint.pt")
    parser.add_argument("--keep-checkpoint", action="store_true", help="keep OUT/checkpoint.pt after finishing")


def _offsets_text(config: Dict) -> str:
    """How the training run drew its steering offsets, for the model card."""
    k = config["k"]
    if config.get("fixed_delta") is not None:
        return f"one fixed offset δ = {config['fixed_delta']} (a diagnostic run, not a decoding drafter)"
    if config.get("block_accept") is not None:
        return (f"offsets from simulated blocks of ≤ {k} positions, each position past the first kept "
                f"with probability {config['block_accept']}")
    if config.get("delta_decay", 1.0) == 1.0:
        return f"one random offset δ ∈ [1, {k}] per batch, uniform"
    return f"one random offset δ ∈ [1, {k}] per batch, P(δ) ∝ {config['delta_decay']}^(δ−1)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, "runs/distilled")


def config_from_args(args, steer: bool) -> TrainConfig:
    if args.steps < 1 or args.batch_size < 1:
        raise UsageError("--steps and --batch-size must be at least 1")
    if not 0.0 <= args.val_fraction < 1.0:
        raise UsageError("--val-fraction must be in [0, 1)")
    return TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, steer_lr=getattr(args, "steer_lr", None),
        warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
        k=getattr(args, "k", 8), delta_decay=getattr(args, "delta_decay", 1.0),
        block_accept=getattr(args, "block_accept", None), fixed_delta=getattr(args, "fixed_delta", None),
        val_fraction=args.val_fraction, eval_every=args.eval_every,
        save_every=args.save_every, bf16=args.bf16, max_minutes=args.max_minutes, steer=steer,
    )


def load_pair(args, data: SyntheticSet):
    """(verifier or None, verifier config, drafter, drafter_dir, verifier_dir) as float32 on --device.

    The verifier itself is loaded only when `data` caches none of its outputs."""
    # lazy: transformers takes seconds to import
    from transformers import AutoConfig


    device = resolve_device(getattr(args, "device", "cpu"))
    vdir, ddir = resolve_model_dir(args.verifier), resolve_model_dir(args.drafter)
    verifier = load_model(vdir, device=device) if data.teacher is None else None
    vconfig = verifier.config if verifier is not None else AutoConfig.from_pretrained(str(vdir), local_files_only=True)
    drafter = load_model(ddir, device=device, cpu_layout=False, draft_temperature=False)  # trained, then saved
    if vconfig.vocab_size != drafter.config.vocab_size:
        raise UsageError(f"verifier vocab {vconfig.vocab_size} != drafter vocab {drafter.config.vocab_size}")
    return verifier, vconfig, drafter, ddir, vdir


def model_card(title: str, report: Dict, command: str, description: str) -> str:
    r = report
    init, fin = r["initial"], r["final"]
    lines = [
        f"# {title}",
        "",
        description,
        "",
        "## Training",
        f"- command: `{command}`",
        f"- initialised from: `{r['init_from']}`; verifier (frozen): `{r['verifier']}`",
        f"- data: {r['train_sequences']} synthetic sequences ({r['train_answer_tokens']} answer tokens) from the "
        f"verifier at T=1 (`steerspec train synth`), {r['val_sequences']} held out for validation",
        f"- {r['steps_done']} steps (asked {r['steps_planned']}, cosine schedule over {r['steps_scheduled']}) of batch {r['config']['batch_size']}, AdamW "
        f"lr {r['config']['lr']} (warm-up + cosine), grad clip {r['config']['grad_clip']}, seed {r['config']['seed']}",
        f"- training time: {r['train_seconds']:.0f} s on {r.get('device', 'cpu')}",
        "",
        "## Losses (forward KL(p_V ‖ q_D) per answer token, nats)"
        + (f" — over the verifier's cached top {r['teacher_top_k']} tokens (∩ the drafter's support)"
           if r.get("teacher_top_k") else ""),
        f"- validation KL: {init['val_kl']:.4f} before → {fin['val_kl']:.4f} after",
        f"- validation overlap Σ min(p_V, q_D) (expected acceptance of one draft token): "
        f"{init['val_overlap']:.4f} → {fin['val_overlap']:.4f}",
        f"- training KL: first step {r['train_kl_first']}, mean of the last 20 steps {r['train_kl_last20']}",
        "",
        "Weights are stored as fp16 safetensors and load as float32.",
    ]
    if r.get("steering"):
        s = r["steering"]
        lines[-2:-2] = [
            "",
            "## Steering (SD²)",
            f"- verifier layers (hidden states entering them): {s['verifier_layers']}; W_hml {s['head_params']} params, "
            f"W_s {s['ws_params']} params; " + _offsets_text(r['config']),
            "- files: `steering.safetensors` (`head.*` = W_hml for the verifier, `drafter.*` = W_s), `steering.json`",
        ]
    return "\n".join(lines) + "\n"


def finish(args, report: Dict, bundle: DrafterBundle, ddir: Path, vdir: Path, vconfig, title: str, description: str) -> None:
    out: Path = args.out
    bundle.to("cpu")  # saved from host memory
    weights = vdir / "model.safetensors"
    verifier_sha = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None
    steer = dict(verifier_num_layers=int(vconfig.num_hidden_layers), verifier=vdir.name,
                 extra={"verifier_model_sha256": verifier_sha})
    if reduced.is_reduced_dir(ddir):  # own weights + support only; the shared tables stay the verifier's
        reduced.save_drafter(bundle.drafter, out)
        if bundle.steered:
            save_steering(out, bundle.head, bundle.steering, **steer)
    else:
        save_drafter_checkpoint(out, bundle.drafter, tokenizer_from=ddir, head=bundle.head, steering=bundle.steering,
                                **steer)
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["dtype"] = "float32"  # fp16 storage, float32 compute by default (as the bundled pair)
        cfg.pop("torch_dtype", None)
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        gen = out / "generation_config.json"
        if gen.exists():
            gen.unlink()
    report["verifier_model_sha256"] = verifier_sha
    report.update(init_from=str(args.drafter), verifier=str(args.verifier))
    command = "steerspec train " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else "steerspec train"
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(title, report, command, description))
    if not getattr(args, "keep_checkpoint", False) and not report["stopped_early"]:
        (out / CHECKPOINT).unlink(missing_ok=True)


def run(args) -> int:
    torch.set_num_threads(max(1, args.threads))
    cfg = config_from_args(args, steer=False)
    data = load_synthetic(args.data)
    verifier, vconfig, drafter, ddir, vdir = load_pair(args, data)
    bundle = DrafterBundle(drafter)
    pad = int(drafter.config.pad_token_id if drafter.config.pad_token_id is not None else 0)
    report = train(bundle, verifier, data, cfg, args.out, pad, resume=not args.no_resume)
    report["teacher_top_k"] = data.meta.get("teacher_top_k") if data.teacher is not None else None
    finish(args, report, bundle, ddir, vdir, vconfig, "Distilled drafter",
           "The pretrained drafter fine-tuned on the verifier's synthetic answers with forward KL (no steering): "
           "the SD² paper's distillation baseline.")
    print(f"distill: val KL {report['initial']['val_kl']:.4f} -> {report['final']['val_kl']:.4f} "
          f"in {report['train_seconds']:.0f} s -> {args.out}")
    return 0
