"""The verifier reports its load with every result (VerifyResult.pass_rows, blocks_waiting, cost_fixed_ms,
cost_per_block_ms, cost_per_row_ms, cost_row_bucket, cost_block_rows): the rows of the pass that verified the block
and its measured pass cost against blocks and rows, in the units of its kernel path."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch
from service_helpers import make_tiny_llama, open_verifier, verify

from steerspec.models import load_model
from steerspec.models.invariant_pass import InvariantPlan, set_invariant
from steerspec.models.pass_shape import PassShape, pass_shape
from steerspec.v1 import verifier_pb2_grpc
from verifier_service.pass_costs import Anchor, PassCosts
from verifier_service.server import VerifierConfig, serve

pytestmark = [pytest.mark.timeout(120)]


def test_pass_costs_fit_blocks_and_rows():
    costs = PassCosts(beta=0.05)
    assert costs.line() == (0.0, 0.0, 0.0, 0.0)
    rng = random.Random(0)
    for _ in range(400):
        blocks = rng.randint(1, 8)
        rows = blocks * rng.randint(1, 6)
        costs.add([rows // blocks] * blocks, 41.6 + 6.0 * blocks + 1.25 * rows + rng.uniform(-1.0, 1.0))
    fixed, per_block, per_row, _ = costs.line()
    assert fixed == pytest.approx(41.6, abs=1.5) and per_block == pytest.approx(6.0, abs=0.4)
    assert per_row == pytest.approx(1.25, abs=0.1)
    flat = PassCosts()
    for _ in range(10):
        flat.add([6], 30.0)  # one shape only: no slope, the whole cost fixed
    assert flat.line() == pytest.approx((30.0, 0.0, 0.0, 0.0), abs=1e-3)


def test_anchor_passes_split_what_same_sized_blocks_cannot():
    """Sessions all sending blocks of 5 rows make rows = 5 x blocks: the served passes fix only the cost of such a
    block; the anchors (other shapes, timed at start) say how much of it is the block's own and how much its rows."""
    def cost(blocks: int, rows: int) -> float:
        return 40.0 + 6.0 * blocks + 1.0 * rows

    anchors = [(b, b * r, cost(b, b * r)) for b, r in ((1, 1), (1, 8), (4, 1), (4, 8))]
    costs = PassCosts(beta=0.05, anchors=anchors)
    for i in range(200):
        blocks = 1 + i % 8
        costs.add([5] * blocks, cost(blocks, 5 * blocks) + 8.0)  # the served contexts are longer: dearer
    fixed, per_block, per_row, _ = costs.line()
    assert fixed + 8 * per_block + 40 * per_row == pytest.approx(cost(8, 40) + 8.0, rel=0.03)  # what was served
    assert per_block == pytest.approx(6.0, abs=1.0) and per_row == pytest.approx(1.0, abs=0.3)  # the anchors' split
    blind = PassCosts(beta=0.05)
    for i in range(200):
        blocks = 1 + i % 8
        blind.add([5] * blocks, cost(blocks, 5 * blocks))
    assert blind.line()[2] * 8 > 2.0  # without anchors the split is arbitrary (here: onto the rows)


def test_a_bucketed_kernel_path_is_fitted_in_its_own_units():
    """On the batch-invariant path a pass's rows run in products of 16 and a block's attention in one product per 16/3
    rows (SmolLM2's 3 query heads per key head): the cost is a staircase. Fitted in those units the line prices 4
    blocks of 4 rows (16: one product) apart from 4 blocks of 5 (20: two); a line in plain rows would not."""
    shape = PassShape(row_bucket=16, block_rows=16 / 3)
    assert shape.units([4] * 4) == (4.0, 16.0, 0.0) and shape.units([5] * 4) == (4.0, 32.0, 0.0)
    assert shape.units([6])[:2] == (2.0, 16.0) and shape.units([16])[:2] == (3.0, 16.0)
    assert shape.units([1])[:2] == (1.0, 16.0)
    assert PassShape().units([3, 5], [True, False]) == (2.0, 8.0, 3.0)  # the ordinary path: blocks, rows, tree rows

    def cost(block_rows):
        units, rows, _ = shape.units(block_rows)
        return 40.0 + 6.0 * units + 1.5 * rows

    rng = random.Random(0)
    bucketed, plain = PassCosts(beta=0.05, shape=shape), PassCosts(beta=0.05)
    for _ in range(300):
        blocks = [rng.randint(1, 6) for _ in range(rng.randint(1, 8))]
        ms = cost(blocks) + rng.uniform(-0.5, 0.5)
        bucketed.add(blocks, ms)
        plain.add(blocks, ms)
    assert bucketed.line() == pytest.approx((40.0, 6.0, 1.5, 0.0), abs=0.5)

    def priced(costs, block_rows):
        fixed, per_block, per_row, _ = costs.line()
        units, rows, _ = costs.shape.units(block_rows)
        return fixed + per_block * units + per_row * rows

    step = cost([5] * 4) - cost([4] * 4)  # 24 ms: a second product for every linear layer
    assert priced(bucketed, [5] * 4) - priced(bucketed, [4] * 4) == pytest.approx(step, abs=1.0)
    assert priced(plain, [5] * 4) - priced(plain, [4] * 4) < step / 2  # a line through the stairs


def test_a_branching_trees_rows_are_priced_apart_from_a_chains():
    """A branching tree's queries gather their own keys: its rows cost more than a chain's of as many. Served passes of
    chains only leave that term to the anchors (one of them a branching tree); served trees then set it."""
    def cost(block_rows, branched):
        gathered = sum(r for r, tree in zip(block_rows, branched) if tree)
        return 40.0 + 6.0 * len(block_rows) + 1.0 * sum(block_rows) + 1.5 * gathered

    anchors = [Anchor(b, b * r, cost([r] * b, [t] * b), t) for b, r, t in
               ((1, 1, False), (1, 8, False), (4, 1, False), (4, 8, False), (4, 8, True))]
    costs, rng = PassCosts(beta=0.05, anchors=anchors), random.Random(1)
    for _ in range(100):
        blocks = [rng.randint(1, 6) for _ in range(rng.randint(1, 8))]
        costs.add(blocks, cost(blocks, [False] * len(blocks)), [False] * len(blocks))
    assert costs.line() == pytest.approx((40.0, 6.0, 1.0, 1.5), abs=0.3)  # the tree term from the anchor
    for _ in range(200):
        blocks = [rng.randint(2, 6) for _ in range(rng.randint(1, 8))]
        trees = [rng.random() < 0.5 for _ in blocks]
        costs.add(blocks, cost(blocks, trees) + 2.0 * sum(r for r, t in zip(blocks, trees) if t), trees)
    assert costs.line()[3] > 2.5  # served trees cost more than the anchor said (3.5 against 1.5): they move it


def test_the_verifier_names_its_kernel_paths_units(tmp_path):
    model = load_model(str(make_tiny_llama(tmp_path / "verifier", seed=0)))
    assert pass_shape(model) == PassShape()  # ordinary passes: plain counts
    set_invariant(model, InvariantPlan(rows=8))
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    assert pass_shape(model) == PassShape(row_bucket=8, block_rows=16 / group)


def test_the_verifier_times_its_anchor_passes_on_itself(tmp_path):
    from verifier_service.cost_probe import SHAPES, anchor_passes

    torch.set_num_threads(1)
    model = load_model(str(make_tiny_llama(tmp_path / "verifier", seed=0)))
    anchors = anchor_passes(model)
    assert [(a.blocks, a.rows, a.branched) for a in anchors] == [(b, b * r, t) for b, r, t in SHAPES]
    assert all(a.ms > 0 for a in anchors) and any(a.branched for a in anchors)
    assert anchor_passes(model) == anchors  # timed once per model, plan and thread count
    again = load_model(str(make_tiny_llama(tmp_path / "again" / "verifier", seed=1)))
    assert anchor_passes(again) == anchors  # another load of the same shape: timed once per process


async def test_every_result_carries_the_passes_rows_and_cost_line(tmp_path):
    torch.set_num_threads(1)
    model = load_model(str(make_tiny_llama(tmp_path / "verifier", seed=0)))
    set_invariant(model, InvariantPlan(rows=8))  # a bucketed kernel path: its cost is reported in its units
    # a window wide enough that the four sessions share passes on a loaded machine
    running, _ = await serve(model, VerifierConfig(batch_window_ms=20.0))
    channel = grpc.aio.insecure_channel(running.target)
    stub = verifier_pb2_grpc.VerifierServiceStub(channel)

    async def session(i: int):
        rng = random.Random(i)
        prompt = [5 + i, 6, 7]
        call, ready = await open_verifier(stub, prompt, max_k=6)
        assert ready.WhichOneof("kind") == "ready"
        committed, seen = len(prompt), []
        for seq in range(1, 9):
            drafts = [rng.randrange(97) for _ in range(rng.randint(0, 6))]
            result = (await verify(call, seq, committed, drafts)).result
            committed = result.committed_length
            assert result.pass_rows >= len(drafts) + 1 and result.pass_rows >= result.batch_size
            seen.append(result)
        await call.done_writing()
        return seen

    try:
        runs = await asyncio.gather(*[session(i) for i in range(4)])
    finally:
        await channel.close()
        await running.stop(0.5)
    results = [r for run in runs for r in run]
    assert any(r.batch_size > 1 and r.pass_rows > max(7, r.batch_size) for r in results)  # shared passes counted
    last = results[-1]
    terms = (last.cost_fixed_ms, last.cost_per_block_ms, last.cost_per_row_ms)
    assert min(terms) >= 0 and max(terms) > 0  # a line is reported (its intercept may be 0 when passes were noisy)
    assert (last.cost_row_bucket, last.cost_block_rows) == tuple(pass_shape(model))  # the units it was fitted in
    assert last.cost_row_bucket == 8  # the batch-invariant path's row bucket
    assert all(r.blocks_waiting >= 0 for r in results)
