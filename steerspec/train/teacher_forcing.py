"""Teacher forcing on the verifier's own answers: what drafter calibration and the overlap benchmark measure.

`verifier_answer` is the verifier's seeded T=1 continuation of a prompt; `teacher_forced` scores one such
sequence with both models at once (p from the verifier, the drafter's logits, the drafter steered as in
training validation when it carries SD² weights).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
from steerspec.decoding.sampling import SamplingParams
from steerspec.train.distill import gather_steering, steering_sources


def verifier_answer(verifier, prompt: Sequence[int], max_new_tokens: int, seed: int, eos: Sequence[int],
                    max_length: int) -> List[int]:
    """The verifier's own T=1 continuation (what the drafters are measured against)."""
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=1.0), seed=seed,
                       eos_token_ids=tuple(eos), max_length=max_length)
    return list(prompt) + list(autoregressive_generate(verifier, prompt, cfg).token_ids)


@torch.no_grad()
def teacher_forced(verifier_model, drafter, steering, sequence: List[int], prompt_len: int,
                   delta: int) -> Tuple[Tensor, Tensor]:
    """(p [n, V] the verifier's probabilities, the drafter's logits [n, V]) at the n answer positions of one
    sequence, the drafter steered with offset δ when `steering` (as in training validation)."""
    ids = torch.tensor([sequence])
    out = verifier_model(input_ids=ids, output_hidden_states=steering is not None)
    if steering is not None:
        source, steered = steering_sources(torch.tensor([prompt_len]), ids.shape[1], delta)
        steering.hooks.set_vector(gather_steering(steering.head, steering.head.gather(out.hidden_states), source), steered)
    try:
        q_logits = drafter(input_ids=ids).logits
    finally:
        if steering is not None:
            steering.hooks.clear()
    answer = slice(prompt_len - 1, len(sequence) - 1)
    return out.logits[0, answer].float().softmax(-1), q_logits[0, answer]
