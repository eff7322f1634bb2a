"""SD² through the real services: the bundled steered drafter keeps greedy output exact, and the
steering vectors travel in the verify replies (fp16, d_V values) and raise block efficiency."""

import json

import pytest

from coordinator.local import LocalCluster
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
from steerspec.models import load_model, resolve_model_dir
from steerspec.decoding.sampling import SamplingParams
from steerspec.steering import has_steering

PROMPTS = 4
NEW_TOKENS = 32


def _prompts(tokenizer_dir, n):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    path = resolve_model_dir("verifier").parent.parent / "eval" / "indist.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [tok.encode(r["prompt"]) for r in rows]


@pytest.mark.skipif(not has_steering(resolve_model_dir("sd2")), reason="the sd2 drafter is not bundled")
@pytest.mark.slow
async def test_sd2_drafter_through_services_is_exact_and_steered():
    verifier_dir = resolve_model_dir("verifier")
    verifier = load_model(verifier_dir)
    prompts = _prompts(verifier_dir, PROMPTS)
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.0))
    expected = [autoregressive_generate(verifier, p, config).token_ids for p in prompts]

    taus = {}
    for drafter in ("sd2", "pretrained"):
        async with LocalCluster(verifier=str(verifier_dir), drafter=drafter, eos_ids=()) as cluster:
            results = [await cluster.generate(p, max_new_tokens=NEW_TOKENS, k=8, steering=drafter == "sd2")
                       for p in prompts]
            for got, want in zip(results, expected):
                assert list(got.token_ids) == list(want)
            taus[drafter] = sum(r.generated for r in results) / sum(r.rounds for r in results)
            if drafter == "sd2":
                bytes_down = sum(r.bytes_down for r in results) / len(results)
                d_v = verifier.config.hidden_size
                # the fp16 vector plus the small result fields (acceptance, timings, the verifier's load report)
                assert 2 * d_v <= bytes_down <= 2 * d_v + 96
    assert taus["sd2"] > taus["pretrained"]


@pytest.mark.skipif(not has_steering(resolve_model_dir("sd2")), reason="the sd2 drafter is not bundled")
async def test_a_loaded_sd2_drafter_is_flagged_as_unsteered(caplog):
    """Given the SD² drafter as a loaded model (no way to attach its W_s), the cluster runs it
    unsteered and says so in one warning that names the fix; given its directory, it steers."""
    verifier, drafter = load_model("verifier"), load_model("sd2")
    with caplog.at_level("WARNING", logger="coordinator.local"):
        async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
            assert not cluster.steering
    assert any("pass the directory to steer it" in r.getMessage() for r in caplog.records)
    caplog.clear()
    async with LocalCluster(verifier=verifier, drafter=str(resolve_model_dir("sd2")), tokenizer=None,
                            eos_ids=()) as cluster:
        assert cluster.steering
    assert not [r for r in caplog.records if r.name == "coordinator.local"]
