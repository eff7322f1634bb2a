"""Greedy speculative decoding with a static draft tree, in process (steerspec/trees.py).

Per block the drafter drafts the tree level by level (one pass per depth below the deepest, each
over that level's nodes with an ancestor mask), the verifier scores the pending token and every
node in one pass, greedy acceptance walks the tree (`trees.greedy_walk`), and both caches keep
only the accepted path (`FastCachedLM.keep`). On a CPU a verifier pass costs about the same for
3 rows as for 12, so a tree commits more tokens per pass than a chain at the same drafter cost.
The output is the verifier's greedy output, token for token. Same protocol, round loop and
accounting as `engine.speculative_generate` (pending token, prefill, SD² steering).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from steerspec.engine import DrafterSteering, RoundOut, RoundRecord, _check_prompt, run_rounds
from steerspec.metrics import GenerationResult
from steerspec.models.kv import FastCachedLM, as_cached
from steerspec.rounds import DecodeConfig
from steerspec.speculative import DraftBlock
from steerspec.trees import TreeShape, ancestor_mask, greedy_walk, parse_tree


def _pruned(shape: TreeShape, max_depth: int) -> Optional[TreeShape]:
    """The tree's nodes down to `max_depth` (None when that leaves none): near the token budget."""
    if max_depth >= shape.depth:
        return shape
    paths = [p for p in shape.paths if len(p) <= max_depth]
    return parse_tree(",".join("".join(map(str, p)) for p in paths)) if paths else None


def _top(logits: Tensor, count: int) -> List[int]:
    return logits.topk(count).indices.tolist()


def draft_tree(drafter: FastCachedLM, committed: Sequence[int], shape: TreeShape) -> Tuple[List[int], List[int]]:
    """Fill the tree with the drafter's ranked tokens after `committed` (its last token pending).

    Returns (token per node, nodes fed to the drafter in cache order after the committed tokens);
    the drafter's cache then holds committed + those nodes."""
    n = len(committed)
    out = drafter.extend(committed[drafter.length:])
    tokens = [0] * shape.size
    roots = shape.children(-1)
    ranked = _top(out.logits[-1], 1 + max(shape.ranks[c] for c in roots))
    for c in roots:
        tokens[c] = ranked[shape.ranks[c]]
    fed: List[int] = []
    for depth in range(1, shape.depth):
        level = [i for i in shape.at_depth(depth) if shape.children(i)]
        among = ancestor_mask(shape, level, fed + level, with_root=False)
        visible = torch.cat([torch.ones(len(level), n, dtype=torch.bool), among], dim=1)
        positions = torch.full((len(level),), n - 1 + depth, dtype=torch.long)
        out = drafter.extend_tree([tokens[i] for i in level], positions, visible)
        fed.extend(level)
        for row, node in enumerate(level):
            kids = shape.children(node)
            ranked = _top(out.logits[row], 1 + max(shape.ranks[c] for c in kids))
            for c in kids:
                tokens[c] = ranked[shape.ranks[c]]
    return tokens, fed


def verify_tree(verifier: FastCachedLM, pending: int, tokens: Sequence[int], shape: Optional[TreeShape],
                hidden_layers: Optional[Sequence[int]] = None) -> Tuple[List[int], int, Optional[Tensor]]:
    """Score [pending, nodes...] in one pass, walk the tree greedily, keep the accepted path.

    Returns (accepted node path, next token, hidden states [L, D] at the row that chose it)."""
    start = verifier.length
    size = 0 if shape is None else shape.size
    if shape is None:
        out = verifier.extend([pending], hidden_layers)
        argmax = out.logits.argmax(-1).tolist()
        return [], argmax[0], (out.hidden[:, 0] if hidden_layers else None)
    among = ancestor_mask(shape, range(size), range(size), with_root=True)  # [N, N + 1]
    root = torch.zeros(1, size + 1, dtype=torch.bool)
    root[0, 0] = True
    visible = torch.cat([torch.ones(size + 1, start, dtype=torch.bool), torch.cat([root, among])], dim=1)
    positions = start + torch.tensor((0,) + shape.depths, dtype=torch.long)
    out = verifier.extend_tree([pending] + list(tokens), positions, visible, hidden_layers)
    argmax = out.logits.argmax(-1).tolist()
    path, row = greedy_walk(shape, tokens, argmax)
    verifier.keep(start + 1, [start + 1 + node for node in path])
    hidden = out.hidden[:, row] if hidden_layers else None
    return path, argmax[row], hidden


def tree_generate(
    verifier,
    drafter,
    prompt_ids: Sequence[int],
    config: DecodeConfig,
    tree: "TreeShape | str" = "default",
    steering: Optional[DrafterSteering] = None,
    tokenizer=None,
    on_round: Optional[Callable[[RoundRecord], None]] = None,
) -> GenerationResult:
    """Greedy speculative decoding with a draft tree (lossless: the verifier's greedy output).

    Needs the fast KV backend on both sides (`FastCachedLM`) and temperature 0; raises ValueError
    naming the fix otherwise."""
    shape = parse_tree(tree) if isinstance(tree, str) else tree
    if not config.greedy:
        raise ValueError("tree drafting is greedy only: use --temperature 0, or drop --tree for sampling")
    verifier, drafter = as_cached(verifier), as_cached(drafter)
    if not (isinstance(verifier, FastCachedLM) and isinstance(drafter, FastCachedLM)):
        raise ValueError("tree drafting needs the fast KV backend on both models (Llama/Qwen/Mistral-style)")
    prompt = _check_prompt(prompt_ids, config)

    def one_round(committed: List[int], room: int, layers: Optional[Sequence[int]]) -> RoundOut:
        n = len(committed)
        t0 = time.perf_counter()
        here = _pruned(shape, room - 1)
        tokens, fed = draft_tree(drafter, committed, here) if here is not None else ([], [])
        if here is None:
            drafter.extend(committed[drafter.length:])  # keep the drafter caught up (pending fed)
        t1 = time.perf_counter()
        path, next_token, hidden = verify_tree(verifier, committed[-1], tokens, here, layers)
        t2 = time.perf_counter()
        kept = []
        for node in path:  # the accepted nodes the drafter already holds, in order
            if node not in fed:
                break
            kept.append(n + fed.index(node))
        drafter.keep(n, kept)
        rest = [i for i in range(len(tokens)) if i not in path]
        order = [tokens[i] for i in path] + [tokens[i] for i in rest]
        block = DraftBlock(tokens=torch.tensor([order], dtype=torch.long), lengths=torch.tensor([len(order)]))
        return RoundOut(block, len(path), next_token, hidden, t1 - t0, t2 - t1)

    result = GenerationResult(token_ids=[], mode="speculative", prompt_tokens=len(prompt))
    return run_rounds(verifier, drafter, prompt, config, result, one_round, steering, None, tokenizer, on_round)
