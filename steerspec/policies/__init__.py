"""Draft-length policies: how many tokens the drafter proposes per block (one file per policy).

Importing this package registers every bundled policy with `steerspec.policies.registry`.
"""

from steerspec.policies.base import BlockFeedback, DraftLengthPolicy, DraftStep, PolicyBase
from steerspec.policies.fixed import FixedK
from steerspec.policies.registry import PolicyContext, PolicyError, known_policies, make_policy, parse_spec

__all__ = ["BlockFeedback", "DraftLengthPolicy", "DraftStep", "FixedK", "PolicyBase", "PolicyContext",
           "PolicyError", "known_policies", "make_policy", "parse_spec"]
