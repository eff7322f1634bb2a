"""The verifier gRPC service: exact batched verification, limits, freeing, steering, health."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import pytest_asyncio
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_helpers import greedy_reference, make_tiny_llama, open_verifier, verify, wait_for_stats

from steerspec.models import load_model
from steerspec.serving import wire
from steerspec.steering import SteeringHead, default_layers
from steerspec.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service import verify_sessions
from verifier_service.server import VerifierConfig, VerifierServicer, serve

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


class Server:
    def __init__(self, running, servicer):
        self.running, self.servicer = running, servicer
        self.channel = grpc.aio.insecure_channel(running.target)
        self.stub = verifier_pb2_grpc.VerifierServiceStub(self.channel)

    async def stats(self):
        return (await self.stub.GetVerifierStats(verifier_pb2.GetVerifierStatsRequest(), timeout=10)).stats

    async def stop(self):
        await self.channel.close()
        await self.running.stop(0.5)


async def start(model, **config):
    head = config.pop("steering_head", None)
    running, servicer = await serve(model, VerifierConfig(**config), steering_head=head)
    return Server(running, servicer)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    return load_model(str(make_tiny_llama(tmp_path_factory.mktemp("verifier"), seed=0)))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(model):
    head = SteeringHead(model.config.hidden_size, default_layers(model.config.num_hidden_layers))
    with torch.no_grad():
        head.proj.weight.add_(0.05 * torch.randn_like(head.proj.weight))
    srv = await start(model, batch_window_ms=5.0, steering_head=head.eval())
    yield srv
    await srv.stop()


async def greedy_session(stub, prompt, reference, n_tokens, rng, max_k=6):
    """Drive one greedy session with drafts that are partly right, partly wrong; return its output."""
    call, ready = await open_verifier(stub, prompt, max_k=max_k)
    assert ready.WhichOneof("kind") == "ready"
    out, seq, committed, batch_sizes = [], 1, len(prompt), []
    while len(out) < n_tokens:
        k = rng.randint(0, max_k)
        good = rng.randint(0, k)
        drafts = reference[len(out): len(out) + good]
        drafts += [rng.randrange(97) for _ in range(k - len(drafts))]
        reply = await verify(call, seq, committed, drafts)
        assert reply.WhichOneof("kind") == "result", reply
        result = reply.result
        new = drafts[: result.accepted] + [result.next_token]
        out += new
        committed += len(new)
        assert result.committed_length == committed and result.seq == seq
        assert result.is_bonus == (result.accepted == len(drafts))
        assert result.verify_ms > 0 and result.queue_ms >= 0
        batch_sizes.append(result.batch_size)
        seq += 1
    await call.done_writing()
    return out[:n_tokens], batch_sizes


async def test_single_session_greedy_equals_verifier_only(server, model):
    prompt = [5, 6, 7, 8]
    reference = greedy_reference(model, prompt, 24)
    out, sizes = await greedy_session(server.stub, prompt, reference, 24, random.Random(0))
    assert out == reference
    assert set(sizes) == {1}


async def test_concurrent_sessions_batched_and_exact(server, model):
    prompts = [[5, 6, 7, 8], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [40, 41], [3, 3, 3], [77, 12, 60, 2, 8, 9]]
    references = [greedy_reference(model, p, 20) for p in prompts]
    runs = await asyncio.gather(*[greedy_session(server.stub, p, r, 20, random.Random(i))
                                  for i, (p, r) in enumerate(zip(prompts, references))])
    for (out, _), reference in zip(runs, references):
        assert out == reference
    assert max(max(sizes) for _, sizes in runs) > 1, "concurrent blocks were never batched"
    stats = await server.stats()  # the load counters GetStats reports (what `bench capacity` reads)
    assert 0 < stats.passes_total < stats.blocks_total < stats.rows_total and stats.busy_s > 0


async def test_transformers_cache_backend_batched_and_exact(model):
    """`--kv-backend hf`: sessions on transformers caches (the padded batched pass) stay exact."""
    srv = await start(model, batch_window_ms=5.0, kv_backend="hf")
    try:
        prompts = [[5, 6, 7, 8], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
        references = [greedy_reference(model, p, 16) for p in prompts]
        runs = await asyncio.gather(*[greedy_session(srv.stub, p, r, 16, random.Random(i))
                                      for i, (p, r) in enumerate(zip(prompts, references))])
        assert [out for out, _ in runs] == references
        assert max(max(sizes) for _, sizes in runs) > 1, "concurrent blocks were never batched"
        assert srv.servicer.table.kv_backend == "hf"
        assert type(verify_sessions.session_lm(model, "hf")).__name__ == "CachedLM"
    finally:
        await srv.stop()
    with pytest.raises(ValueError, match="unknown KV backend 'paged'"):
        VerifierServicer(model, VerifierConfig(kv_backend="paged"))


async def sampled_session(stub, prompt, seed, blocks=6, k=3):
    """A sampling session with fixed drafts and a fixed q; returns the (accepted, next) per block."""
    call, _ = await open_verifier(stub, prompt, temperature=30.0, seed=seed)  # flat enough to vary
    ids = torch.arange(16).view(1, 16).expand(k, 16)
    probs = torch.full((k, 16), 1 / 16)
    q = wire.encode_sparse(ids, probs)
    outcomes, committed = [], len(prompt)
    for seq in range(1, blocks + 1):
        result = (await verify(call, seq, committed, [1, 2, 3][:k], q)).result
        outcomes.append((result.accepted, result.next_token))
        committed = result.committed_length
    await call.done_writing()
    return outcomes


async def test_seeded_sampling_does_not_depend_on_batching(server):
    alone = await sampled_session(server.stub, [4, 5, 6], seed=11)
    crowd = await asyncio.gather(sampled_session(server.stub, [4, 5, 6], seed=11),
                                 sampled_session(server.stub, [9, 9], seed=3),
                                 sampled_session(server.stub, [1, 2, 3, 4, 5], seed=5))
    assert crowd[0] == alone
    assert await sampled_session(server.stub, [4, 5, 6], seed=12) != alone


async def test_close_cancel_and_deadline_free_the_cache(server):
    base = await wait_for_stats(server.stats, lambda s: s.active_sessions == 0)
    assert base.active_sessions == 0 and base.cache_bytes == 0
    call, _ = await open_verifier(server.stub, list(range(1, 30)))
    stats = await server.stats()
    assert stats.active_sessions == 1 and stats.cache_bytes > 0
    await call.write(verifier_pb2.VerifyRequest(close=verifier_pb2.VerifyClose(reason="done")))
    stats = await wait_for_stats(server.stats, lambda s: s.active_sessions == 0)
    assert stats.active_sessions == 0 and stats.cache_bytes == 0

    call, _ = await open_verifier(server.stub, list(range(1, 30)))
    call.cancel()
    stats = await wait_for_stats(server.stats, lambda s: s.active_sessions == 0)
    assert stats.active_sessions == 0 and stats.cache_bytes == 0

    call, _ = await open_verifier(server.stub, list(range(1, 30)), timeout=0.5)
    assert (await server.stats()).active_sessions == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = await wait_for_stats(server.stats, lambda s: s.active_sessions == 0)
    assert stats.active_sessions == 0 and stats.cache_bytes == 0


def expected_steering(model, head, committed):
    """g from the hidden states entering the head's layers at the position whose logits produced
    the last committed token (len - 2), from a plain full forward."""
    with torch.inference_mode():
        hs = model(input_ids=torch.tensor([committed]), output_hidden_states=True).hidden_states
        return head(torch.cat([hs[i][0, len(committed) - 2] for i in head.layers])).float()


async def steered_session(server, model, prompt, blocks=3):
    head, hidden = server.servicer.head, model.config.hidden_size
    call, ready = await open_verifier(server.stub, prompt, steering=True)
    assert ready.ready.steering.dtype == "float16" and list(ready.ready.steering.shape) == [hidden]
    g = wire.tensor_from_proto(ready.ready.steering, size=hidden)
    torch.testing.assert_close(g, expected_steering(model, head, prompt).half().float(), atol=2e-2, rtol=2e-3)
    committed, sizes = list(prompt), []
    reference = greedy_reference(model, prompt, 3 * blocks)
    for seq in range(1, blocks + 1):
        drafts = reference[len(committed) - len(prompt):][:1] + [0]  # first right, second (likely) wrong
        result = (await verify(call, seq, len(committed), drafts)).result
        committed += drafts[: result.accepted] + [result.next_token]
        g = wire.tensor_from_proto(result.steering, size=hidden)
        torch.testing.assert_close(g, expected_steering(model, head, committed).half().float(), atol=2e-2, rtol=2e-3)
        sizes.append(result.batch_size)
    await call.done_writing()
    return sizes


async def test_steering_vectors_come_from_the_right_position(server, model):
    await steered_session(server, model, [5, 6, 7, 8, 9])
    sizes = await asyncio.gather(*[steered_session(server, model, p) for p in ([5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [9, 8])])
    assert max(max(s) for s in sizes) > 1  # also right inside batched passes
    # a one-token prompt has no verifier position yet: the head applied to zeros
    call, ready = await open_verifier(server.stub, [7], steering=True)
    g = wire.tensor_from_proto(ready.ready.steering)
    torch.testing.assert_close(g, server.servicer.head.initial(1)[0].detach().half().float())
    await call.done_writing()


async def test_limits_sessions_memory_and_idle(model):
    srv = await start(model, max_sessions=2, max_cache_mb=0.02, idle_timeout_s=0.4)
    try:
        a, _ = await open_verifier(srv.stub, [1, 2])
        b, _ = await open_verifier(srv.stub, [3, 4])
        c, reply = None, None
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await open_verifier(srv.stub, [5, 6])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-sessions 2" in info.value.details()
        # idle sessions expire: both streams are aborted and their caches freed
        for call in (a, b):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "idle" in info.value.details()
        assert (await wait_for_stats(srv.stats, lambda s: s.active_sessions == 0)).active_sessions == 0
        # memory: a prompt whose cache does not fit is refused at open ...
        per_token = srv.servicer.table.bytes_per_token
        fits = int(0.02 * 2**20 // per_token)
        assert fits + 1 < srv.servicer.context
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await open_verifier(srv.stub, [1] * (fits + 1), max_k=1)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-cache-mb" in info.value.details()
        # ... and a block that would pass the limit gets an in-stream error, the session stays usable
        c, reply = await open_verifier(srv.stub, [1] * (fits - 9), max_k=8)
        assert reply.WhichOneof("kind") == "ready"
        committed, seq = fits - 9, 1
        while committed < fits - 7:  # verifier-only steps (no drafts) grow the cache one token each
            committed = (await verify(c, seq, committed, [])).result.committed_length
            seq += 1
        reply = await verify(c, seq, committed, [1] * 8)
        assert reply.WhichOneof("kind") == "error"
        assert reply.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "--max-cache-mb" in reply.error.message
        reply = await verify(c, seq, committed, [1])
        assert reply.WhichOneof("kind") == "result"
        c.cancel()
    finally:
        await srv.stop()


async def test_health_reflection_and_graceful_stop(model):
    srv = await start(model)
    health = health_pb2_grpc.HealthStub(srv.channel)
    for name in ("", "steerspec.v1.VerifierService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(srv.channel)
    call = refl.ServerReflectionInfo(timeout=5)
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    listed = {s.name for s in (await call.read()).list_services_response.service}
    await call.done_writing()
    assert "steerspec.v1.VerifierService" in listed and "grpc.health.v1.Health" in listed
    session, _ = await open_verifier(srv.stub, [1, 2, 3])
    stopping = asyncio.ensure_future(srv.running.stop(0.3))
    with pytest.raises(grpc.aio.AioRpcError):
        await session.read()
    await stopping
    assert len(srv.servicer.table) == 0
    await srv.channel.close()


@pytest.mark.slow
async def test_cli_serves_with_device_map_and_stops_gracefully(tmp_path):
    """`steerspec serve verifier --port 0 --device-map cpu` prints its address, answers health checks
    and a session, and exits 0 on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    model_dir = make_tiny_llama(tmp_path / "v", seed=0)
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "steerspec", "serve", "verifier", "--model", str(model_dir),
                             "--port", "0", "--device-map", "cpu", "--threads", "1", "--grace-s", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, line + proc.stderr.read()
        target = line.split()[-1]
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service="steerspec.v1.VerifierService"), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            requests = iter([verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(prompt_ids=[5, 6, 7]))])
            replies = list(stub.Verify(requests, timeout=20))
            assert replies[0].WhichOneof("kind") == "ready" and replies[0].ready.committed_length == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_cpu_replica_verifies_batches_on_the_event_loops_thread(model, monkeypatch):
    """On a CPU every pass (prefill, lone blocks, batches of two) runs on the thread that loaded the model
    and runs the loop: a second thread computing would give the process a second OpenMP pool and slow
    every pass (steerspec/serving/compute.py). The batched results stay exact."""
    import threading

    monkeypatch.delenv("STEERSPEC_INLINE_COMPUTE", raising=False)
    srv = await start(model, batch_window_ms=500.0)
    assert srv.servicer.batcher.inline and srv.servicer.batcher.executor is None
    threads, sizes = set(), []
    real_run, real_prefill = srv.servicer.runner.run, srv.servicer.runner.prefill

    def run(jobs):
        threads.add(threading.get_ident())
        sizes.append(len(jobs))
        return real_run(jobs)

    def prefill(*args):
        threads.add(threading.get_ident())
        return real_prefill(*args)

    srv.servicer.runner.run = srv.servicer.batcher.compute = run
    srv.servicer.runner.prefill = prefill
    try:
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
        references = [greedy_reference(model, p, 4) for p in prompts]
        calls = [(await open_verifier(srv.stub, p))[0] for p in prompts]
        replies = await asyncio.gather(*(verify(call, 1, len(p), ref[:3])
                                         for call, p, ref in zip(calls, prompts, references)))
        for reply, ref in zip(replies, references):
            assert reply.WhichOneof("kind") == "result", reply
            assert reply.result.accepted == 3 and reply.result.next_token == ref[3]
        assert 2 in sizes, sizes  # the two blocks were verified in one batch
        assert threads == {threading.get_ident()}, "a pass ran off the event loop's thread"
        for call in calls:
            await call.done_writing()
    finally:
        await srv.stop()


@pytest.mark.parametrize("kv_backend", ["fast", "hf"])
async def test_a_long_prompt_is_prefilled_in_chunks_with_the_loop_running(model, monkeypatch, kv_backend):
    """On a CPU replica a prompt longer than --prefill-chunk goes in chunks, with the event loop running
    between them; the session then verifies as with a one-pass prefill: same steering vector for block 1
    (to fp32 noise), same accepted count and next token."""
    monkeypatch.delenv("STEERSPEC_INLINE_COMPUTE", raising=False)
    head = SteeringHead(model.config.hidden_size, default_layers(model.config.num_hidden_layers))
    with torch.no_grad():
        head.proj.weight.add_(0.05 * torch.randn_like(head.proj.weight))
    head = head.eval()
    prompt = [(7 * i + 3) % 50 + 1 for i in range(14)]
    reference = greedy_reference(model, prompt, 4)
    replies = {}
    for chunk in (0, 3):
        srv = await start(model, prefill_chunk=chunk, kv_backend=kv_backend, steering_head=head)
        calls, ticks = [], 0
        real_chunk = srv.servicer.runner.prefill_chunk

        def counted(*args):
            calls.append((args[2], args[3], ticks))
            return real_chunk(*args)

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        srv.servicer.runner.prefill_chunk = counted
        tick_task = asyncio.ensure_future(ticker())
        try:
            call, ready = await open_verifier(srv.stub, prompt, steering=True)
            reply = await verify(call, 1, len(prompt), reference[:3])
            await call.done_writing()
        finally:
            tick_task.cancel()
            await srv.stop()
        assert ready.WhichOneof("kind") == "ready" and ready.ready.committed_length == len(prompt)
        assert reply.WhichOneof("kind") == "result" and reply.result.accepted == 3
        assert reply.result.next_token == reference[3]
        replies[chunk] = (wire.tensor_from_proto(ready.ready.steering), calls)
    assert replies[0][1] == []  # one pass
    chunks = replies[3][1]
    assert [(a, b) for a, b, _ in chunks] == [(0, 3), (3, 6), (6, 9), (9, 12)]  # then 12 is fed with the steering taps
    assert len({t for _, _, t in chunks}) == len(chunks), "the loop did not run between chunks"
    torch.testing.assert_close(replies[3][0], replies[0][0], atol=1e-5, rtol=1e-4)


async def test_cancelling_a_session_mid_batch_keeps_the_batch_exact(model, monkeypatch):
    """A stream cancelled while its block is in a batch on the compute thread (a GPU replica's; forced
    here): the batch still runs on that session's cache, the other session's result is exact, and the
    cancelled cache is freed after."""
    import threading
    import time

    monkeypatch.setenv("STEERSPEC_INLINE_COMPUTE", "0")
    srv = await start(model, batch_window_ms=500.0)
    real_run, entered, seen = srv.servicer.runner.run, threading.Event(), {}

    def gated_run(jobs):  # the compute thread: hold the batch until the cancelled session has closed
        victim = next((j.session for j in jobs if j.session.session_id == "cancelled"), None)
        if victim is not None and len(jobs) > 1:
            entered.set()
            deadline = time.monotonic() + 10.0
            while not victim.closed and time.monotonic() < deadline:
                time.sleep(0.002)
            seen.update(closed=victim.closed, cached=victim.lm.length, session=victim)
        return real_run(jobs)

    srv.servicer.runner.run = srv.servicer.batcher.compute = gated_run
    try:
        prompt_a, prompt_b = [5, 6, 7, 8, 9, 10], [11, 12, 13]
        reference = greedy_reference(model, prompt_b, 4)
        call_a, _ = await open_verifier(srv.stub, prompt_a, session_id="cancelled")
        call_b, _ = await open_verifier(srv.stub, prompt_b)
        task_a = asyncio.ensure_future(verify(call_a, 1, len(prompt_a), [1, 2, 3]))
        task_b = asyncio.ensure_future(verify(call_b, 1, len(prompt_b), reference[:3]))
        assert await asyncio.to_thread(entered.wait, 10.0), "the two blocks were never batched"
        call_a.cancel()
        reply = await task_b
        assert reply.WhichOneof("kind") == "result", reply
        assert reply.result.accepted == 3 and reply.result.next_token == reference[3]
        assert seen["closed"] and seen["cached"] == len(prompt_a) - 1  # closed, yet its cache was intact
        await wait_for_stats(srv.stats, lambda s: s.active_sessions == 1)
        assert seen["session"].lm.length == 0  # freed once the batch was done with it
        task_a.cancel()
        await asyncio.gather(task_a, return_exceptions=True)
        await call_b.done_writing()
    finally:
        await srv.stop()


async def test_packed_fast_sessions_verify_as_the_transformers_path(model):
    """Sessions on FastCachedLM (what a CPU replica gives them: one packed pass per batch) return
    what transformers-cache sessions return for the same blocks and seeds: accepted counts, next
    tokens, steering vectors; batches of three ragged sessions and of one, greedy and sampled."""
    from steerspec.decoding.sampling import SamplingParams, SparseDist
    from steerspec.models.kv import CachedLM, FastCachedLM
    from steerspec.serving.wire import WireBlock
    from verifier_service.verify_batcher import VerifyRunner
    from verifier_service.verify_jobs import VerifyJob
    from verifier_service.verify_sessions import VerifierSession

    head = SteeringHead(model.config.hidden_size, default_layers(model.config.num_hidden_layers))
    with torch.no_grad():
        head.proj.weight.add_(0.05 * torch.randn_like(head.proj.weight))
    runner, vocab = VerifyRunner(model, steering_head=head.eval()), model.config.vocab_size
    assert isinstance(verify_sessions.session_lm(model), FastCachedLM)  # a CPU replica's sessions
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (5, 12, 1)]
    temps = [0.0, 1.0, 0.8]

    def open_all(cache):
        sessions = [VerifierSession(session_id=str(i), lm=cache(model), committed=len(p), pending=p[-1],
                                    params=SamplingParams(temperature=t), generator=torch.Generator().manual_seed(i),
                                    max_k=16, steering=i != 2)
                    for i, (p, t) in enumerate(zip(prompts, temps))]
        return sessions, [runner.prefill(s, p) for s, p in zip(sessions, prompts)]

    fast, fast_g = open_all(FastCachedLM)
    slow, slow_g = open_all(CachedLM)
    for a, b in zip(fast_g, slow_g):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-4))
    accepted, texts = [], [list(p) for p in prompts]
    for round_ in range(5):
        rows = [0] if round_ == 2 else [0, 1, 2]  # round 2: a batch of one
        blocks = []
        for i in rows:
            k = 2 + (i + round_) % 4  # the verifier's greedy continuation, its last draft random
            last = int(torch.randint(0, vocab, (1,), generator=gen))
            ids = torch.tensor(greedy_reference(model, texts[i], k - 1) + [last])
            if temps[i] == 0.0:
                q = None
            else:  # a sparse q over 8 ids, the draft among them
                support = torch.randint(0, vocab, (k, 8), generator=gen)
                support[:, 0] = ids
                q = SparseDist(ids=support, probs=torch.softmax(torch.randn(k, 8, generator=gen), -1),
                               floor=torch.zeros(k), vocab=vocab)
            blocks.append((i, ids, q))
        results = []
        for sessions in (fast, slow):
            jobs = [VerifyJob(sessions[i], WireBlock(round_ + 1, sessions[i].committed, ids.numpy(), q))
                    for i, ids, q in blocks]
            results.append(runner.run(jobs))
            for job, result in zip(jobs, results[-1]):
                job.session.committed += result.accepted + 1
                job.session.pending = result.next_token
        for (i, ids, _), result in zip(blocks, results[0]):
            texts[i] += ids[: result.accepted].tolist() + [result.next_token]
        for got, want in zip(*results):
            assert (got.accepted, got.next_token, got.is_bonus) == (want.accepted, want.next_token, want.is_bonus)
            assert (got.steering is None) == (want.steering is None)
            if got.steering is not None:
                torch.testing.assert_close(got.steering, want.steering, atol=1e-4, rtol=1e-4)
            accepted.append(got.accepted)
        assert [s.lm.length for s in fast] == [s.lm.length for s in slow] == [s.committed - 1 for s in fast]
    assert len(set(accepted)) > 1  # both accepting and rejecting blocks were compared


async def test_the_weight_copies_of_multi_row_passes_are_made_before_serving(tmp_path):
    """A fresh model's packed (or out-major) copies exist once the server is up: the first block
    does not pay for them."""
    from steerspec.models.layouts import CACHE_ATTR, PACKED_ATTR, onednn_min_rows

    fresh = load_model(str(make_tiny_llama(tmp_path, seed=3)))
    assert PACKED_ATTR not in fresh.__dict__ and CACHE_ATTR not in fresh.__dict__
    srv = await start(fresh)
    try:
        attr = PACKED_ATTR if onednn_min_rows() else CACHE_ATTR
        assert len(fresh.__dict__[attr]) == 7 * fresh.config.num_hidden_layers + 1
    finally:
        await srv.stop()
