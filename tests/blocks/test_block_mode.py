"""`blocks.block_mode.parse_mode`: a request's fields parsed once into the typed mode every service reads."""

from __future__ import annotations

import pytest

from steerspec.blocks.block_mode import CHAIN, SPRINTER_RUN, TREE, VERIFIER_ALONE, ModeError, parse_mode


def test_each_kind_and_its_block_limit():
    chain = parse_mode(k=3)
    assert (chain.kind, chain.policy, chain.block_limit, chain.draft_depth, chain.tree_spec) == (CHAIN, "fixed", 3, 3, "")
    assert parse_mode(k=3, policy="gammatune:gmax=8").block_limit == 8  # the policy's own bound
    tree = parse_mode(tree="0, 1 ,00", verification="block")
    assert (tree.kind, tree.tree_spec, tree.block_limit, tree.draft_depth, tree.acceptance) == (TREE, "0,1,00", 3, 2,
                                                                                                "block")
    run = parse_mode(verification="sprinter:max_run=6")
    assert (run.kind, run.k, run.block_limit, run.lossy, run.policy) == (SPRINTER_RUN, 6, 6, True, "fixed")
    alone = parse_mode(speculative=False)
    assert (alone.kind, alone.speculative, alone.block_limit) == (VERIFIER_ALONE, False, 0)
    assert not chain.lossy and chain.acceptance == "token" and chain.verification.spec() == "exact"


def test_a_chain_that_names_no_policy_takes_the_default_and_others_keep_their_own():
    assert parse_mode(k=4, default_policy="latency").policy == "latency"
    assert parse_mode(k=4, policy="fixed", default_policy="latency").policy == "fixed"
    assert parse_mode(tree="0,1", default_policy="latency").policy == "fixed"  # the tree sets the length
    assert parse_mode(verification="sprinter", default_policy="latency").policy == "fixed"


@pytest.mark.parametrize("fields, message", [
    ({"tree": "0,11"}, "tree: "),
    ({"tree": "0,1", "speculative": False}, "needs mode 'speculative'"),
    ({"tree": "0,1", "verification": "sprinter"}, "'exact' or 'block'"),
    ({"tree": "0,1", "policy": "gammatune"}, "sizes trees (fixed, load)"),
    ({"verification": "sprinter", "policy": "latency"}, "policy 'fixed'"),
    ({"verification": "sprinter", "speculative": False}, "mode 'speculative'"),
    ({"verification": "sprinter:max_run=65"}, "at most 64"),
    ({"verification": "blocky"}, "verification: unknown verification"),
    ({"policy": "warp9"}, "warp9"),
    ({"k": 2, "default_policy": "warp9"}, "warp9"),
])
def test_refusals_name_the_field_and_the_fix(fields, message):
    with pytest.raises(ModeError) as info:
        parse_mode(**fields)
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1
