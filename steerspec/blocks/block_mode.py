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
from steerspec.policies.registry import PolicyError, max_block, parse_spec
from steerspec.sprinter.spec import Verification, VerificationError, parse_verification

VERIFIER_ALONE, CHAIN, TREE, SPRINTER_RUN = "verifier", "chain", "tree", "sprinter"
BUNDLED = (VERIFIER_ALONE, CHAIN, TREE, SPRINTER_RUN)  # told apart by the request's fields; others by name
FIXED = "fixed"


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
    def draft_depth(self) -> int:
        """The drafter's per-block length bound before the budget and context cut it: a tree's depth, else k."""
        return self.tree.depth if self.tree is not None else self.k


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
        if not _fixed(policy):
            raise ModeError(f"a draft tree replaces the draft length: policy '{policy}' does not apply; send policy "
                            "'fixed' (or none)")
        return BlockMode(TREE, rule, FIXED, int(k), shape)
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


EXACT_CHAIN = parse_mode()
VERIFIER_ONLY = parse_mode(speculative=False)  # 0-length blocks: autoregressive sessions, and those out of drafters  # chains verified exactly with `fixed` k: what a session that names nothing decodes
