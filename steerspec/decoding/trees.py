"""Static draft trees for greedy speculative decoding (pure; no models, no I/O).

A tree is a set of rank paths: "0,1,00,000" drafts the drafter's top-1 and top-2 tokens after the
pending token, the top-1 after the first of them, and the top-1 after that (Medusa's and EAGLE's
static trees, SpecInfer's token trees). The verifier scores every node in one pass with an
ancestor mask; greedy acceptance walks from the root along the child whose token equals the
verifier's argmax, so the committed text is exactly the verifier's greedy output. At T > 0 a node's
children are instead samples from the drafter's distribution there, without replacement in rank order
(the ranks only say how many), and `sampled_walk` is recursive rejection sampling over them (or, under block
verification, `traversal.traversal_walk` leaf to root): exactly the verifier's distribution. A chain of k
zeros is plain speculative decoding at k. Nodes are kept in breadth-first order (by depth, then parent, then
rank): a parent always comes before its children.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

MAX_NODES = 64
MAX_RANK = 9

# Chosen from measurement (current figures: docs/results/engine.md, services.md): depth 2, 5 nodes, the fastest
# of 13 trees tried with `smollm2-sd2` on the AVX-512 EPYC; passes of 7 or more rows cost more there.
DEFAULT_TREE = "0,1,2,00,10"


@dataclass(frozen=True)
class TreeShape:
    """A static draft tree: per node (breadth-first) its rank among its parent's children's
    candidates, its parent's node index (-1: the root, i.e. the pending token) and its depth (1..)."""

    paths: Tuple[Tuple[int, ...], ...]
    ranks: Tuple[int, ...]
    parents: Tuple[int, ...]
    depths: Tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def spec(self) -> str:
        return ",".join("".join(str(r) for r in p) for p in self.paths)

    def children(self, node: int) -> List[int]:
        """Node indices whose parent is `node` (-1: the root), in rank order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def at_depth(self, depth: int) -> List[int]:
        return [i for i, d in enumerate(self.depths) if d == depth]

    def ancestors(self, node: int) -> List[int]:
        """`node`'s ancestors among the nodes (nearest last), itself excluded; the root is not a node."""
        out: List[int] = []
        parent = self.parents[node]
        while parent >= 0:
            out.append(parent)
            parent = self.parents[parent]
        return out[::-1]


def parse_tree(spec: str) -> TreeShape:
    """'0,1,00' -> TreeShape; every path's parent must be in the tree; ranks 0..9, at most 64 nodes.

    Raises ValueError with the fix on a bad spec."""
    text = (spec or "").strip()
    if not text:
        raise ValueError("empty tree spec: give rank paths such as --tree 0,1,00,000 (or --tree default)")
    if text == "default":
        text = DEFAULT_TREE
    paths = []
    for part in text.split(","):
        part = part.strip()
        if not part or not part.isdigit():
            raise ValueError(f"tree path {part!r} is not a string of ranks 0-9 (e.g. 0,1,00,000)")
        paths.append(tuple(int(c) for c in part))
    if len(set(paths)) != len(paths):
        raise ValueError(f"tree spec {spec!r} repeats a path")
    if len(paths) > MAX_NODES:
        raise ValueError(f"a tree has at most {MAX_NODES} nodes; {spec!r} has {len(paths)}")
    known = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in known:
            raise ValueError(f"tree path {''.join(map(str, p))} needs its parent {''.join(map(str, p[:-1]))} in the tree")
    ordered = sorted(paths, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(ordered)}
    parents = tuple(index[p[:-1]] if len(p) > 1 else -1 for p in ordered)
    return TreeShape(tuple(ordered), tuple(p[-1] for p in ordered), parents, tuple(len(p) for p in ordered))


def from_paths(paths: Sequence[Sequence[int]]) -> TreeShape:
    """The tree of these rank paths (any order; none: the empty tree); ValueError as `parse_tree`."""
    if not paths:
        return TreeShape((), (), (), ())
    return parse_tree(",".join("".join(str(int(r)) for r in p) for p in paths))


def from_parents(parents: Sequence[int]) -> TreeShape:
    """The tree whose node i has parent parents[i] (-1: the root), nodes breadth-first, each parent's children in
    rank order: a block's shape as the wire carries it (DraftBlock.parents). ValueError naming the fault."""
    paths: List[Tuple[int, ...]] = []
    for i, parent in enumerate(int(p) for p in parents):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a node's parent must be -1 (the root) or an earlier node")
        above = paths[parent] if parent >= 0 else ()
        rank = sum(1 for p in paths if p[:-1] == above)
        if rank > MAX_RANK:
            raise ValueError(f"node {i} would be child {rank} of its parent; at most {MAX_RANK + 1} children")
        paths.append(above + (rank,))
    shape = from_paths(paths)
    if list(shape.paths) != paths:
        raise ValueError(f"parents {list(parents)} are not breadth-first (by depth, then parent, then rank)")
    return shape


def prefix(shape: TreeShape, size: int) -> TreeShape:
    """The tree of `shape`'s first `size` nodes (breadth-first, so parents come first): what a block cut
    to `size` draft tokens carries (a depth cut near the token budget is one too)."""
    n = max(0, min(int(size), shape.size))
    return TreeShape(shape.paths[:n], shape.ranks[:n], shape.parents[:n], shape.depths[:n])


def cut_to_depth(shape: TreeShape, depth: int) -> TreeShape:
    """The nodes of `shape` down to `depth` (none when depth < 1): a prefix, since nodes go by depth."""
    return prefix(shape, sum(1 for d in shape.depths if d <= depth))


def chain(k: int) -> TreeShape:
    """The tree of plain speculative decoding at k: one path of top-1 drafts."""
    return parse_tree(",".join("0" * i for i in range(1, k + 1)))


def q_parents(shape: TreeShape) -> List[int]:
    """The parents whose children the tree draws (-1: the root), in order of their first child: the rows of q a
    tree block carries, one per parent, since siblings are drawn from the same distribution. Those of a
    breadth-first prefix of the tree are a prefix of these."""
    seen: List[int] = []
    for parent in shape.parents:
        if parent not in seen:
            seen.append(parent)
    return seen


def node_q_rows(shape: TreeShape, rows: int) -> Optional[List[int]]:
    """Which row of a tree block's q of `rows` rows each node's tokens were drawn from: None for one row per
    node (row i, its parent's distribution), else each parent's index in `q_parents` (one row per parent).
    ValueError naming both layouts for any other count."""
    if rows == shape.size:
        return None
    parents = q_parents(shape)
    if rows != len(parents):
        raise ValueError(f"q has {rows} row(s); a tree block of {shape.size} nodes carries one per node "
                         f"({shape.size}) or one per parent ({len(parents)})")
    return [parents.index(parent) for parent in shape.parents]


def ancestor_mask(shape: TreeShape, nodes: Sequence[int], fed: Sequence[int], with_root: bool) -> Tensor:
    """Boolean [len(nodes), len(fed_all)] mask among tree tokens: row r (node nodes[r]) sees the
    fed column c when that column's node is the row's node or one of its ancestors.

    Columns: the root first when `with_root` (every node sees it), then `fed` (node indices in
    their cache order). Rows are `nodes`, which must be among `fed` or fed in the same call."""
    cols = ([-1] if with_root else []) + list(fed)
    mask = torch.zeros(len(nodes), len(cols), dtype=torch.bool)
    for r, node in enumerate(nodes):
        seen = set(shape.ancestors(node)) | {node, -1}
        for c, col in enumerate(cols):
            mask[r, c] = col in seen
    return mask


def greedy_walk(shape: TreeShape, node_tokens: Sequence[int], argmax: Sequence[int]) -> Tuple[List[int], int]:
    """Greedy acceptance over a verified tree: `argmax[0]` is the verifier's choice after the root,
    `argmax[1 + i]` after node i. Returns (accepted node path, index into argmax of the row that
    gave the next token); the next token is argmax[that row]."""
    path: List[int] = []
    row, node = 0, -1
    while True:
        want = argmax[row]
        step = next((c for c in shape.children(node) if node_tokens[c] == want), None)
        if step is None:
            return path, row
        path.append(step)
        node, row = step, 1 + step


def sibling_proposal(q: Tensor, earlier: Sequence[int]) -> Tensor:
    """q with the earlier siblings' tokens removed and renormalised: the distribution a sibling drawn
    without replacement came from (all zeros once q has no mass left)."""
    if not earlier:
        return q
    rest = q.clone()
    rest[list(earlier)] = 0
    mass = float(rest.sum())
    return rest / mass if mass > 0 else rest


def node_tests(p: Tensor, q: Optional[Tensor], children: Sequence[int], node_tokens: Sequence[int],
               distinct: bool = True) -> Iterator[Tuple[Optional[int], float, Tensor]]:
    """Recursive rejection sampling at one node: for each child in turn (child, the chance it is accepted given
    the earlier ones were not, p then), p becoming norm(max(0, p - q_i)) after each rejection; last
    (None, 1.0, the p left), from which the next token is drawn when no child was accepted. `distinct`: q_i is
    q without the earlier siblings' tokens (drawn without replacement in rank order), else q (None: no children)."""
    earlier: List[int] = []
    for child in children:
        x = int(node_tokens[child])
        q_i = sibling_proposal(q, earlier) if distinct else q
        earlier.append(x)
        if float(q_i.sum()) <= 0:  # q had fewer tokens than siblings: the rest were never drawn from it
            break
        ratio = float(p[x]) / float(q_i[x]) if float(q_i[x]) > 0 else 0.0
        yield child, min(1.0, ratio), p
        residual = (p - q_i).clamp_(min=0)
        mass = float(residual.sum())
        if mass > 0:  # with no mass left p equals q: a rejection cannot happen then (rounding aside)
            p = residual / mass
    yield None, 1.0, p


def sampled_walk(shape: TreeShape, node_tokens: Sequence[int], p_rows: Tensor, q_at: Dict[int, Tensor],
                 generator: Optional[torch.Generator] = None, distinct: bool = True) -> Tuple[List[int], int, int]:
    """Multi-step speculative sampling over a verified tree: exactly the verifier's distribution.

    `p_rows` [1 + N, V]: the verifier's warped probabilities after the root (row 0) and after node i
    (row 1 + i); `q_at[parent]` [V]: the drafter's distribution its children were drawn from. At a node,
    each child x in turn is accepted with probability min(1, p(x) / q_i(x)); on a rejection p becomes
    norm(max(0, p - q_i)) for the next child; when none is accepted (or there are none) the next token is
    drawn from the p left (`node_tests`). `distinct`: the children were drawn without replacement in rank
    order, so q_i is q without the earlier siblings' tokens (recursive rejection sampling, Jeon et al. 2024);
    otherwise i.i.d., q_i = q (SpecInfer, Miao et al. 2024, Alg. 2). Returns (accepted path, next token, row
    that gave it)."""
    path: List[int] = []
    node, row = -1, 0
    while True:
        for child, chance, p in node_tests(p_rows[row], q_at.get(node), shape.children(node), node_tokens, distinct):
            if child is None:
                token = int(torch.multinomial(p.unsqueeze(0), 1, generator=generator)[0, 0])
                return path, token, row
            if float(torch.rand((), generator=generator, device=p.device)) < chance:  # on the rows' device, the generator's
                break
        path.append(child)
        node, row = child, 1 + child
