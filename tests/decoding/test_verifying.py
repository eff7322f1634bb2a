"""steerspec/decoding/verifying.py: a batch of sessions is accepted exactly as each session alone."""

from __future__ import annotations

import torch

from steerspec.decoding.sampling import SamplingParams, draft_distribution
from steerspec.decoding.verifying import VerifyRow, accept

V = 50


def _rows(seed: int):
    torch.manual_seed(seed)
    rows = []
    specs = [(3, 8, SamplingParams(1.0)), (0, 8, SamplingParams(1.0)), (5, 4, SamplingParams(0.7, top_p=0.9)),
             (2, 0, SamplingParams(0.0)), (4, 16, SamplingParams(1.0, top_k=20))]
    for i, (k, support, params) in enumerate(specs):
        logits = torch.randn(k + 1, V)
        q = None
        if not params.greedy and k:
            draft = (logits[:k] + 0.3 * torch.randn(k, V)).softmax(-1)
            q = draft_distribution(draft, support, True)
        tokens = torch.randint(0, V, (k,)) if q is None else torch.stack(
            [q.ids[j, torch.randint(0, q.ids.shape[-1], ())] for j in range(k)])
        if params.greedy and k:
            tokens[0] = logits[0].argmax()
        rows.append(VerifyRow(logits, tokens.long(), q, params, torch.Generator().manual_seed(100 + i)))
    return rows


def test_batch_equals_each_row_alone():
    for seed in range(20):
        batch, alone = _rows(seed), _rows(seed)
        together = accept(batch)
        for i, row in enumerate(alone):
            one = accept([row])
            assert int(together.accepted[i]) == int(one.accepted[0])
            assert int(together.next_tokens[i]) == int(one.next_tokens[0])
            assert bool(together.is_bonus[i]) == bool(one.is_bonus[0])
            if row.generator is not None:  # each row drew exactly what it draws alone
                assert torch.equal(batch[i].generator.get_state(), row.generator.get_state())
