"""Pacer: blockwise pre-verification with a one-layer transformer (its Section 3 and Appendix A).

Drafting goes in rounds of b tokens. After each round the pre-verification layer reads the
drafter's final hidden states of the round's drafts plus draft-position embeddings (positions
i..i+b-1 counted from the block start), attending causally to the hidden states of earlier
drafts of this block and of up to `ctx` earlier accepted tokens (the paper's h_x, kept from
the drafts the verifier accepted; a bonus/correction token has no drafter state and is skipped).
If the mean predicted acceptance of the round is ≤ t the block ends (verification);
otherwise t <- t·ρ and another round follows. t restarts at its initial value every block.
The block is capped at `max` drafts. b, t and ρ default to the values `steerspec train pacer`
tuned for the head on the training split (stored in the head; `steerspec/train/pacer_tune.py`),
else to Table 10's HumanEval values (b=4, t=0.7, ρ=1.05); a spec's own values always win.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from steerspec.policies.base import BlockFeedback, DraftStep, PolicyBase, check_k, check_open_unit
from steerspec.policies.catalog import Key, register
from steerspec.policies.heads import context_hidden_size, head_path, load_head_and_meta

TABLE10 = {"b": 4, "t": 0.7, "rho": 1.05}


@register("pacer", {"b": Key(int, TABLE10["b"], "block size (default: the head's tuned b, else Table 10's)"),
                    "t": Key(float, TABLE10["t"], "stop threshold on a round's mean acceptance (tuned, else Table 10)"),
                    "rho": Key(float, TABLE10["rho"], "threshold growth per round (tuned, else Table 10)"),
                    "max": Key(int, 32, "cap on drafts per block"),
                    "ctx": Key(int, 32, "accepted hidden states kept as context"),
                    "head": Key(str, "", "head file (default: <drafter>/policy_heads/pacer.safetensors)")},
          doc="Pacer: blockwise pre-verification", length_keys=("max",))
class Pacer(PolicyBase):
    """Rounds of b drafts; stop when the pre-verification layer's mean acceptance ≤ t (t·ρ per round)."""

    name = "pacer"
    stops_early = True
    needs_hidden = True

    def __init__(self, b: Optional[int] = None, t: Optional[float] = None, rho: Optional[float] = None,
                 max: int = 32, ctx: int = 32, head: str = "", context: Optional[Any] = None) -> None:
        path = head or head_path("pacer", getattr(context, "drafter_dir", None))
        self.layer, meta = load_head_and_meta("pacer", path, context_hidden_size(context))
        defaults = {**TABLE10, **{k: v for k, v in meta.get("tuned", {}).items() if k in TABLE10}}
        b, t, rho = (defaults[k] if v is None else v for k, v in (("b", b), ("t", t), ("rho", rho)))
        self.b = check_k(int(b), "b")
        self.t0 = check_open_unit(float(t), "t")
        if not 1.0 <= rho <= 2.0:
            raise ValueError(f"rho must be in [1, 2], got {rho}")
        self.rho = float(rho)
        self.max_k = check_k(max, "max")
        if not 0 <= ctx <= 256:
            raise ValueError(f"ctx must be in [0, 256], got {ctx}")
        self.ctx = int(ctx)
        self.reset()

    def reset(self) -> None:
        self.context: List[torch.Tensor] = []
        self._drafts: List[torch.Tensor] = []
        self.t = self.t0

    def next_k(self) -> int:
        self._drafts = []
        self.t = self.t0
        return self.max_k

    @torch.inference_mode()
    def acceptance(self, drafts: List[torch.Tensor], start: int) -> torch.Tensor:
        """Predicted acceptance [n] of drafts[start:] given the context and drafts[:start]."""
        param = next(self.layer.parameters())
        seq = torch.stack(drafts).to(param.device, param.dtype)[None]  # [1, N, D]
        ctx = (torch.stack(self.context).to(param.device, param.dtype)[None] if self.context
               else seq.new_zeros(1, 0, seq.shape[-1]))
        positions = torch.arange(seq.shape[1], device=param.device)
        return torch.sigmoid(self.layer(ctx, seq, positions))[0, start:]

    def observe(self, step: DraftStep) -> bool:
        if step.hidden is None:
            raise RuntimeError("pacer needs the drafter's hidden states (the draft loop gave none)")
        self._drafts.append(step.hidden.detach().float().cpu())
        n = len(self._drafts)
        if n % self.b:
            return False
        mean = float(self.acceptance(self._drafts, n - self.b).mean())
        if mean <= self.t:
            return True
        self.t *= self.rho
        return False

    def update(self, feedback: BlockFeedback) -> None:
        if self.ctx:
            self.context = (self.context + self._drafts[: feedback.accepted])[-self.ctx:]
        self._drafts = []

    def state_dict(self) -> Dict[str, Any]:
        return {"context": [h.tolist() for h in self.context]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.context = [torch.tensor(h, dtype=torch.float32) for h in state["context"]][-self.ctx:] if self.ctx else []
