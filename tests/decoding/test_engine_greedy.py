"""End-to-end engine tests: greedy equality, seeded determinism, stops, metrics, extension hooks."""

from __future__ import annotations

import pytest
import torch

from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
from steerspec.models import FastCachedLM, cached_lm
from steerspec.policies import FixedK, PolicyBase
from steerspec.decoding.sampling import SamplingParams

@pytest.fixture(scope="module")
def engine(loaded_pair, pair_greedy):
    verifier, drafter, tok = loaded_pair
    prompts, config, _ = pair_greedy
    assert len(prompts) == 16 and all(prompts)
    return cached_lm(verifier), cached_lm(drafter), tok, prompts, config


@pytest.fixture(scope="module")
def greedy_reference(pair_greedy):
    return pair_greedy[2]


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.slow
def test_greedy_speculative_equals_verifier_greedy(engine, greedy_reference, k):
    verifier, drafter, _, prompts, config = engine
    accepted = 0
    for ids, expected in zip(prompts, greedy_reference):
        result = speculative_generate(verifier, drafter, ids, config, FixedK(k))
        assert result.token_ids == expected
        assert result.rounds >= 1 and result.drafted <= k * result.rounds
        assert result.block_efficiency == pytest.approx(len(expected) / result.rounds)
        accepted += result.accepted
    assert accepted > 0, "the drafter never agreed with the verifier: the test would prove little"


@pytest.mark.slow
def test_dynamic_cache_backend_gives_the_same_tokens(engine, greedy_reference):
    """The transformers-forward backend (DynamicCache.crop rollback) through the same engine."""
    verifier, drafter, _, prompts, config = engine
    hf_verifier, hf_drafter = cached_lm(verifier.model, "hf"), cached_lm(drafter.model, "hf")
    assert not isinstance(hf_verifier, FastCachedLM)
    for ids, expected in list(zip(prompts, greedy_reference))[:4]:
        assert speculative_generate(hf_verifier, hf_drafter, ids, config, FixedK(4)).token_ids == expected
        assert autoregressive_generate(hf_verifier, ids, config).token_ids == expected


def test_seeded_sampling_is_deterministic(engine):
    verifier, drafter, _, prompts, config = engine
    sampled = DecodeConfig(max_new_tokens=24, sampling=SamplingParams(temperature=1.0, top_p=0.95),
                           seed=1234, eos_token_ids=config.eos_token_ids, max_length=config.max_length)
    a = speculative_generate(verifier, drafter, prompts[0], sampled, FixedK(4))
    b = speculative_generate(verifier, drafter, prompts[0], sampled, FixedK(4))
    assert a.token_ids == b.token_ids and a.block_accepted == b.block_accepted
    outputs = {tuple(speculative_generate(verifier, drafter, prompts[0],
                                          DecodeConfig(max_new_tokens=24, sampling=sampled.sampling, seed=s),
                                          FixedK(4)).token_ids) for s in range(4)}
    assert len(outputs) > 1, "different seeds should give different samples"
    ar = [autoregressive_generate(verifier, prompts[1], sampled).token_ids for _ in range(2)]
    assert ar[0] == ar[1]


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_exactly_max_new_tokens(engine, greedy_reference, max_new):
    verifier, drafter, _, prompts, _ = engine
    config = DecodeConfig(max_new_tokens=max_new)  # no EOS: always runs to the budget
    result = speculative_generate(verifier, drafter, prompts[2], config, FixedK(8))
    assert len(result.token_ids) == max_new and result.stop_reason == "length"
    assert result.token_ids == autoregressive_generate(verifier, prompts[2], config).token_ids


def test_eos_and_context_stops(engine):
    verifier, drafter, _, prompts, _ = engine
    base = autoregressive_generate(verifier, prompts[3], DecodeConfig(max_new_tokens=12)).token_ids
    eos_token = base[5]
    cut = base.index(eos_token) + 1
    config = DecodeConfig(max_new_tokens=12, eos_token_ids=(eos_token,))
    for result in (speculative_generate(verifier, drafter, prompts[3], config, FixedK(8)),
                   autoregressive_generate(verifier, prompts[3], config)):
        assert result.token_ids == base[:cut] and result.stop_reason == "eos"
    limit = len(prompts[3]) + 5
    config = DecodeConfig(max_new_tokens=12, max_length=limit)
    result = speculative_generate(verifier, drafter, prompts[3], config, FixedK(8))
    assert result.token_ids == base[:5] and result.stop_reason == "context"
    assert verifier.length <= limit


def test_metrics_are_consistent(engine):
    verifier, drafter, tok, prompts, config = engine
    result = speculative_generate(verifier, drafter, prompts[4], config, FixedK(4), tokenizer=tok)
    assert sum(result.block_drafted) == result.drafted and sum(result.block_accepted) == result.accepted
    assert all(0 <= d <= 4 for d in result.block_drafted)
    per_pos = result.accepted_per_position
    assert len(per_pos) == 4 and all(0.0 <= x <= 1.0 for x in per_pos)
    assert per_pos == sorted(per_pos, reverse=True)  # accepting position i+1 needs position i
    assert result.acceptance_rate == pytest.approx(result.accepted / result.drafted)
    data = result.to_json()
    for key in ("text", "token_ids", "block_efficiency", "acceptance_rate", "accepted_per_position",
                "rounds", "tokens_per_s", "wall_s"):
        assert key in data
    assert data["text"] == tok.decode(result.token_ids, skip_special_tokens=True)


class StopAfterOne(PolicyBase):
    """A confidence-stop stand-in: draft one token, then stop."""

    stops_early = True

    def __init__(self):
        self.updates = []

    def next_k(self) -> int:
        return 8

    def observe(self, step) -> bool:
        assert step.probs.dim() == 1 and abs(float(step.probs.sum()) - 1) < 1e-4
        return True

    def update(self, feedback):
        self.updates.append((feedback.accepted, feedback.drafted))


def test_policy_hooks_keep_output_exact(engine, greedy_reference):
    verifier, drafter, _, prompts, config = engine
    policy = StopAfterOne()
    result = speculative_generate(verifier, drafter, prompts[0], config, policy)
    assert result.token_ids == greedy_reference[0]
    assert set(result.block_drafted) <= {0, 1} and all(d == 1 for _, d in policy.updates)


class RecordingSteering:
    """Records the hidden states the engine hands to an SD²-style drafter before each block."""

    def __init__(self, layers):
        self.verifier_layers = layers
        self.seen = []

    def begin_block(self, hidden):
        self.seen.append(hidden.clone())


def test_steering_gets_hidden_states_of_the_pending_token(engine, greedy_reference):
    verifier, drafter, _, prompts, config = engine
    model = verifier.model
    layers = [0, model.config.num_hidden_layers // 2, model.config.num_hidden_layers - 1]
    steering = RecordingSteering(layers)
    committed_per_round = []
    ids = prompts[5]
    result = speculative_generate(verifier, drafter, ids, config, FixedK(4), steering=steering,
                                  on_round=lambda r: committed_per_round.append(list(r.committed)))
    assert len(steering.seen) == result.rounds
    sequence = list(ids)
    with torch.inference_mode():
        for hidden, new in zip(steering.seen, committed_per_round):
            # the position whose logits produced the pending token is len(sequence) - 2
            full = model(input_ids=torch.tensor([sequence[:-1]]), output_hidden_states=True).hidden_states
            expected = torch.stack([full[layer][0, -1] for layer in layers])
            torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=0)
            sequence.extend(new)
    assert result.token_ids == greedy_reference[5]
