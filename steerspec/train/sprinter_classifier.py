"""Train a SPRINTER classifier head for a (verifier, drafter) pair on the corpus training split.

Labels come from teacher-forced windows of the stdlib training split: at each position the
drafter's draft distribution q (T = 1, its top --draft-top-k plus the spread tail, exactly what
decoding samples from) draws a token x, and x is acceptable when q(x)/p(x) ≤ λ under the
verifier's p. Features are the drafter's only (features.py). A small MLP is trained with BCE on
those labels (class-balanced), or with --labels soft on min(1, λ·p(x)/q(x)) (the probability that the
exact rule accepts x: the head then ranks tokens by how much mass keeping them moves), seeded and
resumable (WORK/checkpoint.pt, features cached in WORK/features.pt); it reports
held-out ROC AUC and η_TP / η_FP at --threshold, writes roc.png, and exports the head with a
model card to --out (default: DRAFTER/sprinter, where decoding looks for it).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Dict, List

import torch

from steerspec.data.corpus import read_source, stdlib_split
from steerspec.decoding.sampling import draft_distribution, sample_sparse
from steerspec.errors import UsageError
from steerspec.models import load_model, load_tokenizer, resolve_model_dir
from steerspec.models.draft_temperature import configured
from steerspec.models.kv import CachedLM
from steerspec.sprinter import features as F
from steerspec.sprinter.classifier import SprinterHead, head_dir_for, save_head
from steerspec.sprinter.features import feature_dim, soft_target
from steerspec.steering.drafter import SteeringHooks
from steerspec.steering.runtime import maybe_steering_weights
from steerspec.steering.verifier_head import vector_from_bytes, vector_to_bytes
from steerspec.train import common
from steerspec.train.common import load_checkpoint, progress, save_checkpoint, seed_everything


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="verifier", help="verifier checkpoint dir or bundled name")
    parser.add_argument("--drafter", default="pretrained", help="drafter checkpoint dir or bundled name")
    parser.add_argument("--out", type=Path, default=None, help="head directory (default: DRAFTER/sprinter)")
    parser.add_argument("--work", type=Path, default=None,
                        help="resumable state: cached features + checkpoint (default /tmp/steerspec-sprinter-NAME)")
    parser.add_argument("--lambda", dest="lam", type=float, default=1.0,
                        help="label x acceptable when q(x)/p(x) <= lambda (paper: 1, 1.2, 1.5; default 1)")
    parser.add_argument("--labels", choices=("binary", "soft"), default="binary",
                        help="binary: q/p <= lambda (the paper's); soft: min(1, lambda*p/q), the chance the "
                             "exact rule accepts x (default binary)")
    parser.add_argument("--threshold", type=float, default=0.5, help="keep a token when P(acceptable) >= this")
    parser.add_argument("--train-tokens", type=int, default=60000, help="labelled training tokens")
    parser.add_argument("--heldout-tokens", type=int, default=10000, help="labelled held-out tokens")
    parser.add_argument("--seq-len", type=int, default=128, help="teacher-forced window length")
    parser.add_argument("--draft-top-k", type=int, default=64, help="the draft distribution's top K (as in decoding)")
    parser.add_argument("--max-offset", type=int, default=4,
                        help="SD² drafters: steer position j from the verifier's position j - δ, δ in [1, this]")
    parser.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    common.add_device_argument(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--no-resume", action="store_true", help="recompute features and restart training")


def _windows(tokenizer, files: List[str], split, seq_len: int, tokens: int, seed: int) -> List[List[int]]:
    """Seeded windows of seq_len tokens from shuffled files until `tokens` positions are covered."""
    order = list(files)
    random.Random(seed).shuffle(order)
    out: List[List[int]] = []
    covered = 0
    for rel in order:
        text = read_source(split.root, rel)
        if not text.strip():
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - seq_len, seq_len * 4):  # spread windows over the file
            out.append(ids[start:start + seq_len])
            covered += seq_len - 1
            if covered >= tokens:
                return out
    return out


def steering_per_position(weights, hidden_states, gen: torch.Generator, max_offset: int):
    """g [1, T, d_V] and its mask [1, T] for a teacher-forced window: drafter position j is steered by the
    verifier's vector from position j − δ, δ uniform in [1, max_offset] per position (decoding steers the
    i-th draft of a block, or of a SPRINTER run, from δ = i positions back); unsteered where j − δ < 1: a window
    starts a sequence, and its first position is the verifier's attention sink (SmolLM2's hidden states there
    reach 2.5e4), which decoding never steers from (a prompt's last position is its first vector)."""
    g = weights.head.from_hidden_states(hidden_states)[0].float()  # [T, d_V]
    g = vector_from_bytes(vector_to_bytes(g)).view_as(g).to(g.device)  # the wire's fp16, as decoding gets it
    width = g.shape[0]
    delta = torch.randint(1, max_offset + 1, (width,), generator=gen, device=gen.device).to(g.device)
    source = torch.arange(width, device=g.device) - delta
    return g[source.clamp_min(0)][None], (source >= 1)[None]


@torch.inference_mode()
def label_windows(verifier, drafter, windows: List[List[int]], draft_top_k: int, lam: float, seed: int,
                  desc: str, steering=None, max_offset: int = 4) -> Dict[str, torch.Tensor]:
    """Features [N, F], labels [N] and the ratio q/p [N] for every position of every window. With an
    SD² drafter's `steering` weights the drafter runs steered, as it decodes (`steering_per_position`)."""
    cached = CachedLM(drafter)
    layer = cached.num_layers - 1
    embed = drafter.get_input_embeddings().weight
    gen = torch.Generator(device=drafter.device).manual_seed(seed)
    hooks = SteeringHooks(drafter, steering.drafter) if steering is not None else None
    feats, labels, ratios = [], [], []
    bar = progress(len(windows), desc=desc)
    for window in windows:
        vout = verifier(input_ids=torch.tensor([window], device=verifier.device),
                        output_hidden_states=hooks is not None)
        p_full = vout.logits[0, :-1].float().softmax(-1)
        if hooks is not None:
            hooks.set_vector(*steering_per_position(steering, vout.hidden_states, gen, max_offset))
        cached.reset()
        out = cached.extend(window, [layer])
        q_full = out.logits.float().softmax(-1)[:-1]  # rows that predict positions 1..n-1
        hidden = out.hidden[0, :-1].float()
        dist = draft_distribution(q_full, draft_top_k)
        x = sample_sparse(dist, gen)
        q_x = dist.prob_of(x).float()
        p_x = p_full.gather(-1, x.view(-1, 1).to(p_full.device)).squeeze(-1).to(q_x.device)
        feats.append(F.build_features(hidden, embed[x].float(), q_x, F.entropy(q_full)).cpu())
        labels.append(F.acceptable(q_x, p_x, lam).cpu())
        ratios.append((q_x / p_x.clamp_min(1e-30)).cpu())
        bar.update(1)
    bar.close()
    if hooks is not None:
        hooks.remove()
    return {"x": torch.cat(feats), "y": torch.cat(labels), "ratio": torch.cat(ratios)}


def training_target(data: Dict[str, torch.Tensor], labels: str, lam: float) -> torch.Tensor:
    """The BCE target per token: the binary label, or the soft min(1, λ·p/q) from the cached ratio q/p."""
    return data["y"].float() if labels == "binary" else soft_target(data["ratio"], lam)


def _checkpoint_labels(path: Path) -> str:
    return torch.load(path, map_location="cpu", weights_only=False).get("extra", {}).get("labels", "binary")


def _fit(head, data, args, work: Path, resume: bool) -> List[float]:
    """BCE training over shuffled mini-batches; checkpoint per epoch; returns per-epoch loss."""
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(args.seed)
    ckpt = work / "checkpoint.pt"
    start, losses = 0, []
    # resume only a checkpoint trained on the same kind of label (one from before --labels was binary)
    if resume and ckpt.exists() and _checkpoint_labels(ckpt) == args.labels:
        state = load_checkpoint(ckpt, head, opt, gen)
        start, losses = state["step"], list(state["extra"].get("losses", []))
    x, y = data["x"], training_target(data, args.labels, args.lam)
    pos_weight = None
    if args.labels == "binary":  # balance the classes so the 0.5 threshold sits between them
        pos = float(y.mean())
        pos_weight = torch.tensor((1 - pos) / max(pos, 1e-6))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    steps_per_epoch = max(1, (len(x) + args.batch_size - 1) // args.batch_size)
    bar = progress(args.epochs * steps_per_epoch, initial=start * steps_per_epoch, desc="train sprinter")
    for epoch in range(start, args.epochs):
        perm = torch.randperm(len(x), generator=gen)
        total = 0.0
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            loss = loss_fn(head(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            bar.update(1)
        losses.append(total / len(x))
        save_checkpoint(ckpt, head, opt, epoch + 1, gen, {"losses": losses, "labels": args.labels})
    bar.close()
    return losses


def evaluate(head, data, threshold: float) -> Dict[str, float]:
    """Held-out ROC AUC, η_TP and η_FP at `threshold`, and the positive rate."""
    scores = head.prob(data["x"])
    tp, fn, fp, tn = F.confusion(scores >= threshold, data["y"])
    eta_tp, eta_fp = F.rates(tp, fn, fp, tn)
    return {"roc_auc": round(F.roc_auc(scores, data["y"]), 6), "eta_tp": round(eta_tp, 6),
            "eta_fp": round(eta_fp, 6), "acceptable_fraction": round(float(data["y"].float().mean()), 6),
            "tokens": int(len(data["y"]))}


def write_roc(head, data, path: Path, threshold: float, title: str) -> None:
    """The held-out ROC curve as a PNG, with the operating point at `threshold` marked."""
    # lazy: matplotlib only to draw the figure
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only to draw the figure
    import matplotlib.pyplot as plt


    scores = head.prob(data["x"])
    fpr, tpr, _ = F.roc_curve(scores, data["y"])
    point = evaluate(head, data, threshold)
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot(fpr.numpy(), tpr.numpy(), label=f"AUC {point['roc_auc']:.3f}")
    ax.plot([0, 1], [0, 1], ls=":", c="grey")
    ax.scatter([point["eta_fp"]], [point["eta_tp"]], c="red", zorder=3, label=f"threshold {threshold:g}")
    ax.set_xlabel("η_FP (unacceptable tokens kept)")
    ax.set_ylabel("η_TP (acceptable tokens kept)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


STEERED_NOTE = ("\nThis SD² drafter ran steered while labelling, as it decodes: drafter position j got the verifier's\n"
                "steering vector from position j − δ (δ uniform in [1, {max_offset}] per position; fp16 as on the wire),\n"
                "so the head sees the hidden states decoding gives it.\n")

MODEL_CARD = """# SPRINTER head for `{drafter}` (verifier `{verifier}`)

A drafter-side classifier for SteerSpec's **lossy, opt-in** `--verification sprinter` mode
(SPRINTER, paper 004). It predicts whether a draft token x is acceptable, q(x)/p(x) ≤ λ, from
the drafter's own features only: the hidden state entering its last decoder layer at the
position that sampled x, the input embedding of x, q(x), log q(x) and the entropy of q.

- Architecture: LayerNorm({feature_dim}) → Linear({feature_dim}, {hidden}) → GELU → Linear({hidden}, 1);
  {params} parameters.
- Labels: {labels_line}; teacher-forced windows of {seq_len} tokens from the stdlib training split,
  x drawn from the drafter's draft distribution at T = 1 (top {draft_top_k} + spread tail{temperature_line}).
- Training: {train_tokens} tokens, {epochs} epochs, AdamW lr {lr}, {loss_line}, seed {seed}.
- Held-out ({heldout_tokens} tokens from held-out files): ROC AUC {roc_auc:.3f}; at threshold
  {threshold:g}: η_TP = {eta_tp:.3f}, η_FP = {eta_fp:.3f}; acceptable fraction {acceptable_fraction:.3f}.
- Made by: `{command}`

What it gives up: every token the head keeps without the verifier is unverified. Theorem 1
bounds the deviation from the verifier's distribution by η_FP · d_TV(p, q); decoding reports the
η's measured on its own tokens and that bound. Outputs are not the verifier's distribution.
"""


def run(args: argparse.Namespace) -> int:
    if not 0.0 < args.threshold < 1.0:
        raise UsageError(f"--threshold must be in (0, 1), got {args.threshold}")
    if args.lam <= 0:
        raise UsageError(f"--lambda must be > 0, got {args.lam}")
    if args.max_offset < 1:
        raise UsageError(f"--max-offset must be >= 1, got {args.max_offset}")
    if args.train_tokens < 100 or args.heldout_tokens < 100:
        raise UsageError("--train-tokens and --heldout-tokens must be at least 100")
    torch.set_num_threads(max(1, args.threads))
    seed_everything(args.seed)
    ddir, vdir = resolve_model_dir(args.drafter), resolve_model_dir(args.verifier)
    out = Path(args.out) if args.out is not None else head_dir_for(ddir)
    work = Path(args.work) if args.work is not None else Path(f"/tmp/steerspec-sprinter-{ddir.name}")
    work.mkdir(parents=True, exist_ok=True)
    verifier = load_model(vdir, device=args.device).eval()
    drafter = load_model(ddir, device=args.device).eval()
    tokenizer = load_tokenizer(vdir)
    cache = work / "features.pt"
    steering = maybe_steering_weights(drafter, ddir, device=args.device)  # an SD² drafter labels steered
    key = {"verifier": str(vdir), "drafter": str(ddir), "lam": args.lam, "seq_len": args.seq_len,
           "train_tokens": args.train_tokens, "heldout_tokens": args.heldout_tokens,
           "draft_top_k": args.draft_top_k, "seed": args.seed}
    if steering is not None:
        key.update(steered=True, max_offset=args.max_offset)
    temperature = configured(drafter.config)  # q, and with it every feature and label, depends on it
    if temperature is not None:
        key.update(draft_temperature=temperature)
    resume = not args.no_resume
    data = None
    if resume and cache.exists():
        stored = torch.load(cache, weights_only=False)
        data = stored if stored.get("key") == key else None
    if data is None:
        split = stdlib_split()
        started = time.perf_counter()
        train = label_windows(verifier, drafter, _windows(tokenizer, split.train, split, args.seq_len,
                                                          args.train_tokens, args.seed),
                              args.draft_top_k, args.lam, args.seed, "label train", steering, args.max_offset)
        held = label_windows(verifier, drafter, _windows(tokenizer, split.heldout, split, args.seq_len,
                                                         args.heldout_tokens, args.seed + 1),
                             args.draft_top_k, args.lam, args.seed + 1, "label held-out", steering, args.max_offset)
        data = {"key": key, "train": train, "heldout": held, "label_s": time.perf_counter() - started}
        torch.save(data, cache)
        (work / "checkpoint.pt").unlink(missing_ok=True)  # new features: train from scratch
    head = SprinterHead(feature_dim(int(drafter.config.hidden_size)), args.hidden)
    losses = _fit(head, data["train"], args, work, resume)
    head.eval()
    metrics = evaluate(head, data["heldout"], args.threshold)
    train_metrics = evaluate(head, data["train"], args.threshold)
    title = f"SPRINTER head: {ddir.name} vs {vdir.name} (λ={args.lam:g}, held-out)"
    out.mkdir(parents=True, exist_ok=True)
    write_roc(head, data["heldout"], out / "roc.png", args.threshold, title)
    command = ("steerspec train sprinter --verifier {} --drafter {} --lambda {:g}{} --train-tokens {} "
               "--heldout-tokens {} --epochs {} --seed {}").format(
        args.verifier, args.drafter, args.lam, "" if args.labels == "binary" else f" --labels {args.labels}",
        args.train_tokens, args.heldout_tokens, args.epochs, args.seed)
    meta = {"verifier": vdir.name, "drafter": ddir.name, "lambda": args.lam, "labels": args.labels,
            "threshold": args.threshold,
            "draft_top_k": args.draft_top_k, "seq_len": args.seq_len, "seed": args.seed,
            "heldout": metrics, "train": train_metrics, "losses": [round(x, 6) for x in losses],
            "command": command}
    if temperature is not None:
        meta["draft_temperature"] = temperature
    save_head(head, out, meta)
    params = sum(p.numel() for p in head.parameters())
    (out / "MODEL_CARD.md").write_text(MODEL_CARD.format(
        drafter=ddir.name, verifier=vdir.name, feature_dim=head.feature_dim, hidden=head.hidden, params=params,
        labels_line=(f"acceptable when q(x)/p(x) ≤ λ = {args.lam:g}" if args.labels == "binary" else
                     f"soft, min(1, λ·p(x)/q(x)) with λ = {args.lam:g} (the chance that the exact rule accepts "
                     f"x), so the head predicts that chance and the threshold is a floor on it; the η's below "
                     f"use the binary label q(x)/p(x) ≤ λ"),
        loss_line="class-balanced BCE" if args.labels == "binary" else "BCE on the soft labels",
        temperature_line=("" if temperature is None else
                          f", the drafter's calibrated draft temperature {temperature:g} applied"),
        seq_len=args.seq_len, draft_top_k=args.draft_top_k, train_tokens=len(data["train"]["y"]),
        heldout_tokens=metrics["tokens"], epochs=args.epochs, lr=args.lr, seed=args.seed,
        threshold=args.threshold, command=command, **{k: metrics[k] for k in
                                                      ("roc_auc", "eta_tp", "eta_fp", "acceptable_fraction")})
        + (STEERED_NOTE.format(max_offset=args.max_offset) if steering is not None else ""))
    print(json.dumps({"out": str(out), "heldout": metrics, "train": train_metrics, "params": params}))
    return 0
