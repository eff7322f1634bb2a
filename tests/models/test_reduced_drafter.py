"""The reduced-vocabulary drafter (models/reduced.py) on a tiny random verifier: exact q, faithful export."""

from __future__ import annotations

import json

import pytest
import torch

from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
from steerspec.models import cached_lm, load_model
from steerspec.models.kv import FastCachedLM
from steerspec.models.layouts import ONEDNN_ENV, onednn_available
from steerspec.models.reduced import MASKED_LOGIT, init_from_verifier, masked_logit, is_reduced_dir, load_reduced, save_drafter
from steerspec.policies import FixedK
from steerspec.decoding.sampling import SamplingParams
from steerspec.train.smollm2_loop import LoopConfig, support_index, train
from steerspec.train.smollm2_drafter import choose_support

VOCAB = 96


@pytest.fixture(scope="module")
def tiny_verifier(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=[0])
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_verifier")
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def support():
    return torch.arange(0, VOCAB, 2)  # even ids only


def test_q_is_a_full_distribution_that_is_zero_outside_the_support(tiny_verifier, support):
    drafter = init_from_verifier(tiny_verifier, str(tiny_verifier), support, [0, 3])
    logits = drafter(torch.tensor([[1, 5, 7, 2]])).logits
    assert logits.shape[-1] == VOCAB
    q = logits.softmax(-1)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[support] = False
    assert torch.all(q[..., outside] == 0)
    assert torch.allclose(q.sum(-1), torch.ones(q.shape[:-1]))
    assert torch.all(logits[..., outside] == MASKED_LOGIT)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_reduced_head_masks_with_a_value_its_dtype_holds(tiny_verifier, support, dtype):
    """float16 cannot hold MASKED_LOGIT (−1e9): the head masks with −32752 there, still exactly 0 after
    softmax (`--dtype float16` used to fail on a reduced drafter)."""
    drafter = init_from_verifier(tiny_verifier, str(tiny_verifier), support, [0, 3]).to(dtype)
    logits = drafter(torch.tensor([[1, 5, 7, 2]])).logits
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[support] = False
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert torch.all(logits[..., outside] == masked_logit(dtype))
    assert torch.all(logits.float().softmax(-1)[..., outside] == 0)
    assert masked_logit(torch.float32) == MASKED_LOGIT


def test_export_holds_only_own_weights_and_loads_exactly(tiny_verifier, support, tmp_path):
    drafter = init_from_verifier(tiny_verifier, str(tiny_verifier), support, [0, 3])
    out = save_drafter(drafter, tmp_path / "d")
    assert is_reduced_dir(out)
    from safetensors import safe_open

    with safe_open(str(out / "drafter.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names and "support" in names
    loaded = load_reduced(out, verifier_dir=tiny_verifier)
    again = load_reduced(save_drafter(loaded, tmp_path / "e"), verifier_dir=tiny_verifier)
    assert json.loads((tmp_path / "e" / "config.json").read_text())["_name_or_path"] == ""  # no machine path ships
    ids = torch.tensor([[3, 9, 4, 4, 8]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, again(ids).logits)  # fp16 storage, exact fp32 reload
        assert torch.allclose(loaded(ids).logits.softmax(-1), drafter(ids).logits.softmax(-1), atol=1e-2)


def test_fast_backend_matches_the_transformers_forward(tiny_verifier, support):
    drafter = init_from_verifier(tiny_verifier, str(tiny_verifier), support, [1, 2]).eval()
    fast = cached_lm(drafter, "fast")
    assert isinstance(fast, FastCachedLM)
    ids = [5, 8, 13, 2, 40]
    out = fast.extend(ids).logits
    with torch.no_grad():
        ref = drafter(torch.tensor([ids])).logits[0]
    assert torch.allclose(out, ref, atol=1e-4)


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")
def test_multi_row_passes_read_the_reduced_heads_packed_copy_with_the_same_logits(tiny_verifier, support,
                                                                                   tmp_path, monkeypatch):
    """The reduced head used to run on its own (input-major) weight in every pass, 1.0 / 1.6 / 2.2 ms for 2 / 3 / 4
    rows of SmolLM2's 8,192-row head against 0.2–0.3 ms from the oneDNN-packed copy the layers already read."""
    drafter = load_model(save_drafter(init_from_verifier(tiny_verifier, str(tiny_verifier), support, [0, 1]),
                                      tmp_path / "d"))
    monkeypatch.setenv(ONEDNN_ENV, "2")
    fast = FastCachedLM(drafter)
    plans, head = fast.plans_for(3)
    assert head[0].is_mkldnn and fast.plans_for(1)[1][0] is drafter.lm_head.weight
    ids = [5, 8, 13, 2, 40]
    calls = []
    monkeypatch.setattr(type(drafter.lm_head), "forward", lambda self, h: calls.append(h) or None)
    for feed in ([7, 9], [7, 9, 11], [7, 9, 11, 3]):
        fast.reset()
        fast.extend(ids)
        out = fast.extend(feed).logits
        with torch.no_grad():
            ref = drafter.model(torch.tensor([ids + feed])).last_hidden_state[0, -len(feed):]
            ref = drafter.lm_head.scatter(torch.nn.functional.linear(ref, drafter.lm_head.weight))
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[support] = False
        assert torch.all(out[:, outside] == MASKED_LOGIT)
    assert not calls  # every pass projected through the plans' head, not the module


def test_speculation_with_a_reduced_drafter_is_exact(tiny_verifier, support, tmp_path):
    drafter_dir = save_drafter(init_from_verifier(tiny_verifier, str(tiny_verifier), support, [0, 1]), tmp_path / "d")
    verifier = cached_lm(load_model(tiny_verifier))
    drafter = cached_lm(load_model(drafter_dir))  # the loader reads the embedding from the verifier dir
    config = DecodeConfig(max_new_tokens=24, eos_token_ids=(), max_length=128)
    for prompt in ([4, 6, 8], [1, 3, 5, 7]):
        expected = autoregressive_generate(verifier, prompt, config).token_ids
        assert speculative_generate(verifier, drafter, prompt, config, FixedK(4)).token_ids == expected
    sampled = DecodeConfig(max_new_tokens=16, sampling=SamplingParams(temperature=1.0), seed=7, eos_token_ids=(),
                           max_length=128)
    result = speculative_generate(verifier, drafter, [4, 6, 8], sampled, FixedK(4))
    # tokens outside the drafter's support still come out (through the residual): q = 0 there is exact
    assert len(result.token_ids) == 16 and any(t % 2 == 1 for t in result.token_ids)


def test_support_keeps_the_most_frequent_tokens_and_eos():
    import numpy as np

    tokens = np.array([5, 5, 5, 7, 7, 9, 1], dtype=np.uint16)
    assert choose_support(tokens, 3, 16, always=[0]).tolist() == [0, 5, 7]
    index = support_index(torch.tensor([0, 5, 7]), 16)
    assert index[5] == 1 and index[9] == -100


def test_training_lowers_the_loss_and_resumes(tiny_verifier, support, tmp_path):
    import numpy as np

    tokens = np.tile(np.arange(0, 40, 2, dtype=np.uint16), 50)  # a repeating pattern inside the support
    drafter = init_from_verifier(tiny_verifier, str(tiny_verifier), support, [0, 1])
    cfg = LoopConfig(steps=30, batch_size=4, seq_len=16, lr=3e-3, warmup=2, checkpoint_s=0.0)
    first = train(drafter, tokens, LoopConfig(**{**cfg.__dict__, "steps": 1}), tmp_path / "w")
    last = train(init_from_verifier(tiny_verifier, str(tiny_verifier), support, [0, 1]), tokens, cfg, tmp_path / "w")
    assert last["step"] == 30 and last["loss"] < first["loss"]


def test_synthetic_answers_flatten_with_a_target_mask_that_skips_prompts():
    from steerspec.train.smollm2_drafter import flatten_synthetic
    from steerspec.train.synth import SyntheticSet

    data = SyntheticSet([torch.tensor([7, 8, 9, 10]), torch.tensor([3, 4, 5])], [2, 1], {})
    tokens, mask = flatten_synthetic(data, eos_id=0)
    assert tokens.tolist() == [7, 8, 9, 10, 0, 3, 4, 5, 0]
    assert mask.tolist() == [False, False, True, True, False, False, True, True, False]


def test_masked_training_learns_only_the_answers(tiny_verifier, support, tmp_path):
    import numpy as np

    from steerspec.train.smollm2_loop import reduced_loss

    # prompts and answers are both fixed patterns: masked training must learn the answers, not the prompts
    tokens, mask = [], []
    for _ in range(60):
        tokens += [np.arange(60, 72, 2), np.arange(10, 26, 2)]
        mask += [np.zeros(6, bool), np.ones(8, bool)]
    tokens, mask = np.concatenate(tokens).astype(np.uint16), np.concatenate(mask)
    cfg = LoopConfig(steps=60, batch_size=8, seq_len=28, lr=1e-2, warmup=2, checkpoint_s=0.0)
    drafter = init_from_verifier(tiny_verifier, str(tiny_verifier), support, [0, 1])
    index = support_index(drafter.lm_head.support, VOCAB)
    batch = torch.from_numpy(tokens[:8 * 14 + 1].astype(np.int64))[None]
    target = torch.from_numpy(mask[1:8 * 14 + 1])[None]
    with torch.no_grad():
        before = float(reduced_loss(drafter, batch, index, target))
    train(drafter, tokens, cfg, tmp_path / "w", target_mask=mask)
    with torch.no_grad():
        after = float(reduced_loss(drafter, batch, index, target))
        prompts = float(reduced_loss(drafter, batch, index, ~target))
    assert after < before - 0.5 and after < prompts - 0.5
    with pytest.raises(ValueError):
        train(drafter, tokens, cfg, tmp_path / "x", target_mask=mask[:-1])
