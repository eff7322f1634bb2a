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
