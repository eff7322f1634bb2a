"""Train SD²: the drafter, W_s and W_hml together on the verifier's synthetic answers (verifier frozen).

Each batch draws one offset δ ∈ [1, k]; the steering vector g of verifier position t−δ (from the
hidden states entering the low/mid/high layers) conditions the drafter's prediction at position t
through W_s on every MLP up-projection. Prompt positions stay unsteered. Loss: forward KL(p_V ‖ q_D)
per token summed over the vocabulary, averaged over answer tokens. AdamW, warm-up + cosine,
gradient clipping, seeded and resumable (OUT/checkpoint.pt). The output directory is a transformers
checkpoint plus `steering.safetensors` + `steering.json`, usable as `--drafter DIR`; given such a
directory as `--drafter`, training continues its W_hml and W_s (a second phase) instead of starting them at zero.
"""

from __future__ import annotations

import argparse

import torch

from steerspec.errors import UsageError
from steerspec.steering import DrafterSteering, SteeringHead, has_steering, load_steering, parse_layers
from steerspec.train import distill
from steerspec.train.synth import load_synthetic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    distill.add_common_arguments(parser, "runs/sd2")
    parser.add_argument("--k", type=int, default=8, help="largest training offset δ (the draft length)")
    parser.add_argument("--delta-decay", type=float, default=1.0,
                        help="P(δ) ∝ decay^(δ−1); 1 = uniform over [1, k] as in the paper, < 1 favours the early "
                             "offsets that decide block efficiency")
    parser.add_argument("--block-accept", type=float, default=None,
                        help="draw offsets from simulated decoding blocks instead of one δ per batch: each "
                             "block of ≤ k positions is steered by the vector just before it, and grows past "
                             "its first position with this probability (about the drafter's acceptance rate)")
    parser.add_argument("--fixed-delta", type=int, default=None,
                        help="diagnostic: steer every position (training and validation) with the vector from "
                             "exactly this many positions back; 0 is an oracle (the verifier's own position, which "
                             "decoding never has) that shows how much the mechanism can carry")
    parser.add_argument("--steer-layers", default="auto",
                        help="verifier layers low,mid,high whose input hidden states feed W_hml (default 3, L/2, L-2 clamped)")
    parser.add_argument("--steer-lr", type=float, default=None, help="peak learning rate of W_hml and W_s (default --lr)")


def run(args) -> int:
    if args.k < 1:
        raise UsageError("--k must be at least 1")
    if not 0.0 < args.delta_decay <= 1.0:
        raise UsageError(f"--delta-decay must be in (0, 1], got {args.delta_decay}")
    if args.block_accept is not None and not 0.0 <= args.block_accept < 1.0:
        raise UsageError(f"--block-accept must be in [0, 1), got {args.block_accept}")
    if args.fixed_delta is not None and not 0 <= args.fixed_delta <= args.k:
        raise UsageError(f"--fixed-delta must be in [0, --k = {args.k}], got {args.fixed_delta}")
    if args.fixed_delta is not None and args.block_accept is not None:
        raise UsageError("--fixed-delta and --block-accept are two different offset schemes: pick one")
    torch.set_num_threads(max(1, args.threads))
    cfg = distill.config_from_args(args, steer=True)
    data = load_synthetic(args.data)
    verifier, vconfig, drafter, ddir, vdir = distill.load_pair(args, data)
    spec = args.steer_layers
    if data.tap_layers is not None and str(spec).strip().lower() in ("", "auto"):
        spec = list(data.tap_layers)  # the layers the data cached
    layers = parse_layers(spec, int(vconfig.num_hidden_layers))
    head, steering, continued = _initial_steering(ddir, drafter, int(vconfig.hidden_size), layers)
    bundle = distill.DrafterBundle(drafter, head, steering)
    pad = int(drafter.config.pad_token_id if drafter.config.pad_token_id is not None else 0)
    report = distill.train(bundle, verifier, data, cfg, args.out, pad, resume=not args.no_resume)
    report["teacher_top_k"] = data.meta.get("teacher_top_k") if data.teacher is not None else None
    report["steering"] = {
        "verifier_layers": list(layers),
        "head_params": sum(p.numel() for p in head.parameters()),
        "ws_params": sum(p.numel() for p in steering.parameters()),
        "continued_from": str(ddir) if continued else None,
    }
    distill.finish(args, report, bundle, ddir, vdir, vconfig, "SD² drafter",
                   "The pretrained drafter with SD² steering (W_s on every MLP up-projection, W_hml on the verifier) "
                   "trained jointly on the verifier's synthetic answers.")
    print(f"sd2: val KL {report['initial']['val_kl']:.4f} -> {report['final']['val_kl']:.4f} "
          f"in {report['train_seconds']:.0f} s -> {args.out}")
    return 0


def _initial_steering(ddir, drafter, hidden_size: int, layers):
    """(W_hml, W_s, continued): the initial drafter's own steering when it has some, else fresh (W_s zero).

    A continued head must read the layers this run taps; anything else is refused with the fix."""
    if not has_steering(ddir):
        return SteeringHead(hidden_size, layers), DrafterSteering.for_model(drafter, hidden_size), False
    weights = load_steering(ddir)
    if tuple(weights.config.verifier_layers) != tuple(layers) or weights.config.verifier_hidden_size != hidden_size:
        raise UsageError(
            f"--drafter {ddir} carries SD² steering for verifier layers {list(weights.config.verifier_layers)} "
            f"(d={weights.config.verifier_hidden_size}); this run taps {list(layers)} (d={hidden_size}): "
            "pass --steer-layers to match, or start from a drafter without steering")
    steering = DrafterSteering.for_model(drafter, hidden_size)
    steering.load_state_dict(weights.drafter.state_dict())  # also checks the drafter's shape
    return weights.head.train(), steering, True
