"""A real two-node Ray cluster on loopback (the session's `ray_cluster` fixture): actors land on the
right nodes and generation works.

Head raylet: {"edge": 2, CPU 1} (drafter + coordinator); second raylet: {"verifier": 1, CPU 1}.
"""

from __future__ import annotations

import json
import os

import grpc
import pytest
import torch

pytestmark = pytest.mark.timeout(240)


def _node_with(resource: str) -> str:
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource, 0) > 0]
    assert len(nodes) == 1, nodes
    assert nodes[0]["NodeManagerAddress"] == "127.0.0.1"
    return nodes[0]["NodeID"]


def _redis_or_none(request):
    """The session's real redis-server when there is one: the deployment then self-registers."""
    try:
        return request.getfixturevalue("redis_url")
    except pytest.skip.Exception:
        return None


def _registry(redis_url: str) -> dict:
    """{kind: {address: meta}} of the live entries in the Redis endpoint registry."""
    import asyncio

    from steerspec.serving.store import connect_redis

    async def read():
        store = await connect_redis(redis_url)
        try:
            return {kind: {e.address: e.meta for e in await store.live(kind)} for kind in ("verifier", "drafter")}
        finally:
            await store.close()
    return asyncio.run(read())


@pytest.mark.slow
def test_actors_land_on_their_nodes_and_generate(ray_cluster, tiny_pair, tmp_path, request):
    import ray

    from coordinator.cli import eos_ids_of
    from coordinator.client import Client
    from coordinator.ray_app import deploy
    from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
    from steerspec.models import load_model

    verifier_dir, drafter_dir = tiny_pair
    edge_node, verifier_node = _node_with("edge"), _node_with("verifier")
    assert edge_node != verifier_node
    trace_file = tmp_path / "trace.jsonl"  # every actor appends its spans here
    redis_url = _redis_or_none(request)
    deployment = deploy(verifier=str(verifier_dir), drafter=str(drafter_dir), drafters=1, num_threads=1,
                        trace_file=str(trace_file), redis_url=redis_url, http_port=0, timeout=180)
    try:
        if redis_url:  # the model actors registered themselves, with their load
            registry = _registry(redis_url)
            assert deployment.verifier_target in registry["verifier"]
            assert deployment.drafter_targets[0] in registry["drafter"]
        nodes = deployment.nodes()
        assert nodes["verifier"] == [verifier_node]
        assert nodes["drafter"] == [edge_node]
        assert nodes["coordinator"] == [edge_node]
        for target in (deployment.verifier_target, *deployment.drafter_targets, *deployment.coordinator_targets):
            assert target.startswith("127.0.0.1:")
        # Every actor is in its own worker process, none in this driver.
        pids = ray.get([a.pid.remote() for a in deployment.actors()])
        assert len(set(pids)) == 3 and os.getpid() not in pids

        prompt = [5, 17, 42, 99, 7]
        with Client(deployment.coordinator_target, retries=1) as client:
            summary = client.complete(prompt_ids=prompt, max_new_tokens=12, k=4, timeout=120)
        assert summary.rounds >= 1 and summary.drafted > 0
        # Lossless: greedy output across the cluster equals the verifier's own greedy output.
        torch.set_num_threads(1)
        config = DecodeConfig(max_new_tokens=12, eos_token_ids=eos_ids_of(verifier_dir))
        expected = autoregressive_generate(load_model(verifier_dir), prompt, config)
        assert summary.token_ids == expected.token_ids
        assert summary.finish_reason == expected.stop_reason
        _check_cross_process_trace(trace_file, summary, pids)
        # The coordinator actor's OpenAI-compatible HTTP API: the same greedy output
        import openai
        from transformers import AutoTokenizer

        http = openai.OpenAI(base_url=deployment.coordinator_http[0] + "/v1", api_key="x", max_retries=1)
        out = http.completions.create(model=http.models.list().data[0].id, prompt=prompt, max_tokens=12,
                                      temperature=0, extra_body={"k": 4})
        tokenizer = AutoTokenizer.from_pretrained(str(verifier_dir))
        assert out.choices[0].text == tokenizer.decode(expected.token_ids, skip_special_tokens=True)
        # Adaptive draft-length policies (stopping inside a block, carrying state) on the drafter actor:
        # still the verifier's greedy output.
        with Client(deployment.coordinator_target, retries=1) as client:
            for spec in ("latency", "gammatune+:k=2", "adaedl"):
                assert client.complete(prompt_ids=prompt, max_new_tokens=12, policy=spec,
                                       timeout=120).token_ids == expected.token_ids, spec
            # ... and a draft tree, drafted by the drafter actor and walked by the verifier actor
            tree = client.complete(prompt_ids=prompt, max_new_tokens=12, tree="0,1,2,00,10", timeout=120)
            assert tree.token_ids == expected.token_ids and tree.rounds < 12
        # Deployed without allow_lossy: a sprinter request is refused, and the coordinator keeps serving.
        with Client(deployment.coordinator_target, retries=0) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.complete(prompt_ids=prompt, max_new_tokens=4, verification="sprinter", timeout=60)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--allow-lossy" in info.value.details()
            assert client.complete(prompt_ids=prompt, max_new_tokens=4, k=4, timeout=120).token_ids == \
                expected.token_ids[:4]
    finally:
        deployment.shutdown()
    if redis_url:  # a graceful stop leaves the registry
        registry = _registry(redis_url)
        assert deployment.verifier_target not in registry["verifier"]
        assert deployment.drafter_targets[0] not in registry["drafter"]


def _check_cross_process_trace(trace_file, summary, pids) -> None:
    """The generation's spans come from three processes and form one tree under one trace id."""
    import json

    spans = [json.loads(line) for line in trace_file.read_text().splitlines() if line.strip()]
    spans = [s for s in spans if s["trace_id"] == summary.trace_id]
    by_id = {s["span_id"]: s for s in spans}
    assert sum(1 for s in spans if s["parent_id"] is None or s["parent_id"] not in by_id) == 1
    servers = {s["name"]: s for s in spans if s["kind"] == "SERVER"}
    clients = {s["name"]: s for s in spans if s["kind"] == "CLIENT"}
    for method, service in (("/steerspec.v1.VerifierService/Verify", "steerspec-verifier"),
                            ("/steerspec.v1.DrafterService/Draft", "steerspec-drafter")):
        server, client = servers[method], clients[method]
        assert server["parent_id"] == client["span_id"] and server["parent_remote"]
        assert server["service"] == service and client["service"] == "steerspec-coordinator"
        assert server["pid"] != client["pid"]
    assert {s["pid"] for s in spans} == set(pids)
    blocks = [s for s in spans if s["name"] == "steerspec.block"]
    assert len(blocks) == summary.rounds
    assert len([s for s in spans if s["name"] == "steerspec.verifier.forward"]) == summary.rounds


@pytest.mark.slow
def test_steerspec_run_sprinter_on_ray_equals_in_process(ray_cluster, capsys):
    """`steerspec run --deployment ray --verification sprinter` (the coordinator actor started with
    allow_lossy, the drafter actor drafting runs with the bundled head) gives the in-process tokens, and
    its --rtt-ms reaches the coordinator actor's link."""
    from steerspec.cli import main

    argv = ["run", "def parse(line):", "--verifier", "verifier", "--drafter", "pretrained", "--max-new-tokens", "16",
            "--temperature", "1", "--seed", "5", "--threads", "1", "--json", "--verification",
            "sprinter:threshold=0.4,max_run=6"]
    assert main([*argv, "--transport", "grpc", "--deployment", "ray", "--rtt-ms", "10"]) == 0
    on_ray = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*argv, "--transport", "inproc"]) == 0
    in_process = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert on_ray["deployment"] == "ray" and on_ray["lossy"] is True and on_ray["verification"] == "sprinter"
    assert on_ray["token_ids"] == in_process["token_ids"] and len(on_ray["token_ids"]) == 16
    assert on_ray["verifier_calls"] == in_process["verifier_calls"] < 16
    assert on_ray["sprinter"] == in_process["sprinter"]  # the verifier actor's labels: the same theory figures
    assert on_ray["stage_ms"]["network"] >= 9.0


@pytest.mark.parametrize("draft", [["--k", "6"], ["--tree", "0,1,00"]], ids=["chain", "tree"])
@pytest.mark.slow
def test_steerspec_run_block_verification_on_ray_equals_in_process(ray_cluster, capsys, draft):
    """`steerspec run --deployment ray --verification block`: the verifier actor accepts a chain by block
    verification and a tree by traversal verification, token for token what the in-process engine does with the
    same seed."""
    from steerspec.cli import main

    argv = ["run", "def parse(line):", "--verifier", "verifier", "--drafter", "pretrained", "--max-new-tokens", "16",
            "--temperature", "1", "--seed", "4", *draft, "--threads", "1", "--json", "--verification", "block"]
    assert main([*argv, "--transport", "grpc", "--deployment", "ray"]) == 0
    on_ray = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*argv, "--transport", "inproc"]) == 0
    in_process = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert on_ray["deployment"] == "ray" and on_ray["verification"] == "block" and on_ray["lossy"] is False
    assert in_process["verification"] == "block"
    assert on_ray["token_ids"] == in_process["token_ids"] and len(on_ray["token_ids"]) == 16


def test_ray_app_refuses_a_missing_sprinter_head_before_ray(tmp_path, capsys):
    from coordinator.ray_app import main

    with pytest.raises(SystemExit) as info:
        main(["--allow-lossy", "--sprinter-head", str(tmp_path / "none")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no SPRINTER head" in err[0]


@pytest.mark.parametrize("argv, words", [(["--max-sessions-per-identity", "-1"], "--max-sessions-per-identity"),
                                         (["--host", "0.0.0.0"], "--insecure")])
def test_ray_app_refuses_bad_quota_and_plaintext_exposure_before_ray(argv, words, capsys):
    from coordinator.ray_app import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and words in err[0], err


@pytest.mark.slow
def test_ray_deployment_serves_tls_and_tokens(ray_cluster, tiny_pair, tmp_path, monkeypatch):
    """TLS and bearer tokens reach the Ray actors (as STEERSPEC_* variables in their runtime_env): the
    coordinator actor serves TLS, checks tokens and dials the verifier and drafter actors over TLS with
    its token; the SDK gets the verifier's greedy output only with the CA and the token."""
    from pki_helpers import make_pki

    from coordinator.client import Client
    from coordinator.ray_app import deploy
    from steerspec.serving import security
    from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
    from steerspec.models import load_model
    from steerspec.v1 import verifier_pb2, verifier_pb2_grpc

    token = "ray-test-token"
    pki = make_pki(tmp_path, token)
    (tmp_path / "token").write_text(token + "\n")
    cert, key = pki["server"]
    for name, value in {"STEERSPEC_TLS_CERT": cert, "STEERSPEC_TLS_KEY": key, "STEERSPEC_TLS_CA": pki["ca"],
                        "STEERSPEC_AUTH_TOKENS_FILE": pki["tokens"],
                        "STEERSPEC_TOKEN_FILE": str(tmp_path / "token")}.items():
        monkeypatch.setenv(name, value)
    security.reset()
    verifier_dir, drafter_dir = tiny_pair
    deployment = deploy(verifier=str(verifier_dir), drafter=str(drafter_dir), drafters=1, num_threads=1, timeout=180)
    try:
        prompt = [5, 17, 42, 99, 7]
        with Client(deployment.coordinator_target, tls_ca=pki["ca"], token=token, retries=1) as client:
            summary = client.complete(prompt_ids=prompt, max_new_tokens=8, k=4, timeout=120)
        expected = autoregressive_generate(load_model(verifier_dir), prompt, DecodeConfig(max_new_tokens=8))
        assert summary.token_ids == expected.token_ids[:len(summary.token_ids)] and summary.drafted > 0
        with Client(deployment.coordinator_target, tls_ca=pki["ca"], token="wrong", retries=0) as client:
            with pytest.raises(grpc.RpcError) as bad:
                client.complete(prompt_ids=prompt, max_new_tokens=4, timeout=60)
        assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(deployment.verifier_target) as plain:  # the verifier actor is TLS-only
            stub = verifier_pb2_grpc.VerifierServiceStub(plain)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Verify(iter([verifier_pb2.VerifyRequest()]), timeout=5))
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        deployment.shutdown()
        security.reset()


@pytest.mark.parametrize("temperature", ["0", "1"], ids=["greedy", "seeded"])
@pytest.mark.slow
def test_bfloat16_invariant_verifier_agrees_in_process_through_the_services_and_on_ray(ray_cluster, capsys,
                                                                                     temperature):
    """With the verifier in bfloat16 on its batch-invariant path, a seed gives the same tokens in process, through
    the local services and on Ray (issue 50, item 3); greedy, they are the bfloat16 verifier alone's."""
    from steerspec.cli import main

    argv = ["run", "def parse(line):", "--verifier", "verifier", "--drafter", "pretrained", "--max-new-tokens", "24",
            "--temperature", temperature, "--seed", "7", "--k", "4", "--threads", "1", "--json",
            "--dtype", "bfloat16", "--invariant", "on"]
    runs = {}
    for name, where in {"ray": ["--transport", "grpc", "--deployment", "ray"],
                        "services": ["--transport", "grpc", "--deployment", "local"],
                        "in process": ["--transport", "inproc"],
                        "alone": ["--transport", "inproc", "--mode", "autoregressive"]}.items():
        assert main([*argv, *where]) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["ray"]["deployment"] == "ray" and len(runs["ray"]["token_ids"]) == 24
    assert runs["ray"]["token_ids"] == runs["services"]["token_ids"] == runs["in process"]["token_ids"]
    if temperature == "0":
        assert runs["in process"]["token_ids"] == runs["alone"]["token_ids"]
