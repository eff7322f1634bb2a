"""Tracing: JSONL export, gRPC context propagation across streams, block spans, `trace summarize`."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import grpc
import pytest

from steerspec.errors import UsageError
from steerspec.decoding.rounds import overhead_ms
from steerspec.observability.tracing import (BLOCK_SPAN, GENERATION_SPAN, block_attributes, block_span,
    flush_tracing, generation_span, get_tracer, instrument_grpc, record_span, setup_tracing, shutdown_tracing,
    span_context, now_ns, uninstrument_grpc)
from steerspec.observability import trace_summary as summarize
from steerspec.v1 import common_pb2 as cpb
from steerspec.v1 import drafter_pb2 as dpb
from steerspec.v1 import drafter_pb2_grpc as dgrpc
from steerspec.v1 import verifier_pb2 as vpb
from steerspec.v1 import verifier_pb2_grpc as vgrpc

VERIFY = "/steerspec.v1.VerifierService/Verify"
DRAFT = "/steerspec.v1.DrafterService/Draft"


@pytest.fixture
def traced(tmp_path):
    """Tracing to a fresh JSONL file with gRPC instrumented; undone afterwards."""
    path = tmp_path / "trace.jsonl"
    setup_tracing("steerspec-test", trace_file=str(path))
    instrument_grpc()
    try:
        yield path
    finally:
        flush_tracing()
        shutdown_tracing()
        uninstrument_grpc()


def read_spans(path: Path) -> list[dict]:
    flush_tracing()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_one_tree(spans: list[dict]) -> dict:
    """All spans share one trace id, every parent exists, exactly one root; returns id -> span."""
    assert len({s["trace_id"] for s in spans}) == 1, Counter(s["trace_id"] for s in spans)
    by_id = {s["span_id"]: s for s in spans}
    roots = [s for s in spans if s["parent_id"] is None]
    assert len(roots) == 1, [s["name"] for s in roots]
    for s in spans:
        if s["parent_id"] is not None:
            assert s["parent_id"] in by_id, f"{s['name']} has a dangling parent"
    return by_id


class FakeVerifier(vgrpc.VerifierServiceServicer):
    """Async-generator style handler that records queue/forward spans per block like the real one."""

    async def Verify(self, request_iterator, context):
        tracer = get_tracer("fake.verifier")
        session = span_context()
        async for request in request_iterator:
            if request.WhichOneof("kind") == "open":
                yield vpb.VerifyResponse(ready=vpb.VerifyReady(session_id=request.open.session_id))
                continue
            t0 = now_ns()
            record_span(tracer, "steerspec.verifier.queue", t0, t0 + 1000, parent=session, block=request.block.seq)
            record_span(tracer, "steerspec.verifier.forward", t0 + 1000, now_ns(), parent=session,
                        block=request.block.seq, batch_size=1)
            yield vpb.VerifyResponse(result=cpb.VerifyResult(seq=request.block.seq, accepted=1, queue_ms=0.001))


class FakeDrafter(dgrpc.DrafterServiceServicer):
    """Read/write (coroutine) style handler: the instrumentation must support it too."""

    async def Draft(self, request_iterator, context):
        tracer = get_tracer("fake.drafter")
        seq = 0
        while True:
            request = await context.read()
            if request is grpc.aio.EOF or request.WhichOneof("kind") == "close":
                break
            with tracer.start_as_current_span("steerspec.drafter.draft"):
                seq += 1
            await context.write(dpb.DraftResponse(block=cpb.DraftBlock(seq=seq, draft_ids=[1, 2, 3])))


async def _fake_generation(blocks: int = 3) -> None:
    server = grpc.aio.server()
    vgrpc.add_VerifierServiceServicer_to_server(FakeVerifier(), server)
    dgrpc.add_DrafterServiceServicer_to_server(FakeDrafter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tracer = get_tracer("fake.coordinator")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with generation_span(tracer, session_id="s1", k=3):
                verify = vgrpc.VerifierServiceStub(channel).Verify()
                draft = dgrpc.DrafterServiceStub(channel).Draft()
                await verify.write(vpb.VerifyRequest(open=vpb.VerifyOpen(session_id="s1")))
                await verify.read()
                await draft.write(dpb.DraftRequest(open=dpb.DraftOpen(session_id="s1", k=3)))
                for seq in range(1, blocks + 1):
                    with block_span(tracer, seq, k=3) as span:
                        block = (await draft.read()).block
                        await verify.write(vpb.VerifyRequest(block=block))
                        result = (await verify.read()).result
                        if seq < blocks:
                            await draft.write(dpb.DraftRequest(feedback=dpb.DraftFeedback(result=result, want_block=True)))
                        span.set_attributes(block_attributes(accepted=result.accepted, bytes_up=block.ByteSize(),
                                                             bytes_down=result.ByteSize()))
                        stages = dict(draft_ms=0.5, network_ms=1.0, queue_ms=0.1, verify_ms=0.2 * seq)
                        span.set_attributes(block_attributes(rtt_ms=2.0 + seq, **stages,
                                                             overhead_ms=overhead_ms(2.0 + seq, **stages)))
                await draft.write(dpb.DraftRequest(close=dpb.DraftClose(reason="done")))
                await verify.done_writing()
                await draft.done_writing()
                assert await verify.read() is grpc.aio.EOF  # read to the end so the client spans end
                assert await draft.read() is grpc.aio.EOF
    finally:
        await server.stop(0)


def test_grpc_streams_link_into_one_trace(traced):
    asyncio.run(_fake_generation(blocks=3))
    spans = read_spans(traced)
    by_id = check_one_tree(spans)
    names = Counter(s["name"] for s in spans)
    assert names[GENERATION_SPAN] == 1 and names[BLOCK_SPAN] == 3
    assert names["steerspec.verifier.queue"] == 3 and names["steerspec.verifier.forward"] == 3
    assert names["steerspec.drafter.draft"] == 3
    for method in (VERIFY, DRAFT):
        client = [s for s in spans if s["name"] == method and s["kind"] == "CLIENT"]
        server = [s for s in spans if s["name"] == method and s["kind"] == "SERVER"]
        assert len(client) == 1 and len(server) == 1, method
        assert by_id[client[0]["parent_id"]]["name"] == GENERATION_SPAN
        assert server[0]["parent_id"] == client[0]["span_id"] and server[0]["parent_remote"]
    server_verify = next(s for s in spans if s["name"] == VERIFY and s["kind"] == "SERVER")
    for s in spans:
        if s["name"].startswith("steerspec.verifier."):
            assert s["parent_id"] == server_verify["span_id"]
            assert s["end_ns"] >= s["start_ns"]
    block = next(s for s in spans if s["name"] == BLOCK_SPAN and s["attributes"]["steerspec.block"] == 2)
    attrs = block["attributes"]
    assert attrs["steerspec.k"] == 3 and attrs["steerspec.accepted"] == 1
    assert attrs["steerspec.bytes_up"] > 0 and attrs["steerspec.bytes_down"] > 0
    assert attrs["steerspec.rtt_ms"] == 4.0
    assert abs(attrs["steerspec.overhead_ms"] - (4.0 - 0.5 - 1.0 - 0.1 - 0.4)) < 1e-9
    assert all(s["service"] == "steerspec-test" for s in spans)


def test_summarize_reports_stage_percentiles(traced, capsys):
    asyncio.run(_fake_generation(blocks=3))
    flush_tracing()
    parser = __import__("argparse").ArgumentParser()
    summarize.add_arguments(parser)
    assert summarize.run(parser.parse_args([str(traced), "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["blocks"] == 3 and data["traces"] == 1
    assert data["stages"]["rtt"]["median_ms"] == 4.0
    assert abs(data["stages"]["rtt"]["p90_ms"] - 4.8) < 1e-9
    assert abs(data["stages"]["verify"]["median_ms"] - 0.4) < 1e-9
    assert data["stages"]["network"]["median_ms"] == 1.0
    assert summarize.run(parser.parse_args([str(traced)])) == 0
    table = capsys.readouterr().out
    for stage in ("draft", "network", "queue", "verify", "overhead", "rtt"):
        assert stage in table


def test_summarize_bad_files_are_one_line_usage_errors(tmp_path):
    parser = __import__("argparse").ArgumentParser()
    summarize.add_arguments(parser)
    cases = {"missing.jsonl": None, "garbage.jsonl": "not json\n", "nospans.jsonl": '{"a": 1}\n',
             "noblocks.jsonl": '{"name": "x", "trace_id": "00"}\n', "binary.jsonl": b"\xff\xfe\x00"}
    for name, content in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        with pytest.raises(UsageError) as info:
            summarize.run(parser.parse_args([str(path)]))
        assert "\n" not in str(info.value) and str(info.value), name


def test_setup_is_idempotent_and_repoints_file(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    try:
        p1 = setup_tracing("svc", trace_file=str(first))
        assert setup_tracing("svc", trace_file=str(first)) is p1
        with get_tracer().start_as_current_span("one"):
            pass
        p2 = setup_tracing("svc", trace_file=str(second))
        assert p2 is p1
        with get_tracer().start_as_current_span("two"):
            pass
        flush_tracing()
        assert [json.loads(x)["name"] for x in first.read_text().splitlines()] == ["one"]
        assert [json.loads(x)["name"] for x in second.read_text().splitlines()] == ["two"]
    finally:
        shutdown_tracing()


def test_otlp_exporter_sends_to_a_collector(monkeypatch, tmp_path):
    """OTEL_EXPORTER_OTLP_ENDPOINT set: spans go over OTLP/gRPC (to a fake collector), not to the file."""
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    try:
        setup_tracing("steerspec-otlp-test", trace_file=str(tmp_path / "unused.jsonl"))
        with block_span(get_tracer(), 7, k=4) as span:
            span.set_attributes(block_attributes(accepted=2))
        assert flush_tracing()
    finally:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
        shutdown_tracing()
        server.stop(0)
    assert not (tmp_path / "unused.jsonl").exists()
    spans = [(rs, sp) for req in received for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans]
    assert [sp.name for _, sp in spans] == [BLOCK_SPAN]
    resource, span = spans[0]
    names = {a.key: a.value.string_value for a in resource.resource.attributes}
    assert names["service.name"]  # the provider's resource (first setup_tracing call of this process)
    attrs = {a.key: a.value.int_value for a in span.attributes}
    assert attrs["steerspec.block"] == 7 and attrs["steerspec.k"] == 4 and attrs["steerspec.accepted"] == 2


def test_real_generation_through_local_servers_is_one_linked_trace(traced, tiny_pair, capsys):
    """A generation through in-process verifier/drafter/coordinator servers and the asyncio client."""
    import torch

    from coordinator.local import LocalCluster

    torch.set_num_threads(1)
    verifier_dir, drafter_dir = tiny_pair

    async def generate():
        async with LocalCluster(str(verifier_dir), str(drafter_dir), tracer=get_tracer("coordinator")) as cluster:
            async with cluster.client(retries=0) as client:
                first = await client.acomplete(prompt_ids=[5, 17, 42, 99, 7], max_new_tokens=10, k=4, timeout=120)
                second = await client.acomplete(prompt_ids=[8, 9], max_new_tokens=3, k=2, timeout=120)
                return first, second

    summary, second = asyncio.run(generate())
    everything = read_spans(traced)
    # One trace per generation: the second generation is a tree of its own.
    assert {s["trace_id"] for s in everything} == {summary.trace_id, second.trace_id}
    assert summary.trace_id != second.trace_id
    check_one_tree([s for s in everything if s["trace_id"] == second.trace_id])
    spans = [s for s in everything if s["trace_id"] == summary.trace_id]
    by_id = check_one_tree(spans)

    def one(name, kind):
        found = [s for s in spans if s["name"] == name and s["kind"] == kind]
        assert len(found) == 1, (name, kind, len(found))
        return found[0]

    generate_client = one("/steerspec.v1.CoordinatorService/Generate", "CLIENT")
    generate_server = one("/steerspec.v1.CoordinatorService/Generate", "SERVER")
    root = one(GENERATION_SPAN, "INTERNAL")
    assert generate_client["parent_id"] is None
    assert generate_server["parent_id"] == generate_client["span_id"] and generate_server["parent_remote"]
    assert root["parent_id"] == generate_server["span_id"]
    for method in (VERIFY, DRAFT):
        client, server = one(method, "CLIENT"), one(method, "SERVER")
        assert client["parent_id"] == root["span_id"]
        assert server["parent_id"] == client["span_id"] and server["parent_remote"]
    blocks = [s for s in spans if s["name"] == BLOCK_SPAN]
    assert len(blocks) == summary.rounds >= 1
    block_ids = {b["span_id"]: b["attributes"]["steerspec.block"] for b in blocks}
    # Each block's verify (queue, forward) and draft are children of that block's span.
    for name in ("steerspec.verifier.queue", "steerspec.verifier.forward", "steerspec.drafter.draft"):
        inner = [s for s in spans if s["name"] == name]
        assert len(inner) == summary.rounds, name
        assert all(s["parent_id"] in block_ids and s["parent_remote"] for s in inner), name
        assert len({s["parent_id"] for s in inner}) == summary.rounds, name  # one per block
    for block in blocks:
        assert block["parent_id"] == root["span_id"]
        attrs = block["attributes"]
        for key in ("block", "k", "accepted", "bytes_up", "bytes_down", "draft_ms", "network_ms", "queue_ms",
                    "verify_ms", "overhead_ms", "rtt_ms"):
            assert f"steerspec.{key}" in attrs, key
        assert attrs["steerspec.bytes_up"] > 0 and attrs["steerspec.bytes_down"] > 0
        assert 0 <= attrs["steerspec.accepted"] <= attrs["steerspec.k"]
    assert sum(b["attributes"]["steerspec.accepted"] for b in blocks) == summary.accepted

    parser = __import__("argparse").ArgumentParser()
    summarize.add_arguments(parser)
    assert summarize.run(parser.parse_args([str(traced), "--trace-id", summary.trace_id])) == 0
    table = capsys.readouterr().out
    assert "round-trip breakdown" in table and "overhead" in table and f"blocks={summary.rounds}" in table
    assert summarize.run(parser.parse_args([str(traced)])) == 0
    assert f"blocks={summary.rounds + second.rounds} traces=2" in capsys.readouterr().out

