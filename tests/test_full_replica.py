"""A full verifier replica (RESOURCE_EXHAUSTED) gets no new session: it goes to another replica.

Reproduction (before, issue 15 item 1/6): 64 idle VerifyOpen streams filled one replica and every
generation placed there then failed with RESOURCE_EXHAUSTED although a second replica was idle.
"""

from __future__ import annotations

import grpc
import pytest

from coord_helpers import greedy_reference
from coordinator.local import LocalCluster
from service_helpers import open_verifier
from steerspec.v1 import verifier_pb2_grpc
from verifier_service.capacity import default_cache_mb

pytestmark = pytest.mark.timeout(120)
PROMPT = [5, 17, 42, 9]


async def test_full_replica_fails_over(tiny_pair):
    want = greedy_reference(tiny_pair[0], PROMPT, 10)
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=(), verifiers=2,
                            verifier_options={"max_sessions": 1}) as cluster:
        full = cluster.verifier_targets[0]
        async with grpc.aio.insecure_channel(full) as channel:
            squatter, opened = await open_verifier(verifier_pb2_grpc.VerifierServiceStub(channel), [1, 2, 3],
                                                   session_id="squatter")
            assert opened.WhichOneof("kind") != "error", opened
            results = [await cluster.generate(PROMPT, max_new_tokens=10, k=4) for _ in range(4)]
            squatter.cancel()
    assert all(r.token_ids == want for r in results)


def test_default_cache_budget_is_bounded():
    """--max-cache-mb defaults to a share of the device's memory, never 'no limit'."""
    mb = default_cache_mb("cpu")
    assert 64.0 <= mb < float("inf")
