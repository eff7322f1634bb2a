"""Drafter side of SD²: W_s and its retrofit onto any Llama/Qwen-family (SwiGLU) drafter.

W_s = LayerNorm(d_V) then Linear(d_V → L_D·d_ff, bias=False), zero-initialised. Its output is
cut into one d_ff-slice per drafter layer l and added to that layer's up-projection:

    mlp(x) = down(act(gate(x)) * (up(x) + W_s^(l) g))

The retrofit uses forward hooks on each decoder layer's `mlp.up_proj`, so transformers' source is
untouched and `SteeringHooks.remove()` restores the plain drafter. The per-layer biases are
computed once per block (`set_vector`) and reused for every position the drafter processes in
that block; training passes one vector per position instead (`set_vector(g [B, T, d_V])`).
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_UP_PROJ = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.up_proj$")


def find_up_projections(model: nn.Module) -> List[nn.Module]:
    """The `mlp.up_proj` of every decoder layer, ordered by layer index.

    Works for LlamaForCausalLM, Qwen2/Qwen3, Mistral and other SwiGLU decoders laid out as
    `*.layers.<i>.mlp.up_proj`. Raises ValueError for a model without that structure.
    """
    found = {}
    for name, module in model.named_modules():
        match = _UP_PROJ.search(name)
        if match:
            found[int(match.group(1))] = module
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no '*.layers.<i>.mlp.up_proj' modules: SD² steering needs a "
            "SwiGLU decoder (Llama, Qwen2/3, Mistral families)"
        )
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"decoder layers are not numbered 0..L-1: {sorted(found)}")
    return [found[i] for i in range(len(found))]


def drafter_shape(model: nn.Module) -> Tuple[int, int]:
    """(number of decoder layers L_D, MLP width d_ff) of a drafter."""
    ups = find_up_projections(model)
    return len(ups), int(ups[0].out_features)


class DrafterSteering(nn.Module):
    """W_s: LayerNorm(d_V) → Linear(d_V → L_D·d_ff, no bias), zero-initialised."""

    def __init__(self, steer_dim: int, num_layers: int, intermediate_size: int):
        super().__init__()
        self.steer_dim = int(steer_dim)
        self.num_layers = int(num_layers)
        self.intermediate_size = int(intermediate_size)
        self.norm = nn.LayerNorm(self.steer_dim)
        self.proj = nn.Linear(self.steer_dim, self.num_layers * self.intermediate_size, bias=False)
        nn.init.zeros_(self.proj.weight)

    @classmethod
    def for_model(cls, model: nn.Module, steer_dim: int) -> "DrafterSteering":
        num_layers, width = drafter_shape(model)
        return cls(steer_dim, num_layers, width)

    def forward(self, g: Tensor) -> Tensor:
        """g [..., d_V] → per-layer up-projection biases [..., L_D, d_ff].

        Functional calls, not the submodules': the same arithmetic with less dispatch, which counts
        here because this runs once per block on a cold cache (part of the steering's ≤ 5% budget).
        """
        g = g.to(self.proj.weight.dtype)
        norm = self.norm
        out = F.linear(F.layer_norm(g, norm.normalized_shape, norm.weight, norm.bias, norm.eps), self.proj.weight)
        return out.view(*g.shape[:-1], self.num_layers, self.intermediate_size)


class SteeringHooks:
    """Forward hooks that add W_s^(l) g to each decoder layer's up-projection output.

    With no vector set the hooks return the output unchanged, so the drafter behaves exactly
    like the plain one. Use as a context manager or call `remove()` to detach.
    """

    def __init__(self, model: nn.Module, steering: DrafterSteering):
        ups = find_up_projections(model)
        if len(ups) != steering.num_layers or ups[0].out_features != steering.intermediate_size:
            raise ValueError(
                f"steering weights are for {steering.num_layers} layers × d_ff {steering.intermediate_size}, "
                f"the drafter has {len(ups)} layers × d_ff {ups[0].out_features}"
            )
        self.model = model
        self.steering = steering
        self._bias: Optional[Tensor] = None  # [B, L, F] (one per block) or [B, T, L, F] (per position)
        self._last_only = False  # the next forward call steers only its last position
        self._num_layers = len(ups)
        self._dtype = ups[0].weight.dtype
        self._per_layer: List[Tensor] = []
        self._handles = [up.register_forward_hook(self._make_hook(i)) for i, up in enumerate(ups)]

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    @property
    def active(self) -> bool:
        return self._bias is not None

    def _make_hook(self, layer: int):
        def hook(module: nn.Module, inputs, output: Tensor) -> Optional[Tensor]:
            bias = self._bias
            if bias is None:
                return None
            if bias.dim() == 3:  # [B, L, F]: the same bias at every position of this call
                add = self._per_layer[layer]
                if self._last_only:
                    if layer == self._num_layers - 1:
                        self._last_only = False
                    if output.shape[1] > 1:
                        out = output.clone()
                        out[:, -1:] = out[:, -1:] + add
                        return out
                return output + add
            else:  # [B, T, L, F]: one bias per position (training)
                add = bias[:, :, layer]
                if add.shape[1] != output.shape[1]:
                    raise ValueError(
                        f"per-position steering covers {add.shape[1]} positions, the drafter processed {output.shape[1]}"
                    )
            return output + add.to(output.dtype)

        hook.steerspec_steering = self  # lets FastCachedLM apply the bias itself and keep its fast path
        return hook

    def fast_path_ok(self) -> bool:
        """True when the bias is one per block ([B, L, F]), which `fast_up_bias` can hand out."""
        return self._bias is None or self._bias.dim() == 3

    def fast_up_bias(self, layer: int) -> Tuple[Optional[Tensor], bool]:
        """(bias [B, 1, F] or None, last position only) for `layer`, exactly as the hook would add it."""
        if self._bias is None:
            return None, False
        last_only = self._last_only
        if last_only and layer == self._num_layers - 1:
            self._last_only = False
        return self._per_layer[layer], last_only

    def set_vector(self, g: Optional[Tensor], mask: Optional[Tensor] = None, *, steer_prefix: bool = True) -> None:
        """Steer with g [B, d_V] (one per row, for the whole block) or g [B, T, d_V] (per position).

        `mask` [B, T] (per-position only) zeroes the steering where False (unsteered positions).
        `steer_prefix=False` leaves all but the last position of the *next* forward call unsteered:
        the first block, where the drafter feeds the whole prompt, keeps prompt[:-1] unsteered as in
        training and steers the pending token onward. None clears the steering.
        """
        self._last_only = False
        if g is None:
            self._bias = None
            return
        if g.dim() == 1:
            g = g.unsqueeze(0)
        bias = self.steering(g)
        if mask is not None:
            if g.dim() != 3:
                raise ValueError("a steering mask needs per-position vectors g [B, T, d_V]")
            bias = bias.masked_fill(~mask.to(torch.bool)[..., None, None], 0.0)  # an inf there cannot leak
        self._set(bias)
        self._last_only = not steer_prefix and bias.dim() == 3

    def up_biases(self, g: Tensor) -> List[Tensor]:
        """The per-layer biases [F] that `set_vector(g)` adds for one sequence (g [d_V]); for
        callers that steer several sequences at once (FastCachedLM.set_up_bias per sequence)."""
        bias = self.steering(g.reshape(1, -1)).to(self._dtype)
        return [bias[0, layer] for layer in range(bias.shape[1])]

    def set_bias(self, bias: Optional[Tensor]) -> None:
        """Install precomputed biases ([B, L, F] or [B, T, L, F]); e.g. cached per session."""
        self._last_only = False
        self._set(bias)

    def _set(self, bias: Optional[Tensor]) -> None:
        self._bias = bias
        if bias is not None and bias.dim() == 3:  # per-layer [B, 1, F] views in the model's dtype, made once
            bias = bias.to(self._dtype)
            self._per_layer = [bias[:, layer].unsqueeze(1) for layer in range(bias.shape[1])]
        else:
            self._per_layer = []

    @property
    def bias(self) -> Optional[Tensor]:
        return self._bias

    def clear(self) -> None:
        self._bias = None
        self._last_only = False

    def remove(self) -> None:
        """Detach every hook; the model is the plain drafter again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._bias = None

    def __enter__(self) -> "SteeringHooks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def attach_steering(model: nn.Module, steering: DrafterSteering) -> SteeringHooks:
    """Retrofit `steering` onto `model` (no change to its parameters); returns the hooks."""
    return SteeringHooks(model, steering)
