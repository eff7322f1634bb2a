"""Block shapes through the real services: a tree session whose policy drafts chains, grown trees and blocks of no
drafts (not breadth-first prefixes of its tree) sends each shape as DraftBlock.parents; the verifier scores that shape, the
coordinator commits along it, the drafter's policy learns from it. Greedy output is the verifier's; the policy's
state (and so the shape it picks next) carries through a drafter failover. Tiny pair: cheap."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import grpc
import pytest

from coordinator.client import Chunk
from coordinator.local import LocalCluster
from steerspec.blocks.tree_kind import block_shape
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
from steerspec.decoding.trees import parse_tree
from steerspec.models import load_model
from steerspec.policies.base import BlockFeedback
from steerspec.policies.load import LoadAware
from steerspec.policies.catalog import REGISTERED
from steerspec.policies.registry import Key, register
from steerspec.serving.linkemu import LinkModel
from steerspec.serving.wire import ProtocolError

def chain(k: int):
    return tuple((0,) * i for i in range(1, k + 1))


PROMPTS = [[5, 17, 42, 9], [88, 23, 7]]
NEW_TOKENS = 23
CYCLE = [chain(3), chain(1), ((0,), (1,), (0, 0), (0, 1)), (), parse_tree("default").paths[:4]]
SEEN: List[BlockFeedback] = []
LOADED: List[Dict[str, Any]] = []


class ShapeCycle(LoadAware):
    """The load-aware policy with its choice replaced by a cycle of shapes none of which (but one) is a prefix of the
    default tree, indexed by the blocks it has seen (its state: a fresh policy after a failover restarts the cycle)."""

    name = "test_shapes"

    def next_shape(self, tree: Sequence[Sequence[int]]):
        self.last_shape = CYCLE[self.seen % len(CYCLE)]
        return self.last_shape

    def update(self, feedback: BlockFeedback) -> None:
        SEEN.append(feedback)
        super().update(feedback)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        LOADED.append(dict(state))
        super().load_state_dict(state)


@pytest.fixture(autouse=True)
def shape_cycle():
    """`test_shapes` registered for this module's tests only (a policy that sizes trees is named in refusals)."""
    register("test_shapes", {"max": Key(int, 5, "most nodes")}, doc="test: cycles chains, grown trees and no drafts",
             length_keys=("max",), trees=True)(ShapeCycle)
    yield
    REGISTERED.pop("test_shapes", None)


def test_the_verifier_reads_a_blocks_shape_from_its_parents():
    tree = parse_tree("default")
    assert block_shape(tree, 3, 1).paths == tree.paths[:3]
    assert block_shape(tree, 3, 1, [-1, 0, 1]).paths == chain(3)
    for parents, code in (([-1, 0], grpc.StatusCode.INVALID_ARGUMENT), ([-1, 0, -1], grpc.StatusCode.INVALID_ARGUMENT),
                          ([-1] * 6, grpc.StatusCode.OUT_OF_RANGE)):
        with pytest.raises(ProtocolError) as err:
            block_shape(tree, 6 if len(parents) == 6 else 3, 1, parents)
        assert err.value.code == code


async def test_shapes_travel_through_the_services_and_greedy_is_the_verifiers(tiny_pair):
    verifier_dir, drafter_dir = tiny_pair
    verifier = load_model(verifier_dir)
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    SEEN.clear()
    async with LocalCluster(str(verifier_dir), str(drafter_dir), eos_ids=()) as cluster:
        for ids in PROMPTS:
            for ahead in ("", "on"):
                got = await cluster.generate(ids, max_new_tokens=NEW_TOKENS, tree="default", policy="test_shapes",
                                             draft_ahead=ahead)
                assert list(got.token_ids) == autoregressive_generate(verifier, ids, config).token_ids
    seen = {f.shape for f in SEEN}
    assert {chain(3), chain(1), CYCLE[2]} <= seen, seen  # drafted as chosen (none cut: far from budget)
    for f in SEEN:  # each verdict's path is a root-down path of the block's own shape
        assert len(f.path) == f.accepted and all(f.shape[n][:-1] == (f.shape[m] if m >= 0 else ())
                                                 for m, n in zip((-1,) + f.path[:-1], f.path))


async def test_the_policy_and_its_shapes_carry_through_a_drafter_failover(tiny_pair):
    verifier_dir, drafter_dir = tiny_pair
    LOADED.clear()
    SEEN.clear()
    async with LocalCluster(str(verifier_dir), str(drafter_dir), drafters=2, eos_ids=(),
                            link=LinkModel(rtt_ms=4)) as c:
        by_target = dict(zip(c.drafter_targets, c.drafter_servers))
        streamed, summary, chunks = [], None, 0
        async with c.client(retries=0) as client:
            async for item in client.agenerate(prompt_ids=PROMPTS[0], max_new_tokens=40, tree="default",
                                               policy="test_shapes", timeout=60, session_id="shapes-fo"):
                if isinstance(item, Chunk):
                    streamed.extend(item.token_ids)
                    chunks += 1
                    if chunks == 4:
                        placement = (await c.coordinator.store.get_session("shapes-fo")).placement
                        await by_target[placement["drafter"]].stop(grace=0)
                else:
                    summary = item
    verifier = load_model(verifier_dir)
    assert summary is not None and summary.resumes == 1
    assert streamed == autoregressive_generate(verifier, PROMPTS[0], DecodeConfig(max_new_tokens=40)).token_ids
    assert len(LOADED) == 1 and LOADED[0]["seen"] >= 2 and LOADED[0]["include"], LOADED  # resumed with its estimates
