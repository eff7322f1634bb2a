"""Per-identity session quotas (issue 15, "per-identity session quotas"): with
--max-sessions-per-identity 1 an identity's second concurrent generation gets RESOURCE_EXHAUSTED
while another identity's runs; once the first ends the identity may start again.

Reproduction (before): the coordinator had no such limit, so one token could open as many sessions
as it liked (64 idle streams filled a replica for everyone)."""

from __future__ import annotations

import grpc
import pytest

from coordinator.client import Client
from coordinator.local import LocalCluster
from steerspec.serving import security
from steerspec.serving.linkemu import LinkModel
from steerspec.observability import service_metrics

pytestmark = pytest.mark.timeout(120)
PROMPT = [5, 17, 42, 9]
ALICE, BOB = "alice-token-0123", "bob-token-4567"


@pytest.fixture(autouse=True)
def _reset():
    security.reset()
    metrics = service_metrics.CallMetrics("coordinator")
    service_metrics.install(metrics)
    yield metrics
    service_metrics.install(None)
    security.reset()


async def test_second_session_of_an_identity_is_refused(tiny_pair, _reset):
    security.configure(server=security.ServerSecurity(tokens=frozenset({ALICE, BOB, "service-token"})),
                       client=security.ClientSecurity(token="service-token"))
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=(), link=LinkModel(rtt_ms=20),
                            coordinator_options={"max_sessions_per_identity": 1}) as cluster:
        async with Client(cluster.target, token=ALICE, retries=0) as alice, \
                Client(cluster.target, token=BOB, retries=0) as bob:
            running = alice.agenerate(prompt_ids=PROMPT, max_new_tokens=30, k=2)
            await running.__anext__()  # Alice's first session is live
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await alice.acomplete(prompt_ids=PROMPT, max_new_tokens=4)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-sessions-per-identity 1" in refused.value.details()
            assert len((await bob.acomplete(prompt_ids=PROMPT, max_new_tokens=4)).token_ids) == 4  # Bob's own quota
            async for _ in running:  # Alice's first session ends ...
                pass
            assert len((await alice.acomplete(prompt_ids=PROMPT, max_new_tokens=4)).token_ids) == 4  # ... she may again
    assert _reset.registry.get_sample_value("steerspec_quota_refusals_total", {"service": "coordinator"}) == 1


def test_cli_refuses_a_negative_quota():
    from steerspec.cli import main

    assert main(["serve", "coordinator", "--max-sessions-per-identity", "-1", "--verifier", "127.0.0.1:1"]) == 2
