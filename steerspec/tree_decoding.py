"""Speculative decoding with a static draft tree, in process (steerspec/trees.py).

Per block the drafter drafts the tree level by level (one pass per depth below the deepest, each
over that level's nodes with an ancestor mask), the verifier scores the pending token and every
node in one pass, acceptance walks the tree (`trees.greedy_walk`), and both caches keep
only the accepted path (`FastCachedLM.keep`). On the 2-core CPU a verifier pass of up to 6 rows costs
about what one of 3 does, so a small tree commits more tokens per pass than a chain at the same
drafter cost (docs/results/real-pair.md, "Draft trees").
Greedy, the output is the verifier's greedy output, token for token; at T > 0 each node's children are
independent samples of the drafter's distribution there and acceptance is SpecInfer's multi-step
speculative sampling (`trees.sampled_walk`): exactly the verifier's distribution. Same protocol, round loop and
accounting as `engine.speculative_generate` (pending token, prefill, SD² steering).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from steerspec.engine import DrafterSteering, RoundOut, RoundRecord, _check_prompt, run_rounds
from steerspec.metrics import GenerationResult
from steerspec.models.kv import FastCachedLM, as_cached
from steerspec.rounds import DecodeConfig, make_generators
from steerspec.speculative import DraftBlock
from steerspec.sampling import draft_distribution, probs_from_logits, sample_sparse
from steerspec.trees import TreeShape, ancestor_mask, greedy_walk, parse_tree, sampled_walk


ROOT_ONLY = TreeShape((), (), (), ())  # a tree without nodes: the verifier scores the pending token alone


def _pruned(shape: TreeShape, max_depth: int) -> TreeShape:
    """The tree's nodes down to `max_depth` (ROOT_ONLY when that leaves none): near the token budget."""
    if max_depth >= shape.depth:
        return shape
    paths = [p for p in shape.paths if len(p) <= max_depth]
    return parse_tree(",".join("".join(map(str, p)) for p in paths)) if paths else ROOT_ONLY


def _top(logits: Tensor, count: int) -> List[int]:
    return logits.topk(count).indices.tolist()


def _fill(shape: TreeShape, parent: int, logits: Tensor, tokens: List[int], q_at: Dict[int, Tensor],
          config: DecodeConfig, generator: Optional[torch.Generator]) -> None:
    """Set the tokens of `parent`'s children from the drafter's logits there: its ranked tokens when
    greedy, else independent samples of its warped, top-`draft_top_k` distribution (kept in q_at)."""
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
    dist = draft_distribution(probs, config.draft_top_k, config.draft_tail)
    q_at[parent] = dist.to_dense(probs.shape[-1])[0]
    for c in kids:
        tokens[c] = int(sample_sparse(dist, generator)[0])


def draft_tree(drafter: FastCachedLM, committed: Sequence[int], shape: TreeShape,
               config: Optional[DecodeConfig] = None, generator: Optional[torch.Generator] = None,
               ) -> Tuple[List[int], List[int], Dict[int, Tensor]]:
    """Fill the tree with the drafter's tokens after `committed` (its last token pending): ranked
    when greedy, sampled i.i.d. per parent otherwise.

    Returns (token per node, nodes fed to the drafter in cache order after the committed tokens,
    the distribution each parent's children were drawn from — empty when greedy); the drafter's
    cache then holds committed + the fed nodes."""
    config = config if config is not None else DecodeConfig()
    n = len(committed)
    out = drafter.extend(committed[drafter.length:])
    tokens = [0] * shape.size
    q_at: Dict[int, Tensor] = {}
    _fill(shape, -1, out.logits[-1], tokens, q_at, config, generator)
    fed: List[int] = []
    for depth in range(1, shape.depth):
        level = [i for i in shape.at_depth(depth) if shape.children(i)]
        among = ancestor_mask(shape, level, fed + level, with_root=False)
        visible = torch.cat([torch.ones(len(level), n, dtype=torch.bool), among], dim=1)
        positions = torch.full((len(level),), n - 1 + depth, dtype=torch.long)
        out = drafter.extend_tree([tokens[i] for i in level], positions, visible)
        fed.extend(level)
        for row, node in enumerate(level):
            _fill(shape, node, out.logits[row], tokens, q_at, config, generator)
    return tokens, fed, q_at


def verify_tree(verifier: FastCachedLM, pending: int, tokens: Sequence[int], shape: TreeShape,
                hidden_layers: Optional[Sequence[int]] = None, config: Optional[DecodeConfig] = None,
                q_at: Optional[Dict[int, Tensor]] = None, generator: Optional[torch.Generator] = None,
                ) -> Tuple[List[int], int, Optional[Tensor]]:
    """Score [pending, nodes...] in one pass, accept a path (greedy walk, or multi-step speculative
    sampling against `q_at` at T > 0), keep it in the cache.

    Returns (accepted node path, next token, hidden states [L, D] at the row that chose it)."""
    config = config if config is not None else DecodeConfig()
    start = verifier.length
    size = shape.size
    among = ancestor_mask(shape, range(size), range(size), with_root=True)  # [N, N + 1]
    root = torch.zeros(1, size + 1, dtype=torch.bool)
    root[0, 0] = True
    visible = torch.cat([torch.ones(size + 1, start, dtype=torch.bool), torch.cat([root, among])], dim=1)
    positions = start + torch.tensor((0,) + shape.depths, dtype=torch.long)
    out = verifier.extend_tree([pending] + list(tokens), positions, visible, hidden_layers)
    path, token, row = _accept(shape, tokens, out.logits, config, q_at or {}, generator)
    verifier.keep(start + 1, [start + 1 + node for node in path])
    hidden = out.hidden[:, row] if hidden_layers else None
    return path, token, hidden


def _accept(shape: TreeShape, tokens: Sequence[int], logits: Tensor, config: DecodeConfig,
            q_at: Dict[int, Tensor], generator: Optional[torch.Generator]) -> Tuple[List[int], int, int]:
    """(accepted path, next token, row that gave it) from the verifier's logits over [pending, nodes...]."""
    if config.greedy:
        argmax = logits.argmax(-1).tolist()
        path, row = greedy_walk(shape, tokens, argmax)
        return path, argmax[row], row
    params = config.sampling
    p_rows = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
    return sampled_walk(shape, tokens, p_rows, q_at, generator)


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
    """Speculative decoding with a draft tree, lossless: greedy, the verifier's greedy output; at T > 0
    (children sampled i.i.d., multi-step speculative sampling) exactly the verifier's distribution.

    Needs the fast KV backend on both sides (`FastCachedLM`); raises ValueError naming the fix otherwise."""
    shape = parse_tree(tree) if isinstance(tree, str) else tree
    verifier, drafter = as_cached(verifier), as_cached(drafter)
    if not (isinstance(verifier, FastCachedLM) and isinstance(drafter, FastCachedLM)):
        raise ValueError("tree drafting needs the fast KV backend on both models (Llama/Qwen/Mistral-style)")
    prompt = _check_prompt(prompt_ids, config)
    g_draft, g_verify = make_generators(config.seed, drafter.device, verifier.device)

    def one_round(committed: List[int], room: int, layers: Optional[Sequence[int]]) -> RoundOut:
        n = len(committed)
        t0 = time.perf_counter()
        here = _pruned(shape, room - 1)
        tokens, fed, q_at = draft_tree(drafter, committed, here, config, g_draft)
        t1 = time.perf_counter()
        path, next_token, hidden = verify_tree(verifier, committed[-1], tokens, here, layers, config, q_at, g_verify)
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
