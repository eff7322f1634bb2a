"""Draft-length policies: how many tokens the drafter proposes per block (one file per policy).

Importing this package registers every bundled policy with `steerspec.policies.registry`.
"""

from steerspec.policies.adaedl import AdaEDL
from steerspec.policies.base import BlockFeedback, DraftLengthPolicy, DraftStep, PolicyBase
from steerspec.policies.fixed import FixedK
from steerspec.policies.gammatune import GammaTune, GammaTunePlus
from steerspec.policies.heuristic import Heuristic
from steerspec.policies.latency import LatencyAware
from steerspec.policies.load import LoadAware
from steerspec.policies.pacer import Pacer
from steerspec.policies.registry import (
           PolicyContext,
           PolicyError,
           known_policies,
           make_policy,
           max_block,
           parse_spec,
           split_specs,
)
from steerspec.policies.specdecpp import SpecDecPP
from steerspec.policies.threshold import AssistantThreshold

__all__ = ["AdaEDL", "AssistantThreshold", "GammaTune", "GammaTunePlus", "Heuristic", "LatencyAware", "LoadAware",
           "Pacer", "SpecDecPP", "BlockFeedback", "DraftLengthPolicy", "DraftStep", "FixedK", "PolicyBase", "PolicyContext",
           "PolicyError", "known_policies", "make_policy", "max_block", "parse_spec", "split_specs"]
