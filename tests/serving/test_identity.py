"""Model identity: services state what they serve by content, and pair only with what fits.

The fingerprint is of content, not names (bundled name or directory, float32 or bfloat16: one identity; a
tokenizer of equal size with two ids swapped: another); a mismatch is refused at the verifier's and the
drafter's session open (FAILED_PRECONDITION naming both models) and the services keep serving; placement over a
registry holding two verifier models pairs each session with a compatible replica, or refuses.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from coord_helpers import greedy_reference
from coordinator.local import LocalCluster
from coordinator.model_check import FOLLOW, follow, local_model
from coordinator.server import Coordinator, serve as serve_coordinator
from steerspec.serving import wire
from steerspec.errors import UsageError
from steerspec.models import load_model, resolve_model_dir
from steerspec.serving.identity import (ModelIdentity, compatible, describe, describe_model, pair_differences,
    tokenizer_differences)
from steerspec.serving.store import InProcessStore
from steerspec.v1 import coordinator_pb2, coordinator_pb2_grpc, verifier_pb2, verifier_pb2_grpc

PROMPT = "def fibonacci(n):\n"


def permuted_copy(src: Path, dst: Path) -> Path:
    """A checkpoint copy whose tokenizer swaps two ids: same size, other content."""
    shutil.copytree(src, dst)
    data = json.loads((dst / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def permuted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("permuted")
    return {"verifier": permuted_copy(resolve_model_dir("verifier"), root / "verifier"),
            "pretrained": permuted_copy(resolve_model_dir("pretrained"), root / "pretrained")}


# ------------------------------------------------------------------------------------------ the fingerprint
def test_the_fingerprint_is_of_content_not_names_or_dtypes(permuted, tmp_path):
    by_name = describe("verifier")
    by_dir = describe(resolve_model_dir("verifier"))
    copied = describe(shutil.copytree(resolve_model_dir("verifier"), tmp_path / "elsewhere"))
    assert by_name.tokenizer == by_dir.tokenizer == copied.tokenizer and len(by_name.tokenizer) == 64
    assert replace(by_name, name="") == replace(copied, name="")
    f32 = describe_model(load_model("verifier", dtype="float32"), "verifier")
    bf16 = describe_model(load_model("verifier", dtype="bfloat16"), "verifier")
    assert f32 == bf16 == by_name
    other = describe(permuted["verifier"])
    assert other.vocab_size == by_name.vocab_size and other.tokenizer != by_name.tokenizer
    assert tokenizer_differences(by_name, other, "coordinator") and not tokenizer_differences(by_name, by_dir, "x")
    # the tiny drafters share the tiny verifier's tokenizer; the real pair's drafter reads its verifier's
    assert not pair_differences(by_name, describe("pretrained", role="drafter"))
    assert describe(permuted["pretrained"], role="drafter").draft_support == 4096


def test_identities_round_trip_the_wire_and_the_registry():
    identity = describe("sd2", role="drafter", steering_dir=resolve_model_dir("sd2"))
    assert identity.steering and identity.steering_layers == (3, 4, 5) and identity.steering_hidden_size == 256
    assert wire.identity_from_proto(wire.identity_to_proto(identity)) == identity
    assert ModelIdentity.from_dict(json.loads(json.dumps(identity.to_dict()))) == identity
    assert wire.identity_from_proto(wire.identity_to_proto(None)) is None  # an older peer: unknown, not a mismatch
    assert compatible(None, identity, "drafter") and ModelIdentity.from_dict({"bad": 1}) == ModelIdentity()


def test_steering_pairs_only_with_the_head_of_its_own_checkpoint():
    sd2 = resolve_model_dir("sd2")
    drafter = describe("sd2", role="drafter", steering_dir=sd2)
    verifier = describe("verifier", steering_dir=sd2)
    assert not pair_differences(verifier, drafter, steering=True)
    assert "no SD² steering head" in pair_differences(describe("verifier"), drafter, steering=True)[0]
    moved = replace(verifier, steering_layers=(1, 2, 3))
    assert "layers [3, 4, 5]" in " ".join(pair_differences(moved, drafter, steering=True))
    assert "different checkpoints" in pair_differences(replace(verifier, steering="0" * 64), drafter, True)[0]
    assert not pair_differences(describe("verifier"), drafter)  # unsteered sessions don't need the head


def test_the_coordinator_follows_the_verifier_and_checks_an_explicit_tokenizer(permuted):
    verifier = describe("verifier")
    model = follow(verifier)
    assert model.identity.tokenizer == verifier.tokenizer and model.max_length == verifier.context_length
    assert model.eos_ids == verifier.eos_ids
    assert follow(verifier, str(resolve_model_dir("verifier")), 100).max_length == 100
    with pytest.raises(UsageError, match="does not match the verifier's 'verifier'.*Drop --tokenizer"):
        follow(verifier, str(permuted["verifier"]))
    with pytest.raises(UsageError, match="--max-length 9999 exceeds the verifier's context of 512"):
        follow(verifier, FOLLOW, 9999)
    with pytest.raises(UsageError, match="does not resolve on this host.*pass --tokenizer"):
        follow(replace(verifier, name="/no/such/dir/on/this/host"))


def test_steerspec_run_refuses_a_drafter_of_another_vocabulary(permuted, capsys):
    from steerspec.cli import main

    code = main(["run", "--verifier", "verifier", "--drafter", str(permuted["pretrained"]), "--max-new-tokens", "4",
                 "def f(x):"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "the drafter's model" in err[0] and "'verifier'" in err[0]


# ------------------------------------------------------------------------------------------ at session open
async def _generate(target: str, prompt: str = PROMPT, n: int = 8, **fields):
    async with grpc.aio.insecure_channel(target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        out = []
        async for response in stub.Generate(coordinator_pb2.GenerateRequest(prompt=prompt, max_new_tokens=n, **fields),
                                            timeout=60):
            out.append(response)
        return out


async def test_local_cluster_refuses_a_drafter_of_another_vocabulary(permuted):
    with pytest.raises(UsageError, match="the drafter's model .* does not match the verifier's 'verifier'"):
        async with LocalCluster(verifier="verifier", drafter=str(permuted["pretrained"])):
            pass


async def test_mismatches_found_at_session_open_are_failed_precondition_and_the_services_keep_serving(permuted):
    """Replicas that did not answer at start-up: the verifier's and the drafter's handshakes refuse."""
    async with LocalCluster(verifier="verifier", drafter="pretrained") as good:
        # a coordinator whose tokenizer has two ids swapped, told nothing at start-up
        wrong = local_model(str(permuted["verifier"]))
        coordinator = Coordinator(verifiers=good.verifier_targets, drafters=good.drafter_targets,
                                  tokenizer=wrong.tokenizer, model=wrong.identity, max_length=256)
        running = await serve_coordinator(coordinator)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _generate(running.target)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            message = info.value.details()
            assert "the coordinator's model" in message and "'verifier'" in message and str(permuted["verifier"]) in message
        finally:
            await running.stop(0)
        # the verifier keeps serving: the good coordinator's greedy output is the verifier's own
        reply = await _generate(good.target, n=12)
        ids = list(reply[-1].summary.token_ids)
        prompt_ids = good.coordinator.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        assert ids == greedy_reference(resolve_model_dir("verifier"), prompt_ids, 12)[:len(ids)] and ids

    # a drafter of another vocabulary behind a verifier whose coordinator never probed it
    async with LocalCluster(verifier="verifier", drafter="pretrained", drafters=0) as verifier_only:
        drafter_cluster = LocalCluster(verifier="verifier", drafter=str(permuted["pretrained"]), tokenizer=None)
        async with drafter_cluster:
            coordinator = Coordinator(verifiers=verifier_only.verifier_targets,
                                      drafters=drafter_cluster.drafter_targets, tokenizer=verifier_only.coordinator.tokenizer)
            running = await serve_coordinator(coordinator)
            try:
                coordinator.config.identities.clear()  # as if the drafter had not answered GetStats yet
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _generate(running.target)
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "the drafter's model" in info.value.details() and "'verifier'" in info.value.details()
            finally:
                await running.stop(0)


async def test_a_coordinator_started_before_its_verifier_follows_it_at_the_first_session():
    async with LocalCluster(verifier="verifier", drafter="pretrained") as cluster:
        coordinator = Coordinator(verifiers=cluster.verifier_targets, drafters=cluster.drafter_targets,
                                  follow_verifier=True)
        running = await serve_coordinator(coordinator)
        try:
            assert coordinator.tokenizer is None
            reply = await _generate(running.target, n=10)
            assert reply[-1].summary.text and coordinator.config.model.tokenizer == describe("verifier").tokenizer
            assert coordinator.config.max_length == 512 and coordinator.config.eos_ids == (0,)
            assert list(reply[-1].summary.token_ids) == list((await _generate(cluster.target, n=10))[-1].summary.token_ids)
        finally:
            await running.stop(0)


async def test_placement_pairs_sessions_with_the_verifier_of_their_model(permuted):
    """One registry, two verifier models: each coordinator's sessions land on its own model's replica."""
    store = InProcessStore()
    async with LocalCluster(verifier="verifier", drafters=0, store=store, tokenizer=None) as ours, \
            LocalCluster(verifier=str(permuted["verifier"]), drafters=0, store=store, tokenizer=None) as theirs:
        for cluster in (ours, theirs):  # self-registration, as `serve verifier --redis-url` does
            servicer_identity = wire.identity_from_proto((await _stats(cluster.verifier_targets[0])).identity)
            await store.register("verifier", cluster.verifier_targets[0], 30.0,
                                 {"active_sessions": 0, "identity": servicer_identity.to_dict()})
        model = local_model("verifier")
        coordinator = Coordinator(store=store, tokenizer=model.tokenizer, model=model.identity,
                                  eos_ids=model.eos_ids, max_length=256)
        running = await serve_coordinator(coordinator)
        try:
            for _ in range(3):
                await _generate(running.target, n=3, mode="autoregressive")
            assert (await _stats(ours.verifier_targets[0])).blocks_total >= 9
            assert (await _stats(theirs.verifier_targets[0])).blocks_total == 0
        finally:
            await running.stop(0)
        await store.expire("verifier", ours.verifier_targets[0])  # only the other model is left: refused
        coordinator = Coordinator(store=store, tokenizer=model.tokenizer, model=model.identity, max_length=256)
        running = await serve_coordinator(coordinator)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _generate(running.target, n=3, mode="autoregressive")
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "no live verifier serves the coordinator's tokenizer" in info.value.details()
        finally:
            await running.stop(0)


async def _stats(target: str):
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await verifier_pb2_grpc.VerifierServiceStub(channel).GetVerifierStats(
            verifier_pb2.GetVerifierStatsRequest(), timeout=10)
        return reply.stats
