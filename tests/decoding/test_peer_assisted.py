"""Peer check: our greedy speculative output equals transformers' own assisted generation."""

from __future__ import annotations

import torch

from steerspec.decoding.engine import DecodeConfig, speculative_generate
from steerspec.models import cached_lm, eos_token_ids
from steerspec.policies import FixedK
import pytest

N_PROMPTS = 8
MAX_NEW = 32


def assisted_generate(verifier, drafter, ids, eos, max_new):
    """transformers' assisted generation (greedy, default assistant settings); new tokens only."""
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = verifier.generate(input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=drafter,
                                do_sample=False, max_new_tokens=max_new, eos_token_id=list(eos) or None,
                                pad_token_id=eos[0] if eos else 0)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_greedy_equals_transformers_assisted_generation(loaded_pair, eval_prompts):
    verifier, drafter, tok = loaded_pair
    eos = eos_token_ids(verifier, tok)
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=eos)
    v, d = cached_lm(verifier), cached_lm(drafter)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in eval_prompts[:N_PROMPTS]]
    assert len(prompts) == N_PROMPTS
    for ids in prompts:
        ours = speculative_generate(v, d, ids, config, FixedK(8)).token_ids
        theirs = assisted_generate(verifier, drafter, ids, eos, MAX_NEW)
        assert ours == theirs
