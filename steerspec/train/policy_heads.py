"""Train the heads of the trained draft-length policies (`steerspec train pacer|specdecpp`).

Labels as Pacer's Section 3.3 builds them: the verifier answers training-split prompts (function
and class headers of the stdlib *training* files) greedily; from prefixes of each answer the
drafter drafts a long greedy block (--gamma tokens); a draft is labelled accepted up to the first
position where it differs from the verifier's answer, rejected from there on (the exact greedy
acceptance rule, T = 0). Features are the drafter's final-normed hidden states at the positions
that produced each draft, plus (Pacer) the hidden states of the last --ctx prefix tokens.
SpecDec++'s head learns P(reject | earlier accepted) from the drafts up to and including the first
rejection; Pacer's layer learns every draft's label. Seeded and resumable (WORK/labels.pt, shared by
both kinds, and WORK/checkpoint-KIND.pt), with a tqdm bar; reports held-out accuracy and ROC AUC (held-out = a
seeded 15% of the prompts); writes the head to DRAFTER/policy_heads/KIND.safetensors (or --out) with a model card.
Pacer's b, t and ρ are then tuned by replaying greedy decoding of the held-out prompts, labelled again at every
answer position (WORK/trajectory.pt; steerspec/train/pacer_tune.py).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from steerspec.data.corpus import stdlib_split
from steerspec.data.evalsets import code_prompts
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
from steerspec.errors import UsageError, float_list
from steerspec.models import cached_lm, load_model, load_tokenizer, resolve_model_dir
from steerspec.policies.heads import HEADS_DIR, build_head, save_head
from steerspec.sprinter.features import roc_auc
from steerspec.steering.io import has_steering
from steerspec.steering.runtime import maybe_steering
from steerspec.train import common
from steerspec.train.common import load_checkpoint, progress, save_checkpoint, seed_everything
from steerspec.train.pacer_tune import decoding_chains, measure_costs, tune

MODEL_CARD = """# {kind} head for drafter `{drafter}` (verifier `{verifier}`)

What: {what}
Input: the drafter's final-normed hidden state (size {hidden_size}){extra}.
Parameters: {params:,} (stored fp16, {size_kb:.0f} kB).
Labels: Pacer Section 3.3: the verifier's greedy answers to {prompts} training-split prompts (stdlib training
files), greedy drafter blocks of {gamma} tokens from every {stride}th prefix, accepted up to the first
mismatch. {blocks} blocks ({train_blocks} train / {held_blocks} held-out by prompt).
Training: {epochs} epochs, AdamW lr {lr}, batch {batch}, seed {seed}.
Held-out: accuracy {accuracy:.4f}, ROC AUC {roc_auc:.4f} (positive = {positive}; {tokens} tokens).
Command: `{command}`
"""


TUNED_CARD = """Tuned (the policy's defaults for this head): b={b}, t={t}, rho={rho}, chosen by replaying greedy decoding
of the {tune_prompts} held-out prompts (blocks labelled at every answer position and chained as decoding chains
them; {blocks} blocks visited) under the measured block cost (draft {draft_ms:.2f} ms per token in the draft loop,
Pacer layer {round_ms:.2f} ms per round, a verify pass of {verify_text}, plus the network RTT), for the
best worst-case gain over the best fixed k across RTTs; {mean_drafts:.2f} drafts per block. Modelled:
{rtt_lines}
"""
RTT_LINE = "- RTT {rtt_ms:g} ms: {tokens_per_s:.2f} tokens/s, {gain:.3f}x the best fixed k ({best_fixed_k}, {best_fixed_tokens_per_s:.2f})"


def _verify_text(tuned: Dict) -> str:
    """The verify cost the tuning used: per token count where measured, else the line."""
    table = tuned.get("verify_ms") or []
    if not table:
        return f"{tuned['v0']:.1f} + {tuned['v1']:.2f}·tokens ms"
    return f"1..{len(table)} tokens {', '.join(f'{ms:.1f}' for ms in table)} ms"


def tune_pacer(layer, trajectory, verifier, drafter, args) -> Optional[Dict[str, float]]:
    """Pacer's (b, t, rho) for this head: greedy decoding of the held-out prompts replayed on `trajectory`
    (blocks labelled at every answer position) under the pair's measured costs (None without blocks:
    the policy then keeps Table 10's values)."""
    if len(trajectory["label"]) == 0:
        return None
    with torch.no_grad():
        acceptance = torch.cat([torch.sigmoid(_pacer_logits(layer, _subset(trajectory, idx)))
                                for idx in torch.arange(len(trajectory["label"])).split(256)])
    accepted = trajectory["label"].sum(dim=1).long()
    chains = decoding_chains(trajectory["prompt"])
    size = int(trajectory["hidden"].shape[-1])
    ctx, drafts = torch.randn(1, args.ctx, size), torch.randn(1, 4, size)

    def one_round() -> None:  # what the policy runs after each round of b drafts
        with torch.no_grad():
            layer(ctx, drafts, torch.arange(4))

    probe = list(range(100, 164))  # a 64-token context: the cost of a step, not of any particular text
    cost = measure_costs(cached_lm(verifier), cached_lm(drafter), probe, stop_head=one_round,
                         tokens=args.gamma + 1)
    costs = [replace(cost, rtt_ms=rtt) for rtt in args.tune_rtts]
    result = tune(acceptance, accepted, costs, cap=args.gamma, chains=chains)
    return {**result, "tune_prompts": len(chains),
            "draft_ms": round(cost.draft_ms, 3), "round_ms": round(cost.round_ms, 3), "v0": round(cost.v0, 3),
            "v1": round(cost.v1, 3), "verify_ms": [round(ms, 2) for ms in cost.verify_ms],
            "rtts_ms": list(args.tune_rtts)}


def trajectory_blocks(verifier, drafter, prompts: List[List[int]], held: List[int], key: Dict, args, work: Path,
                      drafter_dir, resume: bool) -> Dict[str, torch.Tensor]:
    """Blocks at every answer position of the held-out prompts (Pacer's tuning replays decoding on them);
    cached in WORK/trajectory.pt under the labels' key."""
    path = work / "trajectory.pt"
    key = {**key, "held": held}
    if resume and path.exists():
        stored = torch.load(path, weights_only=False)
        if stored.get("key") == key:
            return stored["data"]
    every = argparse.Namespace(**{**vars(args), "stride": 1})
    data = label_blocks(verifier, drafter, [prompts[i] for i in held], every, "label decoding replay",
                        drafter_dir=drafter_dir)
    torch.save({"key": key, "data": data}, path)
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="verifier", help="verifier checkpoint dir or bundled name")
    parser.add_argument("--drafter", default="pretrained", help="drafter checkpoint dir or bundled name")
    parser.add_argument("--out", type=Path, default=None, help="head file (default DRAFTER/policy_heads/KIND.safetensors)")
    parser.add_argument("--work", type=Path, default=None, help="resumable state shared by both kinds: labels.pt, checkpoint-KIND.pt (default /tmp/steerspec-heads-NAME)")
    parser.add_argument("--prompts", type=int, default=160, help="training-split prompts to label")
    parser.add_argument("--answer-tokens", type=int, default=64, help="verifier answer length per prompt")
    parser.add_argument("--gamma", type=int, default=20, help="draft block length for labelling")
    parser.add_argument("--stride", type=int, default=4, help="draft from every STRIDE-th answer prefix")
    parser.add_argument("--ctx", type=int, default=32, help="prefix hidden states kept as Pacer's context")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    common.add_device_argument(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--no-resume", action="store_true", help="relabel and restart training")
    parser.add_argument("--tune-rtt-ms", default="0,50",
                        help="pacer: network RTTs (ms, comma-separated) b, t and rho are tuned for: the setting "
                             "whose worst gain over the best fixed k across them is highest")


def training_prompts(tokenizer, count: int, seed: int) -> List[List[int]]:
    """`count` seeded header prompts from the stdlib training split (never the eval files)."""
    split = stdlib_split()
    files = sorted(split.train)
    random.Random(seed).shuffle(files)
    ntok = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    out: List[List[int]] = []
    for rel in files:
        for _, prompt in list(code_prompts(split.root, rel, ntok))[:2]:
            out.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            if len(out) >= count:
                return out
    return out


STEERED_NOTE = ("\nThis SD² drafter drafted its labelled blocks steered, as it decodes: before each block the\n"
                "verifier's steering vector from its hidden states at the block start (the prefix itself\n"
                "was fed unsteered in one pass).\n")


@torch.inference_mode()
def label_blocks(verifier, drafter, prompts: List[List[int]], args, desc: str,
                 drafter_dir=None) -> Dict[str, torch.Tensor]:
    """Per block: draft hidden [B, γ, D], labels [B, γ] (1 until the first mismatch), valid [B, γ],
    prefix context [B, C, D] (zero-padded on the left) and its mask [B, C]; prompt index [B].
    An SD² drafter (steering weights in `drafter_dir`) drafts each block steered by the verifier's
    vector at that block's start, as in decoding, so the head sees the states it will see."""
    v, d = cached_lm(verifier), cached_lm(drafter)
    steer = maybe_steering(d, drafter_dir, device=d.device)
    final = [d.num_layers]
    size, gamma, ctx = d.hidden_size, args.gamma, args.ctx
    config = DecodeConfig(max_new_tokens=args.answer_tokens, eos_token_ids=(), max_length=100000)
    rows: Dict[str, list] = {k: [] for k in ("hidden", "label", "valid", "context", "context_mask", "prompt")}
    bar = progress(len(prompts), desc=desc)
    for p, prompt in enumerate(prompts):
        answer = autoregressive_generate(v, prompt, config).token_ids
        full = list(prompt) + list(answer)
        taps = None
        if steer is not None:  # the verifier's SD² taps at every position; the prefix pass unsteered
            v.reset()
            taps = v.extend(full[:-1], steer.verifier_layers).hidden  # [3, T-1, D]: state j produces j+1
            steer.hooks.set_vector(None)
        d.reset()
        prefix_hidden = d.extend(full, final).hidden[0].float().cpu()  # state at j produces token j+1
        for s in range(0, len(answer) - 1, args.stride):
            cut = len(prompt) + s  # committed = full[:cut]; targets = full[cut:]
            d.rollback(cut - 1)  # keep full[:cut-1] cached, refeed full[cut-1] for its logits
            if taps is not None:  # the vector decoding would send: the state that produced full[cut-1]
                steer.begin_block(taps[:, max(0, cut - 2)])
            out = d.extend([full[cut - 1]], final)
            states, tokens = [], []
            for _ in range(gamma):
                token = int(out.logits[-1].argmax())
                states.append(out.hidden[0, -1].float().cpu())
                tokens.append(token)
                out = d.extend([token], final)
            targets = full[cut:cut + gamma]
            label = torch.zeros(gamma)
            for i, t in enumerate(targets):
                if tokens[i] != t:
                    break
                label[i] = 1.0
            valid = torch.zeros(gamma)
            first_miss = int(label.sum())
            valid[: min(len(targets), gamma)] = 1.0
            if first_miss < len(targets):  # everything after a mismatch is rejected, whatever the target
                valid[first_miss:] = 1.0
            context = torch.zeros(ctx, size)
            mask = torch.zeros(ctx, dtype=torch.bool)
            have = prefix_hidden[max(0, cut - 1 - ctx):cut - 1]  # states that produced full[1:cut]
            if len(have):
                context[ctx - len(have):] = have
                mask[ctx - len(have):] = True
            rows["hidden"].append(torch.stack(states))
            rows["label"].append(label)
            rows["valid"].append(valid)
            rows["context"].append(context)
            rows["context_mask"].append(mask)
            rows["prompt"].append(p)
        bar.update(1)
    bar.close()
    if steer is not None:
        steer.close()
    out = {k: torch.stack(v) if k != "prompt" else torch.tensor(v) for k, v in rows.items()}
    out["hidden"], out["context"] = out["hidden"].half(), out["context"].half()
    return out


def _pacer_logits(layer, batch) -> torch.Tensor:
    """Pacer layer over each block's context (masked on the left) and drafts: logits [B, γ]."""
    # left-padded zero context rows are kept out by replacing them with nothing: run per context length
    logits = []
    for i in range(batch["hidden"].shape[0]):
        mask = batch["context_mask"][i]
        ctx = batch["context"][i][mask].float()[None]
        drafts = batch["hidden"][i].float()[None]
        logits.append(layer(ctx, drafts, torch.arange(drafts.shape[1]))[0])
    return torch.stack(logits)


def forward(kind: str, head, batch) -> torch.Tensor:
    """Logits [B, γ]: P(reject) for specdecpp, P(accept) for pacer."""
    if kind == "specdecpp":
        return head(batch["hidden"].float())
    return _pacer_logits(head, batch)


def targets_and_weights(kind: str, batch):
    """specdecpp: target = rejected, weight on drafts up to the first rejection; pacer: every valid draft."""
    label, valid = batch["label"], batch["valid"]
    if kind == "specdecpp":
        earlier = torch.cat([torch.ones_like(label[:, :1]), label[:, :-1]], dim=1)  # all earlier accepted
        return 1.0 - label, valid * earlier
    return label, valid


def _subset(data, idx):
    return {k: v[idx] for k, v in data.items()}


def fit(kind: str, head, data, args, work: Path, resume: bool) -> List[float]:
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(args.seed)
    ckpt = work / f"checkpoint-{kind}.pt"
    start, losses = 0, []
    if resume and ckpt.exists():
        state = load_checkpoint(ckpt, head, opt, gen)
        start, losses = state["step"], list(state["extra"].get("losses", []))
    n = data["label"].shape[0]
    steps = max(1, (n + args.batch_size - 1) // args.batch_size)
    bar = progress(args.epochs * steps, initial=start * steps, desc=f"train {kind}")
    for epoch in range(start, args.epochs):
        head.train()
        perm = torch.randperm(n, generator=gen)
        total = 0.0
        for i in range(steps):
            batch = _subset(data, perm[i * args.batch_size:(i + 1) * args.batch_size])
            target, weight = targets_and_weights(kind, batch)
            loss = (F.binary_cross_entropy_with_logits(forward(kind, head, batch), target, reduction="none")
                    * weight).sum() / weight.sum().clamp_min(1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach())
            bar.update(1)
        losses.append(total / steps)
        save_checkpoint(ckpt, head, opt, epoch + 1, gen, {"losses": losses})
    bar.close()
    head.eval()
    return losses


@torch.no_grad()
def evaluate(kind: str, head, data) -> Dict[str, float]:
    """Weighted-token accuracy at 0.5 and ROC AUC of the head's positive class."""
    scores, targets = [], []
    n = data["label"].shape[0]
    for i in range(0, n, 256):
        batch = _subset(data, torch.arange(i, min(n, i + 256)))
        target, weight = targets_and_weights(kind, batch)
        keep = weight > 0
        scores.append(torch.sigmoid(forward(kind, head, batch))[keep])
        targets.append(target[keep])
    s, t = torch.cat(scores), torch.cat(targets)
    return {"accuracy": round(float(((s >= 0.5).float() == t).float().mean()), 6),
            "roc_auc": round(roc_auc(s, t.bool()), 6), "positive_fraction": round(float(t.mean()), 6),
            "tokens": int(len(t))}


def run_kind(kind: str, args: argparse.Namespace) -> int:
    if args.gamma < 2 or args.prompts < 4 or args.stride < 1 or args.epochs < 1:
        raise UsageError("need --gamma >= 2, --prompts >= 4, --stride >= 1, --epochs >= 1")
    args.tune_rtts = float_list(args.tune_rtt_ms, "--tune-rtt-ms", nonnegative=True)
    torch.set_num_threads(max(1, args.threads))
    seed_everything(args.seed)
    vdir, ddir = resolve_model_dir(args.verifier), resolve_model_dir(args.drafter)
    out = Path(args.out) if args.out else ddir / HEADS_DIR / f"{kind}.safetensors"
    work = Path(args.work) if args.work else Path(f"/tmp/steerspec-heads-{ddir.name}")
    work.mkdir(parents=True, exist_ok=True)
    verifier, drafter = load_model(vdir, device=args.device).eval(), load_model(ddir, device=args.device).eval()
    key = {"verifier": str(vdir), "drafter": str(ddir), "prompts": args.prompts, "answer": args.answer_tokens,
           "gamma": args.gamma, "stride": args.stride, "ctx": args.ctx, "seed": args.seed}
    steered = has_steering(ddir)
    if steered:
        key["steered"] = True  # labels drafted without steering are stale for an SD² drafter
    labels = work / "labels.pt"
    resume = not args.no_resume
    data = None
    prompts: Optional[List[List[int]]] = None
    if resume and labels.exists():
        stored = torch.load(labels, weights_only=False)
        data = stored["data"] if stored.get("key") == key else None
    if data is None:
        prompts = training_prompts(load_tokenizer(vdir), args.prompts, args.seed)
        started = time.perf_counter()
        data = label_blocks(verifier, drafter, prompts, args, f"label {kind}", drafter_dir=ddir)
        torch.save({"key": key, "data": data, "label_s": time.perf_counter() - started}, labels)
        for stale in work.glob("checkpoint-*.pt"):
            stale.unlink()
    prompt_ids = sorted(set(data["prompt"].tolist()))
    held_prompts = set(random.Random(args.seed).sample(prompt_ids, max(1, len(prompt_ids) * 15 // 100)))
    held = torch.tensor([p in held_prompts for p in data["prompt"].tolist()])
    train, heldout = _subset(data, (~held).nonzero().squeeze(1)), _subset(data, held.nonzero().squeeze(1))
    size = int(drafter.config.hidden_size)
    config = {"hidden_size": size}
    torch.manual_seed(args.seed)
    head = build_head(kind, config)
    losses = fit(kind, head, train, args, work, resume)
    metrics = evaluate(kind, head, heldout)
    tuned = None
    if kind == "pacer":
        prompts = prompts or training_prompts(load_tokenizer(vdir), args.prompts, args.seed)
        trajectory = trajectory_blocks(verifier, drafter, prompts, sorted(held_prompts), key, args, work, ddir, resume)
        tuned = tune_pacer(head, trajectory, verifier, drafter, args)
    command = (f"steerspec train {kind} --verifier {args.verifier} --drafter {args.drafter} --prompts {args.prompts} "
               f"--gamma {args.gamma} --stride {args.stride} --epochs {args.epochs} --seed {args.seed}"
               + (f" --tune-rtt-ms {','.join(f'{r:g}' for r in args.tune_rtts)}" if kind == "pacer" else ""))
    meta = {"verifier": vdir.name, "drafter": ddir.name, "heldout": metrics, "losses": [round(x, 6) for x in losses],
            "command": command}
    if tuned:
        meta["tuned"] = tuned
    save_head(out, kind, head, config, meta)
    params = sum(p.numel() for p in head.parameters())
    what = ("SpecDec++ rejection head (LayerNorm, Linear, SiLU, Linear): P(draft rejected | earlier accepted)"
            if kind == "specdecpp" else
            "Pacer pre-verification layer (one pre-norm transformer layer, 4 heads, draft-position embeddings, "
            "causal attention over prefix context + drafts): P(draft accepted)")
    card = MODEL_CARD.format(kind=kind, drafter=ddir.name, verifier=vdir.name, what=what, hidden_size=size,
                             extra=" plus draft-position embeddings and the last prefix states" if kind == "pacer" else "",
                             params=params, size_kb=out.stat().st_size / 1024, prompts=len(prompt_ids),
                             gamma=args.gamma, stride=args.stride, blocks=len(data["label"]),
                             train_blocks=len(train["label"]), held_blocks=len(heldout["label"]),
                             epochs=args.epochs, lr=args.lr, batch=args.batch_size, seed=args.seed,
                             positive="rejected" if kind == "specdecpp" else "accepted", command=command, **metrics)
    if tuned:
        card += TUNED_CARD.format(**tuned, verify_text=_verify_text(tuned),
                                  rtt_lines="\n".join(RTT_LINE.format(**r) for r in tuned["per_rtt"]))
    card += STEERED_NOTE if steered else ""
    out.with_name(f"{kind}_MODEL_CARD.md").write_text(card)
    print(json.dumps({"out": str(out), "heldout": metrics, "params": params, "losses": meta["losses"],
                      **({"tuned": tuned} if tuned else {})}))
    return 0
