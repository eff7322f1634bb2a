"""`steerspec run` and `steerspec models`: output, --json fields, seeded determinism, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from steerspec.cli import main

JSON_FIELDS = ("text", "token_ids", "block_efficiency", "acceptance_rate", "accepted_per_position", "rounds",
               "tokens_per_s")


@pytest.fixture(scope="module")
def pair_args(model_pair):
    verifier, drafter = model_pair
    return ["--verifier", str(verifier), "--drafter", str(drafter)]


def run_cli(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, argv):
    code, out, err = run_cli(capsys, argv + ["--json"])
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_plain_output_is_text_then_summary(capsys, pair_args):
    code, out, err = run_cli(capsys, ["run", "def fibonacci(n):", "--max-new-tokens", "12"] + pair_args)
    assert code == 0, err
    summary = out.rstrip("\n").splitlines()[-1]
    for name in ("block_efficiency=", "acceptance_rate=", "tokens_per_s="):
        assert name in summary


@pytest.mark.slow
def test_json_fields_and_greedy_modes_agree(capsys, pair_args):
    spec = run_json(capsys, ["run", "def fibonacci(n):", "--max-new-tokens", "16", "--k", "4"] + pair_args)
    for field in JSON_FIELDS:
        assert field in spec
    assert len(spec["token_ids"]) == 16 or spec["stop_reason"] == "eos"
    assert len(spec["accepted_per_position"]) == 4
    ar = run_json(capsys, ["run", "def fibonacci(n):", "--max-new-tokens", "16", "--mode", "autoregressive"]
                  + pair_args)
    assert ar["token_ids"] == spec["token_ids"] and ar["text"] == spec["text"]
    assert ar["block_efficiency"] == 1.0 and ar["acceptance_rate"] is None


def test_seed_fixes_sampled_output(capsys, pair_args):
    argv = ["run", "import os", "--max-new-tokens", "16", "--temperature", "1", "--top-p", "0.9", "--seed", "7"]
    first = run_json(capsys, argv + pair_args)
    second = run_json(capsys, argv + pair_args)
    assert first["token_ids"] == second["token_ids"]


@pytest.mark.parametrize("argv, message", [
    (["run", ""], "empty"),
    (["run", "x", "--temperature", "-1"], "temperature"),
    (["run", "x", "--top-p", "0"], "top-p"),
    (["run", "x", "--top-p", "1.5"], "top-p"),
    (["run", "x", "--k", "0"], "[1, 64]"),
    (["run", "x", "--k", "65"], "[1, 64]"),
    (["run", "x", "--verifier", "/nonexistent/model"], "local"),
    (["run", "x", "--drafter", "/nonexistent/model"], "local"),
    (["run", "x", "--verifier", "meta-llama/Llama-3-8B"], "local directory"),
    (["run", "x", "--max-new-tokens", "0"], "max-new-tokens"),
    (["run", "x", "--k", "two"], "invalid int"),
    (["run", "x", "--device", "cuda:99", "--transport", "grpc"], "cuda:99"),  # before Ray starts its actors
    (["run", "x", "--device", "tpu", "--transport", "inproc"], "unknown device"),
    (["run", "x", "--rtt-ms", "50", "--transport", "inproc"], "--transport grpc"),  # no link in-process
    (["run", "x", "--rtt-ms", "-1"], "--rtt-ms"),
    (["run", "x", "--rtt-ms", "10", "--jitter-ms", "20"], "--jitter-ms"),
    (["run", "x", "--bandwidth-mbps", "nan"], "--bandwidth-mbps"),
    (["run", "x", "--deployment", "k8s"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, pair_args, argv, message):
    code, out, err = run_cli(capsys, argv[:2] + pair_args + argv[2:])
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert message in err


def test_prompt_longer_than_context_names_the_limit(capsys, pair_args, loaded_pair):
    from steerspec.models import context_length

    limit = context_length(loaded_pair[0])
    code, _, err = run_cli(capsys, ["run", "x = 1\n" * (limit + 10)] + pair_args)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert str(limit) in err and "context" in err


def test_models_lists_bundled_models(capsys):
    code, out, _ = run_cli(capsys, ["models", "--json"])
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert {"verifier", "pretrained", "distilled", "sd2"} <= set(rows)
    for name in ("verifier", "pretrained"):
        assert rows[name]["installed"] and rows[name]["parameters"] > 0 and rows[name]["path"]
    assert rows["verifier"]["parameters"] >= 4 * rows["pretrained"]["parameters"]


@pytest.mark.slow
def test_console_script_runs(pair_args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "steerspec", "run", "def f(x):", "--max-new-tokens", "8", "--json"]
                          + pair_args, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert set(JSON_FIELDS) <= set(json.loads(proc.stdout))


@pytest.mark.slow
def test_bench_engine_smoke(capsys, pair_args, tmp_path):
    """`steerspec bench engine` end to end on one prompt: table, JSON, identical greedy outputs."""
    out = tmp_path / "engine.json"
    code, stdout, err = run_cli(capsys, ["bench", "engine", "--prompts", "2", "--max-new-tokens", "6", "--ks", "1,2",
                                         "--compare-layouts", "--out", str(out)] + pair_args)
    assert code == 0, err
    assert "tokens/s" in stdout
    data = json.loads(out.read_text())
    methods = {r["method"] for r in data["results"]}
    assert {"verifier alone", "speculative k=1", "speculative k=2", "transformers assisted (default)",
            "transformers greedy (out-major)", "transformers assisted (default) (out-major)",
            "speculative k=1 (no weight copies)", "speculative k=2 (no weight copies)"} <= methods
    assert data["summary"]["all_outputs_equal"] is True and data["summary"]["ratio_vs_assisted"] > 0
    for row in data["results"]:
        assert row["tokens_per_s"] > 0 and row["block_efficiency"] >= 1.0
    assert data["steering"] is False
    assert data["summary"]["baseline"] in ("verifier alone", "transformers greedy", "transformers greedy (out-major)")


def test_bench_engine_steers_an_sd2_drafter(capsys, tmp_path):
    """An SD² drafter runs steered in our rows (greedy output still the verifier's) and unsteered in
    transformers' assisted generation, which has no hook for g."""
    from steerspec.bench.in_process import load_eval_prompts
    from steerspec.decoding.engine import DecodeConfig, speculative_generate
    from steerspec.models import cached_lm, load_model, load_tokenizer, resolve_model_dir
    from steerspec.policies import FixedK
    from steerspec.steering.runtime import maybe_steering

    out = tmp_path / "engine.json"
    code, stdout, err = run_cli(capsys, ["bench", "engine", "--prompts", "1", "--max-new-tokens", "12", "--ks", "3",
                                         "--verifier", "verifier", "--drafter", "sd2", "--no-assisted",
                                         "--prompt-tokens", "24", "--out", str(out)])
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["steering"] is True and data["summary"]["all_outputs_equal"] is True
    row = next(r for r in data["results"] if r["method"] == "speculative k=3")
    # the same generation steered by hand takes the bench's rounds
    tok = load_tokenizer(resolve_model_dir("verifier"))
    ids = tok(load_eval_prompts("indist", 1)[0], add_special_tokens=False)["input_ids"][-24:]
    verifier, drafter = load_model("verifier"), cached_lm(load_model("sd2"))
    config = DecodeConfig(max_new_tokens=12, eos_token_ids=(tok.eos_token_id,))
    with maybe_steering(drafter, resolve_model_dir("sd2")) as steering:
        steered = speculative_generate(cached_lm(verifier), drafter, ids, config, FixedK(3), steering=steering)
    assert row["rounds"] == steered.rounds


@pytest.mark.slow
def test_invariant_bfloat16_greedy_agrees_across_modes_and_transports(capsys, pair_args):
    """--invariant on in bfloat16: speculative in process, through the services and the verifier alone agree."""
    args = ["run", "def fibonacci(n):", "--max-new-tokens", "16", "--dtype", "bfloat16", "--invariant", "on",
            "--k", "4"] + pair_args
    inproc = run_json(capsys, args + ["--transport", "inproc"])
    services = run_json(capsys, args)
    alone = run_json(capsys, args + ["--mode", "autoregressive", "--transport", "inproc"])
    assert inproc["token_ids"] == services["token_ids"] == alone["token_ids"]


def test_an_unknown_invariant_mode_exits_2(capsys, pair_args):
    code, _, err = run_cli(capsys, ["run", "x", "--invariant", "sometimes", "--transport", "inproc"] + pair_args)
    assert code == 2 and "--invariant" in err
