"""The block-kind seam: what a chain, a draft tree or a SPRINTER run is, written once for every place a block goes.

A block kind is one module behind `BlockKind` plus `@register_kind`, as a draft-length policy is one module behind
`policies.base` plus `@register`. The in-process round (`generate`), the drafter service (`open_drafter`, `draft`,
`encode_block`, `check_feedback`, `feedback`), the verifier service (`open_verifier`, `admit`, `verify`,
`encode_result`) and the coordinator's round (`room`, `cut`, `commit_early`, `accepted_drafts`, `tally`, `count`)
call the session's kind (`kinds.kind_of(mode)`) and never test which kind it is.

The services hand a kind their machinery, not their code: the drafter's `Drafter` (the model, its SD² hooks,
`block_length`, `steer`, `steer_first_feed`, `chain_row`, `output`, `sync`) and the verifier's `VerifyRunner` (the
model, its steering head, `head_layers`, `steering_vectors`, `steering`, `forward_single`, `forward_batch`, `sync`).
Sessions are the services' own `DrafterSession` / `VerifierSession`; a kind reads their documented fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Dict, Generator, List, Optional, Sequence, Tuple, Type

import grpc

from steerspec.decoding.outcomes import Outcome
from steerspec.decoding.sampling import SparseDist
from steerspec.serving import wire
from steerspec.serving.wire import ProtocolError, WireBlock, invalid
from steerspec.v1 import common_pb2

if TYPE_CHECKING:  # annotations only
    from steerspec.blocks.block_mode import BlockMode
    from torch import Tensor


@dataclass
class DraftOutput:
    """A drafted block as the drafter service sends it."""

    draft_ids: List[int]
    q: Optional[SparseDist]  # ids/probs [rows, S] and floor [rows], exactly as the wire decodes them
    draft_ms: float
    batch_size: int = 1  # sessions drafted in the same batched passes
    kept: int = 0  # SPRINTER: leading drafts committed without verification (DraftBlock.kept)
    head_kept: int = 0  # SPRINTER: drafts the classifier kept, the run's last one included (DraftBlock.head_kept)
    fed: Optional[List[int]] = None  # a tree's nodes in the drafter's cache, in order (Proposal.fed)
    shape: Optional[object] = None  # a tree block's shape (decoding.trees.TreeShape; Proposal.shape)


@dataclass
class JobResult:
    """The verifier's verdict on one session's block."""

    accepted: int
    next_token: int
    is_bonus: bool
    steering: Optional["Tensor"]
    queue_ms: float
    verify_ms: float
    batch_size: int
    error: Optional[BaseException] = None
    labels: Optional[object] = None  # SPRINTER runs: steerspec.sprinter.labels.RunLabels of the run's tokens
    path: Optional[List[int]] = None  # tree sessions: the accepted nodes, root to leaf
    pass_rows: int = 0  # rows the pass scored, every session's block together (the verifier's load)


@dataclass(frozen=True)
class Verdict:
    """A verify result as the drafter applies it (DraftFeedback.result, decoded)."""

    accepted: int
    next_token: int
    steering: Optional["Tensor"]
    path: Sequence[int] = ()
    timing: Optional[object] = None  # steerspec.policies.BlockFeedback for the session's draft-length policy


class BlockKind:
    """One kind of block. Defaults are a chain's where a chain's rule is the general one."""

    name: ClassVar[str] = ""
    lean_cache: ClassVar[bool] = False  # sessions need the lean KV cache (FastCachedLM) on both services

    # -- the coordinator's round -------------------------------------------------------------------------
    def room(self, mode: "BlockMode", room: int) -> int:
        """Draft tokens a block may keep when `room` tokens are left (a block commits at most drafts + 1)."""
        return room - 1

    def cut(self, mode: "BlockMode", block: common_pb2.DraftBlock, keep: int) -> None:
        """Cut a block on the wire to its first `keep` drafts (and their rows of q)."""
        cut_rows(block, max(keep, 0), max(keep, 0))

    def commit_early(self, block: common_pb2.DraftBlock) -> int:
        """Leading drafts the coordinator commits before the verifier call (0 for lossless kinds)."""
        return 0

    def accepted_drafts(self, mode: "BlockMode", block: common_pb2.DraftBlock,
                        result: common_pb2.VerifyResult) -> List[int]:
        """The block's drafts in commit order (the first `result.accepted` are committed)."""
        return list(block.draft_ids)

    def tally(self, mode: "BlockMode") -> Optional[object]:
        """A per-session tally the coordinator keeps beside the tokens (None: the kind keeps none)."""
        return None

    def count(self, tally: Optional[object], block: common_pb2.DraftBlock,
              result: Optional[common_pb2.VerifyResult]) -> None:
        """Add a block's verdict to the session's tally (result None: the block was never verified)."""

    # -- the drafter service -----------------------------------------------------------------------------
    def open_drafter(self, drafter, session) -> None:
        """Prepare a new drafter session of this kind; ProtocolError when this drafter cannot draft it."""

    def draft(self, drafter, sessions: Sequence) -> List[DraftOutput]:
        """The next block of every session (all of this kind), each as if drafted alone."""
        raise NotImplementedError

    def encode_block(self, session, out: DraftOutput, block: common_pb2.DraftBlock) -> None:
        """Fields of the kind's own on a drafted block's message."""

    def check_feedback(self, session, result: common_pb2.VerifyResult) -> None:
        """INVALID_ARGUMENT when a result cannot answer the session's open block."""
        k = len(session.proposal.draft_ids)
        if result.is_bonus != (result.accepted == k):
            raise invalid(f"result.is_bonus={result.is_bonus} contradicts accepted {result.accepted} of {k}")

    def draft_steps(self, drafter, sessions: Sequence) -> Generator[None, None, List[DraftOutput]]:
        """`draft` of a batch of sessions, yielding between its drafter passes (drafting ahead runs it so that real
        requests go first); between yields the caches hold partial blocks and global steering hooks are clear. By
        default the whole batch in one step."""
        return self.draft(drafter, sessions)
        yield  # a generator: `return` above ends it at its first step

    def outcomes(self, drafter, session, limit: int) -> List[Outcome]:
        """The `limit` likeliest verdicts of the session's block in flight, by the drafter's own probabilities,
        for drafting ahead (drafter_service/ahead.py); [] when this kind does not draft ahead. The cache must be
        as the block left it when this returns."""
        return []

    def feedback(self, drafter, session, verdict: Verdict) -> None:
        """Commit the accepted drafts and the next token to the session; roll its cache back to them."""
        proposal = session.proposal
        n = proposal.committed_length
        session.committed.extend(proposal.draft_ids[:verdict.accepted])
        session.committed.append(int(verdict.next_token))
        if session.lm.length > n + verdict.accepted:
            session.lm.rollback(n + verdict.accepted)

    # -- the verifier service ----------------------------------------------------------------------------
    def max_block(self, mode: "BlockMode", max_k: int) -> int:
        """Most draft tokens a block of the session may carry, given the opener's max_k."""
        return max_k

    def open_verifier(self, session) -> None:
        """Check a new verifier session of this kind; ProtocolError when this replica cannot verify it."""

    def admit(self, session, msg: common_pb2.DraftBlock, vocab_size: int) -> Tuple[WireBlock, Optional[object]]:
        """Decode and check an arriving block once -> (the block, what `verify` reuses of the check)."""
        block = wire.decode_block(msg, vocab_size, session.greedy)
        refuse_kept(block)
        return block, None

    def verify(self, runner, jobs: Sequence) -> List[JobResult]:
        """Verdicts on a batch of this kind's blocks (VerifyJobs), in job order; caches keep what was accepted."""
        raise NotImplementedError

    def encode_result(self, result: JobResult, out: common_pb2.VerifyResult) -> None:
        """Fields of the kind's own on a verdict's message."""

    def branched(self, job) -> bool:
        """True when the job's rows are a tree that branches: its attention gathers keys per query, which the
        verifier's cost fit prices apart (verifier_service/pass_costs.py). A chain never does."""
        return False

    # -- in process --------------------------------------------------------------------------------------
    def generate(self, verifier, drafter, prompt_ids: Sequence[int], config, mode: "BlockMode", *, policy=None,
                 steering=None, tokenizer=None, on_round: Optional[Callable] = None, head=None):
        """Generate in one process with this kind's round (steerspec/decoding/engine.py's `run_rounds`). `head`: a
        trained head the kind drafts with (SPRINTER's classifier), loaded by the caller."""
        raise NotImplementedError


def refuse_kept(block: WireBlock) -> None:
    """FAILED_PRECONDITION for a block of a lossless session that marks drafts as kept without verification."""
    if block.kept:
        raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"block {block.seq} marks {block.kept} tokens as kept without verification, but this "
                            "session verifies exactly; open it with verification 'sprinter' (lossy) or send kept=0")


def cut_rows(block: common_pb2.DraftBlock, keep: int, rows: int) -> None:
    """Keep a block's first `keep` drafts and `rows` rows of q (fp16 probabilities on the wire)."""
    if len(block.draft_ids) <= keep:
        return
    del block.draft_ids[keep:]
    block.head_kept = min(int(block.head_kept), keep)
    if block.HasField("q"):
        if keep == 0:
            block.ClearField("q")
        else:
            support = block.q.support
            del block.q.ids[rows * support:]
            block.q.probs = block.q.probs[:rows * support * 2]


_KINDS: Dict[str, BlockKind] = {}


def register_kind(cls: Type[BlockKind]) -> Type[BlockKind]:
    """Class decorator: make a block kind known by its `name` (one instance serves every session)."""
    if not cls.name:
        raise ValueError(f"block kind {cls.__name__} has no name")
    _KINDS[cls.name] = cls()
    return cls


def registered_kinds() -> Dict[str, BlockKind]:
    """Every registered kind by name (bundled ones register when `steerspec.blocks.kinds` is imported)."""
    return dict(_KINDS)
