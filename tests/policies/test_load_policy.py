"""The load-aware policy (`load`): block sizes from acceptance per slot, the link and the verifier's reported load;
exact at any size (greedy output is the verifier's, sampling its distribution), carried through failover."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
from steerspec.decoding.sampling import SamplingParams
from steerspec.decoding.tree_decoding import tree_generate
from steerspec.models.backends import cached_lm
from steerspec.policies import BlockFeedback, LoadAware, make_policy
from steerspec.policies.load import PROBE_EVERY, cut_order
from steerspec.policies.registry import known_policies, max_block

PASS = dict(cost_fixed_ms=41.6, cost_per_row_ms=4.25)  # the edge fit of docs/results/capacity.md (AMD EPYC)


def settled(policy: LoadAware, blocks: int, *, accepted: int = 3, drafted: int = 5, path=(0, 3), batch: int = 1,
            queue_ms: float = 0.0, verify_ms: float = 60.0, cost=PASS) -> None:
    """Feed `blocks` verdicts of one shape at one load (RTT 50: network 50 ms; drafting 2.5 ms per draft)."""
    for _ in range(blocks):
        policy.next_k()
        policy.update(BlockFeedback(accepted, drafted, draft_ms=1.0 + 2.5 * drafted, verify_ms=verify_ms,
                                    queue_ms=queue_ms, network_ms=50.0, overhead_ms=3.0, path=path, batch_size=batch,
                                    **cost))


def test_registered_for_trees_with_its_bound():
    entry = known_policies()["load"]
    assert entry.trees and max_block("load:max=6") == 6 and make_policy("load").min_k == 0


def test_alone_on_the_verifier_a_tree_of_likely_nodes_pays():
    """One session, an idle verifier: a tree whose path takes nodes 0 and 3 is priced at one pass of its rows plus
    the link; the 4-node prefix holds both (node 4 never pays) and beats fewer nodes and the verifier alone."""
    policy = LoadAware(max=5)
    settled(policy, 60, accepted=2, drafted=5, path=(0, 3), batch=1)
    assert policy.next_k() == 4
    rates = policy.rates()
    assert rates[4] > max(rates[:4]) and rates[4] > 1.3 * rates[0]


def test_a_crowded_verifier_shrinks_the_block_to_what_pays_for_every_session():
    """About 16 sessions at 8 blocks a pass, waiting about a pass: priced as if every session sent the same size,
    the 5-node tree costs more verifier time than its tokens are worth; one draft still pays, a rare one does not."""
    policy = LoadAware(max=5)
    settled(policy, 60, accepted=2, drafted=5, path=(0, 3), batch=8, queue_ms=60.0)
    assert 10 < policy.sessions < 30
    assert policy.next_k() == 1  # the likely first node only
    weak = LoadAware(max=5)
    settled(weak, 60, accepted=0, drafted=5, path=(), batch=8, queue_ms=60.0)
    assert weak.next_k() == 0  # nothing the drafter proposes is accepted: the verifier alone


def test_a_tree_is_cut_chain_first_and_its_slots_follow_the_cut():
    """Below the tree's size a block takes the top-1 chain first ("0,1,2,00,10" cut to two nodes is the chain
    "0,00", not the siblings "0,1"); a verdict on such a block credits the slots of its own nodes in that order."""
    tree = [(0,), (1,), (2,), (0, 0), (1, 0)]
    assert cut_order(tree) == [(0,), (0, 0), (1,), (1, 0), (2,)]
    assert cut_order([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])[:4] == [(0,), (0, 0), (0, 0, 0), (1,)]
    policy = LoadAware(max=5)
    shape = policy.next_shape(tree)
    assert shape == tuple(sorted(cut_order(tree)[:policy.last_k], key=lambda p: (len(p), p)))
    before = list(policy.include)
    policy.update(BlockFeedback(2, 2, draft_ms=5.0, verify_ms=40.0, network_ms=50.0, path=(0, 1),
                                shape=((0,), (0, 0))))
    assert policy.include[1] > before[1] and policy.include[2] == before[2]  # "00" accepted; "1" not drafted
    policy.update(BlockFeedback(1, 2, draft_ms=5.0, verify_ms=40.0, network_ms=50.0, path=(0,),
                                shape=((0,), (1,))))  # a breadth-first cut: "1" is slot 2
    assert policy.include[2] < before[2] and policy.judged[:3] == [2.0, 1.0, 1.0]


def test_the_choice_follows_the_load_back():
    policy = LoadAware(max=5)
    settled(policy, 60, accepted=2, drafted=5, path=(0, 3), batch=8, queue_ms=60.0)
    busy = policy.next_k()
    settled(policy, 80, accepted=1, drafted=1, path=(0,), batch=1)
    assert busy <= 1 and policy.next_k() >= 4


def test_blocks_of_no_drafts_keep_measuring_the_load():
    """A session at n = 0 still reads the verifier's load from each result, so it drafts again when the load
    falls."""
    policy = LoadAware(max=4)
    settled(policy, 40, accepted=0, drafted=4, path=(), batch=16, queue_ms=120.0)
    assert policy.next_k() == 0
    for _ in range(60):
        policy.update(BlockFeedback(0, 0, draft_ms=1.0, verify_ms=45.0, network_ms=50.0, batch_size=1, **PASS))
    assert policy.blocks < 1.5 and policy.sessions < 1.5


def test_after_a_crowded_spell_drafting_comes_back_when_the_load_falls():
    """A crowded verifier and a busy edge (the coordinator's draft wait 150 ms, the drafter's compute 3 ms a draft)
    settle the size at none; when the load falls the blocks grow again within a few dozen blocks (the hop counts as
    overhead, not as drafting; the load and the draft line follow fast)."""
    policy = LoadAware(max=5)
    settled(policy, 30, accepted=2, drafted=5, path=(0, 3), batch=1)
    for _ in range(60):
        n = policy.next_k()
        policy.update(BlockFeedback(min(n, 1), n, draft_ms=150.0 + 3.0 * n, draft_compute_ms=3.0 * n,
                                    verify_ms=110.0, queue_ms=110.0, network_ms=50.0, overhead_ms=20.0,
                                    path=(0,) if n else (), batch_size=16, **PASS))
    assert policy.next_k() <= 1
    sizes = []
    for _ in range(40):
        n = policy.next_k()
        sizes.append(n)
        policy.update(BlockFeedback(2 if n >= 4 else min(n, 1), n, draft_ms=1.0 + 2.5 * n, draft_compute_ms=2.5 * n,
                                    verify_ms=45.0 + 4.25 * n, network_ms=50.0, overhead_ms=3.0,
                                    path=(0, 3) if n >= 4 else ((0,) if n else ()), batch_size=1, **PASS))
    assert max(sizes[-10:]) >= 4, sizes


def test_a_new_sequence_takes_the_load_from_its_first_result():
    """A drafter service warm-starts a session from the last one's state and resets it: the pair's estimates carry
    over, the load is read afresh from the first result (a crowd that has gone is not followed block by block)."""
    policy = LoadAware(max=5)
    settled(policy, 60, accepted=2, drafted=5, path=(0, 3), batch=8, queue_ms=60.0)
    include = list(policy.include)
    policy.reset()
    settled(policy, 1, accepted=2, drafted=5, path=(0, 3), batch=1)
    assert policy.blocks == 1.0 and policy.sessions == 1.0 and policy.include[:3] == pytest.approx(include[:3], abs=0.1)
    assert policy.next_k() >= 4


def test_blocks_of_no_drafts_feed_the_policy_so_a_crowd_that_has_gone_is_forgotten(loaded_pair):
    """In process, warm from a crowded verifier's state (blocks of no drafts): each round, empty ones too, updates the
    policy, so it measures its own costs again and drafts."""
    verifier, drafter, _ = loaded_pair
    policy = LoadAware(max=5)
    settled(policy, 60, accepted=0, drafted=5, path=(), batch=16, queue_ms=120.0)
    assert policy.next_k() == 0
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
    assert copy.rates() == pytest.approx(policy.rates()) and copy.next_k() == policy.next_k()
    with pytest.raises(ValueError, match="slots"):
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
    """600 samples of the first two tokens at T = 1, one policy across them (so block sizes change from sample to
    sample, including blocks of no drafts): the pairs match the verifier's distribution (chi-square)."""
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
        sizes[policy.next_k()] += 1
        config = DecodeConfig(max_new_tokens=2, sampling=params, draft_top_k=8, seed=7919 * seed + 11)
        counts[tuple(tree_generate(v, d, ids, config, "0,1,2,00,10,000", policy=policy).token_ids)] += 1
    assert len(sizes) >= 2, sizes
    p_first, p_joint = first_two_p_values(verifier, ids, params, counts, n)
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)


def test_a_blocks_own_cost_keeps_drafts_paying_on_a_crowded_verifier():
    """Two verifiers whose passes of 6-row blocks cost the same, one by rows only, one mostly by blocks (each session's
    own attention, as on the batch-invariant path): on the second a draft row is cheap beside the block it rides in,
    so at the same crowd the policy keeps more of the tree."""
    by_rows, by_blocks = LoadAware(max=5), LoadAware(max=5)
    settled(by_rows, 60, batch=8, queue_ms=60.0, cost=dict(cost_fixed_ms=45.0, cost_per_row_ms=2.25))
    settled(by_blocks, 60, batch=8, queue_ms=60.0,
            cost=dict(cost_fixed_ms=45.0, cost_per_block_ms=6.0, cost_per_row_ms=1.25))
    assert by_rows.pass_line == (45.0, 0.0, 2.25, 0.0) and by_blocks.pass_line == (45.0, 6.0, 1.25, 0.0)
    assert by_rows.next_k() == 1 and by_blocks.next_k() == 4


def test_on_a_bucketed_verifier_a_block_fills_the_products_it_pays_for():
    """A batch-invariant verifier computes a pass's rows in products of 16 and reports its cost in those units
    (cost_row_bucket, cost_block_rows): with about 6 blocks a pass, 5-row blocks (30 rows) ride in the same two
    products as 3-row ones (18) and 6-row ones need a third (and a second attention product each), so the policy
    drafts 4 and not 5, more than priced by plain rows; alone on it, a block stops at the 5 rows one attention product
    holds (a sixth costs a second)."""
    def run(shape, batch: int, queue_ms: float) -> LoadAware:
        policy, rng = LoadAware(max=6), random.Random(0)
        for _ in range(150):
            n = policy.next_k()
            accepted = 0
            while accepted < n and rng.random() < 0.7:
                accepted += 1
            policy.update(BlockFeedback(accepted, n, draft_ms=1.0 + 2.5 * n, verify_ms=100.0, queue_ms=queue_ms,
                                        network_ms=50.0, overhead_ms=3.0, batch_size=batch, cost_fixed_ms=30.0,
                                        cost_per_block_ms=6.0, cost_per_row_ms=2.0, cost_row_bucket=shape[0],
                                        cost_block_rows=shape[1]))
        return policy

    bucketed, plain = run((16, 16 / 3), 6, 80.0), run((0, 0.0), 6, 80.0)
    assert bucketed.pass_shape == (16, 16 / 3) and plain.pass_shape == (1, 0.0)
    rates = bucketed.rates()
    assert bucketed.best() == 4 and rates[5] < 0.8 * rates[4]  # 6 x 5 rows fill two products, 6 x 6 need a third
    assert plain.best() < bucketed.best()  # priced by plain rows, every row costs alike
    alone = run((16, 16 / 3), 1, 0.0)
    assert alone.best() == 4 and alone.rates()[5] < alone.rates()[4]
    copy = LoadAware(max=6)
    copy.load_state_dict(bucketed.state_dict())  # the units carry through failover with the line
    assert copy.pass_shape == bucketed.pass_shape and copy.best() == 4


def test_a_branching_cut_pays_for_its_gathered_keys():
    """On the default tree "0,1,2,00,10", cuts of 1 and 2 nodes are paths ("0", "0,00") and a cut of 3 branches
    ("0,00,1"): where the verifier reports a branching block's rows dearer, a crowded session stops at the path."""
    tree = [(0,), (1,), (2,), (0, 0), (1, 0)]

    def settle(per_branched: float) -> LoadAware:
        policy = LoadAware(max=5)
        policy.next_shape(tree)
        for _ in range(40):
            policy.update(BlockFeedback(1, 2, draft_ms=6.0, verify_ms=100.0, queue_ms=80.0, network_ms=50.0,
                                        overhead_ms=3.0, batch_size=6, shape=((0,), (0, 0)), path=(0,),
                                        cost_fixed_ms=30.0, cost_per_block_ms=6.0, cost_per_row_ms=2.0,
                                        cost_per_branched_row_ms=per_branched))
        policy.include = [0.6, 0.35, 0.3, 0.05, 0.05]  # "1" accepted in 30% of blocks: worth a row if rows are cheap
        return policy

    cheap, dear = settle(0.0), settle(1.5)  # 1.5 ms a row: about what SmolLM2 measures (models/pass_shape.py)
    assert cheap.branched(3) and not cheap.branched(2) and not cheap.branched(1)
    assert cheap.best() == 3 and dear.best() == 2


def test_a_tree_session_explores_another_depth_not_a_larger_cut_of_the_same():
    """The drafter's cost line needs two depths. On "0,1,2,00,10" the cuts of 2..5 nodes are all 2 deep: a session
    whose best is the chain "0,00" and which measured only depth 2 explores the 1-deep cut, never the 3-node cut
    (which would measure nothing new, and was taken on every block before)."""
    tree = [(0,), (1,), (2,), (0, 0), (1, 0)]
    policy = LoadAware(max=5)
    policy.next_shape(tree)
    assert [policy.depth(n) for n in range(6)] == [0, 1, 2, 2, 2, 2]
    for _ in range(30):  # blocks of the 2-node chain only: the line has one depth
        policy.update(BlockFeedback(2, 2, draft_ms=6.0, verify_ms=100.0, queue_ms=80.0, network_ms=50.0,
                                    overhead_ms=3.0, batch_size=6, shape=((0,), (0, 0)), path=(0, 1),
                                    cost_fixed_ms=30.0, cost_per_block_ms=6.0, cost_per_row_ms=2.0,
                                    cost_per_branched_row_ms=1.5))
    assert policy.draft.recent_lengths(0.01) == [3] and policy.best() == 2
    assert policy.next_k() == 1


def test_a_slot_past_the_best_is_drafted_again_now_and_then():
    """A slot drafted a few times and found poor keeps that estimate while nothing drafts it: every PROBE_EVERY
    blocks the policy drafts one node past its best, so a sibling that does pay is found."""
    tree = [(0,), (1,), (2,), (0, 0), (1, 0)]
    policy = LoadAware(max=5)
    policy.next_shape(tree)
    sizes = []
    for _ in range(3 * PROBE_EVERY):
        shape = policy.next_shape(tree)
        sizes.append(len(shape))
        policy.update(BlockFeedback(1, len(shape), draft_ms=1.0 + 2.5 * max(map(len, shape), default=0),
                                    verify_ms=60.0, network_ms=50.0, overhead_ms=3.0, batch_size=1, shape=shape,
                                    path=(0,) if shape else (), cost_fixed_ms=40.0, cost_per_row_ms=4.0))
    settled = sizes[PROBE_EVERY:]
    best = max(set(settled), key=settled.count)
    assert best < 5 and 1 <= sum(n == best + 1 for n in settled) <= 4, sizes  # probed, and only now and then
