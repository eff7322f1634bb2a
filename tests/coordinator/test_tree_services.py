"""Draft trees through the real services on 127.0.0.1 (GenerateRequest.tree): the drafter service drafts
the tree, the wire carries its nodes breadth-first with one q row per parent, the verifier walks it and
returns the accepted path, the coordinator commits along it. Greedy output is the verifier's greedy
output; sampled output equals in-process `tree_generate` with the same seed (whose exactness
tests/decoding/test_trees.py checks by chi-square), near the token budget too. Refusals name the fix."""

from __future__ import annotations

import os

import grpc
import pytest

from coordinator.local import LocalCluster
from coordinator.streams import SessionError
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
from steerspec.models import load_model, resolve_model_dir
from steerspec.models.backends import cached_lm
from steerspec.decoding.sampling import SamplingParams
from steerspec.steering import has_steering
from steerspec.decoding.tree_decoding import tree_generate
from steerspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

PROMPTS = [[4, 57, 310, 12, 96], [88, 23, 7], [5, 9, 301, 44, 17, 250, 3]]
NEW_TOKENS = 23  # odd, so the last blocks are cut near the budget
DEVICE = os.environ.get("STEERSPEC_TEST_DEVICE", "cpu")  # scripts/gpu_check.sh 8 runs these on CUDA
TREES = ["0,1,2,00,10", "0,1,00,000,01"]


@pytest.fixture(scope="module")
def pair():
    return (load_model(resolve_model_dir("verifier"), device=DEVICE),
            load_model(resolve_model_dir("pretrained"), device=DEVICE))


@pytest.mark.parametrize("tree", TREES)
async def test_a_greedy_tree_through_the_services_gives_the_verifiers_greedy_output(pair, tree):
    verifier, drafter = pair
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    expected = [autoregressive_generate(verifier, ids, config).token_ids for ids in PROMPTS]
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
        for ids, want in zip(PROMPTS, expected):
            got = await cluster.generate(ids, max_new_tokens=NEW_TOKENS, tree=tree)
            assert list(got.token_ids) == want
            assert got.generated / got.rounds > 1.0  # the tree committed more than one token per round trip


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("verification", ["exact", "block"])
@pytest.mark.slow
async def test_a_sampled_tree_through_the_services_equals_the_in_process_tree(pair, tree, verification):
    """`block`: the verifier walks the tree by traversal verification, as `tree_generate` does in process with
    `acceptance="block"`; with the same seeds it commits other tokens than recursive rejection sampling."""
    verifier, drafter = pair
    params = SamplingParams(temperature=1.0)
    expected, walked_by_rrs = {}, {}
    for seed, ids in enumerate(PROMPTS):  # before the cluster starts: this blocks the event loop
        for acceptance, out in (("block" if verification == "block" else "token", expected), ("token", walked_by_rrs)):
            config = DecodeConfig(max_new_tokens=NEW_TOKENS, sampling=params, seed=seed, draft_top_k=16,
                                  acceptance=acceptance)
            out[seed] = tree_generate(cached_lm(verifier), cached_lm(drafter), ids, config, tree)
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
        with cluster.client() as client:
            for seed, ids in enumerate(PROMPTS):
                summary = await client.acomplete(prompt_ids=ids, max_new_tokens=NEW_TOKENS, temperature=1.0,
                                                 seed=seed, draft_top_k=16, tree=tree, timeout=300,
                                                 verification=verification)
                want = expected[seed]
                assert list(summary.token_ids) == want.token_ids and summary.verification == verification
                assert summary.rounds == want.rounds and summary.accepted == want.accepted
    differs = any(expected[s].token_ids != walked_by_rrs[s].token_ids for s in expected)
    assert differs == (verification == "block")


@pytest.mark.skipif(not has_steering(resolve_model_dir("sd2")), reason="the sd2 drafter is not bundled")
async def test_a_steered_sd2_drafter_drafts_trees_through_the_services_exactly(pair):
    verifier, _ = pair
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    expected = [autoregressive_generate(verifier, ids, config).token_ids for ids in PROMPTS]
    async with LocalCluster(verifier=verifier, drafter=str(resolve_model_dir("sd2")), tokenizer=None,
                            eos_ids=(), device=DEVICE) as cluster:
        assert cluster.steering
        for ids, want in zip(PROMPTS, expected):
            got = await cluster.generate(ids, max_new_tokens=NEW_TOKENS, tree="default", steering=True)
            assert list(got.token_ids) == want


@pytest.mark.parametrize("kwargs,fix", [
    ({"tree": "0,11"}, "needs its parent"),
    ({"tree": "0,1", "policy": "gammatune"}, "sizes trees (fixed, load)"),
    ({"tree": "0,1", "mode": "autoregressive"}, "mode 'speculative'"),
])
async def test_the_coordinator_refuses_a_tree_it_cannot_run(pair, kwargs, fix):
    verifier, drafter = pair
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
        with pytest.raises(SessionError) as info:
            await cluster.generate(PROMPTS[0], max_new_tokens=4, **kwargs)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and fix in str(info.value)


async def test_a_lossy_coordinator_refuses_a_tree_with_sprinter(pair):
    verifier, drafter = pair
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=(),
                            allow_lossy=True) as cluster:
        with pytest.raises(SessionError) as info:
            await cluster.generate(PROMPTS[0], max_new_tokens=4, tree="0,1", verification="sprinter")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'exact' or 'block'" in str(info.value)


async def test_the_verifier_checks_a_tree_blocks_shape_and_rows(pair):
    """A block with more nodes than the session's tree is OUT_OF_RANGE; siblings whose q rows differ, or q with
    neither one row per node nor one per parent, are INVALID_ARGUMENT; the session then verifies a good block
    (one row per parent, as the drafter service sends) and returns its path."""
    verifier, drafter = pair
    ids = PROMPTS[1]
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
        async with grpc.aio.insecure_channel(cluster.verifier_targets[0]) as channel:
            call = verifier_pb2_grpc.VerifierServiceStub(channel).Verify(timeout=60)
            await call.write(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(
                prompt_ids=ids, tree="0,1,00", sampling=common_pb2.SamplingParams(temperature=1.0), seed=1)))
            assert (await call.read()).WhichOneof("kind") == "ready"

            def block(draft_ids, probs_rows):
                support = 2
                q = common_pb2.SparseDistribution(ids=[t for row in probs_rows for t in row[0]], support=support)
                import numpy as np

                q.probs = np.array([p for row in probs_rows for p in row[1]], dtype="<f2").tobytes()
                return common_pb2.DraftBlock(seq=1, committed_length=len(ids), draft_ids=draft_ids, q=q)

            root = ([5, 6], [0.5, 0.5])
            too_many = block([5, 6, 7, 8], [root, root, ([7, 8], [0.5, 0.5]), root])
            await call.write(verifier_pb2.VerifyRequest(block=too_many))
            reply = await call.read()
            assert reply.error.code == grpc.StatusCode.OUT_OF_RANGE.value[0] and "3 nodes" in reply.error.message
            mismatched = block([5, 6, 7], [root, ([6, 9], [0.5, 0.5]), ([7, 8], [0.5, 0.5])])
            await call.write(verifier_pb2.VerifyRequest(block=mismatched))
            reply = await call.read()
            assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "q rows differ" in reply.error.message
            one_row = block([5, 6, 7], [root])
            await call.write(verifier_pb2.VerifyRequest(block=one_row))
            reply = await call.read()
            assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "one per parent (2)" in reply.error.message
            good = block([5, 6, 7], [root, ([7, 8], [0.5, 0.5])])
            await call.write(verifier_pb2.VerifyRequest(block=good))
            reply = await call.read()
            assert reply.WhichOneof("kind") == "result", reply
            path = list(reply.result.path)
            assert len(path) == reply.result.accepted and path in ([], [0], [1], [0, 2])
            await call.done_writing()


@pytest.mark.parametrize("per_parent", [True, False], ids=["per-parent", "per-node"])
def test_the_coordinator_cuts_a_tree_blocks_q_rows_with_its_nodes(per_parent):
    """A block cut to a depth keeps its nodes down to it (a breadth-first prefix) and their rows: with one row per
    parent, the rows of their parents (`trees.q_parents`), which come first. A block carrying its own shape
    (DraftBlock.parents: a chain here) is cut by that shape, its parents with it."""
    from steerspec.blocks.block_mode import parse_mode
    from steerspec.blocks.kinds import kind_of

    mode = parse_mode(tree="0,1,2,00,10")  # parents -1, -1, -1, 0, 1
    kind = kind_of(mode)
    assert kind.room(mode, 3) == 2  # a path of depth 2 and the verifier's token
    for depth, k, rows in ((1, 3, 1), (2, 5, 3), (0, 0, 0)):
        n = 3 if per_parent else 5
        q = common_pb2.SparseDistribution(ids=list(range(2 * n)), probs=bytes(4 * n), support=2)
        block = common_pb2.DraftBlock(seq=1, draft_ids=[1, 2, 3, 4, 5], q=q)
        kind.cut(mode, block, depth)
        want = (rows if per_parent else k) if k < 5 else n
        assert list(block.draft_ids) == [1, 2, 3, 4, 5][:k]
        assert list(block.q.ids) == list(range(2 * want)) and len(block.q.probs) == 4 * want
    q = common_pb2.SparseDistribution(ids=list(range(8)), probs=bytes(16), support=2)  # a chain: a row per node
    block = common_pb2.DraftBlock(seq=2, draft_ids=[1, 2, 3, 4], q=q, parents=[-1, 0, 1, 2])
    kind.cut(mode, block, 2)
    assert list(block.draft_ids) == [1, 2] and list(block.parents) == [-1, 0] and list(block.q.ids) == [0, 1, 2, 3]


async def test_the_drafter_sends_one_q_row_per_parent(pair):
    """Siblings are drawn from one distribution: a sampled tree block carries it once (tree 0,1,2,00,10: three
    rows for five nodes, the root's, node 0's and node 1's)."""
    verifier, drafter = pair
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
        async with grpc.aio.insecure_channel(cluster.drafter_targets[0]) as channel:
            call = drafter_pb2_grpc.DrafterServiceStub(channel).Draft(timeout=60)
            await call.write(drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(
                prompt_ids=PROMPTS[0], tree="0,1,2,00,10", max_new_tokens=20, seed=3, draft_top_k=16,
                sampling=common_pb2.SamplingParams(temperature=1.0))))
            block = (await call.read()).block
            assert len(block.draft_ids) == 5 and block.q.support == 16
            assert len(block.q.ids) == 3 * 16 and len(block.q.probs) == 2 * 3 * 16
            await call.done_writing()


async def test_the_drafter_refuses_feedback_whose_path_is_not_in_its_tree(pair):
    verifier, drafter = pair
    ids = PROMPTS[0]
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
        async with grpc.aio.insecure_channel(cluster.drafter_targets[0]) as channel:
            call = drafter_pb2_grpc.DrafterServiceStub(channel).Draft(timeout=60)
            await call.write(drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(
                prompt_ids=ids, tree="0,1,00", max_new_tokens=20)))
            block = (await call.read()).block
            assert len(block.draft_ids) == 3
            bad = common_pb2.VerifyResult(seq=block.seq, accepted=2, next_token=1, path=[1, 2],
                                          committed_length=len(ids) + 3)
            await call.write(drafter_pb2.DraftRequest(feedback=drafter_pb2.DraftFeedback(result=bad, want_block=True)))
            reply = await call.read()
            assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "not a path" in reply.error.message
            good = common_pb2.VerifyResult(seq=block.seq, accepted=2, next_token=1, path=[0, 2], is_bonus=True,
                                           committed_length=len(ids) + 3)
            await call.write(drafter_pb2.DraftRequest(feedback=drafter_pb2.DraftFeedback(result=good, want_block=True)))
            nxt = (await call.read()).block
            assert nxt.seq == block.seq + 1 and nxt.committed_length == len(ids) + 3
            await call.done_writing()


async def test_a_tree_session_survives_losing_its_drafter_and_its_verifier(pair):
    """Mid-generation the session's drafter stops, then its verifier: both are reopened from the
    committed prefix with the tree, and the greedy output is still the verifier's, streamed once."""
    import asyncio

    from coordinator.client import Chunk

    verifier, drafter = pair
    ids, n = PROMPTS[0], 40
    want = autoregressive_generate(verifier, ids, DecodeConfig(max_new_tokens=n)).token_ids
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=(), verifiers=2,
                            drafters=2) as cluster:
        servers = {**dict(zip(cluster.verifier_targets, cluster.verifier_servers)),
                   **dict(zip(cluster.drafter_targets, cluster.drafter_servers))}
        store = cluster.coordinator.store
        streamed, summary, chunks = [], None, 0
        async with cluster.client(retries=0) as client:
            async for item in client.agenerate(prompt_ids=ids, max_new_tokens=n, tree="0,1,00", timeout=60,
                                               session_id="tree-failover"):
                if not isinstance(item, Chunk):
                    summary = item
                    continue
                streamed.extend(item.token_ids)
                chunks += 1
                if chunks in (2, 4):
                    placement = (await store.get_session("tree-failover")).placement
                    await asyncio.wait_for(servers[placement["drafter" if chunks == 2 else "verifier"]].stop(grace=0), 10)
    assert streamed == want == list(summary.token_ids)
    assert summary.resumes == 2 and summary.rounds < n


async def test_concurrent_tree_sessions_share_a_pass_and_keep_their_own_draws(pair):
    """Three sessions at once at T = 1 (and greedy): their trees are scored in shared packed passes, and
    each still gets exactly its in-process tokens for its seed."""
    import asyncio

    verifier, drafter = pair
    tree = "0,1,2,00,10"
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature)
        want = [tree_generate(cached_lm(verifier), cached_lm(drafter), ids,
                              DecodeConfig(max_new_tokens=NEW_TOKENS, sampling=params, seed=seed, draft_top_k=16),
                              tree).token_ids for seed, ids in enumerate(PROMPTS)]
        async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=(),
                                verifier_options={"batch_window_ms": 20.0}) as cluster:
            results = await asyncio.gather(*[
                cluster.generate(ids, max_new_tokens=NEW_TOKENS, temperature=temperature, seed=seed, draft_top_k=16,
                                 tree=tree) for seed, ids in enumerate(PROMPTS)])
        assert [list(r.token_ids) for r in results] == want, temperature
        assert max(b.batch_size for r in results for b in r.blocks) > 1  # trees shared a verifier pass


async def test_a_verifier_on_the_transformers_cache_refuses_a_tree_and_names_the_fix(pair):
    verifier, drafter = pair
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=(),
                            verifier_options={"kv_backend": "hf"}) as cluster:
        with pytest.raises(SessionError) as info:
            await cluster.generate(PROMPTS[0], max_new_tokens=4, tree="0,1")
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "--kv-backend" in str(info.value)
        assert len((await cluster.generate(PROMPTS[0], max_new_tokens=4, k=2)).token_ids) == 4  # chains still run


async def test_a_tree_session_goes_on_verifier_only_when_no_drafter_is_left(pair):
    import asyncio

    from coordinator.client import Chunk

    verifier, drafter = pair
    ids, n = PROMPTS[2], 24
    want = autoregressive_generate(verifier, ids, DecodeConfig(max_new_tokens=n)).token_ids
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
        streamed, summary, chunks = [], None, 0
        async with cluster.client(retries=0) as client:
            async for item in client.agenerate(prompt_ids=ids, max_new_tokens=n, tree="0,1,00", timeout=60):
                if not isinstance(item, Chunk):
                    summary = item
                    continue
                streamed.extend(item.token_ids)
                chunks += 1
                if chunks == 2:
                    await asyncio.wait_for(cluster.drafter_servers[0].stop(grace=0), 10)
    assert streamed == want == list(summary.token_ids)
    assert summary.resumes == 1
