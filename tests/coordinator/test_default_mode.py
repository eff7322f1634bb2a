"""One default everywhere: a request that names no k, tree or policy drafts the default tree sized by the
load-aware policy (`blocks.block_mode.default_fields`), through the coordinator, the SDK and `steerspec run`;
anything named is honoured as before. Greedy output stays the verifier's."""

from __future__ import annotations

import pytest

from coordinator.local import LocalCluster
from coordinator.loop import SessionRequest
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
from steerspec.decoding.trees import DEFAULT_TREE, parse_tree
from steerspec.models import load_model, resolve_model_dir

PROMPTS = [[4, 57, 310, 12, 96], [88, 23, 7]]
NEW_TOKENS = 21


@pytest.mark.parametrize("fields,want", [
    ({}, (parse_tree(DEFAULT_TREE).spec(), "load", 4)),
    ({"k": 3}, ("", "fixed", 3)),
    ({"policy": "latency"}, ("", "latency", 4)),
    ({"tree": "0,1"}, ("0,1", "fixed", 4)),
    ({"tree": "0,1", "policy": "load"}, ("0,1", "load", 4)),
    ({"verification": "block"}, (parse_tree(DEFAULT_TREE).spec(), "load", 4)),
    ({"mode": "autoregressive"}, ("", "fixed", 4)),
])
def test_a_request_that_names_nothing_gets_the_load_aware_tree(fields, want):
    request = SessionRequest(prompt_ids=[1, 2], **{"k": 0, "policy": "", **fields}).validate()
    assert (request.tree, request.policy, request.k) == want


def test_a_policy_that_drafts_chains_is_refused_with_a_tree():
    from coordinator.streams import SessionError

    with pytest.raises(SessionError, match="sizes trees"):
        SessionRequest(prompt_ids=[1], tree="0,1", policy="latency").validate()


@pytest.fixture(scope="module")
def pair():
    return load_model(resolve_model_dir("verifier")), load_model(resolve_model_dir("pretrained"))


async def test_the_default_through_the_services_and_the_sdk_is_the_verifiers_greedy_output(pair):
    verifier, drafter = pair
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    expected = [autoregressive_generate(verifier, ids, config).token_ids for ids in PROMPTS]
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
        for ids, want in zip(PROMPTS, expected):
            got = await cluster.generate(ids, max_new_tokens=NEW_TOKENS)  # names nothing
            assert list(got.token_ids) == want
        client = cluster.client()
        try:
            summary = await client.acomplete(prompt_ids=PROMPTS[0], max_new_tokens=NEW_TOKENS)
        finally:
            await client.aclose()
        assert list(summary.token_ids) == expected[0]
