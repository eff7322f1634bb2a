"""The verifier's outputs cached at synthesis time (`train synth --teacher-top-k`) are exactly what a
fresh forward over the finished sequence computes, survive the shard round trip, and train the same
way as the verifier in the loop."""

from __future__ import annotations

import torch

from steerspec.steering import load_steering
from steerspec.train import distill
from steerspec.train.synth import SyntheticSet, load_synthetic, sample_answers, save_shard
from tests.train.test_train_sd2 import VOCAB, sd2_bundle, tiny_llama

LAYERS = (1, 2, 3)


def cached_data(verifier, n=16, seed=0, top_k=VOCAB, eos_id=None) -> SyntheticSet:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(n)]
    record = []
    answers = sample_answers(verifier, prompts, 10, gen, eos_id=eos_id, record=record, top_k=top_k, tap_layers=LAYERS)
    return SyntheticSet([torch.tensor(p + a) for p, a in zip(prompts, answers)], [len(p) for p in prompts],
                        {"teacher_top_k": top_k, "tap_layers": list(LAYERS)}, record)


def test_cached_outputs_equal_a_fresh_forward_over_each_sequence():
    verifier = tiny_llama(32, 4, 64, seed=0)
    first = cached_data(verifier, top_k=8)
    eos = int(first.sequences[0][first.prompt_lens[0] + 2])  # the same seed stops row 0 at its third token
    data = cached_data(verifier, top_k=8, eos_id=eos)
    assert any(len(s) - p < 10 for s, p in zip(data.sequences, data.prompt_lens)), "no row stopped at EOS"
    for seq, plen, rec in zip(data.sequences, data.prompt_lens, data.teacher):
        with torch.no_grad():
            out = verifier(input_ids=seq[None], output_hidden_states=True)
        n_ans = len(seq) - plen
        logp = torch.log_softmax(out.logits[0, plen - 1 : plen - 1 + n_ans].float(), -1)
        assert rec.top_ids.shape == (n_ans, 8) and rec.taps.shape == (n_ans + 1, 3, 32)
        torch.testing.assert_close(rec.top_logp.float(), logp.gather(-1, rec.top_ids.long()), atol=2e-2, rtol=1e-2)
        assert torch.equal(rec.top_ids[:, 0].long(), logp.argmax(-1))
        taps = torch.stack([out.hidden_states[i][0] for i in LAYERS], dim=1)  # [T, 3, d]
        first = taps[plen - 2] if plen >= 2 else torch.zeros_like(taps[0])
        torch.testing.assert_close(rec.taps[0].float(), first, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(rec.taps[1:].float(), taps[plen - 1 : plen - 1 + n_ans], atol=2e-2, rtol=1e-2)


def test_cached_shards_round_trip_and_split(tmp_path):
    verifier = tiny_llama(32, 4, 64, seed=0)
    data = cached_data(verifier, n=6, top_k=4)
    save_shard(tmp_path / "shard_00000.safetensors", [s.tolist() for s in data.sequences[:4]], data.prompt_lens[:4],
               data.teacher[:4])
    save_shard(tmp_path / "shard_00001.safetensors", [s.tolist() for s in data.sequences[4:]], data.prompt_lens[4:],
               data.teacher[4:])
    (tmp_path / "meta.json").write_text('{"teacher_top_k": 4, "tap_layers": [1, 2, 3]}')
    back = load_synthetic(tmp_path)
    assert back.tap_layers == LAYERS
    for a, b in zip(data.teacher, back.teacher):
        assert torch.equal(a.top_ids, b.top_ids) and torch.equal(a.top_logp, b.top_logp) and torch.equal(a.taps, b.taps)
    train, val = back.split(0.34, seed=0)
    assert len(train.teacher) == len(train) and len(val.teacher) == len(val)


def test_cached_teacher_loss_matches_the_verifier_in_the_loop():
    """With the full vocabulary cached the loss is the verifier-in-the-loop loss; steering reads the
    cached taps exactly as it reads a fresh forward's hidden states."""
    torch.manual_seed(0)
    verifier = tiny_llama(32, 4, 64, seed=0)
    drafter = tiny_llama(16, 2, 32, seed=1)
    data = cached_data(verifier, n=8, top_k=VOCAB)
    bundle = sd2_bundle(verifier, drafter)
    from steerspec.steering.drafter import SteeringHooks

    hooks = SteeringHooks(drafter, bundle.steering)
    rows = list(range(8))
    sources = lambda plens, width: distill.steering_sources(plens, width, 2)
    live = distill.batch_loss(bundle, hooks, verifier, distill.make_batch(data, rows, 0, cached=False), sources)
    cached = distill.batch_loss(bundle, hooks, None, distill.make_batch(data, rows, 0, cached=True), sources)
    torch.testing.assert_close(cached[0], live[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(cached[1], live[1], atol=2e-3, rtol=2e-3)


def test_reduced_drafter_trains_on_the_cache_and_reloads(tmp_path, monkeypatch):
    """`train distill` and `train sd2` fit a reduced-vocabulary drafter on cached data without loading the
    verifier; the exported directory reloads to the trained weights and its q stays 0 off its support."""
    from steerspec.cli import main
    from steerspec.models import loading, reduced

    verifier = tiny_llama(32, 4, 64, seed=0)
    verifier.save_pretrained(str(tmp_path / "v"), safe_serialization=True)
    support = torch.arange(0, VOCAB, 2)  # half the vocabulary, EOS (0) included
    init = reduced.init_from_verifier(tmp_path / "v", str(tmp_path / "v"), support, [0, 1])
    reduced.save_drafter(init, tmp_path / "d")
    data = cached_data(verifier, n=12, top_k=16)
    (tmp_path / "data").mkdir()
    save_shard(tmp_path / "data" / "shard_00000.safetensors", [s.tolist() for s in data.sequences], data.prompt_lens,
               data.teacher)
    (tmp_path / "data" / "meta.json").write_text('{"teacher_top_k": 16, "tap_layers": [1, 2, 3]}')

    def refuse(path, *a, **k):
        if str(path) == str(tmp_path / "v"):
            raise AssertionError("the verifier was loaded although the data caches its outputs")
        return real_load(path, *a, **k)

    real_load = loading.load_model
    monkeypatch.setattr(loading, "load_model", refuse)
    common = ["--data", str(tmp_path / "data"), "--verifier", str(tmp_path / "v"), "--drafter", str(tmp_path / "d"),
              "--steps", "12", "--batch-size", "4", "--lr", "5e-3", "--eval-every", "0", "--val-fraction", "0.25"]
    assert main(["train", "distill", *common, "--out", str(tmp_path / "dist")]) == 0
    assert main(["train", "sd2", *common, "--out", str(tmp_path / "sd2"), "--k", "3"]) == 0
    import json

    for name in ("dist", "sd2"):
        report = json.loads((tmp_path / name / "train_report.json").read_text())
        assert report["final"]["val_kl"] < report["initial"]["val_kl"], name
        back = real_load(tmp_path / name)
        assert reduced.is_reduced_dir(tmp_path / name) and torch.equal(back.lm_head.support, support)
        assert not torch.equal(back.model.layers[0].mlp.up_proj.weight, init.model.layers[0].mlp.up_proj.weight.half().float())
        with torch.no_grad():
            q = torch.softmax(back(input_ids=data.sequences[0][None]).logits, -1)
        off = torch.ones(VOCAB, dtype=torch.bool)
        off[support] = False
        assert float(q[..., off].max()) == 0.0
    assert load_steering(tmp_path / "sd2").config.verifier_layers == LAYERS
    assert not (tmp_path / "dist" / "steering.safetensors").exists()


def test_support_only_loss_equals_the_full_vocabulary_loss(tmp_path):
    """A reduced drafter's cached loss, computed on its support's logits only, equals the same loss on its
    full-vocabulary row (q = 0 off the support, those tokens left out)."""
    from steerspec.models import reduced

    verifier = tiny_llama(32, 4, 64, seed=0)
    verifier.save_pretrained(str(tmp_path / "v"), safe_serialization=True)
    drafter = reduced.init_from_verifier(tmp_path / "v", str(tmp_path / "v"), torch.arange(0, VOCAB, 3), [0, 2])
    data = cached_data(verifier, n=6, top_k=12)
    batch = distill.make_batch(data, list(range(6)), 0)
    sources = lambda plens, width: distill.steering_sources(plens, width, 1)
    loss, overlap = distill.batch_loss(distill.DrafterBundle(drafter), None, None, batch, sources)
    with torch.no_grad():
        full = drafter(input_ids=batch.ids).logits
    mask = distill.answer_mask(batch.plens, batch.lengths, batch.ids.shape[1])
    want = distill.top_k_kl(batch.top_ids, batch.top_logp, full, mask)
    masked = full.gather(-1, batch.top_ids) <= reduced.MASKED_LOGIT / 2
    assert bool(masked.any()) and not bool(masked.all())  # some cached tokens fall off the support
    torch.testing.assert_close(loss.detach(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(overlap, want[1], atol=1e-5, rtol=1e-5)
