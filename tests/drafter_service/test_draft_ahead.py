"""Drafting ahead (drafter_service/ahead.py): while a block is verified the drafter prepares the next block for the
verdicts it ranks likeliest; a hit sends it at once. Exact (greedy output is the verifier alone's; sampled output
keeps the verifier's distribution, chi-square) and reproducible (a seed gives the same tokens on or off), for chains
and trees, unsteered and steered (SD², prepared with the previous vector), many sessions batched; both the hit and
the miss paths run. The tiny pairs here; the real pair (smollm2 + smollm2-sd2) is marked slow and real_pair."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from steerspec.decoding.outcomes import chain_outcomes, log_probs, tree_outcomes
from steerspec.decoding.trees import parse_tree
from steerspec.serving.linkemu import LinkModel

from conftest import ASSETS, BUNDLED_DRAFTER, BUNDLED_VERIFIER, bundled_pair_present

SD2 = ASSETS / "models" / "sd2"
PROMPTS = ([476, 288, 2767, 268, 591, 518, 8, 78, 303], [509, 2025, 3404, 26, 264, 343], [737, 656, 199, 551, 463])
LINK = LinkModel(rtt_ms=20.0)  # time to prepare while a block is away
AHEAD = {"draft_ahead": "on", "ahead_outcomes": 4, "ahead_budget_ms": -1.0}  # no time limit: hits every run

needs_pair = pytest.mark.skipif(not bundled_pair_present(), reason="needs the bundled model pair")


# -- ranking ------------------------------------------------------------------------------------------
def _rows(*dists):
    return torch.log(torch.tensor(dists, dtype=torch.float))


def test_chain_verdicts_are_ranked_by_the_drafters_probabilities():
    lp = _rows([0.1, 0.7, 0.2, 0.0], [0.6, 0.1, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25])  # drafts 1, 0
    got = chain_outcomes(lp, [1, 0], 3)
    # all accepted (0.7 * 0.6 = 0.42) then any bonus token (x 0.25); a rejection at the first draft: 0.2 (token 2)
    assert [(o.accepted, o.next_token) for o in got][0] == (0, 2)
    assert all(o.next_token != 1 for o in got if o.accepted == 0)  # the rejected draft is never the correction
    assert got[0].logprob == pytest.approx(float(torch.log(torch.tensor(0.2))))
    assert len(got) == 3 and got == sorted(got, key=lambda o: -o.logprob)


def test_tree_verdicts_leave_out_the_children_the_walk_tried():
    shape = parse_tree("0,1,00")  # root children: nodes 0 (rank 0), 1 (rank 1); node 2 under node 0
    tokens = [1, 2, 3]
    lp = log_probs(torch.randn(4, 6), 1.0)
    got = tree_outcomes(lp, tokens, shape, 20)
    for o in got:
        if not o.path:
            assert o.next_token not in (1, 2)  # the root's children were tried
        if o.path == (0,):
            assert o.next_token != 3
    assert {o.path for o in got} >= {(), (0,), (1,), (0, 2)}
    assert all(o.accepted == len(o.path) for o in got)


def test_cache_slices_put_a_lean_cache_back():
    from steerspec.models import load_model
    from steerspec.models.kv import FastCachedLM

    if not bundled_pair_present():
        pytest.skip("needs the bundled model pair")
    lm = FastCachedLM(load_model(BUNDLED_DRAFTER))
    lm.extend([5, 6, 7, 8, 9])
    before = lm.extend([10]).logits
    lm.rollback(5)
    saved = lm.save(3)
    lm.rollback(3)
    lm.extend([1, 2, 3, 4, 5, 6, 7])  # overwrite slots 3.. and grow
    lm.load(saved)
    assert lm.length == 5
    assert torch.equal(lm.extend([10]).logits, before)


# -- through the services -------------------------------------------------------------------------------
async def _run(drafter, requests, link=LINK, concurrent=False, **options):
    """Each request's DistributedResult through a LocalCluster, and the drafter servicer's drafting-ahead counts."""
    from coordinator.local import LocalCluster

    async with LocalCluster(str(BUNDLED_VERIFIER), str(drafter), link=link, drafter_options=options) as cluster:
        if concurrent:
            results = await asyncio.gather(*[cluster.generate(**r, steering=cluster.steering) for r in requests])
        else:
            results = [await cluster.generate(**r, steering=cluster.steering) for r in requests]
        ahead = cluster.drafter_servicers[0].ahead
        return results, (ahead.blocks, ahead.hits, ahead.prepared_total)


@needs_pair
@pytest.mark.parametrize("drafter", [BUNDLED_DRAFTER, SD2], ids=["unsteered", "sd2"])
@pytest.mark.parametrize("shape", [{"k": 4}, {"tree": "default"}], ids=["chain", "tree"])
def test_greedy_with_drafting_ahead_is_the_verifier_alone(drafter, shape):
    requests = [dict(prompt_ids=p, max_new_tokens=24, **shape, **AHEAD) for p in PROMPTS]
    alone = [dict(prompt_ids=p, max_new_tokens=24, mode="autoregressive") for p in PROMPTS]
    results, (blocks, hits, prepared) = asyncio.run(_run(drafter, requests + alone))
    for got, want in zip(results[:len(PROMPTS)], results[len(PROMPTS):]):
        assert got.token_ids == want.token_ids
    assert 0 < hits < blocks and prepared >= hits  # both paths ran: blocks sent at once, and drafted after
    summary = results[0].ahead()
    assert summary["blocks"] > 0 and 0.0 <= summary["hit_rate"] <= 1.0 and summary["prepared"] > 0


@needs_pair
@pytest.mark.parametrize("shape", [{"k": 4}, {"tree": "default"}], ids=["chain", "tree"])
def test_a_seed_gives_the_same_tokens_with_drafting_ahead_on_or_off(shape):
    def requests(setting):
        extra = AHEAD if setting == "on" else {"draft_ahead": "off"}
        return [dict(prompt_ids=p, max_new_tokens=24, temperature=1.0, seed=10 + i, **shape, **extra)
                for i, p in enumerate(PROMPTS)]

    on, (blocks, hits, _) = asyncio.run(_run(BUNDLED_DRAFTER, requests("on") + requests("off")))
    n = len(PROMPTS)
    assert [r.token_ids for r in on[:n]] == [r.token_ids for r in on[n:]]
    assert [r.block_accepted for r in on[:n]] == [r.block_accepted for r in on[n:]]
    assert hits > 0


@needs_pair
def test_batched_sessions_draft_ahead_and_keep_their_outputs():
    """Eight sessions at once (batched drafting, prepared work between their passes): each seeded output is what
    it is alone with drafting ahead off."""
    reqs = [dict(prompt_ids=PROMPTS[i % 3], max_new_tokens=16, temperature=1.0, seed=i, tree="default")
            for i in range(8)]
    together, (blocks, hits, _) = asyncio.run(_run(BUNDLED_DRAFTER, [{**r, **AHEAD} for r in reqs], concurrent=True))
    alone, _ = asyncio.run(_run(BUNDLED_DRAFTER, [{**r, "draft_ahead": "off"} for r in reqs]))
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert blocks > 0


@needs_pair
def test_a_drafter_default_off_drafts_nothing_ahead_and_a_request_can_turn_it_on():
    reqs = [dict(prompt_ids=PROMPTS[0], max_new_tokens=16, k=4)]
    _, (blocks, _, _) = asyncio.run(_run(BUNDLED_DRAFTER, reqs, draft_ahead=False))
    assert blocks == 0
    _, (blocks, hits, _) = asyncio.run(_run(BUNDLED_DRAFTER, [{**reqs[0], **AHEAD}], draft_ahead=False))
    assert blocks > 0


@pytest.mark.slow
@needs_pair
def test_sampling_through_the_services_with_drafting_ahead_is_the_verifiers_distribution():
    """600 samples of the first two tokens at T = 1 through the services with drafting ahead (8 sessions at a time;
    the second block is often the prepared one): the pairs match the verifier's distribution (chi-square)."""
    from distribution_helpers import P_MIN, first_two_p_values
    from steerspec.decoding.sampling import SamplingParams
    from steerspec.models import load_model

    ids, n = PROMPTS[1], 600

    async def sample():
        from coordinator.local import LocalCluster

        counts, hits = Counter(), 0
        async with LocalCluster(str(BUNDLED_VERIFIER), str(BUNDLED_DRAFTER), link=LinkModel(rtt_ms=10.0)) as c:
            for wave in range(0, n, 8):
                results = await asyncio.gather(*[
                    c.generate(ids, max_new_tokens=2, temperature=1.0, seed=7919 * s + 3, k=1, **AHEAD)
                    for s in range(wave, wave + 8)])
                counts.update(tuple(r.token_ids) for r in results)
            hits = c.drafter_servicers[0].ahead.hits
        return counts, hits

    counts, hits = asyncio.run(sample())
    assert hits > 50, hits
    p_first, p_joint = first_two_p_values(load_model(BUNDLED_VERIFIER), list(ids), SamplingParams(temperature=1.0),
                                          counts, n)
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)


@pytest.mark.slow
@pytest.mark.real_pair
def test_the_real_pair_with_drafting_ahead_is_the_verifier_alone_and_hits():
    """smollm2 + smollm2-sd2 (steered), greedy, the default tree at RTT 150: the verifier alone's tokens, hit rate > 0.
    (At RTT 50 a slow or shared 2-core machine drafts ahead for longer than the block is away — 83 ms a block
    measured on one — and prepares nothing in time; 150 ms leaves room on any machine the suite runs on.)"""
    from coordinator.local import LocalCluster
    from steerspec.models.checkpoints import resolve_model_dir

    verifier, drafter = str(resolve_model_dir("smollm2")), str(resolve_model_dir("smollm2-sd2"))

    async def run():
        async with LocalCluster(verifier, drafter, link=LinkModel(rtt_ms=150.0), tokenizer=verifier) as c:
            prompt = c.coordinator.tokenizer("def fibonacci(n):", add_special_tokens=False)["input_ids"]
            got = await c.generate(prompt, max_new_tokens=32, tree="default", steering=c.steering, draft_ahead="on")
            want = await c.generate(prompt, max_new_tokens=32, mode="autoregressive")
            return got, want

    got, want = asyncio.run(run())
    assert got.token_ids == want.token_ids
    assert got.ahead()["hits"] > 0
