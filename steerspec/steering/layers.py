"""Which verifier layers feed the SD² steering head (low, middle, high).

`hidden_states[i]` of a transformers forward with `output_hidden_states=True` is the input to
decoder layer i (index 0 = the embeddings), so a layer index here names the hidden state that
*enters* that layer. The SD² paper uses 3, L/2 and L-2 (EAGLE-3's choice); tiny verifiers need
clamping so the three stay distinct and inside [1, L-1].
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

from steerspec.errors import UsageError

Layers = Tuple[int, int, int]


def default_layers(num_layers: int) -> Layers:
    """(low, mid, high) for a verifier with `num_layers` decoder layers.

    32 layers -> (3, 16, 30); 12 -> (1, 6, 10); 6 -> (1, 3, 4); 4 -> (1, 2, 3); 2 -> (0, 1, 1).
    """
    if num_layers < 1:
        raise ValueError(f"a verifier needs at least one decoder layer, got {num_layers}")
    last = num_layers - 1
    low = min(3, max(1, num_layers // 8))
    mid = num_layers // 2
    high = num_layers - 2
    low = max(0, min(low, mid - 1))
    high = min(last, max(high, mid + 1))
    return (min(low, last), min(mid, last), high)


def parse_layers(spec: Union[str, Sequence[int], None], num_layers: int) -> Layers:
    """Parse "low,mid,high" (or a sequence); None/"" or "auto" gives `default_layers`."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "auto")):
        return default_layers(num_layers)
    if isinstance(spec, str):
        try:
            values = [int(part) for part in spec.split(",")]
        except ValueError:
            raise UsageError(f"steering layers must be three integers like '3,16,30', got {spec!r}") from None
    else:
        values = [int(v) for v in spec]
    if len(values) != 3:
        raise UsageError(f"steering layers must be exactly three (low,mid,high), got {values}")
    for v in values:
        if not 0 <= v < num_layers:
            raise UsageError(f"steering layer {v} is outside the verifier's layers 0..{num_layers - 1}")
    return (values[0], values[1], values[2])


def resolve_layers(spec: Optional[Union[str, Sequence[int]]], num_layers: int) -> Layers:
    """Alias of `parse_layers` for call sites that read better with it."""
    return parse_layers(spec, num_layers)
