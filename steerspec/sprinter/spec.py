"""The `--verification` grammar: `exact` (default, lossless; token-wise acceptance), `block` (lossless; block
verification of chains, steerspec/decoding/block_verify.py, and traversal verification of draft trees,
steerspec/decoding/traversal.py) or `sprinter[:threshold=T,max_run=N]` (lossy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

EXACT, BLOCK, SPRINTER = "exact", "block", "sprinter"
DEFAULT_MAX_RUN = 16


class VerificationError(ValueError):
    """A verification spec that cannot be used; the message says what would work."""


@dataclass(frozen=True)
class Verification:
    """How draft tokens are verified. `threshold` None means the head's own default."""

    mode: str = EXACT
    threshold: Optional[float] = None
    max_run: int = DEFAULT_MAX_RUN

    @property
    def lossy(self) -> bool:
        return self.mode == SPRINTER

    @property
    def acceptance(self) -> str:
        """`DecodeConfig.acceptance` / `VerifyRow.acceptance` of an exact session: "block" or "token"."""
        return "block" if self.mode == BLOCK else "token"

    def spec(self) -> str:
        """The canonical spec string (round-trips through parse_verification)."""
        if self.mode in (EXACT, BLOCK):
            return self.mode
        parts = [f"max_run={self.max_run}"]
        if self.threshold is not None:
            parts.insert(0, f"threshold={self.threshold:g}")
        return f"{SPRINTER}:" + ",".join(parts)


def parse_verification(spec: Optional[str]) -> Verification:
    """Parse a spec; VerificationError (one line) on an unknown mode, key or out-of-range value."""
    spec = (spec or EXACT).strip()
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    if name in (EXACT, BLOCK):
        if rest.strip():
            raise VerificationError(f"verification {name!r} takes no parameters, got {spec!r}")
        return Verification(name)
    if name != SPRINTER:
        raise VerificationError(f"unknown verification {name!r}; expected 'exact', 'block' or "
                                f"'sprinter[:threshold=T,max_run=N]'")
    threshold: Optional[float] = None
    max_run = DEFAULT_MAX_RUN
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise VerificationError(f"sprinter parameter {item!r} needs key=value (threshold, max_run)")
        try:
            if key == "threshold":
                threshold = float(value)
            elif key == "max_run":
                max_run = int(value)
            else:
                raise VerificationError(f"unknown sprinter parameter {key!r}; known: threshold, max_run")
        except ValueError as exc:
            if isinstance(exc, VerificationError):
                raise
            raise VerificationError(f"sprinter {key} must be a number, got {value!r}") from None
    if threshold is not None and not 0.0 < threshold < 1.0:
        raise VerificationError(f"sprinter threshold must be in (0, 1), got {threshold:g}")
    if max_run < 1:
        raise VerificationError(f"sprinter max_run must be >= 1, got {max_run}")
    return Verification(SPRINTER, threshold, max_run)
