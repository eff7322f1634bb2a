"""SD² at decode time: the engine's steering hook (`speculative_generate(..., steering=...)`).

Per block the engine hands `begin_block` the verifier's hidden states [3, d_V] entering the
low/mid/high layers at the position whose logits produced the pending token (the prefill's last
position for the first block). The verifier side turns them into g = W_hml·[l; m; h]; g crosses
the wire as fp16 bytes (d_V·2 bytes; done here too, so in-process equals the services); the
drafter side computes the per-layer biases W_s^(l) g once and its hooks add them to every position
the drafter processes in the block. In the first block the drafter feeds the whole prompt: as in
training, prompt[:-1] stays unsteered and the pending token onward is steered.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor

from steerspec.steering.drafter import SteeringHooks
from steerspec.steering.io import SteeringWeights, has_steering, load_steering
from steerspec.steering.verifier_head import SteeringHead, vector_from_bytes, vector_to_bytes


def steering_vector(head: SteeringHead, hidden: Tensor) -> Tensor:
    """Verifier side: hidden [3, d_V] (layers in head order) → g [d_V]."""
    return head(hidden.reshape(1, -1).to(head.proj.weight.dtype))[0]


class SD2Steering:
    """Engine hook (steerspec.decoding.engine.DrafterSteering) for an SD² drafter, both sides in one process.

    `drafter` is the CachedLM the engine decodes with (or a bare model): its cache length tells the
    first block (empty cache, prompt prefill) from the others. Timings of the steering work are
    accumulated in `steer_s` and the bytes a verify reply would carry in `bytes_per_reply`.
    """

    def __init__(self, drafter, weights: SteeringWeights, wire_fp16: bool = True):
        model = getattr(drafter, "model", drafter)
        self.cached = drafter if hasattr(drafter, "length") else None
        self.weights = weights
        self.head = weights.head
        self.verifier_layers = list(weights.config.verifier_layers)
        self.hooks = SteeringHooks(model, weights.drafter)
        self.wire_fp16 = wire_fp16
        self.bytes_per_reply = 2 * weights.config.verifier_hidden_size
        self.steer_s = 0.0
        self.blocks = 0

    @torch.inference_mode()
    def begin_block(self, hidden: Tensor) -> None:
        t0 = time.perf_counter()
        g = steering_vector(self.head, hidden)
        if self.wire_fp16:
            g = vector_from_bytes(vector_to_bytes(g)).to(g.device)
        first = self.cached is not None and self.cached.length == 0
        self.hooks.set_vector(g.unsqueeze(0), steer_prefix=not first)
        self.steer_s += time.perf_counter() - t0
        self.blocks += 1

    def reset_stats(self) -> None:
        self.steer_s = 0.0
        self.blocks = 0

    def close(self) -> None:
        self.hooks.remove()

    def __enter__(self) -> "SD2Steering":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def maybe_steering_weights(drafter, drafter_dir: Union[str, Path, None],
                           device: Union[str, torch.device] = "cpu") -> Optional[SteeringWeights]:
    """The steering weights in `drafter_dir`, in the drafter's dtype, or None (a plain drafter)."""
    if drafter_dir is None or not has_steering(drafter_dir):
        return None
    model = getattr(drafter, "model", drafter)
    return load_steering(drafter_dir, dtype=next(model.parameters()).dtype, device=device)


def maybe_steering(drafter, drafter_dir: Union[str, Path, None], device: Union[str, torch.device] = "cpu") -> Optional[SD2Steering]:
    """An SD2Steering when `drafter_dir` holds steering weights, else None (a plain drafter)."""
    weights = maybe_steering_weights(drafter, drafter_dir, device)
    return None if weights is None else SD2Steering(drafter, weights)
