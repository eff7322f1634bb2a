"""SPRINTER decoding in-process (lossy, opt-in): runs of classifier-kept tokens, one verifier call each.

Per round the drafter proposes token by token exactly as `engine.draft_block` does (same warping,
draft distribution and generator draws). After each token the head scores it; a token it keeps
extends the run, and the run ends at the first predicted rejection, at `max_run`, or at the
token budget. One verifier call then feeds [pending, x_1..x_j] (bringing its cache up to date),
keeps x_1..x_{j−1} as they are, and checks x_j by the exact rule min(1, p/q) with the residual
resample (or the bonus token from p when x_j passes) via `speculative.rejection_sample`. With a
head that keeps nothing, every run has length 1 and the output is exact decoding with k = 1.

The verifier's p over the whole run comes back in that one pass, so each kept token is also
labelled (q(x)/p(x) ≤ λ; greedy: x is p's argmax) to measure η_TP, η_FP and the run lengths
r on the run's own tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from steerspec.decoding import rounds
from steerspec.decoding.engine import DecodeConfig, DrafterSteering, RoundOut, RoundRecord, check_prompt, run_rounds
from steerspec.decoding.generation_result import GenerationResult
from steerspec.decoding.rounds import BlockStats, make_generators
from steerspec.decoding.sampling import SparseDist, draft_distribution, probs_from_logits, sample_sparse
from steerspec.decoding.speculative import DraftBlock, greedy_verify, rejection_sample
from steerspec.models.backends import as_cached
from steerspec.models.kv import CachedLM
from steerspec.sprinter import features as F
from steerspec.sprinter.classifier import SprinterHead
from steerspec.sprinter.labels import SprinterTally, label_run, theory_line
from steerspec.sprinter.spec import DEFAULT_MAX_RUN


def _tallied(name: str) -> property:
    return property(lambda self: getattr(self.tally, name), doc=f"SprinterTally.{name}")


@dataclass
class SprinterResult(GenerationResult):
    """A SPRINTER generation: the usual metrics plus what it gave up, always marked lossy.

    The labels and run lengths live in `tally` (steerspec.sprinter.labels.SprinterTally, the one the
    coordinator keeps for the services); `tp`, `run_lengths`, ... read through to it.
    """

    mode: str = "sprinter"
    threshold: float = 0.5
    max_run: int = DEFAULT_MAX_RUN
    lam: float = 1.0
    tally: Optional[SprinterTally] = None

    lossy = True

    def __post_init__(self) -> None:
        if self.tally is None:
            self.tally = SprinterTally(max_run=self.max_run)

    tp, fn, fp, tn = _tallied("tp"), _tallied("fn"), _tallied("fp"), _tallied("tn")
    tv_pq_sum, moved_sum, labelled = _tallied("tv_pq_sum"), _tallied("moved_sum"), _tallied("labelled")
    run_lengths, run_r = _tallied("run_lengths"), _tallied("run_r")

    @property
    def eta(self) -> tuple:
        return self.tally.eta

    def theory(self) -> Dict[str, float]:
        """Measured η's, Theorem 1's TV bound and Theorems 2–3's run length beside the measured one."""
        return self.tally.theory()

    def to_json(self) -> Dict[str, object]:
        payload = super().to_json()
        payload.update({"verification": "sprinter", "lossy": True, "threshold": self.threshold,
                        "max_run": self.max_run, "lambda": self.lam, "verifier_calls": self.rounds,
                        "sprinter": self.theory()})
        return payload

    def summary(self) -> str:
        return super().summary() + f"\nLOSSY (sprinter threshold={self.threshold:g} max_run={self.max_run}): " + \
            theory_line(self.theory())


class SprinterScorer:
    """Scores one drafted token from the drafter's own tensors (the features `features.py` defines)."""

    def __init__(self, head: SprinterHead, drafter: CachedLM) -> None:
        self.head = head
        self.layer = drafter.num_layers - 1
        self.embed = drafter.model.get_input_embeddings().weight

    def __call__(self, hidden, token: torch.Tensor, q_x: torch.Tensor, probs: torch.Tensor) -> float:
        feats = F.build_features(hidden.float(), self.embed[token].float(), q_x.float(), F.entropy(probs.float()))
        return float(self.head.prob(feats.to(self.head.fc1.weight.device)).reshape(-1)[0])


def draft_run(drafter: CachedLM, committed: Sequence[int], limit: int, config: DecodeConfig,
              generator: Optional[torch.Generator], scorer: SprinterScorer, threshold: float):
    """Draft up to `limit` tokens, stopping after the first one the head would not keep.

    Returns (DraftBlock, kept flags per token). Sampling follows engine.draft_block draw for draw.
    """
    params = config.sampling
    feed: object = committed[drafter.length:]
    tokens, q_rows, kept = [], [], []
    for _ in range(limit):
        out = drafter.extend(feed, [scorer.layer], logits_to_keep=1)
        logits, hidden = out.logits, out.hidden[0, -1:]  # [1, V], [1, D]
        if params.greedy:
            token = logits.argmax(-1)
            probs = logits.float().softmax(-1)
            q_x = probs.gather(-1, token.view(1, 1)).view(1)  # the head's feature: q at T = 1
        else:
            probs = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
            dist = draft_distribution(probs, config.draft_top_k, config.draft_tail)
            token = sample_sparse(dist, generator)
            q_rows.append(dist)
            q_x = dist.prob_of(token)
        tokens.append(token)
        keep = scorer(hidden, token, q_x, probs) >= threshold
        kept.append(keep)
        if not keep:
            break
        feed = token
    if tokens:
        block_tokens = torch.cat(tokens).view(1, -1)
    else:
        block_tokens = torch.zeros(1, 0, dtype=torch.long, device=drafter.device)
    q = SparseDist.stack(q_rows, dim=1) if q_rows else None
    return DraftBlock(block_tokens, torch.tensor([len(tokens)], device=drafter.device), q), kept


def verify_run(verifier: CachedLM, pending: int, block: DraftBlock, config: DecodeConfig,
               generator: Optional[torch.Generator], hidden_layers: Optional[Sequence[int]] = None,
               kept: Optional[int] = None):
    """One verifier call for a run: feed [pending, x_1..x_j], keep x_1..x_{j−1}, check x_j exactly.

    `kept` (the verifier service passes DraftBlock.kept) keeps the first `kept` tokens instead and
    checks the rest by speculative sampling; None keeps j − 1.
    Returns (accepted count in the run, next token, the verifier's probs [j+1, V] (None when greedy),
    its logits [j+1, V], and the steering hidden states [L, D] or None).
    """
    start = verifier.length
    device = verifier.device
    run = block.tokens[0].to(device)
    j = int(run.shape[0])
    feed = torch.cat([torch.tensor([pending], dtype=torch.long, device=device), run])
    out = verifier.extend(feed, hidden_layers)
    last = max(j - 1, 0) if kept is None else min(int(kept), j)
    tail_block = DraftBlock(run[last:].view(1, -1), torch.tensor([j - last], device=device),
                            None if block.q is None else block.q.map(lambda t: t[:, last:].to(device)))
    params = config.sampling
    probs = None
    if params.greedy:
        outcome = greedy_verify(out.logits[last:].unsqueeze(0), tail_block)
    else:
        probs = probs_from_logits(out.logits.unsqueeze(0), params.temperature, params.top_k, params.top_p)
        outcome = rejection_sample(probs[:, last:], tail_block, generator)
        probs = probs[0]
    accepted = last + int(outcome.accepted[0])
    verifier.rollback(start + 1 + accepted)
    hidden = out.hidden[:, accepted] if hidden_layers else None
    return accepted, int(outcome.next_tokens[0]), probs, out.logits, hidden


def sprinter_generate(
    verifier,
    drafter,
    prompt_ids: Sequence[int],
    config: DecodeConfig,
    head: SprinterHead,
    threshold: float = 0.5,
    max_run: int = DEFAULT_MAX_RUN,
    lam: float = 1.0,
    steering: Optional[DrafterSteering] = None,
    tokenizer=None,
    on_round: Optional[Callable[[RoundRecord], None]] = None,
) -> SprinterResult:
    """Generate with SPRINTER (lossy): the verifier is called once per run the head ends."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"sprinter threshold must be in (0, 1), got {threshold}")
    if max_run < 1:
        raise ValueError(f"sprinter max_run must be >= 1, got {max_run}")
    verifier, drafter = as_cached(verifier), as_cached(drafter)
    prompt = check_prompt(prompt_ids, config)
    scorer = SprinterScorer(head, drafter)
    g_draft, g_verify = make_generators(config.seed, drafter.device, verifier.device)
    base_seed = rounds.stream_seed(config.seed)
    result = SprinterResult(token_ids=[], prompt_tokens=len(prompt), threshold=threshold, max_run=max_run, lam=lam)
    kept_runs: List[List[bool]] = []

    def one_round(committed: List[int], room: int, layers: Optional[Sequence[int]]) -> RoundOut:
        t0 = time.perf_counter()
        rounds.seed_block(g_draft, base_seed, len(committed))  # a block's draws: the seed and the prefix only
        block, kept = draft_run(drafter, committed, rounds.block_k(max_run, room), config, g_draft, scorer, threshold)
        t1 = time.perf_counter()
        accepted, next_token, probs, logits, hidden = verify_run(verifier, committed[-1], block, config,
                                                                 g_verify, layers)
        t2 = time.perf_counter()
        result.tally.add_labels(label_run(block, kept, probs, logits, verifier.vocab_size, lam))
        kept_runs.append(kept)
        return RoundOut(block, accepted, next_token, hidden, t1 - t0, t2 - t1)

    def after_round(stats: BlockStats) -> None:
        result.tally.run_lengths.append(sum(kept_runs[-1]))

    run_rounds(verifier, drafter, prompt, config, result, one_round, steering, after_round, tokenizer, on_round)
    return result
