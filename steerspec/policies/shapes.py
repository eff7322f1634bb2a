"""Block shapes a load-aware choice ranges over, as rank paths (pure: no models): chains, a draft tree's
breadth-first prefixes and trees grown greedily from per-node acceptance, with the tokens each is expected to commit.

A node is its rank path from the pending token ("0" the drafter's top-1, "00" the top-1 after it, "1" the second
choice at the root), the same in every shape, so one estimate of a node's acceptance given its parent's (`acc`)
prices chains and trees alike: a node is on the accepted path with the product of its own and its ancestors'
conditional acceptances, and a block commits 1 + the sum of those over its nodes on average. Shapes are tuples of
paths breadth-first (by depth, then parent, then rank), the order of `decoding.trees.TreeShape.paths`.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

Path = Tuple[int, ...]
Shape = Tuple[Path, ...]
Acceptance = Callable[[Path], float]  # a node's chance to be accepted when its parent was


def ordered(paths: Sequence[Sequence[int]]) -> Shape:
    """The paths breadth-first, each once."""
    return tuple(sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p)))


def chain(k: int) -> Shape:
    """Plain speculative decoding's k drafts: "0", "00", ..."""
    return tuple((0,) * i for i in range(1, max(int(k), 0) + 1))


def depth(shape: Shape) -> int:
    """Drafter passes the shape takes: its deepest node's depth (0 for no drafts)."""
    return max((len(p) for p in shape), default=0)


def key(path: Sequence[int]) -> str:
    """A node's name in a policy's state: its ranks as digits."""
    return "".join(str(int(r)) for r in path)


def inclusion(shape: Shape, acc: Acceptance) -> List[float]:
    """Each node's chance to end on the accepted path: its and its ancestors' conditional acceptances."""
    on: Dict[Path, float] = {(): 1.0}
    out = []
    for path in shape:
        on[path] = on.get(path[:-1], 0.0) * acc(path)
        out.append(on[path])
    return out


def expected_tokens(shape: Shape, acc: Acceptance) -> float:
    """Tokens a block of this shape commits on average: its accepted nodes and the verifier's one."""
    return 1.0 + sum(inclusion(shape, acc))


def grown(acc: Acceptance, nodes: int, max_rank: int) -> List[Shape]:
    """The trees of 1..nodes nodes grown one node at a time, each time the likeliest node to be accepted whose parent
    and elder sibling are in (the best tree of each size when deeper and later nodes are less likely)."""
    chosen: Dict[Path, float] = {(): 1.0}
    out: List[Shape] = []
    for _ in range(max(int(nodes), 0)):
        frontier = []
        for path, p in chosen.items():
            if path + (0,) not in chosen:
                frontier.append((p * acc(path + (0,)), path + (0,)))
            if path and path[-1] < max_rank and path[:-1] + (path[-1] + 1,) not in chosen:
                sibling = path[:-1] + (path[-1] + 1,)
                frontier.append((chosen[path[:-1]] * acc(sibling), sibling))
        likely, node = max(frontier, key=lambda f: (f[0], -len(f[1]), [-r for r in f[1]]))
        chosen[node] = likely
        out.append(ordered([p for p in chosen if p]))
    return out


def candidates(tree: Shape, nodes: int, acc: Acceptance) -> List[Shape]:
    """The shapes to choose among, each once: no drafts, the chains of 1..nodes, `tree`'s breadth-first prefixes of
    up to `nodes` nodes and the grown trees of up to `nodes` nodes (ranks no higher than `tree`'s)."""
    max_rank = max((p[-1] for p in tree), default=0)
    shapes = [()] + [chain(k) for k in range(1, nodes + 1)]
    shapes += [tuple(tree[:n]) for n in range(1, min(nodes, len(tree)) + 1)]
    shapes += grown(acc, nodes, max_rank)
    seen, out = set(), []
    for shape in shapes:
        if shape not in seen:
            seen.add(shape)
            out.append(shape)
    return out
