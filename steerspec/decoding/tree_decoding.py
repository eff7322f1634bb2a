"""Speculative decoding with a static draft tree, in process (steerspec/decoding/trees.py).

Per block the drafter drafts the tree level by level (one pass per depth below the deepest, each
over that level's nodes with an ancestor mask), the verifier scores the pending token and every
node in one pass, acceptance walks the tree (`trees.greedy_walk`), and both caches keep
only the accepted path (`FastCachedLM.keep`); several sequences' trees share the drafter's passes
(`draft_trees`, what the drafter service runs for concurrent tree sessions). On the 2-core CPU a
verifier pass of up to 6 rows costs about what one of 3 does, so a small tree commits more tokens per
pass than a chain at the same drafter cost (docs/results/engine.md, docs/results/services.md).
Greedy, the output is the verifier's greedy output, token for token; at T > 0 each node's children are
samples of the drafter's distribution there, drawn without replacement (or i.i.d.), and acceptance is
multi-step speculative sampling with recursive residuals (`trees.sampled_walk`), or with
`DecodeConfig.acceptance = "block"` traversal verification (`traversal.traversal_walk`, leaf to root): either
exactly the verifier's distribution. Same protocol, round loop and accounting as `engine.speculative_generate`
(pending token, prefill, SD² steering).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from steerspec.decoding.drafting import Steps, drive
from steerspec.decoding.engine import DrafterSteering, RoundOut, RoundRecord, check_prompt, run_rounds
from steerspec.decoding.generation_result import GenerationResult
from steerspec.decoding.rounds import DecodeConfig, make_generators, seed_block, stream_seed
from steerspec.decoding.sampling import SparseDist, draft_distribution, probs_from_logits, sample_sparse
from steerspec.decoding.speculative import DraftBlock
from steerspec.decoding.traversal import traversal_walk
from steerspec.decoding.trees import (
    TreeShape,
    ancestor_mask,
    cut_to_depth,
    from_paths,
    greedy_walk,
    parse_tree,
    prefix,
    sampled_walk,
    sibling_proposal,
)
from steerspec.models.backends import as_cached
from steerspec.models.batched import packed_extend
from steerspec.models.kv import FastCachedLM
from steerspec.policies.base import BlockFeedback, DraftLengthPolicy


def _top(logits: Tensor, count: int) -> List[int]:
    return logits.topk(count).indices.tolist()


def _fill(shape: TreeShape, parent: int, logits: Tensor, tokens: List[int], q_at: Dict[int, SparseDist],
          config: DecodeConfig, generator: Optional[torch.Generator], distinct: bool = True) -> None:
    """Set the tokens of `parent`'s children from the drafter's logits there: its ranked tokens when
    greedy, else samples of its warped, top-`draft_top_k` distribution q (kept in q_at as the wire sends
    it), drawn without replacement in rank order when `distinct` (a child whose q has no mass left repeats
    the first), else i.i.d."""
    kids = shape.children(parent)
    if not kids:
        return
    if config.greedy:
        ranked = _top(logits, 1 + max(shape.ranks[c] for c in kids))
        for c in kids:
            tokens[c] = ranked[shape.ranks[c]]
        return
    params = config.sampling
    probs = probs_from_logits(logits.unsqueeze(0), params.temperature, params.top_k, params.top_p)
    dist = q_at[parent] = draft_distribution(probs, config.draft_top_k, config.draft_tail)
    if not distinct:
        for c in kids:
            tokens[c] = int(sample_sparse(dist, generator)[0])
        return
    drawn: List[int] = []
    for c in kids:
        tokens[c] = _draw_new(dist, drawn, generator)
        if tokens[c] in drawn:  # q has no mass left: never tried by the walk
            continue
        drawn.append(tokens[c])


def _draw_new(dist: SparseDist, drawn: List[int], generator: Optional[torch.Generator], tries: int = 32) -> int:
    """A draw of q conditioned on not being in `drawn` (sampling without replacement): redraw from the
    sparse q until new, which is exactly that conditional; after `tries`, one draw of the renormalised
    dense rest. Returns drawn[0] when q has no mass outside `drawn`."""
    for _ in range(tries if drawn else 1):
        token = int(sample_sparse(dist, generator)[0])
        if token not in drawn:
            return token
    rest = sibling_proposal(dense(dist), drawn)
    if float(rest.sum()) <= 0:
        return drawn[0]
    return int(torch.multinomial(rest.unsqueeze(0), 1, generator=generator)[0, 0])


def dense(dist: SparseDist) -> Tensor:
    """A one-row sparse distribution [1, S] as a dense [V] vector (its tail spread as the wire says)."""
    return dist.to_dense(dist.vocab)[0]


@dataclass
class TreeRow:
    """One sequence's tree to draft in a batch (`draft_trees`): its drafter cache (holding a prefix of
    `committed`, whose last token is pending), the tree, sampling and generator; `first_logits` are the
    root's logits when the caller fed the committed tail itself (e.g. alone, through steering hooks)."""

    lm: FastCachedLM
    committed: Sequence[int]
    shape: TreeShape
    config: DecodeConfig = field(default_factory=DecodeConfig)
    generator: Optional[torch.Generator] = None
    first_logits: Optional[Tensor] = None
    distinct: bool = True


Drafted = Tuple[List[int], List[int], Dict[int, SparseDist]]


def draft_tree(drafter: FastCachedLM, committed: Sequence[int], shape: TreeShape,
               config: Optional[DecodeConfig] = None, generator: Optional[torch.Generator] = None,
               distinct: bool = True) -> Drafted:
    """Fill the tree with the drafter's tokens after `committed` (its last token pending): ranked
    when greedy, sampled per parent otherwise (without replacement when `distinct`).

    Returns (token per node, nodes fed to the drafter in cache order after the committed tokens,
    the distribution [1, S] each parent's children were drawn from — empty when greedy); the drafter's
    cache then holds committed + the fed nodes."""
    row = TreeRow(drafter, committed, shape, config if config is not None else DecodeConfig(), generator,
                  distinct=distinct)
    return draft_trees([row])[0]


def draft_trees(rows: Sequence[TreeRow]) -> List[Drafted]:
    """`draft_tree` for several sequences at once: one packed pass over every row's committed tail, then
    one per depth over every row's nodes there (each row with its own positions and ancestor mask;
    `models.batched.packed_extend`), each row drawing from its own generator in `draft_tree`'s order, so
    each gets what it would alone (to float rounding of the shared pass)."""
    return drive(draft_tree_steps(rows))


def draft_tree_steps(rows: Sequence[TreeRow]) -> "Steps[List[Drafted]]":
    """`draft_trees`, yielding after each forward pass (drafting ahead: drafter_service/ahead.py). A row of no
    nodes (a block of no drafts) runs no pass: its committed tail waits in `committed` for the next block's feed,
    which takes any number of tokens, so the drafter spends nothing on blocks the verifier answers alone."""
    feed = [i for i, row in enumerate(rows) if row.first_logits is None and row.shape.size]
    roots: Dict[int, Tensor] = {}
    if feed:
        outs = packed_extend([rows[i].lm for i in feed], [list(rows[i].committed[rows[i].lm.length:]) for i in feed])
        roots = {i: out.logits[-1] for i, out in zip(feed, outs)}
        yield
    drafted: List[Drafted] = []
    for i, row in enumerate(rows):
        tokens, q_at = [0] * row.shape.size, {}
        if not row.shape.size:
            drafted.append((tokens, [], q_at))
            continue
        root = roots[i] if i in roots else row.first_logits[-1]
        _fill(row.shape, -1, root, tokens, q_at, row.config, row.generator, row.distinct)
        drafted.append((tokens, [], q_at))
    for depth in range(1, max((row.shape.depth for row in rows), default=0)):
        active, levels, feeds, masks = [], [], [], []
        for i, row in enumerate(rows):
            level = [node for node in row.shape.at_depth(depth) if row.shape.children(node)]
            if not level:
                continue
            tokens, fed, _ = drafted[i]
            n = len(row.committed)
            among = ancestor_mask(row.shape, level, fed + level, with_root=False)
            visible = torch.cat([torch.ones(len(level), n, dtype=torch.bool), among], dim=1)
            positions = torch.full((len(level),), n - 1 + depth, dtype=torch.long)
            active.append(i)
            levels.append(level)
            feeds.append([tokens[node] for node in level])
            masks.append((positions, visible))
        if not active:
            break
        outs = packed_extend([rows[i].lm for i in active], feeds, None, masks)
        yield
        for i, level, out in zip(active, levels, outs):
            row, (tokens, fed, q_at) = rows[i], drafted[i]
            fed.extend(level)
            for r, node in enumerate(level):
                _fill(row.shape, node, out.logits[r], tokens, q_at, row.config, row.generator, row.distinct)
    return drafted


def verify_tree(verifier: FastCachedLM, pending: int, tokens: Sequence[int], shape: TreeShape,
                hidden_layers: Optional[Sequence[int]] = None, config: Optional[DecodeConfig] = None,
                q_at: Optional[Dict[int, SparseDist]] = None, generator: Optional[torch.Generator] = None,
                distinct: bool = True) -> Tuple[List[int], int, Optional[Tensor]]:
    """Score [pending, nodes...] in one pass, accept a path (greedy walk, or multi-step speculative
    sampling against `q_at` at T > 0), keep it in the cache.

    Returns (accepted node path, next token, hidden states [L, D] at the row that chose it)."""
    start = verifier.length
    feed, positions, visible = tree_feed(pending, tokens, shape, start)
    out = verifier.extend_tree(feed, positions, visible, hidden_layers)
    return finish_tree(verifier, start, shape, tokens, out, config, q_at, generator, distinct)


def cached_path(path: Sequence[int], fed: Sequence[int], start: int) -> List[int]:
    """The drafter's cache slots of the accepted path's nodes it holds (the leaves were never fed), in order:
    what `FastCachedLM.keep(start, ...)` keeps after a tree block drafted on `start` committed tokens."""
    slots = []
    for node in path:
        if node not in fed:
            break
        slots.append(start + list(fed).index(node))
    return slots


def tree_feed(pending: int, tokens: Sequence[int], shape: TreeShape, start: int) -> Tuple[List[int], Tensor, Tensor]:
    """What the verifier feeds for a tree after `start` cached tokens: [pending, nodes...], their
    positions (by depth) and the visibility mask [N + 1, start + N + 1] (the prefix and each token's ancestry)."""
    size = shape.size
    among = ancestor_mask(shape, range(size), range(size), with_root=True)  # [N, N + 1]
    root = torch.zeros(1, size + 1, dtype=torch.bool)
    root[0, 0] = True
    visible = torch.cat([torch.ones(size + 1, start, dtype=torch.bool), torch.cat([root, among])], dim=1)
    positions = start + torch.tensor((0,) + shape.depths, dtype=torch.long)
    return [pending] + list(tokens), positions, visible


def finish_tree(verifier: FastCachedLM, start: int, shape: TreeShape, tokens: Sequence[int], out,
                config: Optional[DecodeConfig] = None, q_at: Optional[Dict[int, SparseDist]] = None,
                generator: Optional[torch.Generator] = None, distinct: bool = True,
                ) -> Tuple[List[int], int, Optional[Tensor]]:
    """Acceptance over a scored tree (`out`: the verifier's StepOutput for `tree_feed`), the accepted path
    kept in the cache -> (path, next token, hidden states [L, D] at the row that chose it, or None)."""
    config = config if config is not None else DecodeConfig()
    path, token, row = _accept(shape, tokens, out.logits, config, q_at or {}, generator, distinct)
    verifier.keep(start + 1, [start + 1 + node for node in path])
    hidden = out.hidden[:, row] if out.hidden is not None else None
    return path, token, hidden


def _accept(shape: TreeShape, tokens: Sequence[int], logits: Tensor, config: DecodeConfig,
            q_at: Dict[int, SparseDist], generator: Optional[torch.Generator], distinct: bool = True,
            ) -> Tuple[List[int], int, int]:
    """(accepted path, next token, row that gave it) from the verifier's logits over [pending, nodes...]."""
    if config.greedy:
        argmax = logits.argmax(-1).tolist()
        path, row = greedy_walk(shape, tokens, argmax)
        return path, argmax[row], row
    walk = {"token": sampled_walk, "block": traversal_walk}.get(config.acceptance)
    if walk is None:
        raise ValueError(f"unknown acceptance rule {config.acceptance!r}: 'token' or 'block'")
    params = config.sampling
    p_rows = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
    q_dense = {parent: dense(dist).to(p_rows.device, p_rows.dtype) for parent, dist in q_at.items()}
    return walk(shape, tokens, p_rows, q_dense, generator, distinct)


def policy_tree(policy: DraftLengthPolicy, tree: TreeShape) -> TreeShape:
    """The tree a block drafts under `policy`: the shape it picks (`next_shape`: the load-aware policy's chain-first
    cut of `tree`, at most `tree`'s nodes) or `tree`'s first next_k() nodes, breadth-first."""
    pick = getattr(policy, "next_shape", None)
    chosen = from_paths(pick(tree.paths)) if pick is not None else tree
    n = chosen.size if pick is not None else int(policy.next_k())
    return prefix(chosen, max(min(n, tree.size), 0))


def tree_generate(
    verifier,
    drafter,
    prompt_ids: Sequence[int],
    config: DecodeConfig,
    tree: "TreeShape | str" = "default",
    steering: Optional[DrafterSteering] = None,
    tokenizer=None,
    on_round: Optional[Callable[[RoundRecord], None]] = None,
    distinct: bool = True,
    policy: Optional[DraftLengthPolicy] = None,
) -> GenerationResult:
    """Speculative decoding with a draft tree, lossless: greedy, the verifier's greedy output; at T > 0
    (siblings sampled without replacement, or i.i.d. with `distinct=False`; multi-step speculative
    sampling) exactly the verifier's distribution. `policy` (one that sizes trees, e.g. `load`) picks how many of
    the tree's nodes each block drafts, breadth-first; None drafts them all.

    Needs the fast KV backend on both sides (`FastCachedLM`); raises ValueError naming the fix otherwise."""
    shape = parse_tree(tree) if isinstance(tree, str) else tree
    verifier, drafter = as_cached(verifier), as_cached(drafter)
    if not (isinstance(verifier, FastCachedLM) and isinstance(drafter, FastCachedLM)):
        raise ValueError("tree drafting needs the fast KV backend on both models (Llama/Qwen/Mistral-style)")
    prompt = check_prompt(prompt_ids, config)
    g_draft, g_verify = make_generators(config.seed, drafter.device, verifier.device)
    base_seed = stream_seed(config.seed)

    def one_round(committed: List[int], room: int, layers: Optional[Sequence[int]]) -> RoundOut:
        n = len(committed)
        t0 = time.perf_counter()
        seed_block(g_draft, base_seed, n)  # a block's draws: the seed and the prefix only (rounds.block_seed)
        here = cut_to_depth(shape, room - 1)
        if policy is not None:
            here = cut_to_depth(policy_tree(policy, shape), room - 1)
        tokens, fed, q_at = draft_tree(drafter, committed, here, config, g_draft, distinct)
        t1 = time.perf_counter()
        path, next_token, hidden = verify_tree(verifier, committed[-1], tokens, here, layers, config, q_at, g_verify,
                                               distinct)
        t2 = time.perf_counter()
        if drafter.length >= n:  # after a block of no drafts the tail is fed with the next block
            drafter.keep(n, cached_path(path, fed, n))
        rest = [i for i in range(len(tokens)) if i not in path]
        order = [tokens[i] for i in path] + [tokens[i] for i in rest]
        block = DraftBlock(tokens=torch.tensor([order], dtype=torch.long), lengths=torch.tensor([len(order)]))
        paths.append((tuple(path), here.paths))
        return RoundOut(block, len(path), next_token, hidden, t1 - t0, t2 - t1)

    paths: List[tuple] = []  # each block's accepted nodes and its shape, for the policy's feedback

    def after_round(stats) -> None:
        if policy is not None and (stats.drafted or getattr(policy, "min_k", 1) == 0):
            policy.update(BlockFeedback(stats.accepted, stats.drafted, draft_ms=stats.draft_ms,
                                        verify_ms=stats.verify_ms, overhead_ms=stats.overhead_ms, path=paths[-1][0],
                                        shape=paths[-1][1]))

    if policy is not None:
        policy.reset()
    result = GenerationResult(token_ids=[], mode="speculative", prompt_tokens=len(prompt))
    return run_rounds(verifier, drafter, prompt, config, result, one_round, steering, after_round, tokenizer,
                      on_round)
