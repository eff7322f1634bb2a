"""The verifier reports its load with every result (VerifyResult.pass_rows, blocks_waiting, cost_fixed_ms,
cost_per_row_ms): the rows of the pass that verified the block and its measured pass cost against rows."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch
from service_helpers import make_tiny_llama, open_verifier, verify

from steerspec.models import load_model
from steerspec.v1 import verifier_pb2_grpc
from verifier_service.pass_costs import PassCosts
from verifier_service.server import VerifierConfig, serve

pytestmark = [pytest.mark.timeout(120)]


def test_pass_costs_fit_the_line_of_the_passes():
    costs = PassCosts(beta=0.05)
    assert costs.line() == (0.0, 0.0)
    rng = random.Random(0)
    for _ in range(400):
        rows = rng.randint(1, 40)
        costs.add(rows, 41.6 + 4.25 * rows + rng.uniform(-1.0, 1.0))
    fixed, per_row = costs.line()
    assert fixed == pytest.approx(41.6, abs=1.5) and per_row == pytest.approx(4.25, abs=0.1)
    flat = PassCosts()
    for _ in range(10):
        flat.add(6, 30.0)  # one row count only: no slope, the whole cost fixed
    assert flat.line() == pytest.approx((30.0, 0.0))


async def test_every_result_carries_the_passes_rows_and_cost_line(tmp_path):
    torch.set_num_threads(1)
    model = load_model(str(make_tiny_llama(tmp_path / "verifier", seed=0)))
    running, _ = await serve(model, VerifierConfig(batch_window_ms=5.0))
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
    assert last.cost_fixed_ms > 0 and last.cost_per_row_ms >= 0
    assert all(r.blocks_waiting >= 0 for r in results)
