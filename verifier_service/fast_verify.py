"""Prefill on a fast/graphed cache (either path): the prompt fed through `FastCachedLM.extend`, with the hidden
states the SD² head reads for block 1's steering. Batches are verified by the session's block kind
(steerspec/blocks/): a chain on the device path uses `fastpath.verify_blocks` (one forward pass, acceptance on the
device, one device→host copy per batch), used when `fastpath.enabled(device)` (CUDA by default,
STEERSPEC_DEVICE_SAMPLING); otherwise sessions keep a FastCachedLM and the host path.

Hooks (a line or two each): `VerifierSessions.open` builds the session's cache with `verify_sessions.session_lm`;
`VerifyRunner.prefill` hands over to `prefill` for any fast cache.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor


@torch.inference_mode()
def prefill(runner, session, prompt: List[int], start: int = 0) -> Optional[Tensor]:
    """`VerifyRunner.prefill` on a fast/graphed cache (either path): feed prompt[start:-1] (the rest is
    cached); steering for block 1."""
    lm = session.lm
    if start == 0:
        lm.reset()
    feed = prompt[start:-1]
    want = session.steering and runner.head is not None
    if not feed:
        return runner.initial_steering() if want else None
    out = lm.extend(feed, runner.head_layers() if want else None, logits_to_keep=1)
    if not want:
        return None
    return runner.steering_vectors(out.hidden[:, -1].unsqueeze(0))[0]
