"""Verifier side of SD²: the steering head W_hml and the fp16 wire format of steering vectors.

g = W_hml · [h_low; h_mid; h_high] where the three hidden states are the inputs to the chosen
verifier layers at the position whose logits produced the last committed token. W_hml starts as
[I | I | I] with zero bias (g = h_low + h_mid + h_high), as in the SD² paper.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from steerspec.steering.layers import Layers

WIRE_DTYPE = "float16"


class SteeringHead(nn.Module):
    """W_hml: Linear(3·d_V → d_V) with bias, reading three verifier layers."""

    def __init__(self, hidden_size: int, layers: Layers):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.layers = tuple(int(i) for i in layers)
        if len(self.layers) != 3:
            raise ValueError(f"the steering head reads exactly three layers, got {self.layers}")
        self.proj = nn.Linear(3 * self.hidden_size, self.hidden_size, bias=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """[I | I | I] and zero bias: the initial steering vector is the sum of the three states."""
        eye = torch.eye(self.hidden_size)
        with torch.no_grad():
            self.proj.weight.copy_(torch.cat([eye, eye, eye], dim=1))
            self.proj.bias.zero_()

    def gather(self, hidden_states: Sequence[Tensor]) -> Tensor:
        """Concatenate the selected entries of `output_hidden_states` on the feature axis: [..., 3·d_V]."""
        return torch.cat([hidden_states[i] for i in self.layers], dim=-1)

    def forward(self, features: Tensor) -> Tensor:
        """features [..., 3·d_V] (from `gather`) → steering vectors g [..., d_V]."""
        return self.proj(features.to(self.proj.weight.dtype))

    def from_hidden_states(self, hidden_states: Sequence[Tensor]) -> Tensor:
        """g for every position of a forward pass: [B, T, d_V]."""
        return self(self.gather(hidden_states))

    def initial(self, batch: int = 1) -> Tensor:
        """g when there is no verifier position yet (1-token prompt): the head applied to zeros."""
        zeros = torch.zeros(batch, 3 * self.hidden_size, dtype=self.proj.weight.dtype, device=self.proj.weight.device)
        return self(zeros)


def vector_to_bytes(g: Tensor) -> bytes:
    """One steering vector [d_V] as fp16 little-endian bytes (d_V · 2 bytes on the wire), saturated to fp16's
    range: a vector taken at an attention-sink position (SmolLM2's first token: |g| near 9e4) would else
    arrive as inf and turn the steered drafter's logits to NaN."""
    limit = torch.finfo(torch.float16).max
    flat = g.detach().reshape(-1).float().clamp(-limit, limit).to(device="cpu", dtype=torch.float16).contiguous()
    return flat.numpy().astype("<f2", copy=False).tobytes()


def vector_from_bytes(data: bytes, hidden_size: int | None = None) -> Tensor:
    """Inverse of `vector_to_bytes`: a float32 tensor [d_V]."""
    if len(data) % 2:
        raise ValueError(f"a float16 steering vector has an even number of bytes, got {len(data)}")
    if hidden_size is not None and len(data) != 2 * hidden_size:
        raise ValueError(f"steering vector has {len(data) // 2} values, expected {hidden_size}")
    if sys.byteorder == "little":  # one torch op, no numpy round trip (this runs once per block)
        return torch.frombuffer(bytearray(data), dtype=torch.float16).float()

    return torch.from_numpy(np.frombuffer(data, dtype="<f2").astype("float32"))
