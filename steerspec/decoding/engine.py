"""The in-process speculative-decoding engine: a few plain functions (gpt-fast style).

Protocol (identical in-process and over gRPC). The committed sequence is
x_1..x_n; the last committed token x_n is *pending*: neither KV cache holds it yet.

- `prefill`: the verifier feeds prompt[:-1]; its hidden states at the last fed position seed
  the first steering vector (zeros for a one-token prompt).
- `draft_block`: the drafter feeds committed[drafter.length:] (ends with the pending token) and
  then each draft it samples, proposing d_1..d_k; its cache ends holding committed + d_1..d_{k-1}.
- `verify_block`: the verifier feeds [pending, d_1..d_k]; row i of its logits scores d_{i+1},
  row k is the bonus. Greedy: compare argmaxes; else exact rejection sampling against the
  drafter's sparse top-K distribution. The verifier rolls back to n + a tokens (committed plus
  the accepted drafts, minus the new pending token t); the caller rolls the drafter back to
  min(drafter.length, n + a).

Randomness, block length, commit and accounting: steerspec/decoding/rounds.py (shared with the services).
The drafter samples from draft_distribution(probs_from_logits(logits, T, top_k, top_p), draft_top_k).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor

from steerspec.decoding import fastpath, rounds, verifying
from steerspec.decoding.drafting import DraftRow, draft_blocks
from steerspec.decoding.generation_result import GenerationResult
from steerspec.decoding.rounds import BlockStats, DecodeConfig, make_generators  # noqa: F401  (DecodeConfig re-exported)
from steerspec.decoding.sampling import probs_from_logits, sample
from steerspec.decoding.speculative import DraftBlock, VerifyOutcome
from steerspec.decoding.verifying import VerifyRow
from steerspec.models.backends import as_cached
from steerspec.models.kv import CachedLM
from steerspec.policies.base import BlockFeedback, DraftLengthPolicy
from steerspec.policies.fixed import FixedK


class DrafterSteering(Protocol):
    """Extension point for SD²: receives the verifier's hidden states before each block.

    `verifier_layers` names the decoder layers whose *input* hidden states the verifier returns;
    `begin_block(hidden [L, D])` gets them at the position whose logits produced the pending
    token, and may install a bias on the drafter (e.g. on every up-projection) for the block.
    """

    verifier_layers: Sequence[int]

    def begin_block(self, hidden: Tensor) -> None: ...


@dataclass
class RoundRecord:
    """One verify round as seen by `on_round` callbacks."""

    drafted: int
    accepted: int
    committed: List[int]
    draft_s: float
    verify_s: float


def check_prompt(prompt_ids: Sequence[int], config: DecodeConfig) -> List[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    if config.max_length is not None and len(prompt) > config.max_length:
        raise ValueError(f"prompt has {len(prompt)} tokens; the model context is {config.max_length}")
    return prompt


def prefill(verifier: CachedLM, prompt_ids: Sequence[int], hidden_layers: Optional[Sequence[int]] = None) -> Optional[Tensor]:
    """Reset the verifier and feed prompt[:-1]; return hidden states [L, D] at the last fed position."""
    verifier.reset()
    out = verifier.extend(prompt_ids[:-1], hidden_layers, logits_to_keep=1)
    if not hidden_layers:
        return None
    if out.hidden.shape[1] == 0:
        return torch.zeros(len(hidden_layers), verifier.hidden_size, device=verifier.device)
    return out.hidden[:, -1]


def draft_block(
    drafter: CachedLM,
    committed: Sequence[int],
    k: int,
    config: DecodeConfig,
    generator: Optional[torch.Generator] = None,
    policy: Optional[DraftLengthPolicy] = None,
) -> DraftBlock:
    """Propose up to k tokens after `committed`; returns a batch-1 DraftBlock (q None if greedy).

    The same draft loop as the drafter service (steerspec/decoding/drafting.py), with a batch of one."""
    if fastpath.applies(drafter, policy):  # device sampling, one host copy per block (CUDA)
        return fastpath.draft_block(drafter, committed, k, config, generator)
    return draft_blocks([DraftRow(drafter, committed, k, config, generator, policy)])[0]  # a batch of one


def verify_block(
    verifier: CachedLM,
    pending: int,
    block: DraftBlock,
    config: DecodeConfig,
    generator: Optional[torch.Generator] = None,
    hidden_layers: Optional[Sequence[int]] = None,
) -> Tuple[VerifyOutcome, Optional[Tensor]]:
    """Score [pending, d_1..d_k] in one forward pass, accept/reject (steerspec/decoding/verifying.py, the
    verifier service's acceptance too), roll the verifier back.

    Returns the outcome and, when `hidden_layers` is given, the hidden states [L, D] at the
    position whose logits produced the new pending token (for the next steering vector).
    """
    if fastpath.applies(verifier) and config.acceptance == "token":  # on the device, one host copy per block (CUDA)
        return fastpath.verify_block(verifier, pending, block, config, generator, hidden_layers)
    start = verifier.length
    device = verifier.device
    drafts = block.tokens[0].to(device)
    feed = torch.cat([torch.tensor([pending], dtype=torch.long, device=device), drafts])
    out = verifier.extend(feed, hidden_layers)
    q = None if block.q is None or config.greedy else block.q.map(lambda t: t[0].to(device))
    outcome = verifying.accept([VerifyRow(out.logits, drafts, q, config.sampling, generator,
                                          config.acceptance)])  # a batch of one
    accepted = int(outcome.accepted[0])
    verifier.rollback(start + 1 + accepted)
    hidden = out.hidden[:, accepted] if hidden_layers else None
    return outcome, hidden


@dataclass
class RoundOut:
    """What one draft → verify step hands the shared loop: the block, its verdict, the verifier's
    hidden states for the next block's steering, and the two stage times in seconds."""

    block: DraftBlock
    accepted: int
    next_token: int
    hidden: Optional[Tensor]
    draft_s: float
    verify_s: float


def run_rounds(
    verifier: CachedLM,
    drafter: CachedLM,
    prompt: List[int],
    config: DecodeConfig,
    result: GenerationResult,
    one_round: Callable[[List[int], int, Optional[Sequence[int]]], RoundOut],
    steering: Optional[DrafterSteering] = None,
    after_round: Optional[Callable[[BlockStats], None]] = None,
    tokenizer=None,
    on_round: Optional[Callable[[RoundRecord], None]] = None,
) -> GenerationResult:
    """The in-process round loop every lossless or lossy decoder shares: prefill, then per block
    `one_round(committed, room, layers)`, the drafter rollback, commit and accounting of rounds.py."""
    layers = list(steering.verifier_layers) if steering is not None else None
    eos = tuple(config.eos_token_ids)
    t_start = time.perf_counter()
    hidden = prefill(verifier, prompt, layers)
    drafter.reset()
    committed = list(prompt)
    generated: List[int] = []
    reason = None
    mark = time.perf_counter()  # each block's cycle runs from the previous block's end (its accounting included)
    while reason is None:
        n = len(committed)
        remaining = config.max_new_tokens - len(generated)
        room = rounds.room(remaining, n, config.max_length)
        reason = rounds.stop_before_block(remaining, room)
        if reason is not None:
            break
        if steering is not None:
            steering.begin_block(hidden)
        out = one_round(committed, room, layers)
        hidden, accepted = out.hidden, out.accepted
        drafted = int(out.block.tokens.shape[1])
        if drafter.length > n + accepted:
            drafter.rollback(n + accepted)
        new_tokens, reason = rounds.commit_block(out.block.tokens[0, :accepted].tolist(), accepted, out.next_token,
                                                 room, remaining, eos)
        committed.extend(new_tokens)
        generated.extend(new_tokens)
        draft_ms, verify_ms = out.draft_s * 1e3, out.verify_s * 1e3
        now = time.perf_counter()
        cycle_ms, mark = max((now - mark) * 1e3, draft_ms + verify_ms), now
        stats = BlockStats(seq=result.rounds, drafted=drafted, accepted=accepted, committed=len(new_tokens),
                           rtt_ms=verify_ms, draft_ms=draft_ms, verify_ms=verify_ms, cycle_ms=cycle_ms)
        rounds.record_block(result, stats)
        if after_round is not None:
            after_round(stats)
        if on_round is not None:
            on_round(RoundRecord(drafted, accepted, new_tokens, out.draft_s, out.verify_s))
    if verifier.device.type == "cuda":
        torch.cuda.synchronize(verifier.device)
    result.wall_s = time.perf_counter() - t_start
    result.token_ids = generated
    result.stop_reason = reason
    if tokenizer is not None:
        result.text = tokenizer.decode(generated, skip_special_tokens=True)
    return result


def speculative_generate(
    verifier,
    drafter,
    prompt_ids: Sequence[int],
    config: DecodeConfig,
    policy: Optional[DraftLengthPolicy] = None,
    steering: Optional[DrafterSteering] = None,
    tokenizer=None,
    on_round: Optional[Callable[[RoundRecord], None]] = None,
) -> GenerationResult:
    """Generate with the drafter proposing and the verifier verifying (lossless).

    `verifier` / `drafter` are models or CachedLM wrappers (reused caches avoid re-allocation).
    """
    verifier, drafter = as_cached(verifier), as_cached(drafter)
    prompt = check_prompt(prompt_ids, config)
    policy = policy if policy is not None else FixedK(8)
    policy.reset()
    g_draft, g_verify = make_generators(config.seed, drafter.device, verifier.device)
    base_seed = rounds.stream_seed(config.seed)

    def one_round(committed: List[int], room: int, layers: Optional[Sequence[int]]) -> RoundOut:
        t0 = time.perf_counter()
        rounds.seed_block(g_draft, base_seed, len(committed))  # a block's draws: the seed and the prefix only
        block = draft_block(drafter, committed, rounds.block_k(policy.next_k(), room), config, g_draft, policy)
        t1 = time.perf_counter()
        outcome, hidden = verify_block(verifier, committed[-1], block, config, g_verify, layers)
        t2 = time.perf_counter()
        return RoundOut(block, int(outcome.accepted[0]), int(outcome.next_tokens[0]), hidden, t1 - t0, t2 - t1)

    def after_round(stats: BlockStats) -> None:
        if stats.drafted or getattr(policy, "min_k", 1) == 0:  # a policy that sends empty blocks learns the load from them
            policy.update(BlockFeedback(stats.accepted, stats.drafted, draft_ms=stats.draft_ms,
                                        verify_ms=stats.verify_ms, overhead_ms=stats.overhead_ms))

    result = GenerationResult(token_ids=[], mode="speculative", prompt_tokens=len(prompt))
    return run_rounds(verifier, drafter, prompt, config, result, one_round, steering, after_round, tokenizer, on_round)


def autoregressive_generate(
    verifier,
    prompt_ids: Sequence[int],
    config: DecodeConfig,
    tokenizer=None,
) -> GenerationResult:
    """The baseline: the verifier alone, one token per forward pass (same protocol, k = 0)."""
    verifier = as_cached(verifier)
    prompt = check_prompt(prompt_ids, config)
    params = config.sampling
    g_verify = rounds.generator(config.seed, verifier.device)  # direct sampling: the seed itself
    eos = tuple(config.eos_token_ids)
    limit = config.max_length
    result = GenerationResult(token_ids=[], mode="autoregressive", prompt_tokens=len(prompt))

    t_start = time.perf_counter()
    prefill(verifier, prompt)
    pending = torch.tensor([prompt[-1]], dtype=torch.long, device=verifier.device)
    generated: List[int] = []
    reason = None
    n = len(prompt)
    while reason is None:
        remaining = config.max_new_tokens - len(generated)
        reason = rounds.stop_before_block(remaining, rounds.room(remaining, n, limit))
        if reason is not None:
            break
        logits = verifier.extend(pending).logits  # [1, V]
        if params.greedy:
            pending = logits.argmax(-1)
        else:
            probs = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
            pending = sample(probs, g_verify)
        token = int(pending)
        generated.append(token)
        n += 1
        result.rounds += 1
        if token in eos:
            reason = "eos"
    if verifier.device.type == "cuda":
        torch.cuda.synchronize(verifier.device)
    result.wall_s = time.perf_counter() - t_start
    result.verify_s = result.wall_s
    result.token_ids = generated
    result.stop_reason = reason
    if tokenizer is not None:
        result.text = tokenizer.decode(generated, skip_special_tokens=True)
    return result
