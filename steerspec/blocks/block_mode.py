"""A request's decoding mode, parsed once where it enters a service: the block kind, its verification rule, the
draft-length policy and the most draft tokens a block carries.

The coordinator (`SessionRequest.validate`), the drafter (`DraftOpen`) and the verifier (`VerifyOpen`) each build
one `BlockMode` with `parse_mode` from the request's plain fields; the code behind them reads its typed fields
instead of re-deriving kinds from strings. One set of rules, one message per refusal.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from steerspec.blocks.block_kind import registered_kinds
from steerspec.decoding.trees import TreeShape, parse_tree
from steerspec.policies.base import MAX_K
from steerspec.policies.registry import PolicyError, known_policies, max_block, parse_spec
from steerspec.sprinter.spec import Verification, VerificationError, parse_verification

VERIFIER_ALONE, CHAIN, TREE, SPRINTER_RUN = "verifier", "chain", "tree", "sprinter"
BUNDLED = (VERIFIER_ALONE, CHAIN, TREE, SPRINTER_RUN)  # told apart by the request's fields; others by name
FIXED = "fixed"
DEFAULT_K = 4  # a chain's k when a request names a policy or a tree but no k
DEFAULT_TREE_SPEC = "default"  # what a request that names no k, tree or policy drafts: the default tree ...
LOAD_AWARE = "load"  # ... each block sized to the verifier's load (steerspec/policies/load.py)


class ModeError(ValueError):
    """A combination of mode fields that cannot run; the message names the field and the fix."""


@dataclass(frozen=True)
class BlockMode:
    """What a session decodes with. `kind`: `verifier` (0-length blocks: the verifier alone), `chain`, `tree`
    (a static draft tree, `tree` set) or `sprinter` (lossy runs ended by the drafter's classifier)."""

    kind: str
    verification: Verification
    policy: str = FIXED  # the registry spec; `fixed` for kinds whose shape sets the block length
    k: int = 4  # a chain's k under `fixed`; a SPRINTER session's max_run
    tree: Optional[TreeShape] = None

    @property
    def speculative(self) -> bool:
        return self.kind != VERIFIER_ALONE

    @property
    def lossy(self) -> bool:
        return self.verification.lossy

    @property
    def acceptance(self) -> str:
        """At T > 0: "token" (speculative sampling) or "block" (block / traversal verification)."""
        return self.verification.acceptance

    def alone(self) -> "BlockMode":
        """This mode without drafts (a session whose last drafter is gone): 0-length blocks, the same rule."""
        return replace(self, kind=VERIFIER_ALONE, policy=FIXED, tree=None)

    @property
    def custom(self) -> str:
        """The kind's name where the request's fields cannot tell it (a kind registered outside the bundled
        ones: `block_kind` on the wire), else ""."""
        return "" if self.kind in BUNDLED else self.kind

    @property
    def tree_spec(self) -> str:
        return "" if self.tree is None else self.tree.spec()

    @property
    def block_limit(self) -> int:
        """Most draft tokens per block, what both services are opened with: every node of a tree, k for a bare
        `fixed`, otherwise the policy's own bound (gmax, max or k of its spec); 0 for the verifier alone."""
        if not self.speculative:
            return 0
        if self.tree is not None:
            return self.tree.size
        return self.k if self.policy == FIXED else max_block(self.policy)

    @property
    def policy_k(self) -> int:
        """The bound a session's draft-length policy is built with and capped by: a tree's nodes (policies size
        trees by how many of its nodes a block carries, breadth-first), else k (a SPRINTER run's max_run)."""
        return self.tree.size if self.tree is not None else self.k

    @property
    def draft_depth(self) -> int:
        """The drafter's per-block length bound before the budget and context cut it: a tree's depth, else k."""
        return self.tree.depth if self.tree is not None else self.k


def tree_policies() -> list:
    """The registered policies that size draft trees (how many nodes of the tree, breadth-first)."""
    return sorted(name for name, entry in known_policies().items() if entry.trees)


def _sizes_trees(policy: str) -> bool:
    return (policy or FIXED).split(":")[0].strip() in tree_policies()


def _fixed(policy: str) -> bool:
    return (policy or FIXED).split(":")[0].strip() == FIXED


def parse_mode(*, speculative: bool = True, k: int = 4, tree: str = "", verification: str = "", policy: str = "",
               default_policy: str = "", block_kind: str = "") -> BlockMode:
    """The mode of a request's fields; ModeError naming the bad field and the fix. `default_policy`: what a chain
    that names no policy drafts with (a service's `--policy`; `fixed` when empty). `block_kind`: a registered
    kind the other fields cannot express ("": told by them)."""
    try:
        rule = parse_verification(verification)
    except VerificationError as exc:
        raise ModeError(f"verification: {exc}") from None
    name = (block_kind or "").strip()
    if name and name not in BUNDLED:
        return _custom(name, speculative, int(k), tree, rule, policy)
    named = (policy or "").strip()
    policy = named or FIXED
    try:
        parse_spec(policy)
    except PolicyError as exc:
        raise ModeError(str(exc)) from None
    shape = None
    if (tree or "").strip():
        try:
            shape = parse_tree(tree)
        except ValueError as exc:
            raise ModeError(f"tree: {exc}") from None
        if not speculative:
            raise ModeError("a draft tree needs mode 'speculative'")
        if rule.lossy:
            raise ModeError(f"a draft tree is verified losslessly, not by '{rule.mode}': send verification 'exact' "
                            "or 'block', or no tree")
        if not _sizes_trees(policy):
            raise ModeError(f"a draft tree is sized by a policy that sizes trees ({', '.join(tree_policies())}); "
                            f"policy '{policy}' drafts chains: send one of those (or none)")
        return BlockMode(TREE, rule, policy, int(k), shape)
    if rule.lossy:
        if not speculative:
            raise ModeError("sprinter verification needs mode 'speculative' (it verifies a drafter's tokens)")
        if not _fixed(policy):
            raise ModeError(f"sprinter verification ends runs with its classifier; policy '{policy}' does not "
                            "apply: send policy 'fixed' (or none)")
        if rule.max_run > MAX_K:
            raise ModeError(f"sprinter max_run must be at most {MAX_K}, got {rule.max_run}")
        return BlockMode(SPRINTER_RUN, rule, FIXED, rule.max_run)
    if not named and (default_policy or "").strip():
        policy = default_policy.strip()
        try:
            parse_spec(policy)
        except PolicyError as exc:
            raise ModeError(str(exc)) from None
    return BlockMode(CHAIN if speculative else VERIFIER_ALONE, rule, policy, int(k))


def _custom(name: str, speculative: bool, k: int, tree: str, rule: Verification, policy: str) -> BlockMode:
    """A kind registered outside the bundled ones: fixed k blocks, verified losslessly."""
    known = registered_kinds()
    if name not in known:
        raise ModeError(f"unknown block kind {name!r}; known kinds: {', '.join(sorted(known))}")
    if not speculative:
        raise ModeError(f"block kind {name!r} needs mode 'speculative'")
    if (tree or "").strip():
        raise ModeError(f"block kind {name!r} drafts no tree: send no tree with it")
    if rule.lossy or not _fixed(policy):
        raise ModeError(f"block kind {name!r} drafts k tokens, verified losslessly: send policy 'fixed' (or none) "
                        "and verification 'exact' or 'block'")
    return BlockMode(name, rule, FIXED, k)


def default_fields(*, speculative: bool, k: int, tree: str, policy: str, verification: str = "",
                   block_kind: str = "") -> tuple:
    """(tree, policy, k) of a request, with what one that names none of them gets: a speculative, lossless request
    with no k (0), tree, policy or block kind drafts the default tree sized by the load-aware policy; otherwise the
    fields as sent, k defaulting to DEFAULT_K. The one default of the SDK, the coordinator and the deployments."""
    named = int(k or 0) > 0 or (tree or "").strip() or (policy or "").strip() or (block_kind or "").strip()
    lossless = True
    try:
        lossless = not parse_verification(verification).lossy
    except VerificationError:
        pass  # refused with its message by parse_mode
    if speculative and not named and lossless:
        return DEFAULT_TREE_SPEC, LOAD_AWARE, DEFAULT_K
    return tree, policy, int(k or 0) or DEFAULT_K


EXACT_CHAIN = parse_mode()
VERIFIER_ONLY = parse_mode(speculative=False)  # 0-length blocks: autoregressive sessions, and those out of drafters  # chains verified exactly with `fixed` k: what a session that names nothing decodes
