"""The load-aware policy (`load`): block shapes (chains, tree prefixes, grown trees) from acceptance per node, the
link and the verifier's reported load; exact at any size (greedy output is the verifier's, sampling its
distribution), carried through failover."""

from __future__ import annotations

from collections import Counter

import pytest

from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
from steerspec.decoding.sampling import SamplingParams
from steerspec.decoding.tree_decoding import tree_generate
from steerspec.models.backends import cached_lm
from steerspec.decoding.trees import DEFAULT_TREE, parse_tree
from steerspec.policies import BlockFeedback, LoadAware, make_policy
from steerspec.policies import shapes
from steerspec.policies.registry import known_policies, max_block

PASS = dict(cost_fixed_ms=41.6, cost_per_row_ms=4.25)  # the edge fit of docs/results/capacity.md (AMD EPYC)
TREE = parse_tree(DEFAULT_TREE).paths  # "0", "1", "2", "00", "10": node 3 is "00", node 4 "10"


def settled(policy: LoadAware, blocks: int, *, shape=TREE, path=(0, 3), batch: int = 1, queue_ms: float = 0.0,
            verify_ms: float = 60.0, cost=PASS) -> None:
    """Feed `blocks` verdicts of one shape at one load (RTT 50: network 50 ms; drafting 1 ms + 3 ms per level)."""
    for _ in range(blocks):
        policy.next_shape(TREE)
        depth = max((len(p) for p in shape), default=0)
        policy.update(BlockFeedback(len(path), len(shape), draft_ms=1.0 + 3.0 * depth, verify_ms=verify_ms,
                                    queue_ms=queue_ms, network_ms=50.0, overhead_ms=3.0, path=path, shape=shape,
                                    batch_size=batch, **cost))


def test_registered_for_trees_with_its_bound():
    entry = known_policies()["load"]
    assert entry.trees and max_block("load:max=6") == 6 and make_policy("load").min_k == 0


def test_shapes_are_chains_tree_prefixes_and_grown_trees():
    def acc(path):  # a top-1 child accepted 80% of the time when its parent was, a second choice 10%
        return 0.8 if path[-1] == 0 else 0.1

    options = shapes.candidates(TREE, 5, acc)
    assert () in options and shapes.chain(5) in options and TREE[:4] in options
    assert shapes.grown(acc, 3, 2)[-1] == ((0,), (0, 0), (0, 0, 0))  # 0.8, 0.64, 0.51 > 0.1
    assert shapes.grown(acc, 5, 2)[-1] == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0))  # 0.33 > 0.1
    assert shapes.expected_tokens(((0,), (1,), (0, 0)), acc) == pytest.approx(1 + 0.8 + 0.1 + 0.64)


def test_alone_on_the_verifier_a_chain_pays_when_side_branches_never_do():
    """One session, an idle verifier, the tree's path always "0" then "00" and its side branches never accepted: the
    model prices a chain (deeper nodes take what "00" learned) above every prefix of the tree and the verifier alone."""
    policy = LoadAware(max=5)
    settled(policy, 60, path=(0, 3))
    best = policy.next_shape(TREE)
    assert best == shapes.chain(len(best)) and len(best) >= 3
    assert policy.rate(best) > max(policy.rate(TREE[:n]) for n in range(6))
    assert policy.rate(best) > 1.3 * policy.rate(())


def test_a_sibling_that_pays_keeps_a_tree():
    """The top-1 draft accepted half the time and the second choice the other half, each child accepted half the
    time after "0" and never after "1": a tree holding both beats any chain (a chain's first node is lost half the
    time)."""
    policy = LoadAware(max=5)
    for i in range(80):
        settled(policy, 1, path=((0, 3), (0,), (1,), (1,))[i % 4])
    best = policy.next_shape(TREE)
    assert (0,) in best and (1,) in best, best
    assert policy.rate(best) > max(policy.rate(shapes.chain(n)) for n in range(6))


def test_a_crowded_verifier_shrinks_the_block_to_what_pays_for_every_session():
    """About 16 sessions at 8 blocks a pass, waiting about a pass: priced as if every session sent the same shape,
    the 5-node tree costs more verifier time than its tokens are worth; one draft still pays, a rare one does not."""
    policy = LoadAware(max=5)
    settled(policy, 60, path=(0,), batch=8, queue_ms=60.0)  # "0" accepted, its child not
    assert 10 < policy.sessions < 30
    assert policy.next_shape(TREE) == ((0,),) and policy.next_k() == 1  # the likely first node only
    weak = LoadAware(max=5)
    settled(weak, 60, path=(), batch=8, queue_ms=60.0)
    assert weak.next_shape(TREE) == () and weak.next_k() == 0  # nothing the drafter proposes is accepted


def test_the_choice_follows_the_load_back():
    policy = LoadAware(max=5)
    for i in range(60):  # "0" accepted 3 times in 4, "00" after it 2 times in 3
        settled(policy, 1, path=((0, 3), (0, 3), (0,), ())[i % 4], batch=8, queue_ms=60.0)
    busy = len(policy.next_shape(TREE))
    settled(policy, 80, shape=((0,),), path=(0,), batch=1)
    assert busy <= 1 and len(policy.next_shape(TREE)) >= 3


def test_blocks_of_no_drafts_keep_measuring_the_load():
    """A session at n = 0 still reads the verifier's load from each result, so it drafts again when the load
    falls."""
    policy = LoadAware(max=4)
    settled(policy, 40, path=(), batch=16, queue_ms=120.0)
    assert policy.next_k() == 0
    for _ in range(60):
        policy.update(BlockFeedback(0, 0, draft_ms=1.0, verify_ms=45.0, network_ms=50.0, batch_size=1, **PASS))
    assert policy.blocks < 1.5 and policy.sessions < 1.5


def test_after_a_crowded_spell_drafting_comes_back_when_the_load_falls():
    """A crowded verifier and a busy edge (the coordinator's draft wait 150 ms) settle the shape at none or one node;
    when the load falls the blocks grow again, within a few dozen blocks, to the chain of the nodes accepted there
    (the load and the wait per level follow fast)."""
    policy = LoadAware(max=5)
    settled(policy, 30, path=(0, 3), batch=1)
    for _ in range(60):
        shape = policy.next_shape(TREE)
        depth, path = shapes.depth(shape), ((0,) if shape else ())
        policy.update(BlockFeedback(len(path), len(shape), draft_ms=150.0 + 3.0 * depth, draft_compute_ms=3.0 * depth,
                                    verify_ms=110.0, queue_ms=110.0, network_ms=50.0, overhead_ms=20.0,
                                    path=path, shape=shape, batch_size=16, **PASS))
    assert len(policy.next_shape(TREE)) <= 1
    sizes = []
    for _ in range(40):
        shape = policy.next_shape(TREE)
        sizes.append(len(shape))
        path = tuple(i for i, p in enumerate(shape) if p in ((0,), (0, 0)))  # "0" and "00" accepted
        policy.update(BlockFeedback(len(path), len(shape), draft_ms=1.0 + 3.0 * shapes.depth(shape),
                                    draft_compute_ms=3.0 * shapes.depth(shape), verify_ms=45.0 + 4.25 * len(shape),
                                    network_ms=50.0, overhead_ms=3.0, path=path, shape=shape, batch_size=1, **PASS))
    assert min(sizes[-10:]) >= 2 and policy.next_shape(TREE) == ((0,), (0, 0)), sizes  # what pays: "0", "00"


def test_a_new_sequence_takes_the_load_from_its_first_result():
    """A drafter service warm-starts a session from the last one's state and resets it: the pair's estimates carry
    over, the load is read afresh from the first result (a crowd that has gone is not followed block by block)."""
    policy = LoadAware(max=5)
    settled(policy, 60, path=(0, 3), batch=8, queue_ms=60.0)
    acc = dict(policy.acc)
    policy.reset()
    settled(policy, 1, path=(0, 3), batch=1)
    assert policy.blocks == 1.0 and policy.sessions == 1.0
    assert policy.acc["0"] == pytest.approx(acc["0"], abs=0.1) and policy.acc["00"] == pytest.approx(acc["00"], abs=0.1)
    assert len(policy.next_shape(TREE)) >= 3


def test_blocks_of_no_drafts_feed_the_policy_so_a_crowd_that_has_gone_is_forgotten(loaded_pair):
    """In process, warm from a crowded verifier's state (blocks of no drafts): each round, empty ones too, updates the
    policy, so it measures its own costs again and drafts."""
    verifier, drafter, _ = loaded_pair
    policy = LoadAware(max=5)
    settled(policy, 60, path=(), batch=16, queue_ms=120.0)
    assert policy.next_shape(TREE) == ()
    config = DecodeConfig(max_new_tokens=40)
    got = tree_generate(cached_lm(verifier), cached_lm(drafter), [4, 57, 310, 12, 96], config, "default",
                        policy=policy)
    assert got.drafted > 0 and policy.sessions == 1.0


def test_state_round_trips_through_json():
    import json

    policy = LoadAware(max=6)
    settled(policy, 20, batch=4, queue_ms=30.0)
    copy = LoadAware(max=6)
    copy.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert copy.rates() == pytest.approx(policy.rates()) and copy.next_shape(TREE) == policy.next_shape(TREE)
    with pytest.raises(ValueError, match="max=6"):
        LoadAware(max=3).load_state_dict(policy.state_dict())


@pytest.mark.parametrize("tree", [None, "default"])
def test_greedy_output_is_the_verifiers_at_every_size(loaded_pair, tree):
    verifier, drafter, _ = loaded_pair
    v, d = cached_lm(verifier), cached_lm(drafter)
    policy = make_policy("load:max=5")
    config = DecodeConfig(max_new_tokens=24)
    for ids in ([4, 57, 310, 12, 96], [88, 23, 7]):
        want = autoregressive_generate(v, ids, config).token_ids
        got = speculative_generate(v, d, ids, config, policy) if tree is None else \
            tree_generate(v, d, ids, config, tree, policy=policy)
        assert got.token_ids == want


@pytest.mark.slow
def test_sampling_with_load_aware_tree_sizes_is_the_verifiers_distribution(loaded_pair, eval_prompts):
    """600 samples of the first two tokens at T = 1, one policy across them (so block shapes change from sample to
    sample: chains, tree prefixes, grown trees and blocks of no drafts): the pairs match the verifier's distribution
    (chi-square)."""
    from distribution_helpers import P_MIN, first_two_p_values, pick_prompt

    verifier, drafter, tok = loaded_pair
    params = SamplingParams(temperature=1.0)
    ids = pick_prompt(verifier, drafter, tok, eval_prompts, params)
    v, d = cached_lm(verifier), cached_lm(drafter)
    policy = LoadAware(max=6)
    n, counts, sizes = 600, Counter(), Counter()
    for seed in range(n):
        if seed % 50 == 25:  # a load report now and then moves the size
            policy.update(BlockFeedback(0, 0, verify_ms=40.0, network_ms=50.0, batch_size=1 + seed % 16, **PASS))
        sizes[policy.next_shape(parse_tree("0,1,2,00,10,000").paths)] += 1
        config = DecodeConfig(max_new_tokens=2, sampling=params, draft_top_k=8, seed=7919 * seed + 11)
        counts[tuple(tree_generate(v, d, ids, config, "0,1,2,00,10,000", policy=policy).token_ids)] += 1
    assert len(sizes) >= 2, sizes
    p_first, p_joint = first_two_p_values(verifier, ids, params, counts, n)
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)


def test_a_block_of_no_drafts_runs_no_drafter_pass(loaded_pair):
    """The drafter spends nothing on a block the verifier answers alone: its cache stays behind, and the next block
    feeds the whole tail, drafting what a drafter that had kept up drafts."""
    from steerspec.decoding.tree_decoding import draft_tree
    from steerspec.decoding.trees import prefix

    _, drafter, _ = loaded_pair
    tree = parse_tree(DEFAULT_TREE)
    lagging, fresh = cached_lm(drafter), cached_lm(drafter)
    draft_tree(lagging, [4, 57, 310], tree)
    lagging.keep(3, [])
    tokens, fed, _ = draft_tree(lagging, [4, 57, 310, 12, 96], prefix(tree, 0))
    assert tokens == [] and fed == [] and lagging.length == 3  # nothing fed
    assert draft_tree(lagging, [4, 57, 310, 12, 96, 7], tree)[0] == draft_tree(fresh, [4, 57, 310, 12, 96, 7], tree)[0]


def test_a_blocks_own_cost_keeps_drafts_paying_on_a_crowded_verifier():
    """Two verifiers whose passes of 6-row blocks cost the same, one by rows only, one mostly by blocks (each
    session's own attention, as on the batch-invariant path): on the second a draft row is cheap beside the block it
    rides in, so at the same crowd the policy keeps more drafts per block."""
    by_rows, by_blocks = LoadAware(max=5), LoadAware(max=5)
    for i in range(80):  # "0" accepted 3 times in 4, "00" after it 1 in 3
        path = ((0, 3), (0,), (), (0,))[i % 4]
        settled(by_rows, 1, path=path, batch=8, queue_ms=60.0, cost=dict(cost_fixed_ms=45.0, cost_per_row_ms=2.25))
        settled(by_blocks, 1, path=path, batch=8, queue_ms=60.0,
                cost=dict(cost_fixed_ms=45.0, cost_per_block_ms=6.0, cost_per_row_ms=1.25))
    assert by_rows.pass_line == (45.0, 0.0, 2.25) and by_blocks.pass_line == (45.0, 6.0, 1.25)
    assert len(by_blocks.next_shape(TREE)) > len(by_rows.next_shape(TREE))
