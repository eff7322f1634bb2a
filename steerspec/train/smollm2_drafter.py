"""Train a reduced drafter for the `smollm2` verifier on the code corpus (CPU friendly, resumable).

Steps: convert the verifier (once), tokenise the code corpus into WORK/corpus, pick the draft
vocabulary (the N most frequent training tokens plus the EOS ids), initialise the drafter from
verifier layers, train (checkpoints in WORK/train, log in WORK/train.log), export fp16 to OUT.
With --synthetic DIR (from `steerspec train synth`) and --init DRAFTER it distils instead: it starts
from that drafter (same draft vocabulary) and trains on the verifier's answers only (prompts give context).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from steerspec.data.code_corpus import build_token_arrays
from steerspec.errors import UsageError
from steerspec.models import reduced, smollm2
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.loading import resolve_device
from steerspec.train.common import add_device_argument
from steerspec.train.smollm2_loop import CHECKPOINT, LoopConfig, train
from steerspec.train.synth import load_synthetic

DEFAULT_WORK = Path("runs/smollm2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="where to export the trained drafter")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="corpus, checkpoints and log (git-ignored)")
    parser.add_argument("--support", type=int, default=8192, help="draft vocabulary size N")
    parser.add_argument("--init-layers", default="0,1", help="verifier layers the drafter's layers start from")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_device_argument(parser)
    parser.add_argument("--checkpoint-s", type=float, default=600.0, help="seconds between checkpoints")
    parser.add_argument("--train-chars", type=int, default=12_000_000, help="corpus cap (characters)")
    parser.add_argument("--synthetic", type=Path, action="append", default=None,
                        help="train on this `steerspec train synth` dataset (answer tokens as targets) instead of the "
                             "corpus; repeatable (the sets are joined in order)")
    parser.add_argument("--init", default=None,
                        help="start from this reduced drafter (dir or bundled name, e.g. smollm2-pretrained) and its support")
    parser.add_argument("--init-only", action="store_true", help="export the untrained initialisation and stop")
    parser.add_argument("--export-only", action="store_true",
                        help="export WORK/train's latest checkpoint without training (safe while training runs)")


def choose_support(tokens: np.ndarray, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The `size` most frequent ids in `tokens` (ties by id), always including `always`; sorted."""
    counts = np.bincount(tokens.astype(np.int64), minlength=vocab_size)
    for token in always:
        counts[token] = counts.max() + 1
    order = np.lexsort((np.arange(vocab_size), -counts))[:size]
    return torch.from_numpy(np.sort(order)).to(torch.long)


def flatten_synthetic(data, eos_id: int) -> "tuple[np.ndarray, np.ndarray]":
    """Sequences joined by `eos_id` into one token array, and a mask that is true on answer tokens only."""
    tokens, mask = [], []
    for seq, plen in zip(data.sequences, data.prompt_lens):
        ids = np.asarray(seq, dtype=np.int64)
        tokens += [ids, np.asarray([eos_id])]
        mask += [np.arange(ids.size) >= plen, np.zeros(1, dtype=bool)]
    return np.concatenate(tokens).astype(np.uint16), np.concatenate(mask)


def corpus_line(corpus: Optional[dict]) -> str:
    """The card's record of what the corpus read (`code_corpus.build_token_arrays`' summary.json), so a
    rebuild can tell whether it read the same library and packages; empty for a corpus built before it."""
    if not corpus or "packages" not in corpus:
        return ""
    return (f"\nCorpus: {corpus['train']['files']:,} training files ({corpus['train']['tokens']:,} tokens) and "
            f"{corpus['heldout']['files']:,} held-out ones, from the {corpus.get('stdlib', 'Python')} standard library "
            f"and these packages (name==version): {', '.join(corpus['packages'])}.\n")


def model_card(args, figures: dict, seconds: float, tokens_seen: int, corpus: Optional[dict] = None) -> str:
    if args.synthetic is not None:
        sets = " ".join(f"--synthetic {p}" for p in args.synthetic)
        return (f"# smollm2 distilled drafter\n\nBuilt by `steerspec train smollm2 {sets} "
                f"--init {args.init}` for the verifier `smollm2` (SmolLM2-135M-Instruct, Apache-2.0; see NOTICE): "
                f"the drafter {args.init} (same draft vocabulary) trained on the verifier's own T=1 answers "
                f"(sequence-level distillation; cross-entropy on answer tokens only): {tokens_seen:,} window tokens, "
                f"{seconds / 60:.1f} min on {args.device}, seed {args.seed}, lr {args.lr}, last figures {json.dumps(figures)}.\n")
    return (f"# smollm2 reduced drafter\n\nBuilt by `steerspec train smollm2` for the verifier `smollm2` "
            f"(SmolLM2-135M-Instruct, Apache-2.0; see NOTICE). {len(args.init_layers.split(','))} decoder layers "
            f"initialised from verifier layers {args.init_layers}; input embedding and head rows are read from "
            f"the verifier at load time (draft vocabulary: the {args.support} most frequent corpus tokens, "
            f"q = 0 elsewhere). Trained on the code corpus (stdlib + installed packages' sources, deduplicated, "
            f"split by file): {tokens_seen:,} tokens, {seconds / 60:.1f} min on {args.device}, seed {args.seed}, lr {args.lr}, "
            f"last figures {json.dumps(figures)}.\n" + corpus_line(corpus))


def run(args) -> int:
    # lazy: transformers takes seconds to import
    from transformers import AutoTokenizer


    torch.set_num_threads(max(1, args.threads))
    device = resolve_device(args.device)
    try:
        init_layers = [int(x) for x in args.init_layers.split(",") if x.strip()]
    except ValueError as exc:
        raise UsageError(f"--init-layers must be comma-separated integers, got {args.init_layers!r}") from exc
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger("steerspec.train.smollm2_drafter")
    log.setLevel(logging.INFO)
    handler = logging.FileHandler(work / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    vdir = smollm2.ensure_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(vdir))
    eos = smollm2.eos_ids(tokenizer)
    corpus = work / "corpus"
    if args.synthetic is None and not (corpus / "train.npy").is_file():
        log.info("corpus: %s", json.dumps(build_token_arrays(tokenizer, corpus, seed=args.seed,
                                                             max_train_chars=args.train_chars, eos_id=eos[0])))
    target_mask = None
    if args.synthetic is not None:
        parts = [flatten_synthetic(load_synthetic(path), eos[0]) for path in args.synthetic]
        tokens, target_mask = np.concatenate([t for t, _ in parts]), np.concatenate([m for _, m in parts])
        log.info("synthetic: %s, %d tokens, %d answer targets", [str(p) for p in args.synthetic], tokens.size,
                 int(target_mask.sum()))
    else:
        tokens = np.load(corpus / "train.npy")
    if args.init is not None:
        model = reduced.load_reduced(resolve_model_dir(args.init), verifier_dir=vdir)
    else:
        vocab = json.loads((vdir / "config.json").read_text())["vocab_size"]
        support_file = work / f"support-{args.support}.npy"
        if support_file.is_file():
            support = torch.from_numpy(np.load(support_file)).to(torch.long)
        else:
            support = choose_support(tokens, args.support, vocab, always=eos)
            np.save(support_file, support.numpy())
        model = reduced.init_from_verifier(vdir, smollm2.NAME, support, init_layers)
    cfg = LoopConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                     checkpoint_s=args.checkpoint_s)
    started = time.monotonic()
    figures = {}
    if args.export_only:
        state = torch.load(work / "train" / CHECKPOINT, map_location="cpu")
        model.load_state_dict(state["own"], strict=False)
        figures = {"step": int(state["step"])}
        args.lr = state["config"]["lr"]
    elif not args.init_only:
        figures = train(model.to(device), tokens, cfg, work / "train", log=log, stop_file=work / "STOP",
                        target_mask=target_mask)
        model.to("cpu")
    steps_done = int(figures.get("step", 0))
    summary = corpus / "summary.json"
    card = model_card(args, figures, time.monotonic() - started, steps_done * cfg.batch_size * cfg.seq_len,
                      corpus=json.loads(summary.read_text()) if args.synthetic is None and summary.is_file() else None)
    reduced.save_drafter(model, args.out, card=card)
    log.info("exported to %s", args.out)
    print(f"exported {args.out}")
    return 0
