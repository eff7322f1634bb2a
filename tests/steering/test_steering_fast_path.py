"""SD² hooks keep FastCachedLM on its fast path, with logits identical to the transformers module path
(and, with the out-major copies of 2–3-row passes and the oneDNN-packed ones of longer passes, equal
to rounding)."""

import torch

from steerspec.models import load_model, resolve_model_dir
from steerspec.models.kv import CachedLM, FastCachedLM, hook_state
from steerspec.steering import attach_steering, load_steering


def test_steered_fast_path_equals_module_path_and_stays_fast(monkeypatch):
    from steerspec.models.layouts import ENV, ONEDNN_ENV

    directory = resolve_model_dir("sd2")
    model = load_model(directory)
    weights = load_steering(directory)
    hooks = attach_steering(model, weights.drafter)
    try:
        torch.manual_seed(0)
        g = torch.randn(1, weights.config.verifier_hidden_size)
        prompt = torch.randint(1, model.config.vocab_size, (12,)).tolist()
        outputs = {}
        for name, cls, rows, packed_from in (("CachedLM", CachedLM, "", "0"), ("FastCachedLM", FastCachedLM, "", "0"),
                                             ("copies", FastCachedLM, "2,3", "4")):
            # bitwise: the same weights as the module path; "copies": 3-row passes out-major, 12-row packed
            monkeypatch.setenv(ENV, rows)
            monkeypatch.setenv(ONEDNN_ENV, packed_from)
            lm = cls(model)
            with torch.inference_mode():
                hooks.set_vector(g, steer_prefix=False)  # first block: prompt[:-1] stays unsteered
                first = lm.extend(prompt, logits_to_keep=3).logits.clone()
                one = lm.extend([5], logits_to_keep=1).logits.clone()
                hooks.set_vector(0.5 * g, steer_prefix=True)  # a later block
                later = lm.extend([7, 9, 11], logits_to_keep=3).logits.clone()
                hooks.clear()
                plain = lm.extend([13], logits_to_keep=1).logits.clone()
            outputs[name] = (first, one, later, plain)
        for slow, fast, copies in zip(outputs["CachedLM"], outputs["FastCachedLM"], outputs["copies"]):
            assert torch.equal(slow, fast)
            torch.testing.assert_close(copies, slow, atol=1e-4, rtol=1e-4)
        fast_lm = FastCachedLM(model)
        assert all(hook_state(plan.modules) == (False, hooks) for plan in fast_lm.layer_plans)
    finally:
        hooks.remove()
    assert all(hook_state(plan.modules) == (False, None) for plan in FastCachedLM(model).layer_plans)
