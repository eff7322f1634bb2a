"""A drafter's calibrated draft temperature (models/draft_temperature.py, `steerspec train temperature`)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from steerspec.cli import main
from steerspec.errors import UsageError
from steerspec.models import cached_lm, load_model
from steerspec.models.draft_temperature import CONFIG_KEY, apply
from steerspec.train.temperature import acceptance_by_temperature
from steerspec.models.checkpoints import MODELS_DIR
from steerspec.models.reduced import init_from_verifier, save_drafter
from steerspec.train.temperature import write_card, write_config

IDS = [[3, 9, 4, 4, 8, 17]]


@pytest.fixture(scope="module")
def tiny_verifier(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=[0])
    path = tmp_path_factory.mktemp("tiny_verifier")
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


@pytest.fixture()
def reduced_dir(tiny_verifier, tmp_path):
    drafter = init_from_verifier(tiny_verifier, str(tiny_verifier), torch.arange(0, 64, 2), [0, 1])
    return save_drafter(drafter, tmp_path / "drafter")


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits


def test_apply_divides_a_tied_heads_logits_and_leaves_the_embeddings(tiny_verifier):
    model = load_model(tiny_verifier)
    raw, embed = _logits(model), model.get_input_embeddings().weight.clone()
    apply(model, 0.8)
    assert torch.allclose(_logits(model), raw / 0.8, atol=1e-5)
    assert torch.equal(model.get_input_embeddings().weight, embed)  # the tie was broken, not the table scaled
    assert torch.equal(_logits(model).argmax(-1), raw.argmax(-1))  # greedy drafting is unchanged
    with pytest.raises(ValueError, match=r"in \(0, 4\]"):
        apply(model, 0.0)


def test_load_model_folds_the_configured_temperature_into_every_path(reduced_dir):
    raw = _logits(load_model(reduced_dir))
    want = (raw / 0.7).softmax(-1)  # off the support q stays exactly 0 (the mask is not scaled)
    write_config(reduced_dir, 0.7)
    model = load_model(reduced_dir)
    assert torch.allclose(_logits(model).softmax(-1), want, atol=1e-6)
    fast = cached_lm(model, "fast")  # the lean cache reads the head's weights directly
    assert torch.allclose(fast.extend(IDS[0]).logits.softmax(-1), want[0], atol=1e-6)
    plain = load_model(reduced_dir, draft_temperature=False)  # training and calibration read the raw logits
    assert torch.equal(_logits(plain), raw) and not hasattr(plain.config, CONFIG_KEY)


def test_a_retrained_drafter_is_saved_uncalibrated(reduced_dir, tmp_path):
    write_config(reduced_dir, 0.7)
    saved = save_drafter(load_model(reduced_dir, cpu_layout=False), tmp_path / "again")
    assert CONFIG_KEY not in json.loads((saved / "config.json").read_text())


def test_a_bad_configured_temperature_names_the_fix(reduced_dir):
    write_config(reduced_dir, -1.0)
    with pytest.raises(UsageError, match="steerspec train temperature"):
        load_model(reduced_dir)


def test_acceptance_peaks_at_the_temperature_that_recovers_p():
    torch.manual_seed(1)
    z = torch.randn(40, 16) * 2
    p = (z / 0.5).softmax(-1)  # p is the drafter's logits at t = 0.5 exactly
    scores = acceptance_by_temperature(p, z, [0.4, 0.5, 0.7, 1.0], top_k=16)
    assert torch.allclose(scores[0.5], torch.ones(40), atol=1e-3)  # q as decoding sends it (fp16 rows)
    assert all(float(scores[t].mean()) < float(scores[0.5].mean()) - 1e-3 for t in (0.4, 0.7, 1.0))


def test_train_temperature_writes_the_best_of_its_grid(tmp_path, capsys):
    drafter = tmp_path / "sd2"
    shutil.copytree(MODELS_DIR / "sd2", drafter)
    code = main(["train", "temperature", "--verifier", "verifier", "--drafter", str(drafter), "--prompts", "3",
                 "--max-new-tokens", "12", "--grid", "0.6,0.8,1.2", "--write"])
    assert code == 0
    report = json.loads((drafter / "draft_temperature.json").read_text())
    assert set(report["acceptance"]) == {"0.6", "0.8", "1.0", "1.2"} and report["positions"] > 0
    assert report["acceptance"][str(report["best"])] == max(report["acceptance"].values())
    assert report["command"] == (f"steerspec train temperature --verifier verifier --drafter {drafter} --prompts 3 "
                                 "--max-new-tokens 12 --grid 0.6,0.8,1.2 --draft-top-k 64 --k 4 --seed 1 --threads 1 --write")
    assert json.loads((drafter / "config.json").read_text())[CONFIG_KEY] == report["best"]
    assert "best draft temperature" in capsys.readouterr().out
    write_card(drafter, report)  # a later calibration replaces the card's section
    card = (drafter / "MODEL_CARD.md").read_text()
    assert card.count("## Draft temperature") == 1 and f"t = {report['best']:g}:" in card
    assert card.startswith((MODELS_DIR / "sd2" / "MODEL_CARD.md").read_text().rstrip("\n"))


def test_train_temperature_refuses_a_bad_grid(capsys):
    assert main(["train", "temperature", "--drafter", "sd2", "--verifier", "verifier", "--grid", "0.8,-1"]) == 2
    assert "--grid" in capsys.readouterr().err


def test_a_sprinter_head_from_before_a_calibration_is_refused(tmp_path):
    """SPRINTER's features hold q(x) and H(q): a head trained at another draft temperature is refused, naming
    the retraining command; one whose metadata matches the drafter's calibration loads."""
    from steerspec.sprinter.classifier import META, resolve_head

    drafter = tmp_path / "sd2"
    shutil.copytree(MODELS_DIR / "sd2", drafter)
    assert resolve_head(drafter).meta.get("draft_temperature") is None  # uncalibrated drafter, head at t = 1
    write_config(drafter, 0.8)
    with pytest.raises(UsageError, match=r"draft temperature 1, .* calibrated at 0.8; retrain it"):
        resolve_head(drafter)
    meta = json.loads((drafter / "sprinter" / META).read_text())
    (drafter / "sprinter" / META).write_text(json.dumps({**meta, "draft_temperature": 0.8}))
    assert resolve_head(drafter).meta["draft_temperature"] == 0.8
