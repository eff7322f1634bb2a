"""Metrics on every server (calls by method and final code, active calls, replica sessions and cache
bytes, resumes) and logs with timestamps and levels.

Reproduction (before, issue 15 item 6): the verifier and drafter exposed no metrics, the
coordinator had no active-session gauge and no failure or resume counters, and logs carried no
timestamps or levels.
"""

from __future__ import annotations

import io
import json
import logging
import re

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.client import Client
from coordinator.local import LocalCluster
from steerspec.serving import logs
from steerspec.observability import service_metrics

pytestmark = pytest.mark.timeout(120)
PROMPT = [5, 17, 42, 9]


def _samples(registry):
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_calls_counted_by_method_and_code(tiny_pair):
    metrics = service_metrics.CallMetrics("test")
    service_metrics.install(metrics)
    try:
        async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=()) as cluster:
            async with Client(cluster.target, retries=0) as client:
                await client.acomplete(prompt_ids=PROMPT, max_new_tokens=6, k=4)
                with pytest.raises(grpc.aio.AioRpcError):
                    await client.acomplete(prompt_ids=PROMPT, max_new_tokens=6, k=99)
    finally:
        service_metrics.install(None)
    samples = _samples(metrics.registry)

    def calls(method, code):
        return samples.get(("steerspec_calls_total", (("code", code), ("method", method), ("service", "test"))), 0)

    assert calls("Generate", "OK") == 1 and calls("Generate", "INVALID_ARGUMENT") == 1
    assert calls("Verify", "OK") >= 1 and calls("Draft", "OK") >= 1
    assert samples[("steerspec_calls_active", (("method", "Generate"), ("service", "test")))] == 0
    assert samples[("steerspec_call_duration_seconds_count", (("method", "Generate"), ("service", "test")))] == 2


def test_log_lines_have_timestamp_and_level():
    text, as_json = io.StringIO(), io.StringIO()
    log = logging.getLogger("steerspec.test")
    logs.setup("INFO", "text", stream=text)
    log.warning("session %s: lost verifier", "abc")
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING steerspec.test: session abc: lost verifier$",
                    text.getvalue().strip())
    logs.setup("INFO", "json", stream=as_json)
    log.info("opened", extra={"session_id": "abc"})
    log.debug("not shown")
    body = json.loads(as_json.getvalue().strip())
    assert body["level"] == "INFO" and body["session_id"] == "abc" and body["ts"].endswith("Z")
    logging.getLogger().handlers[:] = [h for h in logging.getLogger().handlers if not getattr(h, "_steerspec", 0)]


@pytest.mark.slow
def test_serve_verifier_metrics_port(tiny_pair):
    """`steerspec serve verifier --metrics-port 0`: /metrics with sessions, cache bytes and call counters."""
    import urllib.request
    from pathlib import Path

    from coord_helpers import kill, spawn_service, wait_ready

    proc, log = spawn_service("verifier", tiny_pair[0], "--metrics-port", "0", "--log-format", "json")
    try:
        wait_ready(proc, log)
        url = re.search(r"metrics on (http://\S+)", Path(log).read_text()).group(1)
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        kill(proc)
    assert 'steerspec_sessions_active{service="verifier"} 0.0' in text
    assert "steerspec_cache_bytes" in text and "steerspec_calls_active" in text
