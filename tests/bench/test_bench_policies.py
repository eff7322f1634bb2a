"""`steerspec train specdecpp|pacer` and `steerspec bench policies`: a fast smoke run on the tiny pair."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from steerspec.cli import main
from steerspec.policies import PolicyContext, make_policy
from steerspec.train.pacer_tune import B_GRID


@pytest.mark.slow
def test_train_heads_then_bench_policies(tiny_pair, tmp_path, capsys):
    verifier, drafter = tiny_pair
    heads = {}
    for kind in ("specdecpp", "pacer"):
        out, work = tmp_path / f"{kind}.safetensors", tmp_path / "work"
        base = ["train", kind, "--verifier", str(verifier), "--drafter", str(drafter), "--prompts", "6",
                "--answer-tokens", "12", "--gamma", "6", "--stride", "3", "--out", str(out), "--work", str(work)]
        assert main(base + ["--epochs", "1"]) == 0
        assert main(base + ["--epochs", "2"]) == 0  # resumes from checkpoint-KIND.pt: one more epoch
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert len(report["losses"]) == 2 and 0.0 <= report["heldout"]["roc_auc"] <= 1.0
        with safe_open(str(out), framework="pt") as handle:
            assert handle.metadata()["kind"] == kind and out.stat().st_size < 1_000_000
        assert (tmp_path / f"{kind}_MODEL_CARD.md").read_text().count("ROC AUC") == 1
        heads[kind] = out
    assert (tmp_path / "work" / "labels.pt").is_file()  # labels shared by both kinds
    with safe_open(str(heads["pacer"]), framework="pt") as handle:  # Pacer's b, t, rho tuned on held-out blocks
        tuned = json.loads(handle.metadata()["meta"])["tuned"]
    assert tuned["b"] in B_GRID and 0 < tuned["t"] < 1 and tuned["blocks"] >= 1 and tuned["draft_ms"] > 0
    assert tuned["replay"] == "decoding" and tuned["round_ms"] > 0 and tuned["tune_prompts"] == 1  # 15% of 6
    table = tuned["verify_ms"]  # a verify pass per token count up to gamma + 1, never cheaper when longer
    assert len(table) == 7 and all(0 < a <= b for a, b in zip(table, table[1:]))
    assert "a verify pass of 1..7 tokens" in (tmp_path / "pacer_MODEL_CARD.md").read_text()
    assert (tmp_path / "work" / "trajectory.pt").is_file()
    assert "Tuned (the policy's defaults" in (tmp_path / "pacer_MODEL_CARD.md").read_text()
    pacer = make_policy(f"pacer:head={heads['pacer']}", PolicyContext())
    assert (pacer.b, pacer.t0, pacer.rho) == (tuned["b"], tuned["t"], tuned["rho"])
    own = make_policy(f"pacer:head={heads['pacer']},b=3,t=0.45,rho=1", PolicyContext())
    assert (own.b, own.t0, own.rho) == (3, 0.45, 1.0)  # a spec's own values win

    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    policies = (f"fixed;gammatune+;latency;specdecpp:head={heads['specdecpp']};pacer:head={heads['pacer']},b=2")
    assert main(["bench", "policies", "--quick", "--verifier", str(verifier), "--drafter", str(drafter),
                 "--policies", policies, "--initial-k", "2,4", "--rtt-ms", "0,20", "--prompts", "1",
                 "--max-new-tokens", "8", "--out", str(out), "--plot", str(plot)]) == 0
    report = json.loads(out.read_text())
    assert plot.stat().st_size > 0
    regimes = {r["regime"] for r in report["rows"]}
    assert regimes == {"inprocess", "rtt0", "rtt20"}
    for regime in regimes:
        fixed = [r for r in report["rows"] if r["regime"] == regime and r["policy"] == "fixed"]
        assert [r["initial_k"] for r in fixed] == [2, 4]
        assert sum(r["policy"] == "latency" for r in report["rows"] if r["regime"] == regime) == 1
    for row in report["rows"]:
        m = row["metrics"]
        assert m["tokens"] >= 1 and m["tokens_per_s"] > 0 and m["verifier_calls"] >= 1
        assert len(m["per_prompt_tokens_per_s"]) == 1  # one prompt: no spread to compare against
        if row["policy"] == "verifier":
            continue
        hist = {int(n): c for n, c in m["draft_length_hist"].items()}  # every block's draft length, counted
        assert sum(hist.values()) == m["verifier_calls"] and sum(n * c for n, c in hist.items()) == m["drafter_calls"]
        assert m["draft_length_mean"] == pytest.approx(m["drafter_calls"] / m["verifier_calls"], abs=1e-3)
        if row["policy"] == "fixed":
            assert max(hist) <= row["initial_k"]  # shorter only where the token budget ends a block
    table = {(r["regime"], r["policy"]): r for r in report["gammatune_table"]}
    assert table[("inprocess", "fixed")]["speedup_mean"] == pytest.approx(1.0, abs=1e-3)
    assert table[("rtt20", "latency")]["speedup_std"] is None  # no initial k: runs once
    assert {r["policy"] for r in report["pacer_table"]} == {"fixed", "gammatune+", "latency", "specdecpp", "pacer"}
    # GammaTune+ is checked in every regime (one prompt: no per-prompt spread, so no `latency` or Pacer verdicts)
    assert {(t["regime"], t["target"].split(" ")[0]) for t in report["targets"]} == \
        {(g, "gammatune+") for g in regimes}
    printed = capsys.readouterr().out
    assert "GammaTune Table 2 layout" in printed and "Pacer Tables 1/6 layout" in printed and "k/block" in printed


@pytest.mark.parametrize("argv, fragment", [
    (["--policies", "nosuch"], "unknown draft-length policy"),
    (["--policies", "fixed:k=0"], "[1, 64]"),
    (["--initial-k", "0"], "--initial-k"),
    (["--sets", "bogus"], "--sets"),
    (["--trees", "0,11"], "needs its parent"),
])
def test_bench_policies_bad_flags_exit_2(argv, fragment, capsys):
    assert main(["bench", "policies", *argv]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.slow
def test_bench_policies_runs_draft_trees_beside_the_policies(tmp_path, capsys):
    """--trees adds rows of policy 'tree' in every regime, compared prompt by prompt with the best fixed k
    in the same interleaved run: as many tokens as the verifier alone, in fewer verifier calls."""
    out = tmp_path / "bench.json"
    assert main(["bench", "policies", "--quick", "--verifier", "verifier", "--drafter", "pretrained", "--policies",
                 "fixed", "--initial-k", "2", "--sets", "indist", "--rtt-ms", "0", "--temperatures", "0",
                 "--prompts", "2", "--max-new-tokens", "16", "--trees", "default", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["trees"] == ["0,1,2,00,10"] and "--trees 'default'" in report["command"]
    trees = {r["regime"]: r for r in report["pacer_table"] if r["policy"] == "tree"}
    assert set(trees) == {"inprocess", "rtt0"}
    for regime, row in trees.items():
        assert row["spec"] == "tree:0,1,2,00,10" and row["vs_best_fixed"] is not None
        alone = next(r for r in report["rows"] if r["regime"] == regime and r["policy"] == "verifier")["metrics"]
        tree = next(r for r in report["rows"] if r["regime"] == regime and r["policy"] == "tree")["metrics"]
        assert tree["tokens"] == alone["tokens"] and tree["verifier_calls"] < alone["verifier_calls"]
    assert "tree" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_policies_measures_block_verification(tmp_path):
    """--verification block: every speculative run, in process and through the services, accepts by block
    verification (chains) and traversal verification (trees): the blocks each regime counts are those of
    `speculative_generate` / `tree_generate` with acceptance "block" and the same seeds, not token-wise ones."""
    from coordinator.cli import load_tokenizer_and_eos
    from steerspec.data.evalsets import load_eval_set
    from steerspec.decoding.engine import DecodeConfig, speculative_generate
    from steerspec.models import cached_lm, load_model, resolve_model_dir
    from steerspec.policies import FixedK
    from steerspec.decoding.sampling import SamplingParams
    from steerspec.decoding.tree_decoding import tree_generate

    out = tmp_path / "bench.json"
    assert main(["bench", "policies", "--quick", "--verifier", "verifier", "--drafter", "pretrained", "--policies",
                 "fixed", "--initial-k", "4", "--sets", "indist", "--rtt-ms", "0", "--temperatures", "1", "--prompts",
                 "3", "--max-new-tokens", "24", "--trees", "0,1,00", "--verification", "block", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["verification"] == "block" and "--verification block" in report["command"]
    calls = {(r["regime"], r["policy"]): r["metrics"]["verifier_calls"] for r in report["rows"]}

    vdir, ddir = resolve_model_dir("verifier"), resolve_model_dir("pretrained")
    tokenizer, eos = load_tokenizer_and_eos(str(vdir))
    v, d = cached_lm(load_model(vdir)), cached_lm(load_model(ddir))
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in load_eval_set("indist")[:3]]

    def blocks(acceptance: str, tree: bool) -> int:
        total = 0
        for i, p in enumerate(prompts):
            config = DecodeConfig(max_new_tokens=24, seed=i, eos_token_ids=eos, draft_top_k=64,
                                  sampling=SamplingParams(1.0), acceptance=acceptance)
            total += (tree_generate(v, d, p, config, "0,1,00") if tree else
                      speculative_generate(v, d, p, config, FixedK(4))).rounds
        return total

    for tree, policy in ((False, "fixed"), (True, "tree")):
        want = blocks("block", tree)
        assert calls[("inprocess", policy)] == want == calls[("rtt0", policy)], policy
    assert (blocks("token", False), blocks("token", True)) != (blocks("block", False), blocks("block", True))


def test_an_sd2_drafter_labels_its_blocks_steered():
    """Heads for an SD² drafter learn from the states it decodes with: its labelled blocks are drafted
    steered by the verifier's vector at each block start; the hooks are gone afterwards."""
    import argparse

    import torch

    from steerspec.models import load_model, resolve_model_dir
    from steerspec.train.policy_heads import label_blocks

    ddir = resolve_model_dir("sd2")
    verifier, drafter = load_model(resolve_model_dir("verifier")).eval(), load_model(ddir).eval()
    args = argparse.Namespace(answer_tokens=12, gamma=4, stride=4, ctx=8)
    prompts = [[5, 17, 42, 9, 33, 7]]
    plain = label_blocks(verifier, drafter, prompts, args, "plain")
    steered = label_blocks(verifier, drafter, prompts, args, "steered", drafter_dir=ddir)
    assert plain["hidden"].shape == steered["hidden"].shape
    assert not torch.allclose(plain["hidden"].float(), steered["hidden"].float())
    assert torch.equal(label_blocks(verifier, drafter, prompts, args, "again")["hidden"], plain["hidden"])


@pytest.mark.slow
def test_bench_policies_steers_an_sd2_drafter_in_process_and_through_the_services(tmp_path):
    """An SD² drafter is benchmarked as `steerspec run` decodes with it: steered by the verifier's vector,
    in-process and through the services alike (both regimes count the same blocks as a steered decode)."""
    from coordinator.cli import load_tokenizer_and_eos
    from steerspec.data.evalsets import load_eval_set
    from steerspec.decoding.engine import DecodeConfig, speculative_generate
    from steerspec.models import cached_lm, load_model, resolve_model_dir
    from steerspec.policies import FixedK
    from steerspec.steering.runtime import maybe_steering

    out = tmp_path / "bench.json"
    assert main(["bench", "policies", "--quick", "--verifier", "verifier", "--drafter", "sd2", "--policies", "fixed",
                 "--initial-k", "3", "--sets", "indist", "--rtt-ms", "0", "--temperatures", "0", "--prompts", "2",
                 "--max-new-tokens", "24", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["steered"] is True
    rows = {r["regime"]: r["metrics"] for r in report["rows"] if r["policy"] == "fixed"}

    vdir, ddir = resolve_model_dir("verifier"), resolve_model_dir("sd2")
    tokenizer, eos = load_tokenizer_and_eos(str(vdir))
    v, d = cached_lm(load_model(vdir)), cached_lm(load_model(ddir))
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in load_eval_set("indist")[:2]]

    def blocks(steering) -> int:
        return sum(speculative_generate(v, d, p, DecodeConfig(max_new_tokens=24, seed=i, eos_token_ids=eos),
                                        FixedK(3), steering=steering).rounds for i, p in enumerate(prompts))

    steered = blocks(maybe_steering(d, ddir))
    assert rows["inprocess"]["verifier_calls"] == steered == rows["rtt0"]["verifier_calls"]


@pytest.mark.parametrize("value", ["x", "-5", ""])
def test_train_pacer_bad_tune_rtts_exit_2(value, capsys):
    assert main(["train", "pacer", "--tune-rtt-ms", value]) == 2
    assert "--tune-rtt-ms" in capsys.readouterr().err


def test_each_prompt_runs_the_configurations_in_a_rotated_order():
    from steerspec.bench.policies import rotated

    assert [rotated("abc", i) for i in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_policies_are_compared_with_the_best_fixed_k_prompt_by_prompt():
    """The Pacer-layout row of a policy carries its per-prompt ratio to the best fixed k (same
    prompts, interleaved): mean, spread across prompts and standard error."""
    from steerspec.bench.policies import paired, table_pacer

    def row(policy, k, rates):
        tokens = 48 * len(rates)
        wall = sum(48 / r for r in rates)
        return {"set": "indist", "temperature": 0.0, "regime": "rtt50", "policy": policy, "initial_k": k,
                "spec": policy if k is None else f"{policy}:k={k}",
                "metrics": {"tokens_per_s": tokens / wall, "block_efficiency": 1.5, "acceptance": 0.5,
                            "drafter_per_100": 1.0, "verifier_per_100": 1.0, "ms_per_token": 1e3 * wall / tokens,
                            "per_prompt_tokens_per_s": rates}}

    rows = [row("verifier", None, [5.0, 5.0, 5.0]), row("fixed", 1, [8.0, 9.0, 10.0]),
            row("fixed", 2, [10.0, 10.0, 12.0]), row("latency", None, [11.0, 9.0, 12.0])]
    table = {r["policy"]: r for r in table_pacer(rows)}
    assert table["fixed"]["spec"] == "fixed:k=2" and table["fixed"]["vs_best_fixed"] is None
    versus = table["latency"]["vs_best_fixed"]
    assert versus["prompts"] == 3 and versus["mean"] == pytest.approx((1.1 + 0.9 + 1.0) / 3, abs=1e-4)
    assert versus["sd"] == pytest.approx(0.1, abs=1e-4) and versus["se"] == pytest.approx(0.1 / 3 ** 0.5, abs=1e-4)
    assert paired([1.0], [2.0]) is None and paired([1.0, None], [2.0, 2.0]) is None


@pytest.mark.slow
def test_bench_policies_resume_keeps_measured_regimes_and_refuses_other_settings(tmp_path, capsys):
    """`--resume` measures only the regimes --out lacks (the kept rows are byte-for-byte the earlier
    ones, the new regime is added, the tables cover both) and refuses a report made with other flags."""
    out = tmp_path / "grid.json"
    flags = ["bench", "policies", "--quick", "--verifier", "verifier", "--drafter", "pretrained", "--policies", "fixed",
             "--initial-k", "2", "--sets", "indist", "--temperatures", "0", "--prompts", "1", "--max-new-tokens", "8",
             "--out", str(out)]
    assert main([*flags, "--rtt-ms", "0"]) == 0
    first = json.loads(out.read_text())
    assert {r["regime"] for r in first["rows"]} == {"inprocess", "rtt0"}
    assert main([*flags, "--rtt-ms", "0,20", "--resume"]) == 0
    second = json.loads(out.read_text())
    assert second["rows"][: len(first["rows"])] == first["rows"]
    assert {r["regime"] for r in second["rows"][len(first["rows"]):]} == {"rtt20"}
    assert {r["regime"] for r in second["gammatune_table"]} == {"inprocess", "rtt0", "rtt20"}
    assert second["elapsed_s"] > first["elapsed_s"]
    capsys.readouterr()
    assert main([*flags[:-4], "--prompts", "2", "--max-new-tokens", "8", "--out", str(out), "--resume"]) == 2
    assert "other settings (prompts)" in capsys.readouterr().err
    assert main([*flags[:-2], "--resume"]) == 2  # no --out to continue
    assert json.loads(out.read_text()) == second  # a refused resume leaves the report alone


@pytest.mark.slow
def test_bench_policies_joins_reports_split_across_processes_and_prints_markdown(tmp_path, capsys):
    """A grid split across two processes (--include) is joined without measuring anything again, and
    --markdown prints both tables as Markdown; an unreadable --include is one line and exit 2."""
    a, b, joined = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "joined.json"
    flags = ["bench", "policies", "--verifier", "verifier", "--drafter", "pretrained", "--policies", "fixed",
             "--initial-k", "2", "--sets", "indist", "--temperatures", "0", "--prompts", "1", "--max-new-tokens", "8"]
    assert main([*flags, "--rtt-ms", "0", "--out", str(a)]) == 0
    assert main([*flags, "--rtt-ms", "20", "--no-inprocess", "--out", str(b)]) == 0
    capsys.readouterr()
    assert main([*flags, "--rtt-ms", "0,20", "--include", f"{a},{b}", "--out", str(joined), "--markdown"]) == 0
    out = capsys.readouterr()
    rows = json.loads(a.read_text())["rows"] + json.loads(b.read_text())["rows"]
    report = json.loads(joined.read_text())
    assert report["rows"] == rows  # nothing measured again
    assert "tok/s" not in out.err  # no regime ran
    assert "| policy | inprocess | rtt0 | rtt20 |" in out.out
    assert "| indist | 0 | rtt20 | fixed |" in out.out
    assert main([*flags, "--include", str(tmp_path / "nope.json")]) == 2
    assert "--include: cannot read" in capsys.readouterr().err


def test_targets_are_checked_per_regime_from_the_tables():
    """GammaTune needs ≥ 1.10× with at most half SpecDecode's spread; Pacer +5% per prompt on indist (in
    process, RTT 50); `latency` the best fixed k within one standard error, and above GammaTune at RTT 50/100."""
    from steerspec.bench.policies import check_targets

    def t2(regime, policy, mean, std):
        return {"set": "indist", "temperature": 0.0, "regime": regime, "policy": policy, "speedup_mean": mean,
                "speedup_std": std, "runs": 1 if std is None else 12}

    def vs(regime, policy, mean, se):
        return {"set": "indist", "temperature": 0.0, "regime": regime, "policy": policy,
                "vs_best_fixed": {"mean": mean, "sd": se * 3 ** 0.5, "se": se, "prompts": 3}}

    report = {"gammatune_table": [t2("rtt50", "fixed", 1.0, 0.20), t2("rtt50", "gammatune", 1.12, 0.09),
                                  t2("rtt50", "gammatune+", 1.15, 0.11), t2("rtt50", "latency", 1.10, None),
                                  t2("inprocess", "fixed", 1.0, 0.2), t2("inprocess", "gammatune", 1.2, 0.05)],
              "pacer_table": [vs("rtt50", "pacer", 1.04, 0.01), vs("rtt50", "latency", 0.97, 0.02),
                              vs("inprocess", "latency", 0.97, 0.04)]}
    got = {(t["regime"], t["target"].split(" ")[0], t["target"].split(" ")[-1]): t["pass"]
           for t in check_targets(report)}
    assert got == {("rtt50", "gammatune", "its"): True, ("rtt50", "gammatune+", "its"): False,  # std 0.11 > 0.10
                   ("rtt50", "pacer", "k"): False, ("rtt50", "latency", "spread"): False,  # 0.97 + 0.02 < 1
                   ("rtt50", "latency", "GammaTune"): False,  # 1.10 is not above 1.12
                   ("inprocess", "gammatune", "its"): True, ("inprocess", "latency", "spread"): True}


def test_resume_matches_models_by_directory_name_not_path(tmp_path):
    """A report from another checkout or machine (the bundled drafter under another path) continues;
    one made with another drafter does not."""
    from steerspec.bench.policies import RESUME_KEYS, _earlier
    from steerspec.errors import UsageError

    config = {k: 1 for k in RESUME_KEYS} | {"verifier": "/a/smollm2", "drafter": "/a/assets/smollm2-sd2",
                                            "sets": ["indist"], "temperatures": [0.0], "rtt_ms": [50.0],
                                            "inprocess": True}
    row = {"set": "indist", "temperature": 0.0, "regime": "rtt50", "rtt_ms": 50.0}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"config": config | {"drafter": "/b/wt/assets/smollm2-sd2"}, "rows": [row]}))
    assert _earlier(path, config, "--include")["rows"] == [row]
    path.write_text(json.dumps({"config": config | {"drafter": "/a/assets/smollm2-distilled"}, "rows": [row]}))
    with pytest.raises(UsageError, match=r"other settings \(drafter\)"):
        _earlier(path, config, "--include")
