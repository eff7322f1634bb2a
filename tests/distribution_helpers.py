"""Shared pieces of the chi-square tests: p-values with rare outcomes pooled, the verifier's exact
distribution, a prompt with a mixed acceptance, and two samplers of the first tokens: the engine's
round loop one sample at a time (`sample_tokens`), and many sessions at once through the services'
batched drafting and verification (`sample_batched`; same distribution, a fraction of the time)."""

from __future__ import annotations

import copy
from collections import Counter

import torch
from scipy.stats import chisquare

from steerspec.decoding.engine import draft_block, verify_block
from steerspec.models import cached_lm
from steerspec.decoding.sampling import SamplingParams, probs_from_logits

P_MIN = 1e-3
MIN_EXPECTED = 5.0


def chi_square_p(counts: Counter, expected_probs: dict, n: int) -> float:
    """p-value of observed counts against expected probabilities, pooling rare outcomes."""
    for outcome in counts:
        assert expected_probs.get(outcome, 0.0) > 0, f"sampled {outcome}, which has probability 0"
    common = [o for o, p in expected_probs.items() if p * n >= MIN_EXPECTED]
    observed = [counts.get(o, 0) for o in common]
    expected = [expected_probs[o] * n for o in common]
    rest_obs = n - sum(observed)
    rest_exp = n - sum(expected)
    if rest_exp >= 1e-9:
        observed.append(rest_obs)
        expected.append(rest_exp)
    assert len(observed) >= 3, "too few bins for a meaningful test"
    return float(chisquare(observed, expected).pvalue)


def verifier_probs(model, ids, params: SamplingParams) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor(ids)).logits[:, -1].float()
    return probs_from_logits(logits, params.temperature, params.top_k, params.top_p)


def pick_prompt(verifier, drafter, tok, prompts, params, max_tokens=16):
    """A prompt prefix where the drafter's first proposal is accepted about half the time."""
    best, best_gap = None, 2.0
    for text in prompts[:16]:
        ids = tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
        p = verifier_probs(verifier, [ids], params)[0]
        q = verifier_probs(drafter, [ids], params)[0]
        acceptance = 1.0 - 0.5 * float((p - q).abs().sum())  # P(first draft accepted) = 1 - TV(p, q)
        gap = abs(acceptance - 0.5) + (1.0 if float(p.max()) > 0.9 else 0.0)
        if gap < best_gap:
            best, best_gap = ids, gap
    return best


def sample_tokens(v, d, ids, config, k, g_draft, g_verify, accepted_counts, n_tokens=2):
    """The engine's round loop (draft_block, verify_block, commit, drafter rollback) until `n_tokens`
    tokens are committed; then both caches go back to the prompt, ready for the next sample."""
    committed = list(ids)
    base = v.length
    while len(committed) < len(ids) + n_tokens:
        n = len(committed)
        block = draft_block(d, committed, k, config, g_draft)
        outcome, _ = verify_block(v, committed[-1], block, config, g_verify)
        accepted = int(outcome.accepted[0])
        accepted_counts[accepted] += 1
        if d.length > n + accepted:
            d.rollback(n + accepted)
        committed += block.tokens[0, :accepted].tolist() + [int(outcome.next_tokens[0])]
    v.rollback(base)
    d.rollback(min(d.length, len(ids) - 1))
    return tuple(committed[len(ids):len(ids) + n_tokens])


def first_two_p_values(verifier, ids, params: SamplingParams, counts: Counter, n: int) -> tuple:
    """Chi-square p-values of sampled first-two-token pairs: the first token's marginal against the
    verifier's exact p(x1), and the pairs against p(x1) p(x2 | x1) (one batched pass for x2)."""
    p1 = verifier_probs(verifier, [ids], params)[0]
    firsts = sorted(set(torch.nonzero(p1 * n >= 0.5).flatten().tolist()) | {a for a, _ in counts})
    p2 = verifier_probs(verifier, [ids + [a] for a in firsts], params)
    joint = {}
    for row, a in enumerate(firsts):
        pa = p1[a] * p2[row]
        for b in torch.nonzero(pa * n >= 1e-3).flatten().tolist():
            joint[(a, b)] = float(pa[b])
        for pair in counts:
            if pair[0] == a and pair not in joint:
                joint[pair] = float(pa[pair[1]])
    first_counts: Counter = Counter()
    for (a, _), c in counts.items():
        first_counts[a] += c
    marginal = {i: float(p1[i]) for i in torch.nonzero(p1 > 0).flatten().tolist()}
    return chi_square_p(first_counts, marginal, n), chi_square_p(counts, joint, n)


class _Stream:
    """One row of `sample_batched`: its drafter cache, verifier session and current sample."""

    def __init__(self, index: int, drafter, ids, runner, params: SamplingParams, g_verify, policy,
                 prefilled=None) -> None:
        from steerspec.models.kv import CachedLM
        from verifier_service.verify_sessions import VerifierSession

        self.d = cached_lm(drafter)
        self.session = VerifierSession(session_id=f"row-{index}", lm=CachedLM(runner.model), committed=len(ids),
                                       pending=ids[-1], params=params, generator=g_verify, max_k=64,
                                       steering=False)
        if prefilled is None:
            runner.prefill(self.session, list(ids))
        else:  # the same prompt: a copy of the first row's prefilled cache
            self.session.lm.cache, self.session.lm.length = copy.deepcopy(prefilled.cache), prefilled.length
        self.policy = policy
        self.committed = list(ids)

    def restart(self, ids) -> None:
        """Back to the prompt: the verifier keeps prompt[:-1], the drafter at most that."""
        self.session.lm.rollback(len(ids) - 1)
        self.session.committed, self.session.pending = len(ids), ids[-1]
        self.d.rollback(min(self.d.length, len(ids) - 1))
        self.committed = list(ids)


def sample_batched(verifier, drafter, ids, config, n: int, rows: int, g_draft, g_verify, accepted_counts: Counter,
                   k: int = 0, policies=None, feedback=None, lengths=None, n_tokens: int = 2) -> Counter:
    """`n` samples of the first `n_tokens` tokens, `rows` at a time: each round drafts every row's
    block in one batched draft loop (`drafting.draft_blocks`, the drafter service's) and verifies
    them in one batched forward pass (`VerifyRunner.run`, the verifier service's), each row a
    session with its own caches. A row starts its next sample from the prompt once it has one.

    Block length: `k`, or the row's own policy (`policies[row]`, never reset between samples;
    `feedback(accepted, drafted)` is what it is told after each block). Drafted lengths go to
    `lengths`."""
    from steerspec.decoding.drafting import DraftRow, draft_blocks
    from steerspec.serving.wire import WireBlock
    from verifier_service.verify_jobs import VerifyJob
    from verifier_service.verify_batcher import VerifyRunner

    runner = VerifyRunner(verifier)
    rows = min(rows, n)
    streams: list = []
    for i in range(rows):
        prefilled = streams[0].session.lm if streams else None
        streams.append(_Stream(i, drafter, ids, runner, config.sampling, g_verify,
                               None if policies is None else policies[i], prefilled))
    counts: Counter = Counter()
    started = rows
    active = list(streams)
    while active:
        ks = [k if s.policy is None else s.policy.next_k() for s in active]
        blocks = draft_blocks([DraftRow(s.d, s.committed, kk, config, g_draft, s.policy) for s, kk in zip(active, ks)])
        jobs = [VerifyJob(s.session, WireBlock(0, len(s.committed), b.tokens[0].numpy(), b.q.map(lambda t: t[0])))
                for s, b in zip(active, blocks)]
        results = runner.run(jobs)
        still = []
        for s, block, result in zip(active, blocks, results):
            n_before = len(s.committed)
            drafted, accepted = int(block.tokens.shape[1]), result.accepted
            accepted_counts[accepted] += 1
            if lengths is not None:
                lengths.append(drafted)
            if s.d.length > n_before + accepted:
                s.d.rollback(n_before + accepted)
            s.committed += block.tokens[0, :accepted].tolist() + [result.next_token]
            s.session.committed, s.session.pending = len(s.committed), result.next_token
            if s.policy is not None:
                s.policy.update(feedback(accepted, drafted))
            if len(s.committed) < len(ids) + n_tokens:
                still.append(s)
                continue
            counts[tuple(s.committed[len(ids):len(ids) + n_tokens])] += 1
            if started < n:
                started += 1
                s.restart(ids)
                still.append(s)
        active = still
    return counts
