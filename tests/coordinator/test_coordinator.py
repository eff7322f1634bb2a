"""Coordinator: the round-trip loop over real gRPC services (in-process), link emulation, bad input."""

from __future__ import annotations

import json
import statistics

import grpc
import pytest
import torch

from coord_helpers import greedy_reference
from coordinator.local import LocalCluster
from steerspec.errors import UsageError
from steerspec.serving.linkemu import LinkModel
from steerspec.serving.store import RedisStore
from steerspec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

PROMPT = [5, 17, 42, 9]


# ----------------------------------------------------------------------------- link emulation


def test_link_delay_formula_and_seeded_jitter():
    model = LinkModel(rtt_ms=50, jitter_ms=10, bandwidth_mbps=8, seed=3).validate()
    assert model.one_way_s(1000) == pytest.approx(0.025 + 1000 * 8 / 8e6)

    def draws(key):
        rng = model.link(key).rng
        return [model.one_way_s(0, rng) for _ in range(5)]

    a = draws("s1")
    assert a == draws("s1")  # same seed and session: same jitter
    assert all(0.020 <= x <= 0.030 for x in a) and len(set(a)) > 1
    assert draws("s2") != a
    with pytest.raises(UsageError):
        LinkModel(rtt_ms=-1).validate()
    with pytest.raises(UsageError):
        LinkModel(rtt_ms=5, jitter_ms=10).validate()


async def test_link_delay_is_accurate():
    link = LinkModel(rtt_ms=10).link("x")
    late = []
    for _ in range(20):
        spent = await link.up(0)
        late.append((spent - 0.005) * 1000)
    assert min(late) >= 0.0  # never early
    assert statistics.median(late) < 0.5, late  # ms; measured ~0.003 on an idle core


@pytest.mark.parametrize("argv, needle", [
    (["--verifier", "localhost"], "--verifier expects HOST:PORT"),
    (["--drafter", "a:1,b:x"], "--drafter expects HOST:PORT"),
    (["--rtt-ms", "-5"], "--rtt-ms"),
    (["--rtt-ms", "10", "--jitter-ms", "20"], "--jitter-ms"),
    (["--bandwidth-mbps", "nan"], "--bandwidth-mbps"),
    (["--http-port", "70000"], "--http-port"),
    (["--http-port", "0", "--http-host", "0.0.0.0"], "refusing to serve plaintext on 0.0.0.0"),
])
def test_serve_coordinator_rejects_bad_flags(argv, needle, capsys):
    from steerspec.cli import main

    assert main(["serve", "coordinator", *argv]) == 2
    assert needle in capsys.readouterr().err


# ----------------------------------------------------------------------------- the loop


@pytest.fixture
async def cluster(tiny_pair):
    verifier, drafter = tiny_pair
    async with LocalCluster(str(verifier), str(drafter), eos_ids=()) as c:
        yield c


async def test_speculative_greedy_equals_verifier_greedy(cluster, tiny_pair):
    want = greedy_reference(tiny_pair[0], PROMPT, 24)
    result = await cluster.generate(PROMPT, max_new_tokens=24, k=4)
    assert result.token_ids == want
    assert result.stop_reason == "length"
    assert result.rounds == len(result.blocks) and result.rounds < 24
    assert sum(b.committed for b in result.blocks) == 24
    assert result.block_efficiency == pytest.approx(24 / result.rounds)
    assert all(b.drafted <= 4 for b in result.blocks)
    assert all(b.bytes_up > 0 and b.bytes_down > 0 and b.rtt_ms > 0 for b in result.blocks)
    body = result.to_json()
    for key in ("rtt_ms", "bytes_up", "bytes_down", "block_efficiency", "acceptance_rate", "accepted_per_position"):
        assert key in body
    assert set(body["stage_ms"]) == {"draft", "network", "queue", "verify", "overhead"}
    assert body["stage_ms"]["network"] == 0.0


async def test_a_bfloat16_drafter_under_a_float32_verifier_keeps_greedy_output_exact(tiny_pair, monkeypatch):
    """`drafter_dtype` (the CLI's --drafter-dtype, "auto" = bfloat16 on a native-bf16 CPU) moves only the drafter:
    the verifier stays float32 and the output its greedy one."""
    import coordinator.local as local

    loaded, real = [], local._load

    def load(model, dtype, device):
        out = real(model, dtype, device)
        loaded.append((str(model), next(out.parameters()).dtype))
        return out

    monkeypatch.setattr(local, "_load", load)
    want = greedy_reference(tiny_pair[0], PROMPT, 24)
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=(), drafter_dtype="bfloat16") as c:
        result = await c.generate(PROMPT, max_new_tokens=24, k=4)
    assert result.token_ids == want and result.accepted > 0
    assert loaded == [(str(tiny_pair[0]), torch.float32), (str(tiny_pair[1]), torch.bfloat16)]


async def test_autoregressive_is_one_round_trip_per_token(cluster, tiny_pair):
    want = greedy_reference(tiny_pair[0], PROMPT, 10)
    result = await cluster.generate(PROMPT, max_new_tokens=10, mode="autoregressive")
    assert result.token_ids == want
    assert result.rounds == 10 and result.drafted == 0 and result.block_efficiency == 1.0


async def test_sampling_runs_and_is_seeded(cluster):
    a = await cluster.generate(PROMPT, max_new_tokens=12, temperature=1.0, seed=7, k=3, draft_top_k=16)
    b = await cluster.generate(PROMPT, max_new_tokens=12, temperature=1.0, seed=7, k=3, draft_top_k=16)
    assert len(a.token_ids) == 12 and a.token_ids == b.token_ids
    greedy = await cluster.generate(PROMPT, max_new_tokens=12, k=3)
    assert a.bytes_up > greedy.bytes_up  # sampling blocks carry their sparse q


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (1.0, 3), (0.8, 11)])
async def test_same_tokens_as_the_in_process_engine(cluster, tiny_pair, temperature, seed):
    """Same seed, same output: the distributed path and steerspec.decoding.engine agree token for token."""
    from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
    from steerspec.policies import FixedK
    from steerspec.decoding.sampling import SamplingParams
    from coord_helpers import load_cached

    verifier, drafter = (load_cached(d) for d in tiny_pair)
    config = DecodeConfig(max_new_tokens=16, sampling=SamplingParams(temperature, 0, 1.0), draft_top_k=16,
                          seed=seed, eos_token_ids=(), max_length=256)
    spec = speculative_generate(verifier, drafter, PROMPT, config, FixedK(4))
    got = await cluster.generate(PROMPT, max_new_tokens=16, temperature=temperature, seed=seed, k=4, draft_top_k=16)
    assert got.token_ids == spec.token_ids and got.rounds == spec.rounds
    plain = autoregressive_generate(verifier, PROMPT, config)
    got = await cluster.generate(PROMPT, max_new_tokens=16, temperature=temperature, seed=seed, mode="autoregressive")
    assert got.token_ids == plain.token_ids


@pytest.mark.parametrize("temperature, seed", [(1.0, 3), (0.8, 11), (0.0, 2)])
async def test_block_verification_through_the_services_equals_the_in_process_engine(cluster, tiny_pair,
                                                                                     temperature, seed):
    """verification 'block': the verifier service accepts by block verification, token for token what the
    engine does with DecodeConfig(acceptance='block'), and not what token-wise acceptance gives for the seed."""
    from steerspec.decoding.engine import DecodeConfig, speculative_generate
    from steerspec.policies import FixedK
    from steerspec.decoding.sampling import SamplingParams
    from coord_helpers import load_cached

    verifier, drafter = (load_cached(d) for d in tiny_pair)
    config = DecodeConfig(max_new_tokens=24, sampling=SamplingParams(temperature, 0, 1.0), draft_top_k=16,
                          seed=seed, eos_token_ids=(), max_length=256, acceptance="block")
    want = speculative_generate(verifier, drafter, PROMPT, config, FixedK(6))
    got = await cluster.generate(PROMPT, max_new_tokens=24, temperature=temperature, seed=seed, k=6, draft_top_k=16,
                                 verification="block")
    assert got.token_ids == want.token_ids and got.rounds == want.rounds and got.verification == "block"
    token_wise = await cluster.generate(PROMPT, max_new_tokens=24, temperature=temperature, seed=seed, k=6,
                                        draft_top_k=16)
    if temperature > 0:
        assert token_wise.token_ids != got.token_ids
    else:  # greedy rows accept the leading matches either way
        assert token_wise.token_ids == got.token_ids


async def test_sampling_block_up_is_under_4kb(cluster):
    """T=1, k=8, draft_top_k=64: ids + fp16 probs of the sparse q, at most 4 KB per block."""
    result = await cluster.generate(PROMPT, max_new_tokens=24, temperature=1.0, seed=1, k=8, draft_top_k=64)
    assert max(b.bytes_up for b in result.blocks) <= 4096
    assert max(b.drafted for b in result.blocks) == 8


async def test_model_pair_greedy_equality(model_pair):
    """The bundled pair (when installed): speculative greedy output is the verifier's greedy output."""
    verifier, drafter = model_pair
    prompts = [[5, 17, 42, 9], [100, 7]]
    async with LocalCluster(str(verifier), str(drafter), eos_ids=()) as c:
        for prompt in prompts:
            result = await c.generate(prompt, max_new_tokens=16, k=4)
            assert result.token_ids == greedy_reference(verifier, prompt, 16)


async def test_eos_stops_and_truncates(tiny_pair):
    verifier, drafter = tiny_pair
    want = greedy_reference(verifier, PROMPT, 12)
    eos = want[5]
    stop = want.index(eos)
    async with LocalCluster(str(verifier), str(drafter), eos_ids=(eos,)) as c:
        result = await c.generate(PROMPT, max_new_tokens=12, k=4)
    assert result.token_ids == want[:stop + 1] and result.stop_reason == "eos"


async def test_context_limit_ends_with_context(cluster, tiny_pair):
    """A prompt near the models' context (256): the generation stops with finish reason "context",
    exactly where the in-process engine stops."""
    from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
    from steerspec.policies import FixedK
    from steerspec.decoding.sampling import SamplingParams
    from coord_helpers import load_cached

    prompt = [(7 * i) % 300 + 1 for i in range(248)]
    config = DecodeConfig(max_new_tokens=20, sampling=SamplingParams(0.0, 0, 1.0), seed=0, eos_token_ids=(),
                          max_length=256)
    want = speculative_generate(load_cached(tiny_pair[0]), load_cached(tiny_pair[1]), prompt, config, FixedK(4))
    result = await cluster.generate(prompt, max_new_tokens=20, k=4)
    assert result.stop_reason == want.stop_reason == "context"
    assert result.token_ids == want.token_ids and result.rounds == want.rounds
    plain = autoregressive_generate(load_cached(tiny_pair[0]), prompt, config)
    result = await cluster.generate(prompt, max_new_tokens=20, mode="autoregressive")
    assert result.stop_reason == plain.stop_reason == "context" and result.token_ids == plain.token_ids
    assert len(prompt) + len(result.token_ids) == 256


async def test_link_emulation_sets_the_round_trip(tiny_pair):
    verifier, drafter = tiny_pair
    async with LocalCluster(str(verifier), str(drafter), eos_ids=(), link=LinkModel(rtt_ms=20)) as c:
        result = await c.generate(PROMPT, max_new_tokens=8, k=4)
        c.set_link(LinkModel(rtt_ms=6, bandwidth_mbps=0.02))  # 0.02 Mbit/s: 0.4 ms per byte
        slow = await c.generate(PROMPT, max_new_tokens=8, k=4)
    # Never early; late only by scheduling (loose bounds: other processes on a loaded CI machine can
    # preempt the event loop; measured ~0.003 ms late per message on an idle core).
    assert all(20.0 <= b.network_ms <= b.rtt_ms for b in result.blocks)
    assert statistics.median(b.network_ms for b in result.blocks) < 25.0
    want = [6.0 + (b.bytes_up + b.bytes_down) * 8 / 0.02e6 * 1e3 for b in slow.blocks]  # ~25 ms
    assert all(w <= b.network_ms for w, b in zip(want, slow.blocks))
    assert statistics.median(b.network_ms / w for w, b in zip(want, slow.blocks)) < 1.25


async def test_generate_api_streams_chunks_then_summary(cluster, tiny_pair):
    want = greedy_reference(tiny_pair[0], PROMPT, 16)
    async with grpc.aio.insecure_channel(cluster.target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        responses = [r async for r in stub.Generate(coordinator_pb2.GenerateRequest(
            prompt_ids=PROMPT, max_new_tokens=16, k=4), timeout=60)]
    chunks = [r.chunk for r in responses[:-1]]
    summary = responses[-1].summary
    assert all(r.HasField("chunk") for r in responses[:-1]) and responses[-1].HasField("summary")
    assert [t for c in chunks for t in c.token_ids] == want == list(summary.token_ids)
    assert [c.seq for c in chunks] == list(range(len(chunks))) and summary.rounds == len(chunks)
    assert summary.finish_reason == "length" and summary.session_id
    assert summary.rtt_ms > 0 and summary.bytes_up > 0 and summary.stage_ms.verify_ms > 0


@pytest.mark.parametrize("request_kwargs, code", [
    (dict(), grpc.StatusCode.INVALID_ARGUMENT),  # empty prompt
    (dict(prompt_ids=PROMPT, k=500), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt_ids=PROMPT, mode="beam"), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt_ids=PROMPT, sampling=common_pb2.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt_ids=PROMPT, prompt="both"), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt_ids=[5, 10**6]), grpc.StatusCode.INVALID_ARGUMENT),  # out of vocabulary (verifier says so)
])
async def test_bad_requests_get_clear_status(cluster, request_kwargs, code):
    async with grpc.aio.insecure_channel(cluster.target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(coordinator_pb2.GenerateRequest(max_new_tokens=4, **request_kwargs),
                                         timeout=30):
                pass
        assert info.value.code() == code, info.value.details()
        assert info.value.details()
        # ... and the coordinator keeps serving.
        ok = [r async for r in stub.Generate(coordinator_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=3),
                                              timeout=30)]
        assert len(ok[-1].summary.token_ids) == 3


async def test_no_verifier_is_unavailable(cluster):
    for address in cluster.verifier_targets:
        await cluster.coordinator.store.expire("verifier", address)
    with pytest.raises(Exception) as info:
        await cluster.generate(PROMPT, max_new_tokens=4)
    assert getattr(info.value, "code", None) == grpc.StatusCode.UNAVAILABLE
    assert "no live verifier" in str(info.value)


async def test_redis_checkpoints_and_resume(tiny_pair, redis_url):
    verifier, drafter = tiny_pair
    want = greedy_reference(verifier, PROMPT, 14)
    store = RedisStore(redis_url, prefix="test-coord:")
    async with LocalCluster(str(verifier), str(drafter), eos_ids=(), store=store) as c:
        result = await c.generate(PROMPT, max_new_tokens=14, k=4, session_id="sess-a")
        record = await store.get_session("sess-a")
        assert record.token_ids == result.token_ids == want
        assert record.status == "done" and record.params["prompt_ids"] == PROMPT
        assert record.placement["verifier"] in c.verifier_targets
        # A session cut short (as if its coordinator died after 5 tokens) resumes from its checkpoint.
        await store.create_session("sess-b", dict(record.params), {})
        store.append_tokens("sess-b", want[:5])
        await store.flush()
        async with grpc.aio.insecure_channel(c.target) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            responses = [r async for r in stub.Generate(coordinator_pb2.GenerateRequest(
                prompt_ids=PROMPT, max_new_tokens=14, k=4, session_id="sess-b"), timeout=60)]
        assert list(responses[0].chunk.token_ids) == want[:5]  # the replayed prefix
        assert [t for r in responses[:-1] for t in r.chunk.token_ids] == want
        assert list(responses[-1].summary.token_ids) == want and responses[-1].summary.resumes == 1
        assert (await store.get_session("sess-b")).token_ids == want


def _run_json(capsys, argv) -> dict:
    from steerspec.cli import main

    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_steerspec_run_local_deployment_streams_the_engine_tokens(tiny_pair, capsys):
    """`steerspec run` (default: --transport grpc --deployment local, three gRPC servers on loopback in
    this process) prints the same tokens as `--transport inproc`, plus the round-trip fields."""
    verifier, drafter = tiny_pair
    argv = ["run", "def fibonacci(n):", "--verifier", str(verifier), "--drafter", str(drafter),
            "--max-new-tokens", "12", "--k", "4", "--json"]
    remote = _run_json(capsys, argv)
    local = _run_json(capsys, [*argv, "--transport", "inproc"])
    assert remote["transport"] == "grpc" and remote["deployment"] == "local" and local["transport"] == "inproc"
    assert remote["token_ids"] == local["token_ids"] and remote["rounds"] == local["rounds"]
    assert remote["rtt_ms"] > 0 and remote["bytes_up"] > 0 and remote["bytes_down"] > 0
    assert set(remote["stage_ms"]) == {"draft", "network", "queue", "verify", "overhead"}
    # the drafter's own compute and the verifier's batch size come through the summary (were 0.0 / null)
    assert remote["draft_compute_ms"] > 0 and remote["batch_size"] >= 1
    auto = _run_json(capsys, [*argv, "--mode", "autoregressive"])
    assert auto["token_ids"] == local["token_ids"] and auto["rounds"] == 12


def test_steerspec_run_emulates_the_link(tiny_pair, capsys):
    """--rtt-ms 50 puts about 50 ms of network in every block (`stage_ms.network`), tokens unchanged."""
    verifier, drafter = tiny_pair
    argv = ["run", "def fibonacci(n):", "--verifier", str(verifier), "--drafter", str(drafter),
            "--max-new-tokens", "8", "--k", "4", "--json"]
    plain = _run_json(capsys, argv)
    linked = _run_json(capsys, [*argv, "--rtt-ms", "50", "--jitter-ms", "4", "--bandwidth-mbps", "100"])
    assert linked["token_ids"] == plain["token_ids"]
    # ±4 ms jitter: a block's round trip is 50 ± 4 ms (never less than 46), so the mean may sit just under 50
    assert 46.0 <= linked["stage_ms"]["network"] <= 80.0 and plain["stage_ms"]["network"] < 20.0
    assert linked["link"] == {"rtt_ms": 50.0, "jitter_ms": 4.0, "bandwidth_mbps": 100.0, "seed": 0}


async def test_block_spans_and_metrics(tiny_pair):
    """With a tracer and metrics: one steerspec.block span per round trip under the generation span,
    carrying the stage breakdown, and Prometheus counters that add up."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from steerspec.observability.prometheus import SteerSpecMetrics

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = SteerSpecMetrics()
    verifier, drafter = tiny_pair
    async with LocalCluster(str(verifier), str(drafter), eos_ids=(), tracer=provider.get_tracer("test"),
                            metrics=metrics) as c:
        async with c.client() as client:
            summary = await client.acomplete(prompt_ids=PROMPT, max_new_tokens=10, k=4)
    spans = exporter.get_finished_spans()
    root = [s for s in spans if s.name == "steerspec.generate"]
    blocks = [s for s in spans if s.name == "steerspec.block"]
    assert len(root) == 1 and len(blocks) == summary.rounds
    assert summary.trace_id == f"{root[0].context.trace_id:032x}"
    assert all(b.context.trace_id == root[0].context.trace_id for b in blocks)
    for key in ("rtt_ms", "draft_ms", "network_ms", "queue_ms", "verify_ms", "overhead_ms", "bytes_up", "accepted"):
        assert all(f"steerspec.{key}" in b.attributes for b in blocks)
    text = metrics.exposition().decode()
    assert f'steerspec_round_trip_seconds_count{{service="coordinator"}} {float(summary.rounds)}' in text
    assert f'steerspec_spec_decode_num_draft_tokens_total{{service="coordinator"}} {float(summary.drafted)}' in text
    assert 'gen_ai_server_time_to_first_token_seconds_count{gen_ai_operation_name="text_completion"' in text
    root_attributes = dict(root[0].attributes)  # the GenAI semantic conventions on the generation span
    assert root_attributes["gen_ai.operation.name"] == "text_completion"
    assert root_attributes["gen_ai.usage.output_tokens"] == 10 == root_attributes["gen_ai.request.max_tokens"]
    assert root_attributes["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert root_attributes["gen_ai.response.finish_reasons"] == ("length",)
