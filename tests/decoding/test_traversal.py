"""Traversal verification (steerspec/decoding/traversal.py): exact over draft trees by enumeration, siblings drawn with
or without replacement; block verification on a chain; never fewer accepted drafts than recursive rejection
sampling on average; the sampler draws the walk's law; in process and through the services."""

from __future__ import annotations

import itertools
from typing import Dict, List, Tuple

import pytest
import torch
from scipy.stats import chisquare

from steerspec.decoding.block_verify import block_weights
from steerspec.decoding.sampling import SparseDist
from steerspec.decoding.speculative import DraftBlock
from steerspec.decoding.traversal import expected_path_lengths, traversal_evaluations, traversal_walk
from steerspec.decoding.trees import parse_tree, sampled_walk, sibling_proposal

V = 3
M = 3  # the law compared: of the first M tokens (shorter outputs completed by the verifier)
SHAPES = ["0", "0,00", "0,1,2", "0,00,01", "0,1,00,10", "0,1,00,01,10,000", "0,00,000,1,10"]


class Tables:
    """Random p(.|prefix) and q(.|prefix) over V tokens, fixed per prefix: some with zeros, some with p = q."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.p: Dict[Tuple[int, ...], torch.Tensor] = {}
        self.q: Dict[Tuple[int, ...], torch.Tensor] = {}
        for length in range(6):
            for prefix in itertools.product(range(V), repeat=length):
                self.p[prefix], self.q[prefix] = self._dist(g), self._dist(g)
                if torch.rand((), generator=g) < 0.15:
                    self.q[prefix] = self.p[prefix].clone()

    @staticmethod
    def _dist(g: torch.Generator) -> torch.Tensor:
        x = torch.rand(V, generator=g, dtype=torch.float64) ** 3
        if torch.rand((), generator=g) < 0.4:
            x[int(torch.randint(V, (), generator=g))] = 0.0
        return x / x.sum()

    def target_law(self) -> Dict[Tuple[int, ...], float]:
        return {seq: self.chance(seq, 0) for seq in itertools.product(range(V), repeat=M)}

    def chance(self, seq: Tuple[int, ...], start: int) -> float:
        """p(seq[start:] | seq[:start])."""
        out = 1.0
        for i in range(start, len(seq)):
            out *= float(self.p[seq[:i]][seq[i]])
        return out


def _prefixes(shape, tokens: List[int]):
    """node -> the tokens from the root to it (-1, the root: none): the context the tables give p and q for."""
    def at(node: int) -> Tuple[int, ...]:
        return () if node < 0 else tuple(tokens[a] for a in shape.ancestors(node)) + (tokens[node],)
    return at


def _drafted_trees(shape, tables: Tables, distinct: bool):
    """Every drafted tree with its probability: nodes breadth-first, each drawn from its parent's q (without the
    earlier siblings' tokens when `distinct`; a sibling q cannot give is a placeholder, never judged)."""
    out = []

    def grow(i: int, tokens: List[int], chance: float) -> None:
        if chance == 0:
            return
        if i == shape.size:
            out.append((list(tokens), chance))
            return
        parent = shape.parents[i]
        prefix = () if parent < 0 else tuple(tokens[a] for a in shape.ancestors(parent)) + (tokens[parent],)
        earlier = [tokens[c] for c in shape.children(parent) if c < i]
        q = sibling_proposal(tables.q[prefix], earlier) if distinct else tables.q[prefix]
        if float(q.sum()) <= 0:
            grow(i + 1, tokens + [0], chance)
            return
        for x in range(V):
            if float(q[x]) > 0:
                grow(i + 1, tokens + [x], chance * float(q[x]))

    grow(0, [], 1.0)
    return out


def _inputs(shape, tables: Tables, tokens: List[int]):
    """(p rows [1 + N, V], q_at {parent: q}, node -> prefix) of a drafted tree under the tables."""
    at = _prefixes(shape, tokens)
    p_rows = torch.stack([tables.p[at(n)] for n in range(-1, shape.size)])
    q_at = {n: tables.q[at(n)] for n in range(-1, shape.size) if shape.children(n)}
    return p_rows, q_at, at


def _walk_law(shape, tables: Tables, distinct: bool) -> Tuple[Dict[Tuple[int, ...], float], float, float]:
    """The law of the first M tokens after drafting and walking (`traversal_evaluations`), completed by the
    verifier; and E[accepted drafts] under both rules, averaged over the drafted trees."""
    law: Dict[Tuple[int, ...], float] = {}
    mean_rrs = mean_traversal = 0.0
    for tokens, chance in _drafted_trees(shape, tables, distinct):
        p_rows, q_at, at = _inputs(shape, tables, tokens)
        rest = 1.0
        for node, keep, dist in traversal_evaluations(shape, tokens, p_rows, q_at, distinct):
            taken, rest = rest * keep, rest * (1 - keep)
            for y in range(V):
                out = at(node) + (y,)
                for tail in itertools.product(range(V), repeat=max(0, M - len(out))):
                    seq = out + tail
                    mass = chance * taken * float(dist[y]) * tables.chance(seq[:M], len(out))
                    law[seq[:M]] = law.get(seq[:M], 0.0) + mass
        assert rest == pytest.approx(0.0, abs=1e-12)  # the root always accepts
        rrs, traversal = expected_path_lengths(shape, tokens, p_rows, q_at, distinct)
        mean_rrs += chance * rrs
        mean_traversal += chance * traversal
    return law, mean_rrs, mean_traversal


@pytest.mark.parametrize("spec", SHAPES)
@pytest.mark.parametrize("distinct", [True, False], ids=["without-replacement", "iid"])
def test_traversal_is_exactly_the_verifiers_distribution(spec: str, distinct: bool) -> None:
    shape = parse_tree(spec)
    for seed in range(3):
        tables = Tables(seed)
        law, mean_rrs, mean_traversal = _walk_law(shape, tables, distinct)
        target = tables.target_law()
        assert sum(law.values()) == pytest.approx(1.0, abs=1e-9)
        assert max(abs(law.get(k, 0.0) - v) for k, v in target.items()) < 1e-9, (spec, seed)
        assert mean_traversal >= mean_rrs - 1e-12, (spec, seed, mean_traversal, mean_rrs)


def test_on_a_chain_traversal_is_block_verification() -> None:
    """Judged leaf first, each prefix i is kept with block verification's h_i."""
    k = 4
    shape = parse_tree("0,00,000,0000")
    g = torch.Generator().manual_seed(3)
    vocab = 6
    for _ in range(20):
        p = torch.softmax(2 * torch.randn(k + 1, vocab, generator=g, dtype=torch.float64), -1)
        q = torch.softmax(2 * torch.randn(k, vocab, generator=g, dtype=torch.float64), -1)
        tokens = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        block = DraftBlock(tokens=torch.tensor([tokens]), lengths=torch.tensor([k]),
                           q=SparseDist(ids=torch.arange(vocab).expand(1, k, vocab), probs=q.unsqueeze(0), floor=None,
                                        vocab=vocab))
        h, _, residual = block_weights(p.unsqueeze(0), block)
        q_at = {i - 1: q[i] for i in range(k)}
        judged = list(traversal_evaluations(shape, tokens, p, q_at))
        assert [node for node, _, _ in judged] == [3, 2, 1, 0, -1]
        assert [chance for _, chance, _ in judged[:-1]] == pytest.approx(h[0].flip(0).tolist(), abs=1e-12)
        for node, _, dist in judged[1:]:  # a judged inner node gives the next token from block's residual
            r = residual[0, node + 1]
            if float(r.sum()) > 0:
                assert dist.tolist() == pytest.approx((r / r.sum()).tolist(), abs=1e-12)


@pytest.mark.slow
def test_the_walk_draws_the_law_of_its_judgements() -> None:
    """20,000 walks over one drafted tree: (path, next token) frequencies match the judgements' law (chi-square),
    and the mean accepted length matches `expected_path_lengths` for both rules."""
    shape = parse_tree("0,1,00,01,10,000")
    tables = Tables(7)
    tokens = max(_drafted_trees(shape, tables, True), key=lambda drafted: drafted[1])[0]
    p_rows, q_at, _ = _inputs(shape, tables, tokens)
    want: Dict[Tuple[Tuple[int, ...], int], float] = {}
    rest = 1.0
    for node, keep, dist in traversal_evaluations(shape, tokens, p_rows, q_at):
        path = tuple([] if node < 0 else shape.ancestors(node) + [node])
        for y in range(V):
            want[(path, y)] = want.get((path, y), 0.0) + rest * keep * float(dist[y])
        rest *= 1 - keep
    g = torch.Generator().manual_seed(0)
    n = 20_000
    seen: Dict[Tuple[Tuple[int, ...], int], int] = {}
    length_traversal = length_rrs = 0
    for _ in range(n):
        path, token, row = traversal_walk(shape, tokens, p_rows, q_at, g)
        assert row == 1 + (path[-1] if path else -1)
        seen[(tuple(path), token)] = seen.get((tuple(path), token), 0) + 1
        length_traversal += len(path)
        length_rrs += len(sampled_walk(shape, tokens, p_rows, q_at, g)[0])
    assert set(seen) <= {k for k, v in want.items() if v > 0}
    keys = [k for k, v in want.items() if v > 0]
    _, pvalue = chisquare([seen.get(k, 0) for k in keys], [n * want[k] for k in keys])
    assert pvalue > 1e-3
    rrs, traversal = expected_path_lengths(shape, tokens, p_rows, q_at)
    assert length_traversal / n == pytest.approx(traversal, abs=0.03)
    assert length_rrs / n == pytest.approx(rrs, abs=0.03)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh 8 runs it there)")
def test_both_walks_draw_on_the_generators_device() -> None:
    """On a GPU the verifier's rows and its session generator live on CUDA: each walk draws its uniforms
    there too (a CPU draw with a CUDA generator raised), and the mean accepted length still matches."""
    shape = parse_tree("0,1,00,01,10,000")
    tables = Tables(7)
    tokens = max(_drafted_trees(shape, tables, True), key=lambda drafted: drafted[1])[0]
    p_rows, q_at, _ = _inputs(shape, tables, tokens)
    rrs, traversal = expected_path_lengths(shape, tokens, p_rows, q_at)
    p_rows, q_at = p_rows.cuda(), {parent: q.cuda() for parent, q in q_at.items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 5_000
    for walk, want in ((sampled_walk, rrs), (traversal_walk, traversal)):
        mean = sum(len(walk(shape, tokens, p_rows, q_at, g)[0]) for _ in range(n)) / n
        assert mean == pytest.approx(want, abs=0.05), walk.__name__
