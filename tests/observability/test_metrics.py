"""Prometheus metrics: per-instance registries, names from DESIGN.md, the /metrics endpoint."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from steerspec.observability.prometheus import SteerSpecMetrics, start_metrics_server
from steerspec.decoding.rounds import BlockStats


def _samples(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_counters_and_histograms_per_block():
    metrics = SteerSpecMetrics(service="coordinator")
    stages = dict(cycle_ms=20.0, draft_ms=5.0, network_ms=10.0, queue_ms=1.0, verify_ms=3.5, bytes_up=812, bytes_down=96)
    metrics.observe_block(BlockStats(seq=1, drafted=8, accepted=3, committed=4, **stages))
    metrics.observe_block(BlockStats(seq=2, drafted=8, accepted=8, committed=9, **stages))
    metrics.observe_generation("length")
    s = _samples(metrics.exposition().decode())
    svc = ("service", "coordinator")
    assert s[("steerspec_spec_decode_num_drafts_total", (svc,))] == 2
    assert s[("steerspec_spec_decode_num_draft_tokens_total", (svc,))] == 16
    assert s[("steerspec_spec_decode_num_accepted_tokens_total", (svc,))] == 3 + 8
    pos = "steerspec_spec_decode_num_accepted_tokens_per_pos_total"  # 0-based positions, as vLLM's
    assert s[(pos, (("position", "0"), svc))] == 2
    assert s[(pos, (("position", "3"), svc))] == 1
    assert s[(pos, (("position", "7"), svc))] == 1
    assert (pos, (("position", "8"), svc)) not in s
    assert s[("steerspec_generated_tokens_total", (svc,))] == 4 + 9
    assert s[("steerspec_round_trip_seconds_count", (svc,))] == 2
    assert abs(s[("steerspec_round_trip_seconds_sum", (svc,))] - 0.040) < 1e-12
    for stage, value in (("draft", 5.0), ("network", 10.0), ("queue", 1.0), ("verify", 3.5), ("overhead", 0.5)):
        assert abs(s[("steerspec_stage_seconds_sum", (svc, ("stage", stage)))] - 2 * value / 1e3) < 1e-12, stage
    assert s[("steerspec_block_bytes_sum", (("direction", "up"), svc))] == 2 * 812
    assert s[("steerspec_block_bytes_count", (("direction", "down"), svc))] == 2
    assert s[("steerspec_generations_total", (("finish_reason", "length"), svc))] == 1


def test_registries_are_independent():
    a, b = SteerSpecMetrics(), SteerSpecMetrics()  # no duplicate-registration error, no shared state
    a.observe_block(BlockStats(seq=1, drafted=4, accepted=1, committed=2))
    assert a.registry is not b.registry
    sa, sb = _samples(a.exposition().decode()), _samples(b.exposition().decode())
    assert sa[("steerspec_spec_decode_num_drafts_total", (("service", "coordinator"),))] == 1
    assert ("steerspec_spec_decode_num_drafts_total", (("service", "coordinator"),)) not in sb


def test_truncated_block_counts_committed_tokens():
    metrics = SteerSpecMetrics()
    metrics.observe_block(BlockStats(seq=1, drafted=8, accepted=8, committed=3))
    s = _samples(metrics.exposition().decode())
    assert s[("steerspec_generated_tokens_total", (("service", "coordinator"),))] == 3
    assert s[("steerspec_spec_decode_num_accepted_tokens_per_pos_total",
              (("position", "7"), ("service", "coordinator")))] == 1


def test_autoregressive_block_counts_no_draft():
    metrics = SteerSpecMetrics()
    metrics.observe_block(BlockStats(seq=1, drafted=0, accepted=0, committed=1, cycle_ms=2.0, verify_ms=1.5))
    s = _samples(metrics.exposition().decode())
    assert ("steerspec_spec_decode_num_drafts_total", (("service", "coordinator"),)) not in s
    assert s[("steerspec_generated_tokens_total", (("service", "coordinator"),))] == 1


def test_metrics_server_serves_registry_on_loopback():
    metrics = SteerSpecMetrics()
    metrics.observe_block(BlockStats(seq=1, drafted=8, accepted=2, committed=3, bytes_up=700))
    server, port = start_metrics_server(0, metrics.registry)
    try:
        assert port > 0
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'steerspec_spec_decode_num_drafts_total{service="coordinator"} 1.0' in body
    assert 'steerspec_spec_decode_num_accepted_tokens_per_pos_total{position="1",service="coordinator"} 1.0' in body
    assert "steerspec_block_bytes_bucket" in body


def test_genai_server_histograms_in_seconds():
    metrics = SteerSpecMetrics()
    metrics.observe_request("chat", "m", 0.05, 0.01, 0.5)
    metrics.observe_request("text_completion", "m", None, None, 0.2, "deadline_exceeded")
    s = _samples(metrics.exposition().decode())
    chat = (("gen_ai_operation_name", "chat"), ("gen_ai_request_model", "m"), ("service", "coordinator"))
    assert s[("gen_ai_server_time_to_first_token_seconds_sum", chat)] == 0.05
    assert s[("gen_ai_server_time_per_output_token_seconds_count", chat)] == 1
    failed = (("error_type", "deadline_exceeded"), ("gen_ai_operation_name", "text_completion"),
              ("gen_ai_request_model", "m"), ("service", "coordinator"))
    assert s[("gen_ai_server_request_duration_seconds_count", failed)] == 1
    assert ("gen_ai_server_time_to_first_token_seconds_count", failed[1:]) not in s
