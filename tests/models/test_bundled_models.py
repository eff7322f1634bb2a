"""The bundled drafter/verifier pair and eval sets ship as package data and load offline."""

import json
from pathlib import Path

import pytest
import torch

MODELS = Path(__file__).resolve().parents[2] / "steerspec" / "assets" / "models"
EVAL = Path(__file__).resolve().parents[2] / "steerspec" / "assets" / "eval"
BUDGET_BYTES = 40 * 1024 * 1024  # the tiny pair and its heads
SMOLLM2_BUDGET_BYTES = 100 * 1000 * 1000  # the real pair's drafters: 100 MB in all, no file over 50 MB


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(str(MODELS / name), local_files_only=True).eval()
            for name in ("verifier", "pretrained")}


def _params(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_models_load_offline_and_give_sane_logits(pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODELS / "verifier"), local_files_only=True)
    tok_d = AutoTokenizer.from_pretrained(str(MODELS / "pretrained"), local_files_only=True)
    assert tok.get_vocab() == tok_d.get_vocab() and tok.eos_token == "<|endoftext|>"
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == text
    for name, model in pair.items():
        assert type(model).__name__ == "LlamaForCausalLM"
        assert next(model.parameters()).dtype == torch.float32, name
        assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
        # A trained model predicts Python far better than uniform (log 4096 = 8.3 nats).
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        assert loss < 6.0, (name, float(loss))


def test_verifier_is_at_least_4x_the_drafter(pair):
    assert _params(pair["verifier"]) >= 4 * _params(pair["pretrained"])


def test_verifier_beats_drafter_on_heldout():
    reports = {n: json.loads((MODELS / n / "train_report.json").read_text()) for n in ("verifier", "pretrained")}
    assert reports["verifier"]["heldout_loss"] < reports["pretrained"]["heldout_loss"] - 0.1
    assert not set(["verifier", "drafter"]) - {r["data"]["slice"] for r in reports.values()}


def test_bundled_weights_within_budget():
    weights = [w for w in MODELS.rglob("*.safetensors") if not w.relative_to(MODELS).parts[0].startswith("smollm2-")]
    assert len(weights) >= 2
    assert sum(w.stat().st_size for w in weights) <= BUDGET_BYTES
    assert (MODELS / "verifier" / "model.safetensors").stat().st_size <= 15 * 1024 * 1024
    assert not list(MODELS.rglob("*.pt")), "training checkpoints must not ship"
    for name in ("verifier", "pretrained"):
        assert (MODELS / name / "MODEL_CARD.md").exists()
        assert json.loads((MODELS / name / "config.json").read_text())["dtype"] == "float32"


def test_smollm2_drafters_within_budget_in_fp16():
    from safetensors import safe_open

    weights = sorted(MODELS.glob("smollm2-*/**/*.safetensors"))
    assert {w.relative_to(MODELS).parts[0] for w in weights} == {
        "smollm2-pretrained", "smollm2-distilled", "smollm2-sd2"}
    assert sum(w.stat().st_size for w in weights) <= SMOLLM2_BUDGET_BYTES
    assert max(w.stat().st_size for w in weights) <= SMOLLM2_BUDGET_BYTES // 2
    for w in weights:
        if w.name in ("drafter.safetensors", "steering.safetensors"):
            with safe_open(str(w), "pt") as f:
                floats = {str(f.get_slice(k).get_dtype()) for k in f.keys()} - {"I32", "I64"}
            assert floats == {"F16"}, (w, floats)
    for name in ("smollm2-pretrained", "smollm2-distilled", "smollm2-sd2"):
        assert (MODELS / name / "MODEL_CARD.md").exists()


@pytest.mark.parametrize("name", ["indist", "tests", "docs"])
def test_eval_sets_have_enough_valid_prompts(name):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODELS / "verifier"), local_files_only=True)
    records = [json.loads(line) for line in (EVAL / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    assert len(records) >= 48
    assert len({r["id"] for r in records}) == len(records) and len({r["prompt"] for r in records}) == len(records)
    for r in records:
        assert set(r) == {"id", "prompt", "source"} and r["prompt"].strip()
        assert 20 <= len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) <= 200, r["id"]
    if name == "docs":
        assert all(r["source"].startswith("pydoc_data/") for r in records)
    elif name == "tests":
        from steerspec.data.corpus import is_test_file

        assert all(is_test_file(r["source"].rsplit(":", 1)[0]) for r in records)
    else:
        from steerspec.data.corpus import stdlib_split

        held = set(stdlib_split().heldout)
        assert all(r["source"].rsplit(":", 1)[0] in held for r in records)


def test_smollm2_drafters_ship_their_calibrated_draft_temperature():
    """Each shipped smollm2 drafter carries the draft temperature its calibration report chose, and its SPRINTER
    head was trained at that temperature (resolve_head refuses a mismatch)."""
    from steerspec.models.draft_temperature import CONFIG_KEY
    from steerspec.sprinter.classifier import resolve_head
    from steerspec.train.temperature import REPORT_NAME

    for name in ("smollm2-pretrained", "smollm2-distilled", "smollm2-sd2"):
        config = json.loads((MODELS / name / "config.json").read_text())
        report = json.loads((MODELS / name / REPORT_NAME).read_text())
        best = report["best"]
        assert config[CONFIG_KEY] == best and 0 < best <= 1.0
        assert report["acceptance"][str(best)] == max(report["acceptance"].values())
        assert "## Draft temperature" in (MODELS / name / "MODEL_CARD.md").read_text()
        assert resolve_head(MODELS / name).meta["draft_temperature"] == best
