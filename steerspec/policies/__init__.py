"""Draft-length policies: how many tokens the drafter proposes per block (one file per policy)."""

from steerspec.policies.base import DraftLengthPolicy, PolicyBase
from steerspec.policies.fixed import FixedK

__all__ = ["DraftLengthPolicy", "FixedK", "PolicyBase"]
