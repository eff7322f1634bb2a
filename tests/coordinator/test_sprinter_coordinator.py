"""SPRINTER is lossy, so a coordinator refuses it unless started with --allow-lossy (and keeps serving)."""

from __future__ import annotations

import grpc
import pytest

from coordinator.client import _request
from coordinator.server import Coordinator, serve
from steerspec.v1 import coordinator_pb2, coordinator_pb2_grpc

PROMPT = [5, 6, 7]


async def _status(target: str, **kwargs) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(coordinator_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=4,
                                                                         **kwargs), timeout=20):
                pass
        return info.value


@pytest.mark.parametrize("allow_lossy", [False, True])
async def test_coordinator_refuses_lossy_unless_allowed(allow_lossy):
    coordinator = Coordinator(allow_lossy=allow_lossy)  # no replicas: exact requests end UNAVAILABLE
    running = await serve(coordinator, port=0)
    try:
        err = await _status(running.target, verification="sprinter:threshold=0.5")
        if allow_lossy:  # admitted: it gets past verification to placement, like an exact request
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "no live verifier" in err.details()
        else:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--allow-lossy" in err.details() and "lossy" in err.details()
        bad = await _status(running.target, verification="sprinter:threshold=1.5")
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "threshold" in bad.details()
        # still serving: the default (exact) request gets past verification to placement
        exact = await _status(running.target)
        assert exact.code() == grpc.StatusCode.UNAVAILABLE and "no live verifier" in exact.details()
        explicit = await _status(running.target, verification="exact")
        assert explicit.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(0)
        await coordinator.stop()


def test_sdk_checks_the_spec_before_calling():
    common = dict(max_new_tokens=4, temperature=0.0, top_k=0, top_p=1.0, seed=0, k=4, draft_top_k=64,
                  mode="speculative", policy="fixed", steering=False, session_id="s")
    assert _request(None, PROMPT, **common).verification == "exact"
    assert _request(None, PROMPT, verification="sprinter:max_run=4", **common).verification == "sprinter:max_run=4"
    with pytest.raises(ValueError, match="max_run"):
        _request(None, PROMPT, verification="sprinter:max_run=0", **common)
