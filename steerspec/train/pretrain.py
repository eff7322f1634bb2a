"""Pretrain the bundled verifier or drafter (Llama architecture, SwiGLU) on the CPython stdlib.

The verifier trains on the `verifier` slice of the train files, the drafter on the disjoint
`drafter` slice (see steerspec.data.corpus); both report their loss on the same held-out files.
Seeded, resumable (`--resume` continues from OUT/checkpoint.pt), with a tqdm progress bar. The
result is a Hugging Face checkpoint directory (fp16 safetensors loading as float32, tokenizer
files, train_report.json, MODEL_CARD.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch
import torch.nn.functional as F

from steerspec.data.corpus import DEFAULT_SEED, stdlib_split
from steerspec.data.tokenizer import EOS, build_tokenizer, encode_files, load_tokenizer
from steerspec.errors import UsageError
from steerspec.train import common

ROLE_DEFAULTS: Dict[str, Dict] = {
    "verifier": dict(hidden=256, layers=6, heads=8, intermediate=704, lr=2e-3, steps=600, batch_size=16),
    "drafter": dict(hidden=128, layers=2, heads=4, intermediate=352, lr=3e-3, steps=600, batch_size=16),
}
MAX_POSITIONS = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", required=True, choices=sorted(ROLE_DEFAULTS), help="which model of the pair")
    parser.add_argument("--out", required=True, type=Path, help="output checkpoint directory")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir (default: train one into OUT)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (role default)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (role default)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (role default)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5%% of steps)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234, help="model/data seed (the corpus split seed is --split-seed)")
    parser.add_argument("--split-seed", type=int, default=None, help="corpus split seed (default: corpus default)")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--eval-windows", type=int, default=128, help="held-out windows for the final loss")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--no-bf16", action="store_true", help="train in float32 (default: bf16 autocast)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")


def build_config(vocab_size: int, eos_id: int, hidden: int, layers: int, heads: int, intermediate: int):
    # lazy: transformers takes seconds to import
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
    )


def sample_batch(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, max_windows: int, batch: int = 16, bf16: bool = False) -> float:
    """Mean next-token loss over the first `max_windows` non-overlapping windows of `data`."""
    was_training = model.training
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq_len)
    total, count = 0.0, 0
    for start in range(0, n, batch):
        rows = [data[i * seq_len : i * seq_len + seq_len + 1] for i in range(start, min(n, start + batch))]
        x = torch.stack(rows).long()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / max(1, count)


def _resolve(args) -> Dict:
    d = dict(ROLE_DEFAULTS[args.role])
    for key in ("hidden", "layers", "heads", "intermediate", "lr", "steps", "batch_size"):
        value = getattr(args, key)
        if value is not None:
            d[key] = value
    if d["steps"] < 1 or d["batch_size"] < 1:
        raise UsageError("--steps and --batch-size must be at least 1")
    if not 8 <= args.seq_len <= MAX_POSITIONS:
        raise UsageError(f"--seq-len must be in [8, {MAX_POSITIONS}], got {args.seq_len}")
    if d["hidden"] % d["heads"]:
        raise UsageError(f"--hidden ({d['hidden']}) must be divisible by --heads ({d['heads']})")
    d["warmup"] = args.warmup if args.warmup is not None else max(1, d["steps"] // 20)
    return d


def run(args) -> int:
    # lazy: transformers takes seconds to import
    from transformers import LlamaForCausalLM

    hp = _resolve(args)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    bf16 = not args.no_bf16
    split_seed = args.split_seed if args.split_seed is not None else DEFAULT_SEED
    split = stdlib_split(seed=split_seed)

    tok_dir = args.tokenizer
    if tok_dir is None:
        tok_dir = out / "_tokenizer"
        if not (tok_dir / "tokenizer.json").exists():
            build_tokenizer(tok_dir, split)
    elif not (Path(tok_dir) / "tokenizer.json").exists():
        raise UsageError(f"--tokenizer {tok_dir}: no tokenizer.json there")
    tok = load_tokenizer(tok_dir)
    eos_id = tok.convert_tokens_to_ids(EOS)

    t0 = time.time()
    train_files = split.files_for(args.role)
    train_data = torch.from_numpy(encode_files(tok, split, train_files).astype(np.int32))
    heldout_data = torch.from_numpy(encode_files(tok, split, split.heldout).astype(np.int32))
    print(
        f"[{args.role}] data: {len(train_files)} train files / {len(train_data):,} tokens; "
        f"{len(split.heldout)} held-out files / {len(heldout_data):,} tokens ({time.time() - t0:.1f}s)",
        flush=True,
    )

    common.seed_everything(args.seed)
    config = build_config(len(tok), eos_id, hp["hidden"], hp["layers"], hp["heads"], hp["intermediate"])
    model = LlamaForCausalLM(config).float()
    model.train()
    n_params = common.param_count(model)
    optimizer = common.make_optimizer(model, hp["lr"], args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed + 1)

    ckpt = out / common.CHECKPOINT_NAME
    start_step, elapsed, history = 0, 0.0, []
    if args.resume and ckpt.exists():
        state = common.load_checkpoint(ckpt, model, optimizer, gen)
        start_step = state["step"]
        if start_step > hp["steps"]:
            raise UsageError(f"{ckpt} is at step {start_step}, beyond --steps {hp['steps']}; use a new --out")
        elapsed = float(state["extra"].get("elapsed_s", 0.0))
        history = list(state["extra"].get("history", []))
        print(f"[{args.role}] resumed at step {start_step}/{hp['steps']}", flush=True)
    elif args.resume:
        print(f"[{args.role}] --resume: no checkpoint at {ckpt}, starting fresh", flush=True)

    print(f"[{args.role}] {n_params:,} parameters; {hp}", flush=True)
    seq_len, batch = args.seq_len, hp["batch_size"]
    bar = common.progress(hp["steps"], start_step, desc=f"train {args.role}")
    t_start = time.time() - elapsed
    ema: Optional[float] = history[-1]["train_loss_ema"] if history else None
    for step in range(start_step, hp["steps"]):
        lr = common.lr_at(step, hp["steps"], hp["lr"], hp["warmup"])
        common.set_lr(optimizer, lr)
        x = sample_batch(train_data, batch, seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = common.clip_grad(model, args.grad_clip)
        optimizer.step()
        value = loss.item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}")
        done = step + 1
        if done % args.eval_every == 0 or done == hp["steps"]:
            held = evaluate(model, heldout_data, seq_len, 16, bf16=bf16)
            history.append(dict(step=done, train_loss_ema=ema, heldout_loss_quick=held, grad_norm=grad_norm,
                                elapsed_s=time.time() - t_start))
            print(f"\n[{args.role}] step {done}: train(ema) {ema:.4f} held-out(16 win) {held:.4f} "
                  f"{time.time() - t_start:.0f}s", flush=True)
        if done % args.save_every == 0 or done == hp["steps"]:
            common.save_checkpoint(ckpt, model, optimizer, done, gen,
                                   extra=dict(elapsed_s=time.time() - t_start, history=history))
    bar.close()
    train_seconds = time.time() - t_start

    common.export_hf(model, out, tok_dir)
    # Final losses measured on the shipped weights (fp16 storage, float32 compute).
    from transformers import AutoModelForCausalLM

    shipped = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    heldout_loss = evaluate(shipped, heldout_data, seq_len, args.eval_windows)
    train_loss = evaluate(shipped, train_data, seq_len, args.eval_windows)
    n_heldout_eval = min(args.eval_windows, (len(heldout_data) - 1) // seq_len) * seq_len
    report = dict(
        role=args.role,
        architecture="LlamaForCausalLM",
        parameters=n_params,
        config=dict(hidden_size=hp["hidden"], num_hidden_layers=hp["layers"], num_attention_heads=hp["heads"],
                    intermediate_size=hp["intermediate"], vocab_size=len(tok), max_position_embeddings=MAX_POSITIONS,
                    tie_word_embeddings=True),
        steps=hp["steps"], batch_size=batch, seq_len=seq_len, lr=hp["lr"], warmup=hp["warmup"],
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed, split_seed=split_seed,
        bf16_autocast=bf16, threads=args.threads,
        tokens_seen=hp["steps"] * batch * seq_len,
        data=dict(slice=args.role, train_files=len(train_files), train_tokens=int(len(train_data)),
                  heldout_files=len(split.heldout), heldout_tokens=int(len(heldout_data)),
                  corpus_files=len(split.train) + len(split.heldout)),
        train_seconds=round(train_seconds, 1),
        train_loss=round(train_loss, 4),
        heldout_loss=round(heldout_loss, 4),
        loss_eval_tokens=n_heldout_eval,
        history=history,
        command="steerspec train base " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        if len(sys.argv) > 3 and sys.argv[1:3] == ["train", "base"] else None,
    )
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(report))
    print(f"[{args.role}] done in {train_seconds:.0f}s: train loss {train_loss:.4f}, held-out loss {heldout_loss:.4f} "
          f"-> {out}", flush=True)
    return 0


def model_card(r: Dict, tau_section: str = "") -> str:
    c, d = r["config"], r["data"]
    name = "verifier" if r["role"] == "verifier" else "pretrained drafter"
    lines = [
        f"# SteerSpec bundled {name}",
        "",
        f"A tiny {r['architecture']} (SwiGLU) trained from scratch on CPython standard-library source by",
        "`steerspec train base`. Part of the embedded default pair; not a general-purpose model.",
        "",
        "## Architecture",
        f"- hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} heads, "
        f"MLP intermediate {c['intermediate_size']}, vocab {c['vocab_size']} (shared byte-level BPE), "
        f"max positions {c['max_position_embeddings']}, tied embeddings",
        f"- parameters: {r['parameters']:,}",
        "- storage: fp16 safetensors; config dtype float32 (loads as float32 by default)",
        "",
        "## Training",
        f"- command: `{r['command'] or 'see scripts/build_assets.sh'}`",
        f"- data: the `{d['slice']}` slice of the train split: {d['train_files']} files, {d['train_tokens']:,} tokens "
        f"(corpus: {d['corpus_files']} stdlib files after exclusions, split seed {r['split_seed']})",
        f"- held-out: {d['heldout_files']} files, {d['heldout_tokens']:,} tokens (shared with the other model)",
        f"- {r['steps']} steps × batch {r['batch_size']} × seq {r['seq_len']} = {r['tokens_seen']:,} tokens seen; "
        f"AdamW lr {r['lr']} (warm-up {r['warmup']}, cosine to 10%), wd {r['weight_decay']}, clip {r['grad_clip']}, "
        f"seed {r['seed']}, bf16 autocast {r['bf16_autocast']}, {r['threads']} CPU threads",
        f"- wall-clock training time: {r['train_seconds']:.0f} s (shared 2-core CPU)",
        "",
        "## Losses (shipped weights, float32, mean next-token cross-entropy in nats)",
        f"- train ({d['slice']} slice, first {r['loss_eval_tokens']:,} tokens): {r['train_loss']:.4f}",
        f"- held-out (first {r['loss_eval_tokens']:,} tokens): {r['heldout_loss']:.4f}",
        "",
    ]
    if tau_section:
        lines += [tau_section.rstrip(), ""]
    return "\n".join(lines)
