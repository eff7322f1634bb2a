"""SPRINTER (lossy, opt-in): spec grammar, theory, classifier metrics, and decoding against exact."""

from __future__ import annotations

import json
import math

import pytest
import torch

from steerspec.decoding.engine import DecodeConfig, speculative_generate
from steerspec.models import cached_lm, context_length, eos_token_ids
from steerspec.policies import FixedK
from steerspec.decoding.sampling import SamplingParams
from steerspec.sprinter import features as F
from steerspec.sprinter import theory
from steerspec.sprinter.decoding import sprinter_generate
from steerspec.sprinter.classifier import SprinterHead, load_head, resolve_head, save_head
from steerspec.sprinter.spec import VerificationError, parse_verification
from steerspec.errors import UsageError


# --- the spec grammar ---------------------------------------------------------------------------

def test_spec_defaults_and_round_trip():
    assert parse_verification(None).mode == "exact" and not parse_verification("exact").lossy
    v = parse_verification("sprinter:threshold=0.3,max_run=4")
    assert v.lossy and v.threshold == 0.3 and v.max_run == 4
    assert parse_verification(v.spec()) == v
    assert parse_verification("sprinter").threshold is None


@pytest.mark.parametrize("spec, words", [
    ("sprinter:threshold=1.5", "threshold must be in (0, 1)"),
    ("sprinter:threshold=0", "threshold must be in (0, 1)"),
    ("sprinter:max_run=0", "max_run must be >= 1"),
    ("sprinter:speed=2", "unknown sprinter parameter"),
    ("sprinter:threshold=x", "must be a number"),
    ("fuzzy", "unknown verification"),
])
def test_spec_rejects_bad_input(spec, words):
    with pytest.raises(VerificationError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_verification(spec)


# --- theory -------------------------------------------------------------------------------------

def test_theorem1_tv_equals_eta_fp_times_tv():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(5, 50, generator=g).softmax(-1)
    q = torch.rand(5, 50, generator=g).pow(3).softmax(-1)
    for eta_fp in (0.0, 0.2, 0.7, 1.0):
        mixed = theory.sprinter_distribution(p, q, eta_fp)
        assert torch.allclose(mixed.sum(-1), torch.ones(5))
        tv = theory.tv_distance(p, mixed)
        bound = torch.tensor([theory.tv_bound(eta_fp, float(t)) for t in theory.tv_distance(p, q)])
        assert torch.allclose(tv, bound, atol=1e-6)


@pytest.mark.parametrize("eta_tp, eta_fp, r", [(0.9, 0.3, 5), (0.5, 0.5, 0), (0.99, 0.1, 12), (0.0, 0.4, 3)])
def test_theorem2_closed_form_matches_the_distribution(eta_tp, eta_fp, r):
    pmf = theory.run_length_pmf(eta_tp, eta_fp, r, 400)
    assert sum(pmf) == pytest.approx(1.0, abs=1e-9)
    mean = sum(i * p for i, p in enumerate(pmf))
    assert theory.expected_run_length(eta_tp, eta_fp, r) == pytest.approx(mean, rel=1e-9)
    # Theorem 2's pmf: η_TP^i(1−η_TP) before r, η_TP^r η_FP^(i−r)(1−η_FP) from r on
    for i in range(min(r, 6)):
        assert pmf[i] == pytest.approx(eta_tp ** i * (1 - eta_tp))
    assert pmf[r + 2] == pytest.approx(eta_tp ** r * eta_fp ** 2 * (1 - eta_fp))


def test_theorem2_paper_form_and_theorem3():
    eta_tp, eta_fp, r, t_d = 0.8, 0.3, 5, 0.1
    paper = (eta_tp - eta_tp ** r) / (1 - eta_tp) + eta_tp ** r / (1 - eta_fp)  # eq. 3, rearranged terms
    assert theory.expected_run_length(eta_tp, eta_fp, r) == pytest.approx(paper)
    stop = (1 - eta_tp ** r) * t_d / (1 - eta_tp) + eta_tp ** r * t_d / (1 - eta_fp)  # eq. 4
    assert theory.expected_stop_time(eta_tp, eta_fp, r, t_d) == pytest.approx(stop)


def test_run_length_cap_and_monotonicity():
    assert theory.expected_run_length(1.0, 0.0, 7) == pytest.approx(7.0)
    assert theory.expected_run_length(1.0, 0.5, 7, max_run=4) == pytest.approx(4.0)
    values = [theory.expected_run_length(t, 0.2, 5) for t in (0.1, 0.5, 0.9, 0.99)]
    assert values == sorted(values)
    assert math.isinf(theory.expected_run_length(0.9, 1.0, 3))
    with pytest.raises(ValueError):
        theory.expected_run_length(1.2, 0.1, 3)


# --- classifier metrics -------------------------------------------------------------------------

def test_roc_auc_matches_pair_counting():
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(300, generator=g).round(decimals=1)  # ties
    labels = torch.rand(300, generator=g) < scores
    pos, neg = scores[labels], scores[~labels]
    pairs = (pos.view(-1, 1) > neg.view(1, -1)).double() + 0.5 * (pos.view(-1, 1) == neg.view(1, -1)).double()
    assert F.roc_auc(scores, labels) == pytest.approx(float(pairs.mean()), abs=1e-9)
    fpr, tpr, _ = F.roc_curve(scores, labels)
    assert float(fpr[-1]) == pytest.approx(1.0) and float(tpr[-1]) == pytest.approx(1.0)
    assert float(torch.trapezoid(tpr, fpr)) == pytest.approx(F.roc_auc(scores, labels), abs=1e-9)


def test_labels_and_rates():
    q = torch.tensor([0.2, 0.5, 0.3, 0.1])
    p = torch.tensor([0.4, 0.4, 0.0, 0.1])
    assert F.acceptable(q, p).tolist() == [True, False, False, True]
    assert F.acceptable(q, p, lam=1.3).tolist() == [True, True, False, True]
    tp, fn, fp, tn = F.confusion(torch.tensor([1, 1, 0, 0]), F.acceptable(q, p))
    assert (tp, fn, fp, tn) == (1, 1, 1, 1)
    assert F.rates(tp, fn, fp, tn) == (0.5, 0.5)
    soft = F.soft_target(q / p, lam=1.0)  # min(1, p/q): the chance the exact rule accepts x
    assert soft.tolist() == pytest.approx([1.0, 0.8, 0.0, 1.0])
    assert torch.equal(soft == 1.0, F.acceptable(q, p))  # 1 exactly where the binary label holds
    assert F.soft_target(q / p, lam=1.3).tolist() == pytest.approx([1.0, 1.0, 0.0, 1.0])


def test_head_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    head = SprinterHead(2 * 16 + F.SCALARS, hidden=8)
    save_head(head, tmp_path / "h", {"lambda": 1.2, "threshold": 0.4})
    loaded = load_head(tmp_path / "h")
    x = torch.randn(4, head.feature_dim)
    assert torch.allclose(loaded.head.prob(x), head.prob(x))
    assert loaded.lam == 1.2 and loaded.default_threshold == 0.4
    with pytest.raises(UsageError, match="has none"):
        resolve_head(tmp_path / "no-drafter")


# --- decoding -----------------------------------------------------------------------------------

def constant_head(drafter, keep: bool) -> SprinterHead:
    """A real head whose output is constant: P(acceptable) ≈ 1 (keep) or ≈ 0 (reject)."""
    head = SprinterHead(F.feature_dim(drafter.hidden_size), hidden=4)
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc2.bias.fill_(30.0 if keep else -30.0)
    return head.eval()


@pytest.fixture(scope="module")
def pair(loaded_pair, eval_prompts):
    verifier, drafter, tok = loaded_pair
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in eval_prompts[:6]]
    limit = min(context_length(verifier), context_length(drafter))
    return cached_lm(verifier), cached_lm(drafter), tok, prompts, eos_token_ids(verifier, tok), limit


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.slow
def test_always_reject_head_equals_exact_decoding(pair, temperature):
    """Every run ends at its first token, so each call verifies one draft: exact decoding with k = 1."""
    verifier, drafter, _, prompts, eos, limit = pair
    head = constant_head(drafter, keep=False)
    for seed, ids in enumerate(prompts):
        config = DecodeConfig(max_new_tokens=24, sampling=SamplingParams(temperature=temperature), seed=seed,
                              eos_token_ids=eos, max_length=limit)
        exact = speculative_generate(verifier, drafter, ids, config, FixedK(1))
        lossy = sprinter_generate(verifier, drafter, ids, config, head, threshold=0.5, max_run=8)
        assert lossy.token_ids == exact.token_ids
        assert lossy.rounds == exact.rounds and lossy.accepted == exact.accepted
        assert all(n == 0 for n in lossy.run_lengths)
        assert lossy.fp == 0 and lossy.tp == 0  # it kept nothing
        assert lossy.moved_sum == 0.0 and lossy.theory()["tv_measured"] == 0.0  # so it moved no mass


def test_always_keep_head_calls_the_verifier_once_per_max_run(pair):
    verifier, drafter, _, prompts, eos, limit = pair
    head = constant_head(drafter, keep=True)
    config = DecodeConfig(max_new_tokens=40, sampling=SamplingParams(temperature=1.0), seed=3, max_length=limit)
    exact = speculative_generate(verifier, drafter, prompts[0], config, FixedK(4))
    lossy = sprinter_generate(verifier, drafter, prompts[0], config, head, threshold=0.5, max_run=4)
    assert lossy.generated == 40
    # each call commits the 3 kept tokens plus the checked one (or its replacement) plus maybe a bonus
    assert lossy.rounds <= math.ceil(40 / 4) < exact.rounds
    # every run is max_run long until the token budget shortens it (room − 1 drafts at most)
    left = 40
    for n, committed in zip(lossy.run_lengths, lossy.block_accepted):
        assert n == min(4, left - 1)
        left -= committed + 1
    assert lossy.tp + lossy.fp == sum(lossy.run_lengths)
    assert lossy.fn == 0 and lossy.tn == 0
    eta_tp, eta_fp = lossy.eta
    assert eta_tp == 1.0 and (eta_fp == 1.0 or lossy.fp == 0)
    # every token kept: the measured deviation estimates d_TV(p, q) itself (Theorem 1 at η_FP = 1), the
    # same quantity tv_pq holds in closed form; both are means over the same tokens
    t = lossy.theory()
    assert 0.0 < t["tv_measured"] <= 1.0 and (lossy.fp == 0) == (t["tv_measured"] == 0.0)
    assert abs(t["tv_measured"] - t["tv_pq"]) < 0.25


def test_sprinter_result_is_marked_lossy(pair):
    verifier, drafter, tok, prompts, eos, limit = pair
    head = constant_head(drafter, keep=True)
    config = DecodeConfig(max_new_tokens=16, sampling=SamplingParams(temperature=1.0), seed=0, max_length=limit)
    result = sprinter_generate(verifier, drafter, prompts[1], config, head, threshold=0.5, max_run=6, tokenizer=tok)
    payload = result.to_json()
    assert payload["lossy"] is True and payload["verification"] == "sprinter" and payload["mode"] == "sprinter"
    assert set(payload["sprinter"]) >= {"eta_tp", "eta_fp", "tv_bound", "tv_measured", "mean_run_length",
                                        "expected_run_length"}
    assert "LOSSY" in result.summary()
    json.dumps(payload)


def test_exact_results_stay_unmarked(pair):
    verifier, drafter, _, prompts, eos, limit = pair
    config = DecodeConfig(max_new_tokens=8, max_length=limit)
    result = speculative_generate(verifier, drafter, prompts[0], config, FixedK(4))
    assert "lossy" not in result.to_json() and "LOSSY" not in result.summary()


def test_sprinter_rejects_bad_parameters(pair):
    verifier, drafter, _, prompts, _, limit = pair
    head = constant_head(drafter, keep=True)
    config = DecodeConfig(max_new_tokens=4, max_length=limit)
    with pytest.raises(ValueError, match="threshold"):
        sprinter_generate(verifier, drafter, prompts[0], config, head, threshold=1.0)
    with pytest.raises(ValueError, match="max_run"):
        sprinter_generate(verifier, drafter, prompts[0], config, head, max_run=0)


def test_first_token_distribution_limits():
    g = torch.Generator().manual_seed(2)
    p = torch.rand(3, 40, generator=g).softmax(-1)
    q = torch.rand(3, 40, generator=g).pow(4).softmax(-1)
    assert torch.allclose(theory.first_token_distribution(p, q, torch.zeros_like(q)), p, atol=1e-6)
    assert torch.allclose(theory.first_token_distribution(p, q, torch.ones_like(q)), q, atol=1e-6)
    # keeping exactly the acceptable tokens (a perfect head, η_FP = 0) is lossless, as Theorem 1 says
    perfect = F.acceptable(q, p).float()
    assert torch.allclose(theory.first_token_distribution(p, q, perfect), p, atol=1e-6)
    # keeping every token (η_FP = 1) deviates by d_TV(p, q)
    mixed = theory.first_token_distribution(p, q, torch.ones_like(q))
    assert torch.allclose(theory.tv_distance(p, mixed), theory.tv_distance(p, q), atol=1e-6)


def test_moved_mass_is_exactly_the_deviation_from_the_verifier():
    """d_TV(p, SPRINTER's next-token distribution) = E_{x~q}[keep(x)·(1 − min(1, p(x)/q(x)))], for hard and soft
    keep rules: so the mean of keep·moved_mass over sampled tokens (tv_measured) is unbiased for it."""
    g = torch.Generator().manual_seed(5)
    p = torch.rand(4, 30, generator=g).softmax(-1)
    q = torch.rand(4, 30, generator=g).pow(3).softmax(-1)
    for keep in ((torch.rand(4, 30, generator=g) < 0.5).float(), torch.rand(4, 30, generator=g),
                 F.acceptable(q, p).float(), torch.ones_like(q)):
        tv = theory.tv_distance(p, theory.first_token_distribution(p, q, keep))
        assert torch.allclose(tv, (q * keep * F.moved_mass(q, p)).sum(-1), atol=1e-6)
    assert torch.allclose((q * F.moved_mass(q, p)).sum(-1), theory.tv_distance(p, q), atol=1e-6)
    assert F.moved_mass(torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.4, 0.4, 0.0])).tolist() == \
        pytest.approx([0.0, 0.2, 1.0])


def test_first_token_distribution_matches_sampling():
    """Simulate the first-token rule directly and compare with the closed form."""
    g = torch.Generator().manual_seed(3)
    p = torch.rand(12, generator=g).softmax(-1)
    q = torch.rand(12, generator=g).pow(3).softmax(-1)
    keep = (torch.rand(12, generator=g) < 0.5).float()
    n = 40000
    x = torch.multinomial(q, n, replacement=True, generator=g)
    u = torch.rand(n, generator=g)
    residual = (p - q).clamp(min=0)
    out = torch.where((keep[x] > 0) | (u < (p[x] / q[x]).clamp(max=1)), x,
                      torch.multinomial(residual / residual.sum(), n, replacement=True, generator=g))
    empirical = torch.bincount(out, minlength=12).float() / n
    assert float(theory.tv_distance(empirical, theory.first_token_distribution(p, q, keep))) < 0.02


# --- the CLI ------------------------------------------------------------------------------------

def _cli(capsys, *argv):
    from steerspec.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("spec, words", [
    ("sprinter:threshold=1", "threshold must be in (0, 1)"),
    ("sprinter:max_run=0", "max_run must be >= 1"),
    ("approx", "unknown verification"),
])
def test_cli_bad_verification_is_one_line_exit_2(capsys, spec, words):
    code, _, err = _cli(capsys, "run", "def f():", "--transport", "inproc", "--verification", spec)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_cli_sprinter_without_a_head_is_one_line_exit_2(capsys, tmp_path):
    code, _, err = _cli(capsys, "run", "def f():", "--transport", "inproc", "--verification", "sprinter",
                        "--sprinter-head", str(tmp_path))
    assert code == 2 and "no SPRINTER head" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not (__import__("conftest").bundled_pair_present()), reason="bundled pair not built")
@pytest.mark.slow
def test_cli_json_marks_sprinter_lossy_and_exact_not(capsys):
    args = ("run", "def parse(line):", "--verifier", "verifier", "--drafter", "pretrained", "--transport", "inproc",
            "--max-new-tokens", "12", "--temperature", "1", "--seed", "3", "--json")
    code, out, _ = _cli(capsys, *args, "--verification", "sprinter:threshold=0.4,max_run=4")
    lossy = json.loads(out)
    assert code == 0 and lossy["lossy"] is True and lossy["verification"] == "sprinter" and lossy["max_run"] == 4
    assert lossy["threshold"] == 0.4 and "eta_fp" in lossy["sprinter"]
    code, out, _ = _cli(capsys, *args)
    exact = json.loads(out)
    assert code == 0 and exact["lossy"] is False and exact["verification"] == "exact"
    code, out, _ = _cli(capsys, *args[:-1], "--verification", "sprinter")
    assert code == 0 and "LOSSY (sprinter" in out


# --- training -----------------------------------------------------------------------------------

def test_train_sprinter_is_seeded_and_resumable(capsys, tiny_pair, tmp_path):
    verifier, drafter = tiny_pair
    common = ["train", "sprinter", "--verifier", str(verifier), "--drafter", str(drafter), "--train-tokens", "400",
              "--heldout-tokens", "200", "--seq-len", "32", "--hidden", "8", "--batch-size", "64"]
    code, out, _ = _cli(capsys, *common, "--epochs", "3", "--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa"))
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert 0.0 <= report["heldout"]["roc_auc"] <= 1.0 and report["heldout"]["tokens"] >= 200
    assert (tmp_path / "a" / "roc.png").stat().st_size > 0 and (tmp_path / "a" / "MODEL_CARD.md").exists()
    # two epochs, then resume to three: the same head as three epochs in one go
    _cli(capsys, *common, "--epochs", "2", "--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb"))
    code, _, _ = _cli(capsys, *common, "--epochs", "3", "--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb"))
    assert code == 0
    a, b = load_head(tmp_path / "a"), load_head(tmp_path / "b")
    assert a.meta["losses"] == b.meta["losses"] and len(a.meta["losses"]) == 3
    for key, value in a.head.state_dict().items():
        assert torch.equal(value, b.head.state_dict()[key]), key
    code, _, err = _cli(capsys, *common, "--threshold", "1.2")
    assert code == 2 and "--threshold" in err
    # soft labels on the same cached features: the binary checkpoint there is not resumed
    code, out, _ = _cli(capsys, *common, "--epochs", "3", "--labels", "soft", "--out", str(tmp_path / "s"),
                        "--work", str(tmp_path / "wa"))
    assert code == 0
    soft = load_head(tmp_path / "s")
    assert soft.meta["labels"] == "soft" and a.meta["labels"] == "binary" and len(soft.meta["losses"]) == 3
    assert soft.meta["losses"] != a.meta["losses"] and "--labels soft" in soft.meta["command"]
    assert "min(1, λ·p(x)/q(x))" in (tmp_path / "s" / "MODEL_CARD.md").read_text()


def test_an_sd2_drafter_labels_its_sprinter_tokens_steered():
    """An SD² drafter's SPRINTER features come from its steered states (as it decodes); the hooks are
    gone afterwards, and the CLI refuses a steering offset below 1."""
    from steerspec.models import load_model, resolve_model_dir
    from steerspec.steering.runtime import maybe_steering_weights
    from steerspec.train.sprinter_classifier import label_windows

    ddir = resolve_model_dir("sd2")
    verifier, drafter = load_model(resolve_model_dir("verifier")).eval(), load_model(ddir).eval()
    windows = [[5, 17, 42, 9, 33, 7, 11, 3, 28, 19, 4, 8]]
    weights = maybe_steering_weights(drafter, ddir)
    plain = label_windows(verifier, drafter, windows, 16, 1.0, 0, "plain")
    steered = label_windows(verifier, drafter, windows, 16, 1.0, 0, "steered", weights, max_offset=2)
    assert plain["x"].shape == steered["x"].shape
    assert not torch.allclose(plain["x"][2:], steered["x"][2:])  # positions with an earlier verifier state
    # nothing is steered from a window's first position (the verifier's attention sink): the drafter's states
    # at 0 and 1 stay plain (the sampled tokens differ: steering draws its offsets from the same generator)
    d = int(drafter.config.hidden_size)
    one_back = label_windows(verifier, drafter, windows, 16, 1.0, 0, "steered", weights, max_offset=1)
    torch.testing.assert_close(plain["x"][:2, :d], one_back["x"][:2, :d], rtol=0, atol=1e-5)
    assert not torch.allclose(plain["x"][2:, :d], one_back["x"][2:, :d])
    assert torch.equal(label_windows(verifier, drafter, windows, 16, 1.0, 0, "again")["x"], plain["x"])
    from steerspec.cli import main

    assert main(["train", "sprinter", "--drafter", "sd2", "--max-offset", "0"]) == 2


def test_pooled_tally_sums_counts_and_keeps_runs_in_order():
    from steerspec.sprinter.labels import RunLabels, SprinterTally

    a, b = SprinterTally(max_run=4), SprinterTally(max_run=4)
    a.add_labels(RunLabels(tp=2, fn=0, fp=1, tn=1, r=2, tv_pq_sum=0.5, moved_sum=0.3))
    a.run_lengths.append(3)
    b.add_labels(RunLabels(tp=1, fn=1, fp=0, tn=0, r=2, tv_pq_sum=0.25))
    b.add_labels(None)  # a run with no tokens: nothing labelled
    b.run_lengths.append(1)
    pooled = SprinterTally.pooled([a, b], max_run=4)
    assert (pooled.tp, pooled.fn, pooled.fp, pooled.tn, pooled.labelled) == (3, 1, 1, 1, 6)
    assert pooled.run_lengths == [3, 1] and pooled.run_r == [2, 2] and pooled.tv_pq_sum == 0.75
    t = pooled.theory()
    assert (t["eta_tp"], t["eta_fp"], t["tv_pq"], t["tv_bound"], t["mean_run_length"]) == (0.75, 0.5, 0.125, 0.0625, 2.0)
    assert t["tv_measured"] == 0.05  # 0.3 moved over 6 labelled tokens


@pytest.mark.slow
def test_bench_sprinter_runs_specdecpp_and_adaedl_beside_exact_and_sprinter(capsys, tmp_path):
    """SPRINTER's Table 2 layout: the draft-length policies are exact rows (lossless, no η's) on the
    same prompts and seeds; SPRINTER's rows carry the theory and quality columns; the JSON and PNG exist."""
    out = tmp_path / "sprinter.json"
    code, stdout, err = _cli(capsys, "bench", "sprinter", "--limit", "1", "--seeds", "1", "--max-new-tokens", "10",
                             "--winrate-tokens", "5", "--tv-samples", "0", "--thresholds", "0.4", "--k", "4",
                             "--rtts", "0,50", "--out", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert list(rows) == ["exact", "specdecpp", "adaedl", "sprinter@0.4"]
    assert report["command"].startswith("steerspec bench sprinter ") and "--thresholds 0.4" in report["command"]
    assert report["machine"]["logical_cores"] >= 1
    for name in ("specdecpp", "adaedl"):
        row = rows[name]
        assert row["lossy"] is False and "eta_fp" not in row and row["tokens"] >= 1
        assert row["verifier_calls"] >= 1 and set(row["speedup"]) == {"0", "50"}
        assert any(line.startswith(f"{name} | ") for line in stdout.splitlines())
    assert rows["sprinter@0.4"]["lossy"] is True and "eta_fp" in rows["sprinter@0.4"]
    assert rows["exact"]["ppl_ratio"] == 1.0 and rows["exact"]["ppl_drift"] == 1.0
    for row in rows.values():  # every row: the raw ratio, the excess at the same prefixes, the drift, 95% intervals
        for key in ("ppl_ratio", "ppl_excess", "ppl_drift"):
            assert row[f"{key}_low"] <= row[key] <= row[f"{key}_high"]
    assert out.with_suffix(".png").stat().st_size > 0
    code, _, err = _cli(capsys, "bench", "sprinter", "--policies", "specdecpp:h=2", "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and "--policies" in err
