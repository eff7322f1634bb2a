"""SPRINTER (lossy, opt-in) through the real services on 127.0.0.1: the drafter service runs the
classifier, the coordinator commits and streams kept tokens before the verifier call, the verifier
checks each run's last token exactly. Output equals in-process SPRINTER with the same seed."""

from __future__ import annotations

import json

import grpc
import pytest

from coordinator.client import Chunk, Summary
from coordinator.local import LocalCluster
from steerspec.decoding.engine import DecodeConfig
from steerspec.models import load_model, resolve_model_dir
from steerspec.models.backends import cached_lm
from steerspec.decoding.sampling import SamplingParams
from steerspec.sprinter.decoding import sprinter_generate
from steerspec.sprinter.classifier import resolve_head
from steerspec.observability.prometheus import SteerSpecMetrics
from steerspec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

PROMPTS = [[4, 57, 310, 12, 96], [88, 23, 7]]
NEW_TOKENS = 24
SPEC = "sprinter:threshold=0.5,max_run=16"


@pytest.fixture(scope="module")
def bundled():
    verifier_dir, drafter_dir = resolve_model_dir("verifier"), resolve_model_dir("pretrained")
    return load_model(verifier_dir), load_model(drafter_dir), resolve_head(drafter_dir)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_sprinter_through_services_equals_in_process(bundled, temperature):
    verifier, drafter, head = bundled
    expected = []
    for seed, ids in enumerate(PROMPTS):  # before the cluster starts: this blocks the event loop
        config = DecodeConfig(max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=temperature), seed=seed)
        expected.append(sprinter_generate(cached_lm(verifier), cached_lm(drafter), ids, config, head.head,
                                          threshold=0.5, max_run=16))
    metrics = SteerSpecMetrics()
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=(), allow_lossy=True,
                            metrics=metrics) as cluster:
        with cluster.client() as client:
            for seed, (ids, want) in enumerate(zip(PROMPTS, expected)):
                items = [item async for item in client.agenerate(
                    prompt_ids=ids, max_new_tokens=NEW_TOKENS, temperature=temperature, seed=seed,
                    verification=SPEC, timeout=300)]
                chunks = [i for i in items if isinstance(i, Chunk)]
                summary = items[-1]
                assert isinstance(summary, Summary)
                assert list(summary.token_ids) == want.token_ids
                assert [t for c in chunks for t in c.token_ids] == want.token_ids
                assert summary.lossy and summary.verification == SPEC
                # theory beside measurement: the verifier's labels of each run give the in-process figures
                assert summary.sprinter == want.theory()
                assert summary.sprinter["mean_run_length"] > 0 and 0 < summary.sprinter["eta_tp"] <= 1
                assert summary.rounds == want.rounds < len(want.token_ids)  # fewer verifier calls than tokens
                # kept tokens arrive in their own chunk, before their run's verifier call
                runs_with_kept = sum(1 for d in want.block_drafted if d > 1)
                assert len(chunks) == summary.rounds + runs_with_kept
    lossy = metrics.lossy_sessions.labels("coordinator", "sprinter")._value.get()
    assert lossy == len(PROMPTS)


async def test_exact_verifier_session_refuses_kept_tokens(bundled):
    verifier, drafter, _ = bundled
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
        async with grpc.aio.insecure_channel(cluster.verifier_targets[0]) as channel:
            call = verifier_pb2_grpc.VerifierServiceStub(channel).Verify(timeout=60)
            await call.write(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(prompt_ids=PROMPTS[1], max_k=4)))
            assert (await call.read()).WhichOneof("kind") == "ready"
            block = common_pb2.DraftBlock(seq=1, committed_length=len(PROMPTS[1]), draft_ids=[5, 6], kept=1)
            await call.write(verifier_pb2.VerifyRequest(block=block))
            reply = await call.read()
            assert reply.WhichOneof("kind") == "error"
            assert reply.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
            assert "sprinter" in reply.error.message
            block.kept = 0  # the same block, exact: verified as usual
            await call.write(verifier_pb2.VerifyRequest(block=block))
            assert (await call.read()).WhichOneof("kind") == "result"
            await call.done_writing()


async def test_sprinter_without_a_head_is_failed_precondition(tiny_pair):
    verifier_dir, drafter_dir = tiny_pair  # the tiny drafter has no sprinter/ head
    async with LocalCluster(verifier=str(verifier_dir), drafter=str(drafter_dir), tokenizer=None, eos_ids=(),
                            allow_lossy=True) as cluster:
        with cluster.client() as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in client.agenerate(prompt_ids=[3, 4, 5], max_new_tokens=4, verification="sprinter",
                                                timeout=60):
                    pass
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "train sprinter" in info.value.details()
            # still serving: an exact request on the same cluster runs
            items = [i async for i in client.agenerate(prompt_ids=[3, 4, 5], max_new_tokens=4, timeout=60)]
            assert isinstance(items[-1], Summary) and not items[-1].lossy and len(items[-1].token_ids) == 4


def test_generation_span_marks_sprinter_lossy(bundled, tmp_path):
    import asyncio
    import json

    from steerspec.observability.tracing import (GENERATION_SPAN, flush_tracing, get_tracer, instrument_grpc,
        setup_tracing, shutdown_tracing, uninstrument_grpc)

    verifier, drafter, _ = bundled
    path = tmp_path / "trace.jsonl"
    setup_tracing("steerspec-test", trace_file=str(path))
    instrument_grpc()

    async def generate():
        async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=(), allow_lossy=True,
                                tracer=get_tracer("coordinator")) as cluster:
            async with cluster.client(retries=0) as client:
                lossy = await client.acomplete(prompt_ids=PROMPTS[0], max_new_tokens=8, verification=SPEC, timeout=120)
                exact = await client.acomplete(prompt_ids=PROMPTS[0], max_new_tokens=8, timeout=120)
                return lossy, exact

    try:
        lossy, exact = asyncio.run(generate())
        flush_tracing()
        spans = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    finally:
        shutdown_tracing()
        uninstrument_grpc()
    roots = {s["trace_id"]: s["attributes"] for s in spans if s["name"] == GENERATION_SPAN}
    assert roots[lossy.trace_id]["steerspec.lossy"] is True
    assert roots[lossy.trace_id]["steerspec.verification"] == SPEC
    assert roots[exact.trace_id]["steerspec.lossy"] is False
    assert roots[exact.trace_id]["steerspec.verification"] == "exact"


def test_cli_json_through_the_services_marks_sprinter_lossy(capsys):
    from steerspec.cli import main

    args = ["run", "def parse(line):", "--verifier", "verifier", "--drafter", "pretrained", "--transport", "grpc",
            "--max-new-tokens", "12", "--temperature", "1",
            "--seed", "3", "--json", "--verification", "sprinter:threshold=0.4,max_run=4"]
    assert main(args) == 0
    services = json.loads(capsys.readouterr().out)
    assert services["transport"] == "grpc" and services["deployment"] == "local"
    assert services["lossy"] is True and services["verification"] == "sprinter"
    assert services["verification_spec"] == "sprinter:threshold=0.4,max_run=4"
    assert services["verifier_calls"] == services["rounds"] < services["generated_tokens"]
    assert main(args[:-2] + ["--transport", "inproc", "--verification", "sprinter:threshold=0.4,max_run=4"]) == 0
    in_process = json.loads(capsys.readouterr().out)
    assert in_process["token_ids"] == services["token_ids"]  # the same seed, the same tokens
    assert services["sprinter"] == in_process["sprinter"]  # eta's, Theorem 1's bound, run lengths
    assert set(services["sprinter"]) == {"eta_tp", "eta_fp", "tv_pq", "tv_bound", "tv_measured", "mean_run_length",
                                         "expected_run_length"}


async def test_bench_services_mode_measures_both_through_the_services(bundled):
    from steerspec.bench import lossy_services as sprinter_services

    verifier, drafter, head = bundled
    rows = await sprinter_services.measure(verifier, drafter, PROMPTS[:1], seeds=1, rtts=[0.0], thresholds=[0.3],
                                           max_run=8, k=4, max_new_tokens=12, temperature=1.0, eos=(),
                                           policies=("specdecpp", "adaedl"))
    assert list(rows["0"]) == ["exact", "specdecpp", "adaedl", "sprinter@0.3"]
    for name in ("specdecpp", "adaedl"):  # SPRINTER's Table 2 baselines: exact rows through the same services
        assert rows["0"][name]["tokens"] == 12 and "eta_fp" not in rows["0"][name]
    exact, lossy = rows["0"]["exact"], rows["0"]["sprinter@0.3"]
    assert exact["tokens"] == lossy["tokens"] == 12 and exact["speedup"] == 1.0
    assert lossy["verifier_calls"] < lossy["tokens"] and lossy["wall_s"] > 0
    assert lossy["speedup"] == lossy["tokens_per_s"] / exact["tokens_per_s"]
    # the verifier's labels, pooled over the configuration's runs: one sequence here, so in-process's figures
    config = DecodeConfig(max_new_tokens=12, sampling=SamplingParams(temperature=1.0), seed=0)
    want = sprinter_generate(cached_lm(verifier), cached_lm(drafter), PROMPTS[0], config, head.head, threshold=0.3,
                             max_run=8).theory()
    assert "eta_fp" not in exact and {key: lossy[key] for key in want} == want
    assert len(sprinter_services.table(rows)) == 5


async def test_run_ending_on_a_kept_eos_counts_its_length_without_labels(bundled):
    """An EOS among a run's kept tokens ends the session before the run's verifier call: the tally keeps
    the run's length (as in-process) but has no labels for it; every earlier run's labels are equal."""
    verifier, drafter, head = bundled
    ids, spec = PROMPTS[0], "sprinter:threshold=0.3,max_run=16"

    def in_process(eos):
        config = DecodeConfig(max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=1.0), seed=0,
                              eos_token_ids=tuple(eos))
        return sprinter_generate(cached_lm(verifier), cached_lm(drafter), ids, config, head.head, threshold=0.3,
                                 max_run=16)

    free = in_process(())
    kept_positions, position = [], 0  # output positions committed without the verifier
    for drafted, accepted in zip(free.block_drafted, free.block_accepted):
        kept_positions += range(position, position + drafted - 1)
        position += accepted + 1
    token_ids = free.token_ids
    eos = next(token_ids[p] for p in kept_positions if token_ids[p] not in token_ids[:p])
    want = in_process([eos])
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=(eos,),
                            allow_lossy=True) as cluster:
        got = await cluster.generate(ids, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0, verification=spec,
                                     timeout=300)
    assert got.token_ids == want.token_ids and got.token_ids[-1] == eos and got.stop_reason == "eos"
    assert got.rounds == want.rounds - 1  # the last run needed no verifier call
    assert got.sprinter.run_lengths == want.run_lengths  # ... but its length counts
    assert got.sprinter.run_r == want.run_r[:-1] and got.sprinter.labelled < want.labelled


@pytest.mark.slow
def test_cli_prints_a_server_refusal_as_one_line(tiny_pair, capsys):
    """A status from the services (here FAILED_PRECONDITION: a coordinator not started with
    --allow-lossy refuses a sprinter request) is one line on stderr and exit 2, not a traceback."""
    import asyncio
    import threading

    from steerspec.cli import main

    verifier_dir, drafter_dir = tiny_pair
    ready, state = threading.Event(), {"stop": False}

    async def serve() -> None:
        async with LocalCluster(verifier=str(verifier_dir), drafter=str(drafter_dir), tokenizer=str(verifier_dir),
                                eos_ids=()) as cluster:
            state["target"] = cluster.target
            ready.set()
            for _ in range(1200):  # bounded: at most 60 s
                if state["stop"]:
                    break
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(120)
    try:
        code = main(["run", "def f():", "--coordinator", state["target"], "--max-new-tokens", "4",
                     "--verification", "sprinter", "--verifier", str(verifier_dir),
                     "--drafter", str(drafter_dir)])  # the cluster's pair: its tokenizer, no smollm2 to convert
    finally:
        state["stop"] = True
        thread.join(60)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("steerspec: error: FAILED_PRECONDITION:") and "allow-lossy" in err[0]
