"""Model loading and KV caches: after any rollback, next-token logits equal a fresh full forward."""

from __future__ import annotations

import json

import pytest
import torch

from steerspec.errors import UsageError
from steerspec.models import CachedLM, load_model, load_tokenizer, resolve_model_dir
from steerspec.models.kv import FastCachedLM
from steerspec.models.backends import cached_lm
from steerspec.models.loading import resolve_device

from conftest import make_tiny_model_dir

ATOL = 1e-4


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Tiny random checkpoints of the other SwiGLU families (Qwen2, Qwen3, Mistral)."""
    root = tmp_path_factory.mktemp("families")
    return {t: make_tiny_model_dir(root / t, model_type=t, seed=3, layers=2) for t in ("qwen2", "qwen3", "mistral")}


def fresh_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def check_rollback(model, seed: int, backend: str, length: int = 40, rounds: int = 6):
    """Random extend/rollback schedule; compare every next-token distribution with a fresh pass."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
    lm = cached_lm(model, backend)
    assert isinstance(lm, FastCachedLM) == (backend == "fast")
    prefix = 7
    lm.extend(ids[:prefix])
    committed = prefix
    for _ in range(rounds):
        block = int(torch.randint(1, 9, (1,), generator=gen))
        block = min(block, length - committed)
        out = lm.extend(ids[committed:committed + block])
        assert out.logits.shape == (block, vocab)
        assert lm.length == committed + block
        keep = committed + int(torch.randint(0, block + 1, (1,), generator=gen))
        lm.rollback(keep)
        assert lm.length == keep
        got = lm.extend(ids[keep:keep + 1]).logits[-1]
        torch.testing.assert_close(got, fresh_logits(model, ids[:keep + 1]), atol=ATOL, rtol=0)
        committed = keep + 1
    lm.rollback(0)
    torch.testing.assert_close(lm.extend(ids[:3]).logits[-1], fresh_logits(model, ids[:3]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["fast", "hf"])
@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_rollback_matches_fresh_forward(loaded_pair, role, backend):
    verifier, drafter, _ = loaded_pair
    check_rollback(verifier if role == "verifier" else drafter, seed=11, backend=backend)


@pytest.mark.parametrize("backend", ["fast", "hf"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_swiglu_families_load_and_roll_back(family_dirs, family, backend):
    model = load_model(family_dirs[family])
    assert model.config.model_type == family
    check_rollback(model, seed=5, backend=backend, rounds=3)


def test_fast_cache_grows_past_its_initial_capacity(loaded_pair):
    model = loaded_pair[1]
    lm = FastCachedLM(model, capacity=8)
    ids = list(range(3, 40))
    lm.extend(ids[:5])
    for i in range(5, 30, 6):
        lm.extend(ids[i:i + 6])
    torch.testing.assert_close(lm.extend(ids[35:36]).logits[-1], fresh_logits(model, ids[:36]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_hidden_states_enter_requested_layers(loaded_pair, backend):
    verifier, _, _ = loaded_pair
    layers = [0, verifier.config.num_hidden_layers // 2, verifier.config.num_hidden_layers - 1]
    ids = list(range(3, 15))
    with torch.inference_mode():
        full = verifier(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    lm = cached_lm(verifier, backend)
    lm.extend(ids[:5])
    out = lm.extend(ids[5:], hidden_layers=layers)
    assert out.hidden.shape == (3, len(ids) - 5, verifier.config.hidden_size)
    for slot, layer in enumerate(layers):
        torch.testing.assert_close(out.hidden[slot], full[layer][0, 5:], atol=ATOL, rtol=0)
    assert lm.extend(ids[:1]).hidden is None  # capture only on request


def test_rollback_past_length_is_refused(loaded_pair):
    lm = CachedLM(loaded_pair[0])
    lm.extend([1, 2, 3])
    with pytest.raises(ValueError):
        lm.rollback(4)
    lm.reset()
    assert lm.length == 0


def test_bundled_names_and_dtypes(model_pair):
    verifier_dir, _ = model_pair
    model = load_model(verifier_dir, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    tok = load_tokenizer(verifier_dir)
    assert tok("def f(x):")["input_ids"]
    assert resolve_model_dir("drafter") == resolve_model_dir("pretrained")


def test_refusals(tmp_path):
    with pytest.raises(UsageError, match="local directory"):
        load_model("meta-llama/Llama-3-8B")
    with pytest.raises(UsageError, match="not found"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "activation_function": "gelu"}))
    with pytest.raises(UsageError, match="SwiGLU"):
        load_model(str(tmp_path / "gpt2"))
    with pytest.raises(UsageError, match="dtype"):
        load_model(str(tmp_path / "gpt2"), dtype="int8")
    with pytest.raises(UsageError):
        resolve_device("tpu")
    assert resolve_device("auto").type in ("cpu", "cuda")


def test_up_bias_matches_a_hook_on_up_proj(loaded_pair):
    """SD² steering path: FastCachedLM.set_up_bias == a forward hook adding the bias to mlp.up_proj."""
    model = loaded_pair[1]
    gen = torch.Generator().manual_seed(0)
    biases = [0.1 * torch.randn(model.config.intermediate_size, generator=gen)
              for _ in range(model.config.num_hidden_layers)]
    ids = list(range(5, 17))
    fast = FastCachedLM(model)
    fast.set_up_bias(biases)
    steered = fast.extend(ids).logits
    handles = [layer.mlp.up_proj.register_forward_hook(lambda m, a, out, b=b: out + b)
               for layer, b in zip(model.get_decoder().layers, biases)]
    try:
        with torch.inference_mode():
            reference = model(input_ids=torch.tensor([ids])).logits[0]
        hooked = FastCachedLM(model)  # hooks present: the module path runs them
        torch.testing.assert_close(hooked.extend(ids).logits, reference, atol=ATOL, rtol=0)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(steered, reference, atol=ATOL, rtol=0)
    fast.set_up_bias(None)
    fast.reset()
    assert not torch.allclose(fast.extend(ids).logits, reference, atol=ATOL)


def test_input_major_cpu_layout_keeps_values_ties_and_saves(model_pair, tmp_path):
    """load_model stores CPU linear weights input-major: same values, same ties, same logits, and a
    checkpoint exported from such a model loads back to the same weights."""
    from steerspec.train.common import export_hf

    verifier_dir, _ = model_pair
    plain, fast = load_model(verifier_dir, cpu_layout=False), load_model(verifier_dir)
    linears = [m for m in fast.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.stride() == (1, m.weight.shape[0]) for m in linears)
    assert all(p.is_contiguous() for p in plain.parameters())
    for (name, a), (_, b) in zip(plain.named_parameters(), fast.named_parameters()):
        assert torch.equal(a, b), name
    if plain.config.tie_word_embeddings:
        assert fast.lm_head.weight is fast.get_input_embeddings().weight
    ids = torch.arange(3, 40).tolist()
    torch.testing.assert_close(fresh_logits(fast, ids), fresh_logits(plain, ids), atol=ATOL, rtol=0)
    export_hf(fast, tmp_path / "exported", tokenizer_dir=verifier_dir)
    again = load_model(tmp_path / "exported", cpu_layout=False)
    for (name, a), (_, b) in zip(plain.named_parameters(), again.named_parameters()):
        torch.testing.assert_close(b, a.half().float(), atol=0, rtol=0, msg=name)


def test_the_hf_backend_passes_its_cache_by_the_name_this_transformers_takes(loaded_pair):
    """transformers 5.2x renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40): the HF
    backend and the synthetic-data sampler use whichever name the installed forward declares."""
    import inspect
    import warnings

    from steerspec.models.loading import cache_kwarg

    model = loaded_pair[0]
    name = cache_kwarg(model)
    assert name in inspect.signature(model.forward).parameters
    lm = cached_lm(model, "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        lm.extend([3, 4, 5])
        lm.extend([6])
    assert lm.length == 4


def test_a_prefill_from_empty_uses_the_causal_kernel_and_matches(loaded_pair):
    """A fast-cache prefill from an empty cache (SDPA's causal kernel, no mask) gives every position the
    transformers forward's logits, and what the same ids give fed in two parts (the masked path)."""
    verifier, _, _ = loaded_pair
    ids = torch.randint(0, verifier.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    whole = cached_lm(verifier, "fast").extend(ids).logits
    with torch.no_grad():
        reference = verifier(input_ids=ids).logits[0]
    torch.testing.assert_close(whole, reference, atol=ATOL, rtol=0)
    parts = cached_lm(verifier, "fast")
    first, second = parts.extend(ids[:, :10]).logits, parts.extend(ids[:, 10:]).logits
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=ATOL, rtol=0)


def test_packed_extend_scores_trees_and_chains_together_as_alone():
    """Rows with a tree (positions by depth, an ancestor mask) and plain rows in one packed pass give what
    each row's own extend_tree / extend gives."""
    from steerspec.models import load_model
    from steerspec.models.batched import packed_extend
    from steerspec.models.kv import FastCachedLM
    from steerspec.decoding.tree_decoding import tree_feed
    from steerspec.decoding.trees import parse_tree

    model = load_model("verifier")
    prefixes = [[4, 57, 310, 12], [88, 23, 7, 9, 11], [5, 9]]
    shape = parse_tree("0,1,00,10")
    alone, packed = [], []
    for _ in range(2):
        lms = [FastCachedLM(model) for _ in prefixes]
        for lm, prefix in zip(lms, prefixes):
            lm.extend(prefix)
        feeds, trees = [], []
        for i, lm in enumerate(lms):
            if i == 1:  # a chain row between two tree rows
                feeds.append([3, 4, 5])
                trees.append(None)
                continue
            feed, positions, visible = tree_feed(7 + i, [10, 11, 12, 13], shape, lm.length)
            feeds.append(feed)
            trees.append((positions, visible))
        if not alone:
            alone = [lm.extend(f) if t is None else lm.extend_tree(f, *t) for lm, f, t in zip(lms, feeds, trees)]
        else:
            packed = packed_extend(lms, feeds, None, trees)
    for a, p in zip(alone, packed):
        assert torch.allclose(a.logits, p.logits, atol=1e-4, rtol=1e-4)
