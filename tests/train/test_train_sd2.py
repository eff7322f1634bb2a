"""SD² training pipeline on tiny random models: synthetic data, offsets, loss, resume, CLI output."""

from __future__ import annotations

import torch

from steerspec.steering import DrafterSteering, SteeringHead, load_steering
from steerspec.train import distill
from steerspec.train.synth import SyntheticSet, load_synthetic, sample_answers, save_shard
import pytest

VOCAB = 48


def tiny_llama(hidden, layers, inter, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a peakier verifier than the default init, so there is something to learn
        model.lm_head.weight.mul_(8.0)
    return model


def make_data(verifier, n=24, seed=0) -> SyntheticSet:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(n)]
    answers = sample_answers(verifier, prompts, 12, gen, eos_id=None)
    return SyntheticSet([torch.tensor(p + a) for p, a in zip(prompts, answers)], [len(p) for p in prompts], {})


def sd2_bundle(verifier, drafter):
    head = SteeringHead(verifier.config.hidden_size, (1, 2, 3))
    return distill.DrafterBundle(drafter, head, DrafterSteering.for_model(drafter, verifier.config.hidden_size))


def test_steering_sources_follow_the_inference_offsets():
    source, steered = distill.steering_sources(torch.tensor([4, 1]), 7, delta=2)
    # row 0: prompt of 4 tokens -> positions 0..2 unsteered, position 3 (predicts token 4) onward steered;
    # sources are p-2 clamped to the last prefill position P-2 = 2
    assert steered[0].tolist() == [False, False, False, True, True, True, True]
    assert source[0, 3:].tolist() == [2, 2, 3, 4]
    # row 1: one-token prompt -> no prefill position: source -1 (zero features) until p-2 >= 0
    assert steered[1].all()
    assert source[1].tolist() == [-1, -1, 0, 1, 2, 3, 4]
    mask = distill.answer_mask(torch.tensor([4]), torch.tensor([6]), 7)
    assert mask[0].tolist() == [False, False, False, True, True, False, False]


def test_delta_offsets_uniform_by_default_and_geometric_on_request():
    assert distill.delta_weights(4, 1.0) == [0.25] * 4
    weights = distill.delta_weights(8, 0.5)
    assert abs(sum(weights) - 1.0) < 1e-12 and all(a / b == 2.0 for a, b in zip(weights, weights[1:]))
    draws = lambda decay: [distill._delta(step, 3, 8, decay) for step in range(4000)]
    uniform, geometric = draws(1.0), draws(0.5)
    assert set(uniform) == set(range(1, 9)) and set(geometric) <= set(range(1, 9))
    assert abs(uniform.count(1) / 4000 - 1 / 8) < 0.03
    assert abs(geometric.count(1) / 4000 - weights[0]) < 0.03  # about half the batches train δ = 1
    assert draws(0.5) == geometric  # seeded per step: a resumed run draws the same offsets


def test_block_sources_steer_each_simulated_block_from_the_position_before_it():
    import random

    plens, width, k = torch.tensor([4, 1, 9]), 40, 5
    source, steered = distill.block_steering_sources(plens, width, k, 0.6, random.Random(7))
    again, _ = distill.block_steering_sources(plens, width, k, 0.6, random.Random(7))
    assert torch.equal(source, again)  # seeded: a resumed run draws the same blocks
    assert torch.equal(steered, distill.steering_sources(plens, width, 1)[1])  # prompt positions unsteered
    sizes = []
    for row, plen in enumerate(plens.tolist()):
        pos, run = plen - 1, source[row, plen - 1:].tolist()
        assert run[0] == plen - 2 if plen > 1 else run[0] == -1  # the first block: the prefill's vector
        while run:
            size = run.count(run[0])
            assert run[:size] == [max(pos - 1, -1)] * size  # one block, steered from just before it
            sizes.append(size)
            pos, run = pos + size, run[size:]
    assert max(sizes) <= k and min(sizes) >= 1 and len(set(sizes)) > 1
    # accept = 0: every block is one position, i.e. the paper's δ = 1 everywhere
    zero, _ = distill.block_steering_sources(plens, width, k, 0.0, random.Random(7))
    assert torch.equal(zero, distill.steering_sources(plens, width, 1)[0])


def test_sample_answers_is_seeded_and_stops_at_eos():
    verifier = tiny_llama(32, 4, 64, seed=0)
    prompts = [[3, 4, 5], [7]]
    a = sample_answers(verifier, prompts, 10, torch.Generator().manual_seed(1))
    b = sample_answers(verifier, prompts, 10, torch.Generator().manual_seed(1))
    assert a == b and [len(x) for x in a] == [10, 10]
    # left padding must not change a row's distribution: greedy row 1 alone equals row 1 in the batch
    alone = sample_answers(verifier, [[7]], 6, torch.Generator(), temperature=0.0)
    both = sample_answers(verifier, prompts, 6, torch.Generator(), temperature=0.0)
    assert alone[0] == both[1]
    eos = both[0][2]
    stopped = sample_answers(verifier, [[3, 4, 5]], 6, torch.Generator(), temperature=0.0, eos_id=eos)
    assert stopped[0][-1] == eos and len(stopped[0]) <= 3


def test_dataset_shards_round_trip(tmp_path):
    save_shard(tmp_path / "shard_00000.safetensors", [[1, 2, 3, 4], [5, 6]], [2, 1])
    save_shard(tmp_path / "shard_00001.safetensors", [[7, 8, 9]], [1])
    data = load_synthetic(tmp_path)
    assert [s.tolist() for s in data.sequences] == [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    assert data.prompt_lens == [2, 1, 1] and data.response_tokens() == 5


def test_sd2_training_decreases_the_loss(tmp_path):
    torch.manual_seed(0)
    verifier = tiny_llama(32, 4, 64, seed=0)
    drafter = tiny_llama(16, 2, 32, seed=1)
    data = make_data(verifier)
    bundle = sd2_bundle(verifier, drafter)
    cfg = distill.TrainConfig(steps=30, batch_size=8, lr=1e-2, warmup=3, k=4, val_fraction=0.25,
                              eval_every=0, save_every=0, seed=0, steer=True)
    report = distill.train(bundle, verifier, data, cfg, tmp_path, pad_id=0, log=lambda *_: None)
    assert report["final"]["val_kl"] < 0.8 * report["initial"]["val_kl"]
    assert report["final"]["val_overlap"] > report["initial"]["val_overlap"]
    assert torch.count_nonzero(bundle.steering.proj.weight) > 0  # W_s learned something
    assert not any(len(m._forward_hooks) for m in drafter.modules())  # hooks removed after training


def test_resume_matches_an_uninterrupted_run(tmp_path):
    verifier = tiny_llama(32, 4, 64, seed=0)
    data = make_data(verifier, n=16)
    cfg = dict(steps=6, batch_size=4, lr=5e-3, warmup=2, k=3, val_fraction=0.25, eval_every=0, save_every=0,
               seed=3, steer=True)
    straight = sd2_bundle(verifier, tiny_llama(16, 2, 32, seed=1))
    distill.train(straight, verifier, data, distill.TrainConfig(**cfg), tmp_path / "a", 0, log=lambda *_: None)
    resumed = sd2_bundle(verifier, tiny_llama(16, 2, 32, seed=1))
    part = distill.train(resumed, verifier, data, distill.TrainConfig(**cfg, stop_at=3), tmp_path / "b", 0,
                         log=lambda *_: None)
    assert part["steps_done"] == 3 and (tmp_path / "b" / distill.CHECKPOINT).is_file()
    fresh = sd2_bundle(verifier, tiny_llama(16, 2, 32, seed=1))
    done = distill.train(fresh, verifier, data, distill.TrainConfig(**cfg), tmp_path / "b", 0, log=lambda *_: None)
    assert done["steps_done"] == 6
    for (name, a), (_, b) in zip(straight.state_dict().items(), fresh.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_time_budget_fits_the_schedule(tmp_path):
    verifier = tiny_llama(32, 4, 64, seed=0)
    data = make_data(verifier, n=8)
    cfg = distill.TrainConfig(steps=100_000, batch_size=4, lr=1e-3, warmup=2, k=2, val_fraction=0.25, eval_every=0,
                              save_every=0, max_minutes=0.02, steer=False)
    report = distill.train(distill.DrafterBundle(tiny_llama(16, 2, 32, seed=1)), verifier, data, cfg, tmp_path, 0,
                           log=lambda *_: None)
    assert 10 <= report["steps_scheduled"] < 100_000
    assert report["steps_done"] >= 10


def test_cli_writes_a_loadable_steered_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    from steerspec.cli import main

    verifier = tiny_llama(32, 4, 64, seed=0)
    drafter = tiny_llama(16, 2, 32, seed=1)
    verifier.save_pretrained(str(tmp_path / "v"))
    drafter.save_pretrained(str(tmp_path / "d"))
    data = make_data(verifier, n=8)
    (tmp_path / "data").mkdir()
    save_shard(tmp_path / "data" / "shard_00000.safetensors", [s.tolist() for s in data.sequences], data.prompt_lens)
    common = ["--data", str(tmp_path / "data"), "--verifier", str(tmp_path / "v"), "--drafter", str(tmp_path / "d"),
              "--steps", "2", "--batch-size", "4", "--eval-every", "0"]
    assert main(["train", "sd2", *common, "--out", str(tmp_path / "sd2"), "--k", "4", "--steer-layers", "1,2,3"]) == 0
    assert main(["train", "distill", *common, "--out", str(tmp_path / "dist")]) == 0
    steer = load_steering(tmp_path / "sd2")
    assert steer.config.verifier_layers == (1, 2, 3) and steer.config.drafter_layers == 2
    assert (tmp_path / "sd2" / "MODEL_CARD.md").is_file() and not (tmp_path / "sd2" / "checkpoint.pt").exists()
    assert not (tmp_path / "dist" / "steering.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sd2"), local_files_only=True)
    assert model.dtype == torch.float32


def test_sd2_from_a_steered_drafter_continues_its_steering(tmp_path, capsys):
    import json

    from steerspec.cli import main

    verifier = tiny_llama(32, 4, 64, seed=0)
    verifier.save_pretrained(str(tmp_path / "v"))
    tiny_llama(16, 2, 32, seed=1).save_pretrained(str(tmp_path / "d"))
    data = make_data(verifier, n=8)
    (tmp_path / "data").mkdir()
    save_shard(tmp_path / "data" / "shard_00000.safetensors", [s.tolist() for s in data.sequences], data.prompt_lens)
    common = ["--data", str(tmp_path / "data"), "--verifier", str(tmp_path / "v"), "--batch-size", "4",
              "--eval-every", "0", "--k", "2", "--steer-layers", "1,2,3", "--lr", "1e-2"]
    assert main(["train", "sd2", *common, "--drafter", str(tmp_path / "d"), "--out", str(tmp_path / "one"),
                 "--steps", "4"]) == 0
    first = load_steering(tmp_path / "one")
    assert torch.count_nonzero(first.drafter.proj.weight) > 0
    # a second phase from the first's output starts from its W_s and W_hml, not from zero
    assert main(["train", "sd2", *common, "--drafter", str(tmp_path / "one"), "--out", str(tmp_path / "two"),
                 "--steps", "1", "--lr", "1e-9"]) == 0
    report = json.loads((tmp_path / "two" / "train_report.json").read_text())
    assert report["steering"]["continued_from"] == str(tmp_path / "one")
    second = load_steering(tmp_path / "two")
    torch.testing.assert_close(second.drafter.proj.weight, first.drafter.proj.weight, atol=1e-3, rtol=0)
    torch.testing.assert_close(second.head.state_dict(), first.head.state_dict(), atol=1e-3, rtol=0)
    # taps that differ from the steering's own are refused with the fix
    capsys.readouterr()
    bad = [a if a != "1,2,3" else "0,1,2" for a in common]
    assert main(["train", "sd2", *bad, "--drafter", str(tmp_path / "one"), "--out", str(tmp_path / "three"),
                 "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steer-layers" in err[0] and "[1, 2, 3]" in err[0]


def _bench_inputs(tmp_path, tiny_pair):
    """(verifier dir, pretrained dir, SD² dir with a random W_s, eval dir, verifier config) for `bench sd2`."""
    import json

    from transformers import AutoModelForCausalLM

    from steerspec.steering import default_layers, save_drafter_checkpoint

    verifier_dir, drafter_dir = tiny_pair
    vcfg = json.loads((verifier_dir / "config.json").read_text())
    drafter = AutoModelForCausalLM.from_pretrained(str(drafter_dir), local_files_only=True, dtype=torch.float32)
    head = SteeringHead(vcfg["hidden_size"], default_layers(vcfg["num_hidden_layers"]))
    steering = DrafterSteering.for_model(drafter, vcfg["hidden_size"])
    with torch.no_grad():
        steering.proj.weight.normal_(0, 0.02)
    sd2_dir = save_drafter_checkpoint(tmp_path / "sd2", drafter, tokenizer_from=drafter_dir, head=head, steering=steering)
    evals = tmp_path / "eval"
    evals.mkdir()
    for name in ("indist", "tests", "docs"):
        rows = [{"id": f"{name}-{i}", "prompt": p, "source": "t"} for i, p in enumerate(["def fibonacci(n):", "class Queue:"])]
        (evals / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return verifier_dir, drafter_dir, sd2_dir, evals, vcfg


@pytest.mark.slow
def test_bench_sd2_writes_table_json_and_chart(tmp_path, tiny_pair):
    import json

    from steerspec.cli import main

    verifier_dir, drafter_dir, sd2_dir, evals, vcfg = _bench_inputs(tmp_path, tiny_pair)
    out = tmp_path / "bench.json"
    argv = ["bench", "sd2", "--verifier", str(verifier_dir), "--drafters",
            f"pretrained={drafter_dir},distilled={drafter_dir},sd2={sd2_dir}", "--eval-dir", str(evals),
            "--limit", "2", "--max-new-tokens", "6", "--seeds", "0,1", "--k", "4", "--out", str(out), "--no-services"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    row = report["results"]["indist"]["sd2"]
    assert len(row["tau_t1_seeds"]) == 2 and row["tau_t1_mean"] >= 1.0 and "tau_t0" in row
    assert report["results"]["tests"]["pretrained"]["speedup_t1"] == 1.0
    assert report["steering"]["sd2"]["bytes_per_reply"] == 2 * vcfg["hidden_size"]
    assert {"indist_sd2_vs_pretrained_ge_30pct", "steering_overhead_le_5pct"} <= set(report["targets"])
    assert {"tests_sd2_not_below_distilled", "docs_sd2_not_below_pretrained"} <= set(report["targets"])
    assert "--command" not in report["command"] and report["command"].startswith("steerspec bench sd2 --verifier")
    assert " --no-services" in report["command"] and "True" not in report["command"]  # a set flag, bare
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "tau_services" not in row and report["config"]["services"] is None  # --no-services


@pytest.mark.slow
def test_bench_sd2_services_column(tmp_path, tiny_pair, capsys):
    """The services measurement (LocalCluster over an emulated link) on a drafter subset: keys, τ, speedup, bytes."""
    import json

    from steerspec.cli import main

    verifier_dir, drafter_dir, sd2_dir, evals, vcfg = _bench_inputs(tmp_path, tiny_pair)
    out = tmp_path / "bench.json"
    argv = ["bench", "sd2", "--verifier", str(verifier_dir), "--drafters", f"pretrained={drafter_dir},sd2={sd2_dir}",
            "--eval-dir", str(evals), "--sets", "indist", "--limit", "2", "--max-new-tokens", "8", "--seeds", "0",
            "--k", "4", "--no-greedy", "--services-rtt-ms", "2", "--services-prompts", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    rows = report["results"]["indist"]
    for label in ("pretrained", "sd2"):
        r = rows[label]
        assert r["tokens_per_s_services"] > 0 and r["tau_services"] >= 1.0 and r["services"]["sessions"] == 1
        assert r["services"]["rtt_ms"] >= 2.0  # the emulated link was in the path
    assert rows["pretrained"]["speedup_services"] == 1.0 and rows["sd2"]["speedup_services"] > 0
    assert rows["sd2"]["services"]["steering"] and not rows["pretrained"]["services"]["steering"]
    down = {label: rows[label]["bytes_down_per_block_services"] for label in rows}
    assert down["sd2"] > down["pretrained"] and down["sd2"] >= 2 * vcfg["hidden_size"]  # the fp16 steering vector
    services = report["config"]["services"]
    assert services["rtt_ms"] == 2.0 and services["prompts_per_set"] == {"indist": 1}
    assert report["config"]["transport"] == "inproc" and report["services_elapsed_s"] is not None
    assert "svc tok/s" in capsys.readouterr().out


def test_bench_sd2_rejects_bad_services_flags(capsys):
    from steerspec.cli import main

    for flags in (["--services-rtt-ms", "-5"], ["--services-rtt-ms", "inf"], ["--services-prompts", "0"],
                  ["--steering-repeats", "0"]):
        assert main(["bench", "sd2", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flags[0] in err


def test_train_sd2_rejects_bad_offset_flags(tmp_path, capsys):
    from steerspec.cli import main

    for value in ("0", "1.5", "-0.2"):
        argv = ["train", "sd2", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--delta-decay", value]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--delta-decay" in err[0]
    for value in ("1", "-0.1", "nan"):
        argv = ["train", "sd2", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--block-accept", value]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--block-accept" in err[0]


def test_fixed_delta_steers_every_step_from_that_offset_and_zero_is_the_oracle():
    plens = torch.tensor([3, 5])
    for fixed in (0, 1, 4):
        cfg = distill.TrainConfig(k=8, fixed_delta=fixed)
        for step in (0, 1, 17):
            source, steered = distill.training_sources(step, cfg)(plens, 12)
            want, _ = distill.steering_sources(plens, 12, fixed)
            assert torch.equal(source, want)
    oracle, steered = distill.training_sources(0, distill.TrainConfig(fixed_delta=0))(plens, 12)
    pos = torch.arange(12).expand(2, 12)
    assert torch.equal(oracle[steered], pos[steered]), "δ = 0: each position steered by its own verifier state"
    assert "fixed offset δ = 0" in distill._offsets_text({"k": 8, "fixed_delta": 0})


def test_train_sd2_rejects_bad_fixed_delta(tmp_path, capsys):
    from steerspec.cli import main

    for extra in (["--fixed-delta", "-1"], ["--fixed-delta", "9"], ["--fixed-delta", "1", "--block-accept", "0.5"]):
        argv = ["train", "sd2", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--k", "8", *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--fixed-delta" in err[0]


def test_synth_shards_makes_a_prefix_of_the_full_set_and_extends_it(tmp_path):
    """`--shards K` writes the first K batches of the --samples prompts; a rerun with more extends the set."""
    from steerspec.cli import main

    args = ["train", "synth", "--verifier", "verifier", "--out", str(tmp_path), "--samples", "8", "--batch-size", "2",
            "--max-new-tokens", "3", "--prompt-max", "24", "--seed", "3"]
    assert main(args + ["--shards", "2"]) == 0
    assert sorted(p.name for p in tmp_path.glob("shard_*")) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    first = load_synthetic(tmp_path)
    assert len(first) == 4
    assert main(args + ["--shards", "3"]) == 0
    again = load_synthetic(tmp_path)
    assert len(again) == 6 and all(torch.equal(a, b) for a, b in zip(first.sequences, again.sequences))


def test_synth_workers_split_the_shards_and_together_make_the_same_set(tmp_path):
    """`--worker I/N` makes the shards with index I mod N; N workers together write what one process writes."""
    from steerspec.cli import main

    args = ["train", "synth", "--verifier", "verifier", "--samples", "6", "--batch-size", "2",
            "--max-new-tokens", "3", "--prompt-max", "24", "--seed", "3", "--teacher-top-k", "4"]
    assert main(args + ["--out", str(tmp_path / "one")]) == 0
    assert main(args + ["--out", str(tmp_path / "two"), "--worker", "1/2"]) == 0
    assert sorted(p.name for p in (tmp_path / "two").glob("shard_*")) == ["shard_00001.safetensors"]
    assert main(args + ["--out", str(tmp_path / "two"), "--worker", "0/2"]) == 0
    # a worker rerun on its finished shards (the build script's resume) counts them and makes nothing new
    assert main(args + ["--out", str(tmp_path / "two"), "--worker", "1/2"]) == 0
    one, two = load_synthetic(tmp_path / "one"), load_synthetic(tmp_path / "two")
    assert len(one) == len(two) == 6 and all(torch.equal(a, b) for a, b in zip(one.sequences, two.sequences))
    assert all(torch.equal(a.top_ids, b.top_ids) and torch.equal(a.taps, b.taps) for a, b in zip(one.teacher, two.teacher))
    assert main(args + ["--out", str(tmp_path / "bad"), "--worker", "2/2"]) == 2


def test_bench_sd2_targets_name_drafters_by_role():
    """The real pair's `smollm2-*` drafters get the same targets as the tiny pair's bare names, on
    indist and fresh (gains in τ − 1) and on the other sets (not below beyond the seed spread)."""
    from steerspec.bench.drafters import check_targets, roles

    def row(tau, std=0.02):
        return {"accepted_per_block_t1": tau - 1.0, "tau_t1_mean": tau, "tau_t1_std": std}

    labels = ["smollm2-pretrained", "smollm2-distilled", "smollm2-sd2"]
    assert roles(labels) == dict(zip(("pretrained", "distilled", "sd2"), labels))
    results = {"indist": dict(zip(labels, (row(1.43), row(1.55), row(1.65)))),
               "fresh": dict(zip(labels, (row(1.44), row(1.55), row(1.61)))),
               "docs": dict(zip(labels, (row(1.34), row(1.41), row(1.35)))),}
    t = check_targets(results, labels, {})
    assert t["indist_sd2_vs_pretrained_ge_30pct"]["pass"] and t["indist_sd2_vs_distilled_ge_15pct"]["pass"]
    assert t["fresh_sd2_vs_pretrained_ge_30pct"]["pass"] and not t["fresh_sd2_vs_distilled_ge_15pct"]["pass"]
    assert t["docs_sd2_not_below_pretrained"]["pass"] and not t["docs_sd2_not_below_distilled"]["pass"]
    assert check_targets(results, ["a", "b", "smollm2-sd2"], {}) == {}  # no pretrained drafter: nothing to compare
