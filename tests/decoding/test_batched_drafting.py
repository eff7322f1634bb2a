"""Batched drafting: one forward pass per draft step for several sessions, each exactly as if alone.

- `batched_extend` gives per-row `extend` logits (to 1e-5) and writes each row's own KV cache.
- `draft_blocks` gives every session the tokens, q and generator draws of `draft_block` alone,
  over several blocks with partial / full / no acceptance and rollbacks (bit-exact where the
  forward is per row; with the batched forward: equal tokens and ids, probs to fp32 noise that
  the fp16 wire rounding may turn into one fp16 ulp).
- `Drafter.draft_many` keeps each session's SD² steering bias (or none) while batched.
- Tree sessions batched (`tree_decoding.draft_trees`) draft what each drafts alone, beside a chain session.
"""

from __future__ import annotations

from typing import List, Sequence

import pytest
import torch

from drafter_service.draft_sessions import Drafter, DrafterSessionTable, Proposal
from steerspec.decoding.drafting import DraftRow, draft_blocks
from steerspec.decoding.engine import DecodeConfig, draft_block
from steerspec.models import load_model
from steerspec.models.batched import batched_extend, can_batch, packed_extend
from steerspec.models.kv import CachedLM, FastCachedLM
from steerspec.policies.base import PolicyBase
from steerspec.policies.fixed import FixedK
from steerspec.decoding.sampling import SamplingParams
from steerspec.decoding.speculative import DraftBlock
from steerspec.steering import DrafterSteering, attach_steering
from steerspec.blocks.block_mode import parse_mode

LOGIT_TOL = dict(atol=1e-5, rtol=1e-5)
Q_TOL = dict(atol=1e-5, rtol=1e-3)  # fp32 noise, or one fp16 ulp where it crossed a rounding boundary

# (prompt length, temperature, top_k, top_p, draft_top_k, k, seed)
SPECS = [
    (3, 0.0, 0, 1.0, 16, 5, 11),
    (12, 1.0, 0, 1.0, 64, 8, 12),
    (27, 0.8, 20, 0.9, 32, 3, 13),
    (1, 1.0, 0, 1.0, 0, 6, 14),  # a one-token prompt, full-vocabulary q
    (8, 1.0, 0, 1.0, 64, 8, 15),  # the parameters of row 1: shares its sampling group
    (5, 1.0, 0, 1.0, 64, 7, 16),  # stops early (policy)
    (6, 0.0, 0, 1.0, 16, 7, 17),  # greedy, stops early (policy)
]
BLOCKS = 6


@pytest.fixture(scope="module")
def drafter_model():
    torch.set_num_threads(1)
    return load_model("pretrained")


class StopWhenUnsure(PolicyBase):
    """Stops a block once the draft distribution's top probability falls below `floor`."""

    stops_early = True

    def __init__(self, k: int, floor: float) -> None:
        self.k, self.floor = k, floor

    def next_k(self) -> int:
        return self.k

    def observe(self, step) -> bool:
        return bool(step.probs.max() < self.floor)


def _prompts(vocab: int, lengths: Sequence[int], seed: int = 0) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def _assert_same_caches(rows, alone) -> None:
    """Each row's cached keys and values equal its twin's (fed the same tokens one row at a time)."""
    for lm, twin in zip(rows, alone):
        for layer in range(lm.num_layers):
            torch.testing.assert_close(lm._keys[layer][:, :, : lm.length], twin._keys[layer][:, :, : twin.length],
                                       **LOGIT_TOL)
            torch.testing.assert_close(lm._values[layer][:, :, : lm.length],
                                       twin._values[layer][:, :, : twin.length], **LOGIT_TOL)


# --------------------------------------------------------------------------- batched_extend
@pytest.mark.parametrize("name", ["pretrained", "verifier"])
def test_batched_extend_matches_extend_per_row(name):
    """Ragged caches (one of them grows its buffers mid-way), per-row biases on some rows."""
    torch.set_num_threads(1)
    model = load_model(name)
    vocab, width = model.config.vocab_size, model.config.intermediate_size
    lengths = [1, 6, 15, 40]
    prompts = _prompts(vocab, lengths)
    gen = torch.Generator().manual_seed(5)
    biases = [None, [torch.randn(width, generator=gen) for _ in range(model.config.num_hidden_layers)], None,
              [torch.randn(width, generator=gen) for _ in range(model.config.num_hidden_layers)]]
    rows = [FastCachedLM(model, capacity=16) for _ in lengths]
    alone = [FastCachedLM(model, capacity=16) for _ in lengths]
    for lm, twin, prompt, bias in zip(rows, alone, prompts, biases):
        lm.extend(prompt)
        twin.extend(prompt)
        lm.set_up_bias(bias)
        twin.set_up_bias(bias)
    assert can_batch(rows)
    for _ in range(4):
        tokens = torch.randint(0, vocab, (len(rows),), generator=gen)
        got = batched_extend(rows, tokens)
        want = torch.cat([twin.extend(tokens[i : i + 1]).logits for i, twin in enumerate(alone)])
        assert got.shape == (len(rows), vocab)
        torch.testing.assert_close(got, want, **LOGIT_TOL)
        assert [lm.length for lm in rows] == [twin.length for twin in alone]
    _assert_same_caches(rows, alone)
    lone, twin = FastCachedLM(model), FastCachedLM(model)
    lone.extend(prompts[1])
    twin.extend(prompts[1])
    assert torch.equal(batched_extend([lone], torch.tensor([3])), twin.extend([3]).logits)  # a batch of one: extend


def test_packed_extend_matches_extend_per_row():
    """Several tokens per row (a verifier's [pending, drafts]): ragged caches and feeds (1 to 9
    tokens, one row growing its buffers), per-row biases, hidden states; then a rollback and again."""
    torch.set_num_threads(1)
    model = load_model("verifier")
    vocab, width, layers = model.config.vocab_size, model.config.intermediate_size, model.config.num_hidden_layers
    lengths = [1, 6, 15, 14]
    prompts = _prompts(vocab, lengths, seed=3)
    gen = torch.Generator().manual_seed(9)
    biases = [None, [torch.randn(width, generator=gen) for _ in range(layers)], None, None]
    rows = [FastCachedLM(model, capacity=16) for _ in lengths]
    alone = [FastCachedLM(model, capacity=16) for _ in lengths]
    for lm, twin, prompt, bias in zip(rows, alone, prompts, biases):
        lm.extend(prompt)
        twin.extend(prompt)
        lm.set_up_bias(bias)
        twin.set_up_bias(bias)
    taps = [0, 1, layers]
    for counts in ([5, 1, 9, 3], [2, 4, 1, 6]):
        feeds = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in counts]
        got = packed_extend(rows, feeds, taps)
        for out, twin, feed in zip(got, alone, feeds):
            want = twin.extend(feed, taps)
            assert out.logits.shape == (len(feed), vocab) and out.hidden.shape == want.hidden.shape
            torch.testing.assert_close(out.logits, want.logits, **LOGIT_TOL)
            torch.testing.assert_close(out.hidden, want.hidden, **LOGIT_TOL)
        assert [lm.length for lm in rows] == [twin.length for twin in alone]
        for lm, twin in zip(rows, alone):  # keep two of the fed tokens, as a verifier keeps accepted ones
            lm.rollback(lm.length - len(feeds[0]) + 2 if lm is rows[0] else lm.length - 1)
            twin.rollback(lm.length)
    _assert_same_caches(rows, alone)
    plain = [CachedLM(model) for _ in range(2)]  # transformers caches: each row's own extend
    for lm, prompt in zip(plain, prompts):
        lm.extend(prompt)
    outs = packed_extend(plain, [[4, 5], [6]])
    assert [o.logits.shape[0] for o in outs] == [2, 1] and [lm.length for lm in plain] == [3, 7]
    with pytest.raises(ValueError, match="one feed per sequence"):
        packed_extend(rows, [[1]])


def test_batched_extend_falls_back_to_per_row_extend(drafter_model):
    """Transformers-backed caches, or a hook the fast path cannot run: each row runs its own extend."""
    vocab = drafter_model.config.vocab_size
    prompts = _prompts(vocab, [4, 9])
    tokens = torch.tensor([7, 11])

    def check_falls_back(backend):
        """Rows of `backend` caches the fast path refuses give exactly each row's own extend."""
        rows, alone = [backend(drafter_model) for _ in prompts], [backend(drafter_model) for _ in prompts]
        for lm, twin, prompt in zip(rows, alone, prompts):
            lm.extend(prompt)
            twin.extend(prompt)
        assert not can_batch(rows)
        want = torch.cat([twin.extend(tokens[i : i + 1]).logits for i, twin in enumerate(alone)])
        assert torch.equal(batched_extend(rows, tokens), want)
        return rows

    check_falls_back(CachedLM)
    handle = drafter_model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 0.5)
    try:
        fast = check_falls_back(FastCachedLM)
    finally:
        handle.remove()
    assert can_batch(fast)


# --------------------------------------------------------------------------- draft_blocks
def _sessions(model, backend):
    vocab = model.config.vocab_size
    prompts = _prompts(vocab, [spec[0] for spec in SPECS], seed=1)
    sessions = []
    for i, (spec, prompt) in enumerate(zip(SPECS, prompts)):
        _, temperature, top_k, top_p, draft_top_k, k, seed = spec
        policy = StopWhenUnsure(k, floor=0.5 if temperature == 0.0 else 0.2) if i >= 5 else None
        sessions.append(dict(lm=backend(model), committed=list(prompt), k=k, policy=policy,
                             config=DecodeConfig(sampling=SamplingParams(temperature, top_k, top_p),
                                                 draft_top_k=draft_top_k),
                             generator=torch.Generator().manual_seed(seed)))
    return sessions


def _run_blocks(model, backend, batched: bool) -> List[List[DraftBlock]]:
    """BLOCKS rounds: draft, then accept all / none / half (in turn) and roll back like the drafter does."""
    vocab = model.config.vocab_size
    sessions = _sessions(model, backend)
    rounds = []
    for b in range(BLOCKS):
        ks = [max(0, s["k"] - (b + i) % 4) for i, s in enumerate(sessions)]  # k varies; some blocks are empty
        if batched:
            blocks = draft_blocks([DraftRow(s["lm"], s["committed"], k, s["config"], s["generator"], s["policy"])
                                   for s, k in zip(sessions, ks)])
        else:
            blocks = [draft_block(s["lm"], s["committed"], k, s["config"], s["generator"], s["policy"])
                      for s, k in zip(sessions, ks)]
        for i, (s, block) in enumerate(zip(sessions, blocks)):
            drafted = block.tokens.shape[1]
            accepted = (drafted, 0, drafted // 2)[(b + i) % 3]
            n = len(s["committed"])
            s["committed"] += block.tokens[0, :accepted].tolist() + [(31 * b + 7 * i) % (vocab - 1) + 1]
            if s["lm"].length > n + accepted:
                s["lm"].rollback(n + accepted)
        rounds.append(blocks)
    rounds.append([s["lm"] for s in sessions])
    return rounds


def _assert_same_blocks(got: List[DraftBlock], want: List[DraftBlock], exact: bool) -> None:
    for g, w in zip(got, want):
        assert torch.equal(g.tokens, w.tokens) and torch.equal(g.lengths, w.lengths)
        if w.q is None:
            assert g.q is None
            continue
        assert torch.equal(g.q.ids, w.q.ids)
        if exact:
            assert torch.equal(g.q.probs, w.q.probs)
        else:
            torch.testing.assert_close(g.q.probs, w.q.probs, **Q_TOL)


@pytest.mark.parametrize("backend", [FastCachedLM, CachedLM], ids=["fast", "hf"])
def test_draft_blocks_equal_draft_block_alone(drafter_model, backend):
    """Greedy, T=1 and T=0.8 with top-k/top-p, several k, early stops: same tokens, q, RNG, caches."""
    batched = _run_blocks(drafter_model, backend, batched=True)
    alone = _run_blocks(drafter_model, backend, batched=False)
    exact = backend is CachedLM  # per-row forward: nothing may differ at all
    for got, want in zip(batched[:BLOCKS], alone[:BLOCKS]):
        _assert_same_blocks(got, want, exact)
    drafted = [[int(b.tokens.shape[1]) for b in blocks] for blocks in alone[:BLOCKS]]
    assert any(0 < d[5] < SPECS[5][5] - 3 or 0 < d[6] < SPECS[6][5] - 3 for d in drafted)  # a policy stopped early
    assert any(0 in d for d in drafted)  # an empty block rode along
    for lm, twin in zip(batched[BLOCKS], alone[BLOCKS]):
        assert lm.length == twin.length
    if backend is FastCachedLM:
        for lm, twin in zip(batched[BLOCKS], alone[BLOCKS]):
            for layer in range(lm.num_layers):
                torch.testing.assert_close(lm._keys[layer][:, :, : lm.length],
                                           twin._keys[layer][:, :, : twin.length], **LOGIT_TOL)
        lone = _sessions(drafter_model, backend)[0]  # a greedy row alone: a batch of one is draft_block itself
        row = DraftRow(lone["lm"], lone["committed"], 4, lone["config"])
        want = draft_block(FastCachedLM(drafter_model), row.committed, 4, row.config)
        assert torch.equal(draft_blocks([row])[0].tokens, want.tokens)


# --------------------------------------------------------------------------- steered sessions
def _steered_drafter(model):
    steering = DrafterSteering.for_model(model, steer_dim=48)
    with torch.no_grad():
        steering.proj.weight.normal_(0, 2.0, generator=torch.Generator().manual_seed(3))
    hooks = attach_steering(model, steering.eval())
    return Drafter(model, hooks), hooks


def _open_all(drafter: Drafter, model, vectors) -> list:
    """Five sessions: steered greedy / T=1 (one-token prompt) / top-k+top-p, unsteered T=1 and greedy."""
    table = DrafterSessionTable(model, 16)
    vocab = model.config.vocab_size
    params = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.8, 20, 0.9), SamplingParams(1.0),
              SamplingParams(0.0)]
    prompts = _prompts(vocab, [5, 1, 14, 9, 4], seed=2)
    sessions = []
    for i, (p, prompt, g) in enumerate(zip(params, prompts, vectors)):
        generator = torch.Generator().manual_seed(40 + i)
        sessions.append(table.open(f"s{i}", committed=list(prompt), open_length=len(prompt), params=p,
                                   generator=generator, k=6, draft_top_k=32, policy=FixedK(6), max_new_tokens=0,
                                   steering=g))
    return sessions


def test_draft_many_keeps_each_sessions_steering(drafter_model):
    """Drafter.draft_many == Drafter.draft per session, with per-session SD² vectors (some none) that
    change through feedback; the first block's prompt prefix stays unsteered as when drafted alone."""
    drafter, hooks = _steered_drafter(drafter_model)
    try:
        gen = torch.Generator().manual_seed(9)
        vectors = [torch.randn(48, generator=gen), torch.randn(48, generator=gen), torch.randn(48, generator=gen),
                   None, None]
        batched, alone = _open_all(drafter, drafter_model, vectors), _open_all(drafter, drafter_model, vectors)
        assert can_batch([s.lm for s in batched])
        vocab = drafter_model.config.vocab_size
        for b in range(5):
            got = drafter.draft_many(batched)
            want = [drafter.draft(s) for s in alone]
            assert not hooks.active and all(s.lm.up_bias is None for s in batched)
            for i, (g, w) in enumerate(zip(got, want)):
                assert g.batch_size == len(batched) and w.batch_size == 1
                assert g.draft_ids == w.draft_ids, (b, i)
                if w.q is not None:
                    assert torch.equal(g.q.ids, w.q.ids)
                    torch.testing.assert_close(g.q.probs, w.q.probs, **Q_TOL)
            new_vector = torch.randn(48, generator=gen) if b % 2 else None
            for i, out in enumerate(want):
                accepted = (len(out.draft_ids), 1, 0)[(b + i) % 3]
                token = (17 * b + 5 * i) % (vocab - 1) + 1
                steer = new_vector if i in (0, 2) else None  # none: the last vector stays in force
                for s in (batched[i], alone[i]):
                    s.proposal = Proposal(seq=b + 1, committed_length=len(s.committed), draft_ids=out.draft_ids)
                    drafter.apply_feedback(s, accepted, token, steer)
        assert [s.lm.length for s in batched] == [s.lm.length for s in alone]
    finally:
        hooks.remove()


def test_serve_drafter_flag_sets_the_batch_window():
    import argparse

    from drafter_service import cli
    from drafter_service.server import DrafterConfig
    from steerspec.errors import UsageError

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args([]).draft_batch_window_ms == DrafterConfig().batch_window_ms == 1.0
    assert parser.parse_args(["--draft-batch-window-ms", "2.5"]).draft_batch_window_ms == 2.5
    with pytest.raises(UsageError, match="--draft-batch-window-ms"):
        cli.run(parser.parse_args(["--draft-batch-window-ms", "-1"]))


def _open_trees(drafter: Drafter, model, vectors, specs) -> list:
    """Tree sessions (greedy and sampled, some steered) over the tiny drafter, one per spec."""
    table = DrafterSessionTable(model, 16)
    params = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.8, 20, 0.9), SamplingParams(1.0)]
    prompts = _prompts(model.config.vocab_size, [6, 1, 11, 4], seed=5)
    sessions = []
    for i, (p, prompt, g, spec) in enumerate(zip(params, prompts, vectors, specs)):
        mode = parse_mode(tree=spec)  # a tree session is bounded by its nodes, as the drafter service opens it
        sessions.append(table.open(f"t{i}", committed=list(prompt), open_length=len(prompt), params=p,
                                   generator=torch.Generator().manual_seed(70 + i), k=mode.policy_k, draft_top_k=32,
                                   policy=FixedK(mode.policy_k), max_new_tokens=0, steering=g, mode=mode))
    return sessions


def test_draft_many_batches_tree_sessions_as_if_alone(drafter_model):
    """Tree sessions drafted together (one packed pass per depth) == each drafted alone: the same nodes,
    q rows and cache slots over blocks with accepted paths of every length, per-session SD² vectors
    (some none, the first block's prompt prefix unsteered) and a chain session in the same batch."""
    drafter, hooks = _steered_drafter(drafter_model)
    try:
        gen = torch.Generator().manual_seed(21)
        vectors = [torch.randn(48, generator=gen), None, torch.randn(48, generator=gen), None]
        specs = ["0,1,2,00,10", "0,1,00,000", "0,00,01,000", "0,1,2,3,00"]
        batched, alone = (_open_trees(drafter, drafter_model, vectors, specs) for _ in range(2))
        chain, chain_alone = (_open_all(drafter, drafter_model, vectors[:1])[0] for _ in range(2))
        vocab = drafter_model.config.vocab_size
        for b in range(5):
            got = drafter.draft_many(batched + [chain])
            want = [drafter.draft(s) for s in alone + [chain_alone]]
            assert not hooks.active and all(s.lm.up_bias is None for s in batched + [chain])
            assert [g.batch_size for g in got] == [len(batched)] * len(batched) + [1]
            for i, (g, w) in enumerate(zip(got, want)):
                assert g.draft_ids == w.draft_ids and g.fed == w.fed, (b, i)
                if w.q is not None:
                    assert torch.equal(g.q.ids, w.q.ids)
                    torch.testing.assert_close(g.q.probs, w.q.probs, **Q_TOL)
            for i, out in enumerate(want[:-1]):
                shape = batched[i].mode.tree
                leaves = [n for n in range(shape.size) if not shape.children(n)]
                end = (leaves[(b + i) % len(leaves)], None)[(b + i) % 2]  # a root-to-leaf path, or none
                path = [] if end is None else shape.ancestors(end) + [end]
                token = (13 * b + 3 * i) % (vocab - 1) + 1
                for s in (batched[i], alone[i]):
                    s.proposal = Proposal(seq=b + 1, committed_length=len(s.committed), draft_ids=out.draft_ids,
                                          fed=out.fed)
                    drafter.apply_feedback(s, len(path), token, vectors[(i + b) % 4], path=path)
            for s, out in ((chain, want[-1]), (chain_alone, want[-1])):
                s.proposal = Proposal(seq=b + 1, committed_length=len(s.committed), draft_ids=out.draft_ids)
                drafter.apply_feedback(s, 1, 5, None)
        assert [s.lm.length for s in batched] == [s.lm.length for s in alone]
        assert [s.committed for s in batched] == [s.committed for s in alone]
    finally:
        hooks.remove()
