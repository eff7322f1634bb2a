"""Static KV pool and GraphedLM: the static path (CUDA graphs on a GPU, eager on a CPU) equals
FastCachedLM; rollback is a length change; batched steps equal per-row steps; greedy decoding is
token-for-token the existing path."""

from __future__ import annotations

import pytest
import torch

from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
from steerspec.models import load_model
from steerspec.models.graphed import GraphedLM, StaticKVPool, can_graph, graphed_extend, graphed_step
from steerspec.models.kv import FastCachedLM
from steerspec.models.backends import cached_lm
from steerspec.policies import FixedK
from tests.conftest import make_tiny_model_dir

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _tol(dtype: torch.dtype) -> dict:
    """fp32: rounding only; half types: the masked full-capacity attention rounds differently."""
    return dict(atol=1e-4, rtol=0) if dtype == torch.float32 else dict(atol=0.3, rtol=0.05)


@pytest.fixture(scope="module")
def pair(loaded_pair):
    verifier, drafter, tokenizer = loaded_pair
    return verifier, drafter, tokenizer


def test_static_path_equals_fast_path_and_rollback(pair):
    verifier = pair[0]
    pool = StaticKVPool(verifier, slots=2, capacity=256)
    graphed, fast = GraphedLM(verifier, pool), FastCachedLM(verifier)
    prompt = list(range(3, 40))
    a = graphed.extend(prompt, hidden_layers=[0, 2], logits_to_keep=1)
    b = fast.extend(prompt, hidden_layers=[0, 2], logits_to_keep=1)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
    for feed in ([5], [6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2]):  # one-token step, k+1 = 9, a padded bucket
        a, b = graphed.extend(feed, hidden_layers=[1, 3]), fast.extend(feed, hidden_layers=[1, 3])
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=0)
        assert graphed.length == fast.length
    graphed.rollback(len(prompt) + 1)
    fresh = FastCachedLM(verifier)
    want = fresh.extend(prompt + [5, 6], logits_to_keep=1).logits
    got = graphed.extend([6]).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_final_normed_state_comes_from_the_eager_path_over_the_same_slot(pair):
    """Index num_layers (the state the LM head reads, which Pacer's labelling asks for) is not captured
    by the static path: GraphedLM serves it eagerly over its own slot, equal to FastCachedLM."""
    verifier = pair[0]
    graphed, fast = GraphedLM(verifier, StaticKVPool(verifier, slots=1, capacity=128)), FastCachedLM(verifier)
    final = [fast.num_layers]
    for feed in (list(range(3, 30)), [5], [6], [7, 8, 9]):
        a, b = graphed.extend(feed, final), fast.extend(feed, final)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=0)
    graphed.rollback(20)
    fast.rollback(20)
    torch.testing.assert_close(graphed.extend([4]).logits, fast.extend([4]).logits, atol=1e-4, rtol=0)


def test_batched_step_equals_rows_and_slots_are_reused(pair):
    verifier = pair[0]
    pool = StaticKVPool(verifier, slots=3, capacity=128)
    lms = [GraphedLM(verifier, pool) for _ in range(3)]
    assert pool.acquire() is None  # all three slots taken
    refs = [FastCachedLM(verifier) for _ in range(3)]
    for i, (lm, ref) in enumerate(zip(lms, refs)):
        lm.extend(list(range(4 + i, 20 + 3 * i)))
        ref.extend(list(range(4 + i, 20 + 3 * i)))
    assert can_graph(lms, 1)
    tokens = torch.tensor([7, 8, 9])
    got = graphed_step(lms, tokens)  # batch bucket 4: one padding row on the scratch slot
    want = torch.cat([ref.extend([int(t)]).logits for ref, t in zip(refs, tokens)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert [lm.length for lm in lms] == [ref.length for ref in refs]
    feeds = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 0]])
    logits, _ = graphed_extend(lms, feeds, [3, 2, 1])  # ragged verification, one pass
    for row, (ref, count) in enumerate(zip(refs, [3, 2, 1])):
        want = ref.extend(feeds[row, :count].tolist()).logits
        torch.testing.assert_close(logits[row, :count], want, atol=1e-4, rtol=0)
    slot = lms[0].slot
    lms[0].close()
    assert pool.acquire() == slot


def test_up_bias_is_a_static_input(pair):
    drafter = pair[1]
    pool = StaticKVPool(drafter, slots=1, capacity=64)
    graphed, fast = GraphedLM(drafter, pool), FastCachedLM(drafter)
    gen = torch.Generator().manual_seed(0)
    size = pool.intermediate
    bias = [torch.randn(size, generator=gen) * 0.5 for _ in range(graphed.num_layers)]
    graphed.extend(list(range(3, 12)))
    fast.extend(list(range(3, 12)))
    graphed.set_up_bias(bias)
    fast.set_up_bias(bias)
    a, b = graphed.extend([5]), fast.extend([5])
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
    graphed.set_up_bias(None)
    fast.set_up_bias(None)
    torch.testing.assert_close(graphed.extend([6]).logits, fast.extend([6]).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [0.0])
@pytest.mark.slow
def test_greedy_generation_is_token_for_token(pair, eval_prompts, temperature):
    verifier, drafter, tokenizer = pair
    config = DecodeConfig(max_new_tokens=24, sampling=DecodeConfig().sampling)
    v_fast, d_fast = cached_lm(verifier, "fast"), cached_lm(drafter, "fast")
    v_static, d_static = cached_lm(verifier, "graphed"), cached_lm(drafter, "graphed")
    assert isinstance(v_static, GraphedLM)
    for prompt in eval_prompts[:3]:
        ids = tokenizer(prompt)["input_ids"][-64:]
        want = autoregressive_generate(v_fast, ids, config).token_ids
        assert autoregressive_generate(v_static, ids, config).token_ids == want
        got = speculative_generate(v_static, d_static, ids, config, policy=FixedK(4)).token_ids
        assert got == want
        assert speculative_generate(v_fast, d_fast, ids, config, policy=FixedK(4)).token_ids == want


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_other_families(tmp_path, model_type):
    model = load_model(make_tiny_model_dir(tmp_path / model_type, model_type=model_type, seed=3))
    graphed, fast = GraphedLM(model, StaticKVPool(model, 1, 64)), FastCachedLM(model)
    a, b = graphed.extend([1, 2, 3, 4, 5]), fast.extend([1, 2, 3, 4, 5])
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(graphed.extend([9]).logits, fast.extend([9]).logits, atol=1e-4, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_graphs_equal_eager(model_pair, dtype):
    verifier = load_model(model_pair[0], dtype=dtype, device="cuda")
    pool = StaticKVPool(verifier, slots=4, capacity=512)
    assert pool.use_graphs
    graphed, fast = GraphedLM(verifier, pool), FastCachedLM(verifier)
    prompt = list(range(3, 90))  # longer than the largest token bucket: the eager path fills it
    graphed.extend(prompt)
    fast.extend(prompt)
    for _ in range(3):  # the first call captures, later calls replay
        for feed in ([5], list(range(10, 19))):
            a, b = graphed.extend(feed, hidden_layers=[0, 1]), fast.extend(feed, hidden_layers=[0, 1])
            torch.testing.assert_close(a.logits.float(), b.logits.float(), **_tol(dtype))
            torch.testing.assert_close(a.hidden.float(), b.hidden.float(), **_tol(dtype))
        graphed.rollback(len(prompt))
        fast.rollback(len(prompt))
    assert len(pool._graphs) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_greedy_matches_verifier_alone(model_pair, eval_prompts, dtype):
    """Greedy speculative output equals the verifier alone in the same dtype (both graphed)."""
    from steerspec.models import load_tokenizer

    verifier = load_model(model_pair[0], dtype=dtype, device="cuda")
    drafter = load_model(model_pair[1], dtype=dtype, device="cuda")
    tokenizer = load_tokenizer(model_pair[0])
    config = DecodeConfig(max_new_tokens=32)
    v, d = cached_lm(verifier), cached_lm(drafter)
    assert isinstance(v, GraphedLM)
    for prompt in eval_prompts[:4]:
        ids = tokenizer(prompt)["input_ids"][-64:]
        want = autoregressive_generate(v, ids, config).token_ids
        assert speculative_generate(v, d, ids, config, policy=FixedK(8)).token_ids == want


def test_sd2_hooks_steer_the_static_path():
    """SD² steering hooks on the model: the static path adds the same per-layer up-bias (a static
    input) as FastCachedLM; removing the hooks is seen (the hook scan is cached)."""
    from steerspec.models import resolve_model_dir
    from steerspec.steering import attach_steering, load_steering

    directory = resolve_model_dir("sd2")
    model = load_model(directory)
    weights = load_steering(directory)
    hooks = attach_steering(model, weights.drafter)
    torch.manual_seed(0)
    g = torch.randn(1, weights.config.verifier_hidden_size)
    prompt = torch.randint(1, model.config.vocab_size, (12,)).tolist()
    graphed, fast = GraphedLM(model, StaticKVPool(model, 1, 64)), FastCachedLM(model)
    outputs = []
    try:
        for lm in (fast, graphed):
            with torch.inference_mode():
                hooks.set_vector(g, steer_prefix=False)  # first block: eager path (last position only)
                first = lm.extend(prompt, logits_to_keep=1).logits.clone()
                one = lm.extend([5]).logits.clone()  # steered one-token step
                hooks.set_vector(0.5 * g, steer_prefix=True)
                later = lm.extend([7, 9, 11]).logits.clone()  # steered k+1 extend
                hooks.clear()
                plain = lm.extend([13]).logits.clone()
            outputs.append((first, one, later, plain))
    finally:
        hooks.remove()
    for want, got in zip(*outputs):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert graphed.steering_bias(1) == (True, None)  # the removed hooks are gone from the scan
    with_hook = model.get_decoder().layers[0].mlp.register_forward_hook(lambda *a: None)
    try:
        assert graphed.steering_bias(1)[0] is False  # a foreign hook forces the eager path
    finally:
        with_hook.remove()
