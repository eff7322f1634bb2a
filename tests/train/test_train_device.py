"""Trainers on `--device`: a GPU that is not there is refused in one line, and on a GPU machine the
synth, distill, SD² and reduced-drafter steps compute there and agree with the same steps on the CPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_sd2 import make_data, sd2_bundle, tiny_llama

from steerspec.cli import main
from steerspec.train import distill
from steerspec.train.synth import load_synthetic, sample_answers

ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")


def _char_tokenizer(vocab_size: int):
    """A character-level tokenizer of `vocab_size` ids (0 = EOS, 1 = unknown), so `train synth` can cut prompts."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = " \n\t:()=.,_'\"etaoinsrhldcumfpgwybvkx"[: vocab_size - 2]
    vocab = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


def _saved_pair(tmp_path: Path) -> "tuple[Path, Path]":
    """A tiny verifier and drafter saved with a tokenizer, as the trainers' CLIs load them."""
    verifier, drafter = tiny_llama(32, 4, 64, seed=0), tiny_llama(16, 2, 32, seed=1)
    for model, name in ((verifier, "v"), (drafter, "d")):
        model.save_pretrained(str(tmp_path / name))
        _char_tokenizer(verifier.config.vocab_size).save_pretrained(str(tmp_path / name))
    return tmp_path / "v", tmp_path / "d"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_trainers_refuse_a_gpu_that_is_not_there(tmp_path, capsys):
    vdir, ddir = _saved_pair(tmp_path)
    data = tmp_path / "data"
    assert main(["train", "synth", "--verifier", str(vdir), "--out", str(data), "--samples", "2", "--batch-size", "2",
                 "--max-new-tokens", "2", "--prompt-max", "24"]) == 0
    capsys.readouterr()
    pair = ["--data", str(data), "--verifier", str(vdir), "--drafter", str(ddir), "--steps", "1"]
    for argv in (["train", "synth", "--verifier", str(vdir), "--out", str(tmp_path / "s"), "--samples", "2"],
                 ["train", "distill", *pair, "--out", str(tmp_path / "dist")],
                 ["train", "sd2", *pair, "--out", str(tmp_path / "sd2")],
                 ["train", "smollm2", "--out", str(tmp_path / "r"), "--work", str(tmp_path / "w")]):
        assert main([*argv, "--device", "cuda"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "CUDA is not available" in err[0], (argv, err)
    assert not (tmp_path / "dist").exists() and not (tmp_path / "s").exists()


def test_build_assets_device_needs_a_value():
    out = subprocess.run(["bash", "scripts/build_assets.sh", "smollm2-heads", "--device"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--device needs a value" in out.stderr


@needs_cuda
def test_greedy_synth_on_the_gpu_caches_what_the_cpu_caches():
    verifier = tiny_llama(32, 4, 64, seed=0)
    prompts = [[5, 7, 9], [11, 13], [2, 3, 4, 6]]
    runs = []
    for device in ("cpu", "cuda"):
        record = []
        answers = sample_answers(verifier.to(device), prompts, 6, torch.Generator(device=device), temperature=0.0,
                                 record=record, top_k=4, tap_layers=(1, 2, 3))
        runs.append((answers, record))
    (cpu_answers, cpu_rec), (gpu_answers, gpu_rec) = runs
    assert gpu_answers == cpu_answers
    for a, b in zip(cpu_rec, gpu_rec):
        assert b.top_ids.device.type == "cpu" and torch.equal(a.top_ids, b.top_ids)
        torch.testing.assert_close(a.top_logp.float(), b.top_logp.float(), atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(a.taps.float(), b.taps.float(), atol=2e-3, rtol=1e-3)


@needs_cuda
def test_synth_cli_on_the_gpu_writes_shards_that_say_so(tmp_path):
    vdir, _ = _saved_pair(tmp_path)
    out = tmp_path / "data"
    assert main(["train", "synth", "--verifier", str(vdir), "--out", str(out), "--samples", "4", "--batch-size", "2",
                 "--max-new-tokens", "4", "--prompt-max", "24", "--teacher-top-k", "4", "--tap-layers", "1,2,3",
                 "--device", "cuda"]) == 0
    data = load_synthetic(out)
    assert len(data) == 4 and data.meta["device"] == "cuda" and data.teacher[0].taps is not None


@needs_cuda
@pytest.mark.parametrize("steered", [False, True])
def test_distill_and_sd2_on_the_gpu_follow_the_cpu(tmp_path, steered):
    verifier = tiny_llama(32, 4, 64, seed=0)
    data = make_data(verifier, n=16)
    cfg = dict(steps=4, batch_size=4, lr=5e-3, warmup=1, k=3, val_fraction=0.25, eval_every=0, save_every=0, seed=3,
               steer=steered)
    results = {}
    for device in ("cpu", "cuda"):
        drafter = tiny_llama(16, 2, 32, seed=1)
        bundle = sd2_bundle(verifier, drafter) if steered else distill.DrafterBundle(drafter)
        bundle.to(device)
        report = distill.train(bundle, verifier.to(device), data, distill.TrainConfig(**cfg), tmp_path / device, 0,
                               log=lambda *_: None)
        assert report["device"].startswith(device)
        results[device] = (report, {k: v.cpu() for k, v in bundle.state_dict().items()})
    (cpu_report, cpu_state), (gpu_report, gpu_state) = results["cpu"], results["cuda"]
    assert gpu_report["initial"]["val_kl"] == pytest.approx(cpu_report["initial"]["val_kl"], rel=1e-3)
    assert gpu_report["final"]["val_kl"] == pytest.approx(cpu_report["final"]["val_kl"], rel=1e-2)
    for name, value in cpu_state.items():
        torch.testing.assert_close(gpu_state[name], value, atol=1e-3, rtol=1e-2, msg=name)


@needs_cuda
def test_reduced_drafter_trains_on_the_gpu_like_on_the_cpu(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from steerspec.models.reduced import init_from_verifier
    from steerspec.train.smollm2_loop import LoopConfig, train

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=[0])
    LlamaForCausalLM(config).save_pretrained(str(tmp_path / "v"))
    support = torch.arange(0, 96, 2)
    tokens = np.tile(np.arange(0, 40, 2, dtype=np.uint16), 50)
    cfg = LoopConfig(steps=5, batch_size=4, seq_len=16, lr=3e-3, warmup=2, checkpoint_s=0.0)
    figures = {}
    for device in ("cpu", "cuda"):
        drafter = init_from_verifier(tmp_path / "v", "v", support, [0, 1]).to(device)
        figures[device] = train(drafter, tokens, cfg, tmp_path / device)
        assert drafter.lm_head.weight.device.type == device
    assert figures["cuda"]["loss"] == pytest.approx(figures["cpu"]["loss"], rel=1e-2)


def _labelling(tmp_path, tiny_pair, steered: bool):
    """labels(device): Pacer's and SpecDec++'s labels of three short prompts on the tiny pair (its
    drafter with random SD² steering when `steered`, made once so every call labels the same drafter)."""
    from argparse import Namespace

    from test_train_sd2 import _bench_inputs

    from steerspec.models import load_model
    from steerspec.train.policy_heads import label_blocks

    verifier_dir, drafter_dir = tiny_pair
    if steered:
        drafter_dir = _bench_inputs(tmp_path, tiny_pair)[2]
    args = Namespace(gamma=6, ctx=8, stride=4, answer_tokens=16)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 40))]

    def labels(device: str = "cpu"):
        return label_blocks(load_model(verifier_dir, device=device), load_model(drafter_dir, device=device), prompts,
                            args, "label", drafter_dir=drafter_dir)
    return labels


@needs_cuda
@pytest.mark.parametrize("steered", [False, True])
def test_policy_head_labels_on_the_gpu_equal_the_cpus(tmp_path, tiny_pair, steered):
    """Pacer's and SpecDec++'s labelling (verifier answers, drafted blocks, steered for an SD² drafter)
    gives the same labels on the GPU, whose cached LM serves the final-normed state eagerly."""
    labels = _labelling(tmp_path, tiny_pair, steered)
    cpu, gpu = labels("cpu"), labels("cuda")
    assert cpu["label"].sum() > 0
    for key in ("label", "valid", "context_mask", "prompt"):
        assert torch.equal(cpu[key], gpu[key]), key
    torch.testing.assert_close(gpu["hidden"], cpu["hidden"], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("steered", [False, True])
def test_policy_head_labels_are_the_same_through_the_graphed_cached_lm(tmp_path, tiny_pair, steered, monkeypatch):
    """The GPU's cached LM (GraphedLM: eager static path on a CPU) labels what FastCachedLM labels,
    steering included: the final-normed state it serves eagerly is the one the static path would."""
    import steerspec.models as models
    from steerspec.models.backends import cached_lm

    labels = _labelling(tmp_path, tiny_pair, steered)
    out = {}
    for backend in ("fast", "graphed"):
        monkeypatch.setattr(models, "cached_lm", lambda model, backend=backend: cached_lm(model, backend))
        out[backend] = labels()
    assert out["fast"]["label"].sum() > 0
    for key in ("label", "valid", "context_mask"):
        assert torch.equal(out["fast"][key], out["graphed"][key]), key
    torch.testing.assert_close(out["graphed"]["hidden"], out["fast"]["hidden"], atol=1e-4, rtol=1e-4)
