"""SD² steering mechanism: W_hml init, W_s retrofit via hooks, exactness at W_s = 0, wire format, I/O."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from steerspec.steering import (
    DrafterSteering,
    SteeringHead,
    attach_steering,
    default_layers,
    find_up_projections,
    load_steering,
    parse_layers,
    save_drafter_checkpoint,
    vector_from_bytes,
    vector_to_bytes,
)
from steerspec.errors import UsageError

D_V = 24


def tiny_llama(hidden=16, layers=3, inter=40, vocab=50, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def drafter():
    return tiny_llama()


def random_steering(model, seed=1):
    torch.manual_seed(seed)
    s = DrafterSteering.for_model(model, D_V)
    with torch.no_grad():
        s.proj.weight.normal_(0, 0.5)
        s.norm.weight.normal_(1, 0.1)
    return s


def test_default_layers_are_distinct_and_in_range():
    assert default_layers(32) == (3, 16, 30)
    assert default_layers(6) == (1, 3, 4)
    assert default_layers(4) == (1, 2, 3)
    for n in range(3, 40):
        low, mid, high = default_layers(n)
        assert 0 <= low < mid < high <= n - 1
    assert parse_layers("0,2,3", 6) == (0, 2, 3)
    assert parse_layers("auto", 6) == (1, 3, 4)
    with pytest.raises(UsageError):
        parse_layers("1,2,9", 6)
    with pytest.raises(UsageError):
        parse_layers("1,2", 6)


def test_head_starts_as_sum_of_three_layers():
    head = SteeringHead(D_V, (1, 2, 4))
    hs = [torch.randn(2, 5, D_V) for _ in range(6)]
    g = head.from_hidden_states(hs)
    torch.testing.assert_close(g, hs[1] + hs[2] + hs[4])
    assert torch.equal(head.proj.bias, torch.zeros(D_V))
    assert torch.equal(head.initial(3), torch.zeros(3, D_V))


def test_zero_ws_gives_exactly_the_plain_drafter(drafter):
    ids = torch.randint(0, 50, (2, 7))
    plain = drafter(input_ids=ids).logits
    steering = DrafterSteering.for_model(drafter, D_V)  # zero-initialised W_s
    assert torch.count_nonzero(steering.proj.weight) == 0
    with attach_steering(drafter, steering) as hooks:
        hooks.set_vector(torch.randn(2, D_V) * 10)
        assert hooks.active
        steered = drafter(input_ids=ids).logits
    assert torch.equal(plain, steered)


def test_steering_matches_a_manual_up_projection_bias(drafter):
    """Each layer l gets exactly slice l of W_s g added to its up-projection (per-layer slicing)."""

    class AddBias(nn.Module):
        def __init__(self, inner, bias):
            super().__init__()
            self.inner, self.bias = inner, bias

        def forward(self, x):
            return self.inner(x) + self.bias

    steering = random_steering(drafter)
    g = torch.randn(1, D_V)
    per_layer = steering(g)[0]  # [L, F]
    assert per_layer.shape == (3, 40)
    reference = copy.deepcopy(drafter)
    for layer, bias in zip(reference.model.layers, per_layer):
        layer.mlp.up_proj = AddBias(layer.mlp.up_proj, bias)
    ids = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        with attach_steering(drafter, steering) as hooks:
            hooks.set_vector(g)
            got = drafter(input_ids=ids).logits
        plain = drafter(input_ids=ids).logits
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, plain)


def test_hooks_detach_cleanly(drafter):
    ids = torch.randint(0, 50, (1, 5))
    before = drafter(input_ids=ids).logits
    hooks = attach_steering(drafter, random_steering(drafter))
    hooks.set_vector(torch.randn(D_V))
    assert not torch.equal(drafter(input_ids=ids).logits, before)
    hooks.clear()
    assert torch.equal(drafter(input_ids=ids).logits, before)  # no vector: plain drafter
    hooks.set_vector(torch.randn(D_V))
    hooks.remove()
    assert not hooks.attached
    assert all(len(up._forward_hooks) == 0 for up in find_up_projections(drafter))
    assert torch.equal(drafter(input_ids=ids).logits, before)


def test_per_position_vectors_and_mask(drafter):
    steering = random_steering(drafter)
    ids = torch.randint(0, 50, (2, 6))
    g = torch.randn(2, D_V)
    with torch.no_grad(), attach_steering(drafter, steering) as hooks:
        hooks.set_vector(g)
        block = drafter(input_ids=ids).logits
        hooks.set_vector(g[:, None, :].expand(2, 6, D_V).contiguous())
        per_pos = drafter(input_ids=ids).logits
        torch.testing.assert_close(per_pos, block)
        # masking every position off is the plain drafter
        hooks.set_vector(g[:, None, :].expand(2, 6, D_V).contiguous(), torch.zeros(2, 6, dtype=torch.bool))
        masked = drafter(input_ids=ids).logits
        # a masked-off position's vector cannot reach the logits, even one that overflowed to inf
        poisoned = g[:, None, :].expand(2, 6, D_V).clone()
        poisoned[:, 0] = float("inf")
        mask = torch.ones(2, 6, dtype=torch.bool)
        mask[:, 0] = False
        hooks.set_vector(poisoned, mask)
        partly = drafter(input_ids=ids).logits
        hooks.set_vector(g[:, None, :].expand(2, 6, D_V).contiguous(), mask)
        partly_finite = drafter(input_ids=ids).logits
        hooks.clear()
        plain = drafter(input_ids=ids).logits
    assert torch.equal(masked, plain)
    assert torch.isfinite(partly).all() and torch.equal(partly, partly_finite)


def test_block_bias_with_kv_cache_matches_full_forward(drafter):
    """The vector is applied to every position processed in a block, cached or not."""
    from transformers import DynamicCache

    from steerspec.models.loading import cache_kwarg

    steering = random_steering(drafter)
    ids = torch.randint(0, 50, (1, 8))
    g = torch.randn(1, D_V)
    with torch.no_grad(), attach_steering(drafter, steering) as hooks:
        hooks.set_vector(g)
        full = drafter(input_ids=ids).logits
        cache = {cache_kwarg(drafter): DynamicCache(config=drafter.config)}
        first = drafter(input_ids=ids[:, :5], use_cache=True, **cache).logits
        rest = [drafter(input_ids=ids[:, i : i + 1], use_cache=True, **cache).logits for i in range(5, 8)]
    torch.testing.assert_close(torch.cat([first] + rest, dim=1), full, atol=1e-5, rtol=1e-4)


def test_shape_mismatch_is_refused(drafter):
    with pytest.raises(ValueError, match="layers"):
        attach_steering(drafter, DrafterSteering(D_V, 5, 40))
    with pytest.raises(ValueError, match="SwiGLU"):
        find_up_projections(nn.Sequential(nn.Linear(2, 2)))


def test_vector_wire_format_is_fp16_bytes():
    g = torch.randn(D_V)
    data = vector_to_bytes(g)
    assert len(data) == 2 * D_V
    assert torch.equal(vector_from_bytes(data, D_V), g.half().float())
    with pytest.raises(ValueError):
        vector_from_bytes(data, D_V + 1)
    # beyond fp16's range (SmolLM2's attention-sink position gives |g| near 9e4): saturated, never inf
    g[:3] = torch.tensor([9e4, -1e6, float("inf")])
    back = vector_from_bytes(vector_to_bytes(g), D_V)
    assert torch.isfinite(back).all() and back[:3].tolist() == [65504.0, -65504.0, 65504.0]
    assert torch.equal(back[3:], g[3:].half().float())


def test_checkpoint_round_trip(tmp_path, drafter):
    from transformers import AutoModelForCausalLM

    head = SteeringHead(D_V, (1, 2, 3))
    with torch.no_grad():
        head.proj.weight.add_(torch.randn_like(head.proj.weight) * 0.1)
        head.proj.bias.normal_()
    steering = random_steering(drafter)
    out = save_drafter_checkpoint(tmp_path / "sd2", drafter, head=head, steering=steering, verifier_num_layers=5)
    loaded = load_steering(out)
    assert loaded.config.verifier_layers == (1, 2, 3)
    assert loaded.config.verifier_num_layers == 5
    assert loaded.head.proj.weight.dtype == torch.float32
    torch.testing.assert_close(loaded.head.proj.weight, head.proj.weight.half().float())
    torch.testing.assert_close(loaded.drafter.proj.weight, steering.proj.weight.half().float())
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
    ids = torch.randint(0, 50, (1, 5))
    g = torch.randn(1, D_V)
    with torch.no_grad():
        with attach_steering(model, loaded.drafter) as hooks:
            hooks.set_vector(loaded.head(torch.randn(1, 3 * D_V)) * 0 + g)
            a = model(input_ids=ids).logits
        with attach_steering(drafter, steering) as hooks:
            hooks.set_vector(g)
            b = drafter(input_ids=ids).logits
    torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)  # fp16 storage


# ------------------------------------------------------------------------- decoding with the engine


def steered_pair(tmp_path, zero_ws: bool):
    from steerspec.steering.io import SteeringWeights, SteeringConfig

    verifier = tiny_llama(hidden=D_V, layers=4, inter=48, seed=5)
    drafter = tiny_llama(seed=6)
    head = SteeringHead(D_V, default_layers(4))
    steering = DrafterSteering.for_model(drafter, D_V) if zero_ws else random_steering(drafter)
    cfg = SteeringConfig(D_V, head.layers, steering.num_layers, steering.intermediate_size)
    return verifier, drafter, SteeringWeights(cfg, head, steering)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_with_zero_ws_equals_the_unsteered_drafter(tmp_path, temperature):
    from steerspec.decoding.engine import DecodeConfig, speculative_generate
    from steerspec.models.kv import CachedLM
    from steerspec.decoding.sampling import SamplingParams
    from steerspec.steering.runtime import SD2Steering

    verifier, drafter, weights = steered_pair(tmp_path, zero_ws=True)
    cfg = DecodeConfig(max_new_tokens=20, sampling=SamplingParams(temperature=temperature), seed=7, draft_top_k=16)
    prompt = [3, 9, 4, 11]
    plain = speculative_generate(verifier, drafter, prompt, cfg)
    cached = CachedLM(drafter)
    with SD2Steering(cached, weights) as steer:
        steered = speculative_generate(verifier, cached, prompt, cfg, steering=steer)
        assert steer.blocks == steered.rounds and steer.bytes_per_reply == 2 * D_V
    assert steered.token_ids == plain.token_ids
    assert steered.block_accepted == plain.block_accepted


def test_steered_greedy_output_equals_the_verifier_alone(tmp_path):
    from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
    from steerspec.models.kv import CachedLM
    from steerspec.decoding.sampling import SamplingParams
    from steerspec.steering.runtime import SD2Steering

    verifier, drafter, weights = steered_pair(tmp_path, zero_ws=False)
    cfg = DecodeConfig(max_new_tokens=24, sampling=SamplingParams(temperature=0.0))
    for prompt in ([5], [3, 9, 4, 11, 2]):
        alone = autoregressive_generate(verifier, prompt, cfg)
        cached = CachedLM(drafter)
        with SD2Steering(cached, weights) as steer:
            steered = speculative_generate(verifier, cached, prompt, cfg, steering=steer)
        assert steered.token_ids == alone.token_ids


def test_first_block_at_inference_equals_training_steering(tmp_path):
    """Prompt[:-1] unsteered, then the prefill vector on every position of the block: the
    training-time sources with δ = k give the same drafter logits as cached block decoding."""
    from steerspec.models.kv import CachedLM
    from steerspec.train.distill import gather_steering, steering_sources

    verifier, drafter, weights = steered_pair(tmp_path, zero_ws=False)
    head, k = weights.head, 4
    prompt = torch.tensor([[3, 9, 4, 11, 7]])
    drafts = torch.tensor([[8, 2, 6]])
    seq = torch.cat([prompt, drafts], dim=1)
    P = prompt.shape[1]
    with torch.no_grad():
        hs = verifier(input_ids=seq, output_hidden_states=True).hidden_states
        source, steered = steering_sources(torch.tensor([P]), seq.shape[1], delta=k)
        with attach_steering(drafter, weights.drafter) as hooks:
            hooks.set_vector(gather_steering(head, head.gather(hs), source), steered)
            train_logits = drafter(input_ids=seq).logits[0, P - 1 :]
            g0 = head(head.gather(hs)[:, P - 2])  # verifier position P-2 (prefill of prompt[:-1])
            hooks.set_vector(g0, steer_prefix=False)
            cached = CachedLM(drafter)
            rows = [cached.extend(prompt[0]).logits[-1]] + [cached.extend(drafts[0, i : i + 1]).logits[-1] for i in range(3)]
            hooks.clear()
            plain = drafter(input_ids=prompt).logits[0, : P - 1]
            hooks.set_vector(g0, steer_prefix=False)
            prefix = drafter(input_ids=prompt).logits[0, : P - 1]
    torch.testing.assert_close(torch.stack(rows), train_logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(prefix, plain)
