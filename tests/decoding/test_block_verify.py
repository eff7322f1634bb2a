"""Block verification (steerspec/decoding/block_verify.py): exact, by enumeration; never fewer accepted tokens than
token-wise acceptance in expectation; greedy rows as `greedy_verify`; the sampler draws the rule's law."""

from __future__ import annotations

import itertools
from typing import Dict, Tuple

import pytest
import torch
from scipy.stats import chisquare

from steerspec.decoding.block_verify import block_verify, block_weights
from steerspec.decoding.sampling import SparseDist
from steerspec.decoding.speculative import DraftBlock, greedy_verify, rejection_sample

V = 3


class Tables:
    """Random p(.|prefix) and q(.|prefix) over V tokens, fixed per prefix: some with zeros, some with p = q."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.cache: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}

    def dist(self, which: str, prefix: Tuple[int, ...]) -> torch.Tensor:
        key = (which, prefix)
        if key not in self.cache:
            code = int("1" + "".join(str(t) for t in prefix), V + 1) * 2 + (which == "q")
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + code)
            x = torch.rand(V, generator=g, dtype=torch.float64) ** 2
            if torch.rand((), generator=g) < 0.3:
                x[torch.randint(V, (), generator=g)] = 0.0
            if which == "q" and torch.rand((), generator=g) < 0.2:
                return self.cache.setdefault(key, self.dist("p", prefix))
            self.cache[key] = x / x.sum()
        return self.cache[key]


def _block(tables: Tables, prefix: Tuple[int, ...], gamma: int):
    """Every draft chain of length gamma after `prefix` as one batch: (drafts, their q-probability, p rows, block)."""
    drafts = list(itertools.product(range(V), repeat=gamma))
    p = torch.stack([torch.stack([tables.dist("p", prefix + d[:i]) for i in range(gamma + 1)]) for d in drafts])
    q = torch.stack([torch.stack([tables.dist("q", prefix + d[:i]) for i in range(gamma)]) for d in drafts])
    chance = torch.tensor([float(torch.prod(torch.stack([tables.dist("q", prefix + d[:i])[d[i]] for i in range(gamma)])))
                           for d in drafts], dtype=torch.float64)
    ids = torch.arange(V).expand(len(drafts), gamma, V)
    block = DraftBlock(tokens=torch.tensor(drafts), lengths=torch.full((len(drafts),), gamma),
                       q=SparseDist(ids=ids, probs=q, floor=None, vocab=V))
    return drafts, chance, p, block


def _outcomes(h: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, p: torch.Tensor, gamma: int):
    """Per row: {(accepted, next token): probability} from the rule's h and residuals."""
    rows = []
    for b in range(h.shape[0]):
        law = {}
        for a in range(gamma + 1):
            chance = (1.0 if a == 0 else float(h[b, a - 1])) * float(torch.prod(1 - h[b, a:]))
            if a == gamma:
                nxt = p[b, gamma]
            else:
                r = residual[b, a]
                nxt = r / r.sum() if float(r.sum()) > 0 else p[b, a]
            for y in range(V):
                law[(a, y)] = law.get((a, y), 0.0) + chance * float(nxt[y])
        rows.append(law)
    return rows


def _process(tables: Tables, prefix: Tuple[int, ...], gamma: int, length: int) -> Dict[Tuple[int, ...], float]:
    """The exact law of the next `length` tokens when blocks of gamma drafts are block-verified."""
    if length <= 0:
        return {(): 1.0}
    drafts, chance, p, block = _block(tables, prefix, gamma)
    h, w, residual = block_weights(p, block)
    out: Dict[Tuple[int, ...], float] = {}
    for d, c, law in zip(drafts, chance.tolist(), _outcomes(h, w, residual, p, gamma)):
        for (a, y), pr in law.items():
            emitted = tuple(d[:a]) + (y,)
            if pr * c == 0:
                continue
            if len(emitted) >= length:
                out[emitted[:length]] = out.get(emitted[:length], 0.0) + c * pr
                continue
            for rest, pr2 in _process(tables, prefix + emitted, gamma, length - len(emitted)).items():
                seq = emitted + rest
                out[seq] = out.get(seq, 0.0) + c * pr * pr2
    return out


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_verification_gives_exactly_the_verifiers_law(gamma, seed):
    """Enumerating every draft chain and outcome: the first 3 tokens have exactly p's joint law."""
    tables = Tables(seed)
    got = _process(tables, (), gamma, 3)
    for seq in itertools.product(range(V), repeat=3):
        want = 1.0
        for i in range(3):
            want *= float(tables.dist("p", seq[:i])[seq[i]])
        assert abs(got.get(seq, 0.0) - want) < 1e-9, (seq, got.get(seq), want)


def _token_wise_expected(p: torch.Tensor, block: DraftBlock) -> torch.Tensor:
    """E[accepted] per row under token-wise acceptance: sum over i of prod_{j<=i} min(1, p/q)."""
    tokens = block.tokens
    pd = p[:, : tokens.shape[1]].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    qd = block.q.prob_of(tokens)
    ratio = torch.where(qd > 0, (pd / qd.clamp(min=1e-30)).clamp(max=1.0), torch.zeros_like(pd))
    return ratio.cumprod(-1).sum(-1)


@pytest.mark.parametrize("seed", [3, 4])
def test_block_accepts_at_least_token_wise_in_expectation(seed):
    """Averaged over the drafter's chains, block verification accepts at least as many tokens as
    token-wise acceptance, and more for some prefixes."""
    tables = Tables(seed)
    gains = []
    for prefix in [(), (0,), (1, 2), (2, 2, 0)]:
        drafts, chance, p, block = _block(tables, prefix, 3)
        h, w, residual = block_weights(p, block)
        law = _outcomes(h, w, residual, p, 3)
        block_mean = sum(c * sum(a * pr for (a, _), pr in l.items()) for c, l in zip(chance.tolist(), law))
        token_mean = float((chance * _token_wise_expected(p, block)).sum())
        assert block_mean >= token_mean - 1e-12
        gains.append(block_mean - token_mean)
    assert max(gains) > 1e-3


def test_greedy_rows_accept_the_leading_matches():
    """One-hot verifier rows and greedy drafts: exactly `greedy_verify`'s outcome, ragged rows included."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 6, 11, generator=g)
    argmax = logits.argmax(-1)
    tokens = torch.where(torch.rand(64, 5, generator=g) < 0.7, argmax[:, :5], torch.randint(11, (64, 5), generator=g))
    block = DraftBlock(tokens=tokens, lengths=torch.randint(0, 6, (64,), generator=g))
    onehot = torch.zeros_like(logits).scatter_(-1, argmax.unsqueeze(-1), 1.0)
    got, want = block_verify(onehot, block, torch.Generator().manual_seed(1)), greedy_verify(logits, block)
    assert torch.equal(got.accepted, want.accepted) and torch.equal(got.next_tokens, want.next_tokens)
    assert torch.equal(got.is_bonus, want.is_bonus)


def test_block_verify_draws_the_rules_law():
    """20,000 copies of three blocks in one call: (accepted, next token) counts match the rule's law
    (chi-square), and token-wise rejection sampling on the same blocks accepts fewer on average."""
    tables = Tables(7)
    drafts, chance, p, block = _block(tables, (1,), 3)
    pick = [5, 13, 22]
    laws = _outcomes(*block_weights(p, block), p, 3)
    n = 20000
    rows = torch.tensor(pick).repeat_interleave(n)
    big = DraftBlock(tokens=block.tokens[rows], lengths=block.lengths[rows], q=block.q.map(lambda t: t[rows]))
    out = block_verify(p[rows].float(), big, torch.Generator().manual_seed(11))
    base = rejection_sample(p[rows].float(), big, torch.Generator().manual_seed(11))
    for j, b in enumerate(pick):
        acc = out.accepted[j * n:(j + 1) * n].tolist()
        nxt = out.next_tokens[j * n:(j + 1) * n].tolist()
        keys = sorted(k for k, v in laws[b].items() if v > 0)
        counts = [sum(1 for a, y in zip(acc, nxt) if (a, y) == k) for k in keys]
        assert sum(counts) == n  # nothing outside the law's support
        expected = [laws[b][k] * n for k in keys]
        assert chisquare(counts, expected).pvalue > 1e-4
    assert float(out.accepted.float().mean()) > float(base.accepted.float().mean())


def test_verification_grammar_takes_block():
    from steerspec.sprinter.spec import VerificationError, parse_verification

    v = parse_verification(" Block ")
    assert v.mode == "block" and not v.lossy and v.spec() == "block" and parse_verification(v.spec()) == v
    with pytest.raises(VerificationError, match="takes no parameters"):
        parse_verification("block:k=3")
    with pytest.raises(VerificationError, match="'exact', 'block' or"):
        parse_verification("blocky")


def test_expected_accepted_matches_the_rules_laws():
    """`expected_accepted` = the mean accepted count of each rule's exact law on the same blocks."""
    from steerspec.decoding.block_verify import expected_accepted

    tables = Tables(9)
    drafts, chance, p, block = _block(tables, (0, 1), 3)
    token_wise, block_rule = expected_accepted(p, block)
    laws = _outcomes(*block_weights(p, block), p, 3)
    for b, law in enumerate(laws):
        assert float(block_rule[b]) == pytest.approx(sum(a * pr for (a, _), pr in law.items()), abs=1e-9)
    assert torch.allclose(token_wise, _token_wise_expected(p, block))
    assert float((chance * block_rule).sum()) >= float((chance * token_wise).sum())


def test_a_mixed_batch_accepts_each_row_by_its_own_rule():
    """`verifying.accept` over token-wise, block and greedy rows together: each row's outcome is what it
    gets alone (its own generator), and an unknown rule is refused."""
    from steerspec.decoding.sampling import SamplingParams
    from steerspec.decoding.verifying import VerifyRow, accept

    g = torch.Generator().manual_seed(8)
    rows = []
    for i, (rule, temp) in enumerate([("token", 1.0), ("block", 1.0), ("block", 0.0), ("token", 0.8), ("block", 0.9)]):
        k = 3 + i % 2
        q = torch.softmax(torch.randn(k, 12, generator=g), -1)
        tokens = torch.multinomial(q, 1, generator=g).view(-1)
        dist = SparseDist(ids=torch.arange(12).expand(k, 12), probs=q, floor=None, vocab=12)
        rows.append(lambda seed, rule=rule, temp=temp, k=k, logits=torch.randn(k + 1, 12, generator=g), tokens=tokens,
                    dist=dist: VerifyRow(logits, tokens, dist if temp > 0 else None, SamplingParams(temp),
                                         torch.Generator().manual_seed(seed), rule))
    together = accept([make(30 + i) for i, make in enumerate(rows)])
    for i, make in enumerate(rows):
        alone = accept([make(30 + i)])
        assert int(together.accepted[i]) == int(alone.accepted[0])
        assert int(together.next_tokens[i]) == int(alone.next_tokens[0])
    with pytest.raises(ValueError, match="unknown acceptance"):
        accept([VerifyRow(torch.randn(2, 12), torch.tensor([1]), None, SamplingParams(1.0), None, "blok")])
