"""Pacer's offline tuning (`steerspec/train/pacer_tune.py`): the stop rule replayed on labelled blocks."""

from __future__ import annotations

import pytest
import torch

from steerspec.train.pacer_tune import BlockCost, stop_lengths, tokens_per_ms, tune


def test_stop_rule_rounds_threshold_growth_and_cap():
    acc = torch.tensor([[0.9, 0.9, 0.1, 0.1, 0.9, 0.9],    # round 2 (mean 0.1) is low: stop after 4
                        [0.9, 0.9, 0.9, 0.9, 0.9, 0.9],    # never low: the cap
                        [0.2, 0.9, 0.9, 0.9, 0.9, 0.9]])   # round 1 (mean 0.55) <= 0.6: stop after 2
    assert stop_lengths(acc, b=2, t=0.6, rho=1.0, cap=6).tolist() == [4, 6, 2]
    assert stop_lengths(acc, b=2, t=0.6, rho=1.0, cap=5).tolist() == [4, 5, 2]
    # t grows by rho after each round that continues: 0.5 -> 0.95 stops the second block at round 2
    assert stop_lengths(acc, b=2, t=0.5, rho=1.9, cap=6).tolist() == [4, 4, 4]
    assert stop_lengths(acc, b=1, t=0.15, rho=1.0, cap=6).tolist() == [3, 6, 6]


def test_committed_tokens_over_modelled_time():
    cost = BlockCost(draft_ms=1.0, v0=10.0, v1=0.5)
    stop, accepted = torch.tensor([2, 4]), torch.tensor([5, 1])
    # committed (2+1) + (1+1) = 5 tokens; time (2 + 10 + 1.5) + (4 + 10 + 2.5) = 30 ms
    assert tokens_per_ms(stop, accepted, cost) == pytest.approx(5 / 30)


def _blocks(n: int, gamma: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    accepted = torch.randint(0, gamma + 1, (n,), generator=gen)
    return accepted, torch.arange(gamma)[None, :] < accepted[:, None]


def test_an_informative_head_beats_the_best_fixed_k_and_a_constant_one_cannot():
    accepted, label = _blocks(400, 12)
    cost = BlockCost(draft_ms=2.0, v0=20.0, v1=1.0)
    sharp = tune(label.float() * 0.9 + 0.05, accepted, cost, cap=12)
    assert sharp["gain_over_best_fixed"] > 1.2 and sharp["b"] == 1
    flat = tune(torch.full((400, 12), 0.5), accepted, cost, cap=12)
    assert flat["gain_over_best_fixed"] <= 1.0 + 1e-9  # constant predictions only reproduce fixed lengths
    # a dearer block (network time) makes the best fixed k longer
    far = tune(torch.full((400, 12), 0.5), accepted, BlockCost(2.0, 20.0, 1.0, rtt_ms=200.0), cap=12)
    assert far["best_fixed_k"] > flat["best_fixed_k"]


def test_decoding_replay_chains_blocks_as_greedy_decoding_does():
    """With a block labelled at every answer position, the replay drafts from position 0, then from where
    the last block's min(L, n) + 1 committed tokens end, prompt by prompt."""
    from steerspec.train.pacer_tune import decoding_chains, visited

    prompt = torch.tensor([0] * 6 + [1] * 3)
    accepted = torch.tensor([2, 0, 0, 1, 0, 0, 0, 5, 0])
    chains = decoding_chains(prompt)
    assert chains == [(0, 6), (6, 3)]
    # k=2: prompt 0 commits 3 (rows 0), 2 (row 3), 1 (row 5); prompt 1 commits 1 (row 6), then 3 (row 7) and ends
    assert visited(torch.full((9,), 2), accepted, chains).tolist() == [0, 3, 5, 6, 7]
    assert visited(torch.full((9,), 1), accepted, chains).tolist() == [0, 2, 3, 5, 6, 7]


def test_decoding_replay_scores_only_the_visited_blocks():
    """Blocks decoding never starts from cannot sway the choice: an easy block skipped by every chain
    leaves the replayed rate unchanged, while the pooled replay counts it."""
    prompt = torch.zeros(4, dtype=torch.long)
    cost = BlockCost(draft_ms=1.0, v0=10.0, v1=0.0)
    flat = torch.full((4, 4), 0.5)
    hard = torch.tensor([3, 0, 0, 0])  # k=4 from row 0 commits 4 tokens: rows 1..3 are never visited
    easy = torch.tensor([3, 3, 3, 0])
    from steerspec.train.pacer_tune import decoding_chains

    chains = decoding_chains(prompt)
    a = tune(flat, hard, cost, cap=4, chains=chains, b_grid=(4,), t_grid=(0.5,), rho_grid=(1.0,))
    b = tune(flat, easy, cost, cap=4, chains=chains, b_grid=(4,), t_grid=(0.5,), rho_grid=(1.0,))
    assert a["replay"] == "decoding" and a["tokens_per_s"] == b["tokens_per_s"]
    pooled = (tune(flat, hard, cost, cap=4, b_grid=(4,), t_grid=(0.5,), rho_grid=(1.0,)),
              tune(flat, easy, cost, cap=4, b_grid=(4,), t_grid=(0.5,), rho_grid=(1.0,)))
    assert pooled[0]["tokens_per_s"] < pooled[1]["tokens_per_s"]


def test_a_stop_head_pays_per_round():
    cost = BlockCost(draft_ms=1.0, v0=10.0, v1=0.0, round_ms=2.0)
    n = torch.tensor([4.0])
    assert float(cost.block_ms(n)) == 14.0  # fixed k: no head runs
    assert float(cost.block_ms(n, b=1)) == 22.0 and float(cost.block_ms(n, b=3)) == 18.0  # ⌈4/3⌉ = 2 rounds


def test_a_measured_verify_table_prices_each_block_length():
    """Verify passes measured per token count (flat for 1–3 tokens, a step at 4) replace the line where
    measured; past the table the line's slope continues from its last entry. With that step the best
    fixed k is 2 (3 tokens), where a line through the 1- and 9-token costs would say 1."""
    table = (40.0, 40.5, 41.0, 58.0, 60.0, 62.0, 64.0, 66.0, 68.0)
    cost = BlockCost(draft_ms=3.0, v0=38.5, v1=3.5, verify_ms=table)
    assert cost.verify(torch.tensor([1.0, 3.0, 4.0, 9.0, 11.0])).tolist() == pytest.approx([40.0, 41.0, 58.0, 68.0, 75.0])
    assert cost.block_ms(torch.tensor([2.0])).item() == pytest.approx(2 * 3.0 + 41.0)
    accepted, _ = _blocks(400, 8)
    accepted = accepted.clamp(max=3)
    flat = torch.full((400, 8), 0.5)
    assert tune(flat, accepted, cost, cap=8)["best_fixed_k"] == 2
    assert tune(flat, accepted, BlockCost(draft_ms=3.0, v0=38.5, v1=3.5), cap=8)["best_fixed_k"] != 2


def test_the_model_card_states_the_verify_costs_the_tuning_used():
    from steerspec.train.policy_heads import _verify_text

    assert _verify_text({"v0": 25.06, "v1": 3.624}) == "25.1 + 3.62·tokens ms"
    assert _verify_text({"v0": 1.0, "v1": 2.0, "verify_ms": [40.04, 40.5, 58.0]}) == "1..3 tokens 40.0, 40.5, 58.0 ms"


def test_measured_verify_costs_are_made_non_decreasing_by_pooling_violators():
    from steerspec.train.pacer_tune import nondecreasing

    assert nondecreasing([49.0, 69.0, 64.0, 79.0]) == pytest.approx([49.0, 66.5, 66.5, 79.0])
    assert nondecreasing([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert nondecreasing([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]
