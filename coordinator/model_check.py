"""The coordinator's model follows the verifier's: resolved on this host, checked, or refused with the fix.

A coordinator encodes prompts, decodes output, stops at EOS and caps the context with its tokenizer; if that
is not the verifier's, every token id means other text and the output is garbage. So by default it asks the
verifier what it serves (`GetVerifierStats`: a `ModelIdentity`), resolves that model here (a bundled name
resolves on any host; a directory must exist on this host too, or `--tokenizer DIR` names a copy) and takes
the tokenizer, EOS ids and context limit from it. An explicit `--tokenizer` / `--max-length` is checked
against the verifier, not trusted, and so are the edge drafters. When no verifier answers at start-up, the
check moves to the first session (`Coordinator.ensure_model`) and to the verifier's own handshake.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Iterable, List, Optional, Tuple

import grpc

from steerspec.errors import UsageError
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.loading import load_tokenizer
from steerspec.serving import wire
from steerspec.serving.identity import (
    ModelIdentity,
    describe,
    drafter_fix,
    mismatch_message,
    pair_differences,
    steering_differences,
    tokenizer_differences,
    tokenizer_dir,
)
from steerspec.v1 import drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)
FOLLOW = "auto"  # --tokenizer's default: the verifier's model
PROBE_TIMEOUT_S = 3.0
TOKENIZER_FIX = "Drop --tokenizer (the coordinator follows the verifier's model) or pass the verifier's model"


@dataclass
class CoordinatorModel:
    """What a coordinator tokenises with: the tokenizer, its identity, EOS ids and the context limit."""

    tokenizer: object
    identity: Optional[ModelIdentity]
    eos_ids: Tuple[int, ...] = ()
    max_length: Optional[int] = None


def explicit(tokenizer: Optional[str]) -> bool:
    """Whether --tokenizer names a model (else the coordinator follows the verifier's)."""
    return bool(tokenizer) and tokenizer != FOLLOW


def local_model(name: str, max_length: Optional[int] = None) -> CoordinatorModel:
    """The tokenizer, identity and EOS of a bundled name or directory on this host (UsageError when absent)."""
    path = resolve_model_dir(name)
    source = tokenizer_dir(path)
    if source is None:
        raise UsageError(f"{name} has no tokenizer files (tokenizer.json, ...): pass a checkpoint directory with one")
    tokenizer = load_tokenizer(source)
    identity = replace(describe(path, tokenizer), name=str(name))
    return CoordinatorModel(tokenizer, identity, identity.eos_ids, max_length or identity.context_length or None)


def follow(verifier: ModelIdentity, tokenizer: Optional[str] = None,
           max_length: Optional[int] = None) -> CoordinatorModel:
    """The coordinator's model for a verifier serving `verifier`: its own (resolved here) or the given
    `tokenizer`, checked to agree; UsageError with one line naming both sides and the fix otherwise."""
    named = explicit(tokenizer)
    try:
        model = local_model(tokenizer if named else verifier.name)
    except UsageError as exc:
        if named:
            raise
        raise UsageError(f"the verifier serves {verifier.label()}, which does not resolve on this host ({exc}); "
                         "pass --tokenizer naming a local copy of its checkpoint (tokenizer files suffice)") from None
    differences = tokenizer_differences(verifier, model.identity, "coordinator")
    if differences:
        fix = TOKENIZER_FIX if named else "Pass --tokenizer naming a local copy of the verifier's checkpoint"
        raise UsageError(mismatch_message(verifier, model.identity, "coordinator", differences,
                                          f"{fix} ({verifier.name})"))
    context = verifier.context_length or model.identity.context_length or None
    if max_length is not None and context and max_length > context:
        raise UsageError(f"--max-length {max_length} exceeds the verifier's context of {context} tokens "
                         f"({verifier.name}): pass at most {context}, or leave it out to follow the verifier")
    eos = verifier.eos_ids or model.eos_ids
    return CoordinatorModel(model.tokenizer, model.identity, tuple(eos), max_length or context)


async def stats_identity(channels, kind: str, address: str,
                         timeout: float = PROBE_TIMEOUT_S) -> Optional[ModelIdentity]:
    """What the replica at `address` reports it serves; None when it does not answer (or reports nothing)."""
    try:
        if kind == "verifier":
            reply = await channels.verifier(address).GetVerifierStats(verifier_pb2.GetVerifierStatsRequest(),
                                                                      timeout=timeout)
        else:
            reply = await channels.drafter(address).GetDrafterStats(drafter_pb2.GetDrafterStatsRequest(),
                                                                    timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        log.debug("%s %s did not answer GetStats (%s): its model is checked at session open", kind, address,
                 exc.code().name)
        return None
    return wire.identity_from_proto(reply.stats.identity) if reply.stats.HasField("identity") else None


def check_drafter(verifier: ModelIdentity, drafter: ModelIdentity, address: str) -> None:
    """UsageError for an edge drafter that cannot draft for the verifier; a warning for unpaired SD² weights."""
    differences = pair_differences(verifier, drafter)
    if differences:
        raise UsageError(f"--drafter {address}: " + mismatch_message(verifier, drafter, "drafter", differences,
                                                                      drafter_fix(differences)))
    if verifier.steering and drafter.steering:
        steering = steering_differences(verifier, drafter)
        if steering:
            log.warning("--drafter %s: steered sessions will be refused: %s", address, "; ".join(steering))


async def check_deployment(channels, verifiers: Iterable[str], drafters: Iterable[str], tokenizer: Optional[str],
                           max_length: Optional[int] = None,
                           timeout: float = PROBE_TIMEOUT_S) -> Optional[CoordinatorModel]:
    """The coordinator's model, checked against the replicas that answer now (UsageError on a mismatch).

    None when no verifier answers and `tokenizer` is FOLLOW: the model is resolved at the first session."""
    found: List[Tuple[str, ModelIdentity]] = []
    for address in verifiers:
        identity = await stats_identity(channels, "verifier", address, timeout)
        if identity is not None:
            found.append((address, identity))
    for (a, first), (b, other) in zip(found, found[1:]):
        if tokenizer_differences(first, other, "verifier"):
            raise UsageError(f"--verifier replicas serve different models: {a} {first.label()}, {b} {other.label()}; "
                             "give one coordinator replicas of one model")
    if not found:
        if not explicit(tokenizer):
            return None
        return await asyncio.to_thread(local_model, tokenizer, max_length)
    verifier = found[0][1]
    model = await asyncio.to_thread(follow, verifier, tokenizer, max_length)
    for address in drafters:
        drafter = await stats_identity(channels, "drafter", address, timeout)
        if drafter is not None:
            check_drafter(verifier, drafter, address)
    return model
