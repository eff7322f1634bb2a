"""Device drafting/verification (steerspec/decoding/fastpath.py): greedy token-for-token the host path,
sampled blocks exact in distribution, one packed block on the host."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from steerspec.decoding import fastpath
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, make_generators, speculative_generate
from steerspec.models import load_model
from steerspec.models.backends import cached_lm
from steerspec.policies import FixedK
from steerspec.decoding.sampling import SamplingParams, probs_from_logits


@pytest.fixture()
def device_sampling(monkeypatch):
    monkeypatch.setenv("STEERSPEC_DEVICE_SAMPLING", "1")


def test_switch(monkeypatch):
    monkeypatch.setenv("STEERSPEC_DEVICE_SAMPLING", "auto")
    assert not fastpath.enabled(torch.device("cpu")) and fastpath.enabled(torch.device("cuda"))
    monkeypatch.setenv("STEERSPEC_DEVICE_SAMPLING", "0")
    assert not fastpath.enabled(torch.device("cuda"))


@pytest.mark.parametrize("backend", ["fast", "graphed"])
def test_greedy_is_token_for_token(loaded_pair, eval_prompts, device_sampling, backend):
    verifier, drafter, tokenizer = loaded_pair
    config = DecodeConfig(max_new_tokens=24)
    v, d = cached_lm(verifier, backend), cached_lm(drafter, backend)
    for prompt in eval_prompts[:3]:
        ids = tokenizer(prompt)["input_ids"][-64:]
        want = autoregressive_generate(v, ids, config).token_ids
        assert speculative_generate(v, d, ids, config, policy=FixedK(6)).token_ids == want


def test_sampled_block_is_packed_and_seeded(loaded_pair, device_sampling):
    verifier, drafter, tokenizer = loaded_pair
    config = DecodeConfig(sampling=SamplingParams(temperature=1.0), draft_top_k=16, seed=3)
    ids = tokenizer("def main():")["input_ids"]
    d = cached_lm(drafter, "fast")
    blocks = []
    for _ in range(2):
        g, _ = make_generators(3)
        d.reset()
        blocks.append(fastpath.draft_block(d, ids, 5, config, g))
    a, b = blocks
    assert a.tokens.shape == (1, 5) and a.q.ids.shape == (1, 5, 16) and a.q.floor.shape == (1, 5)
    assert a.tokens.device.type == "cpu" and a.q.probs.dtype == torch.float32
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q.probs, b.q.probs)
    assert torch.all(a.q.prob_of(a.tokens) > 0)  # each draft is possible under its own q
    long_result = speculative_generate(verifier, drafter, ids, DecodeConfig(
        max_new_tokens=20, sampling=SamplingParams(temperature=1.0), seed=5))
    again = speculative_generate(verifier, drafter, ids, DecodeConfig(
        max_new_tokens=20, sampling=SamplingParams(temperature=1.0), seed=5))
    assert long_result.token_ids == again.token_ids and len(long_result.token_ids) == 20


@pytest.mark.slow
def test_first_token_has_the_verifier_distribution(tiny_pair, device_sampling):
    """Drafted, verified and committed through the device path, the first new token is ~ p."""
    verifier, drafter = load_model(tiny_pair[0]), load_model(tiny_pair[1])
    config = DecodeConfig(sampling=SamplingParams(temperature=1.0), draft_top_k=8)
    prompt = [5, 17, 33, 2]
    v, d = cached_lm(verifier, "fast"), cached_lm(drafter, "fast")
    p = probs_from_logits(v.extend(prompt, logits_to_keep=1).logits, 1.0)[0]
    g_draft, g_verify = make_generators(11)
    runs = 3000
    firsts = []
    for _ in range(runs):
        v.rollback(len(prompt) - 1)
        d.reset()
        block = fastpath.draft_block(d, prompt, 2, config, g_draft)
        outcome, _ = fastpath.verify_block(v, prompt[-1], block, config, g_verify)
        firsts.append(int(block.tokens[0, 0]) if int(outcome.accepted[0]) > 0 else int(outcome.next_tokens[0]))
    counts = torch.bincount(torch.tensor(firsts), minlength=p.numel()).double()
    expected = p.double() * runs
    keep = expected > 5
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    assert chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue > 1e-4


@pytest.mark.parametrize("backend", ["fast", "graphed"])
def test_verify_blocks_batched_equals_rows(loaded_pair, device_sampling, backend):
    """Greedy and sampled sessions of ragged k in one batch: greedy rows give the single-row result;
    every row rolls back to its own accepted length; hidden states come at the accepted position."""
    verifier, drafter, tokenizer = loaded_pair
    greedy = DecodeConfig()
    sampled = DecodeConfig(sampling=SamplingParams(temperature=0.8, top_k=20), draft_top_k=16)
    prompts = [tokenizer(t)["input_ids"] for t in ("def main():", "class Queue:", "import os\n")]
    configs, ks = [greedy, sampled, greedy], [4, 3, 2]
    lms, refs, blocks = [], [], []
    for ids, config, k in zip(prompts, configs, ks):
        d = cached_lm(drafter, "fast")
        g, _ = make_generators(1)
        blocks.append(fastpath.draft_block(d, ids, k, config, g))
        for group in (lms, refs):
            lm = cached_lm(verifier, backend)
            lm.extend(ids[:-1])
            group.append(lm)
    gens = [make_generators(2)[1] for _ in prompts]
    results, hidden = fastpath.verify_blocks(lms, [ids[-1] for ids in prompts], blocks,
                                             [c.sampling for c in configs], gens, hidden_layers=[0, 2])
    assert hidden.shape == (3, 2, verifier.config.hidden_size)
    for b, (ids, config) in enumerate(zip(prompts, configs)):
        acc, nxt, bonus = results[b]
        assert lms[b].length == len(ids) + acc and 0 <= acc <= ks[b] and bonus == (acc == ks[b])
        outcome, want_hidden = fastpath.verify_block(refs[b], ids[-1], blocks[b], config, make_generators(2)[1],
                                                     hidden_layers=[0, 2])
        torch.testing.assert_close(hidden[b], want_hidden, atol=1e-4, rtol=0)
        if config.greedy:
            assert (acc, nxt) == (int(outcome.accepted[0]), int(outcome.next_tokens[0]))


@pytest.mark.parametrize("backend", ["fast", "graphed"])
def test_draft_blocks_batched(loaded_pair, monkeypatch, backend):
    """Batched device drafting: greedy rows are token-for-token the host path's; sampled rows
    carry their q and draw from their own generator (a row's block does not depend on the batch)."""
    from steerspec.decoding.drafting import DraftRow, draft_blocks

    _, drafter, tokenizer = loaded_pair
    greedy = DecodeConfig()
    sampled = DecodeConfig(sampling=SamplingParams(temperature=1.0), draft_top_k=16)
    prompts = [tokenizer(t)["input_ids"] for t in ("def main():", "class Queue:", "import os\n", "x = 1")]
    configs, ks = [greedy, sampled, greedy, sampled], [4, 3, 0, 5]

    def run(mode, which):
        monkeypatch.setenv("STEERSPEC_DEVICE_SAMPLING", mode)
        rows = [DraftRow(lm=cached_lm(drafter, backend), committed=prompts[i], k=ks[i], config=configs[i],
                         generator=make_generators(10 + i)[0]) for i in which]
        return draft_blocks(rows)

    host, device, alone = run("0", range(4)), run("1", range(4)), run("1", [3])
    for b in (0, 2):
        assert torch.equal(host[b].tokens, device[b].tokens) and device[b].q is None
    assert device[2].tokens.shape == (1, 0)
    for b in (1, 3):
        assert device[b].tokens.shape == (1, ks[b]) and device[b].q.ids.shape == (1, ks[b], 16)
        assert torch.all(device[b].q.prob_of(device[b].tokens) > 0)
    assert torch.equal(alone[0].tokens, device[3].tokens)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_device_path_end_to_end(model_pair, dtype):
    """On CUDA the default path is graphed + device sampling: seeded sampling repeats, batched
    verification across graphed sessions agrees with the single-session path for greedy rows."""
    from steerspec.models import load_tokenizer
    from steerspec.models.graphed import GraphedLM

    verifier = load_model(model_pair[0], dtype=dtype, device="cuda")
    drafter = load_model(model_pair[1], dtype=dtype, device="cuda")
    tokenizer = load_tokenizer(model_pair[0])
    assert fastpath.enabled(verifier.device)
    ids = tokenizer("def main():")["input_ids"]
    config = DecodeConfig(max_new_tokens=40, sampling=SamplingParams(temperature=1.0), seed=9)
    v, d = cached_lm(verifier), cached_lm(drafter)
    assert isinstance(v, GraphedLM) and isinstance(d, GraphedLM)
    first = speculative_generate(v, d, ids, config).token_ids
    assert first == speculative_generate(v, d, ids, config).token_ids and len(first) == 40
    prompts = [tokenizer(t)["input_ids"] for t in ("def main():", "class Queue:", "import os\n")]
    lms = [cached_lm(verifier) for _ in prompts]
    refs = [cached_lm(verifier) for _ in prompts]
    blocks = []
    for ids_, lm, ref in zip(prompts, lms, refs):
        lm.extend(ids_[:-1])
        ref.extend(ids_[:-1])
        blocks.append(fastpath.draft_block(cached_lm(drafter), ids_, 8, DecodeConfig(), None))
    results, _ = fastpath.verify_blocks(lms, [p[-1] for p in prompts], blocks, [DecodeConfig().sampling] * 3,
                                        [None] * 3)
    for b, (ids_, ref) in enumerate(zip(prompts, refs)):
        outcome, _ = fastpath.verify_block(ref, ids_[-1], blocks[b], DecodeConfig())
        assert 0 <= results[b][0] <= 8 and lms[b].length == len(ids_) + results[b][0]
        if dtype == "float32":  # bf16 batch-4 and batch-1 matmuls may round a near-tie differently
            assert results[b][:2] == (int(outcome.accepted[0]), int(outcome.next_tokens[0]))
