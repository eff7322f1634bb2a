"""Synthetic training data for distillation and SD²: the verifier's own answers at T=1.

Prompts are windows of the corpus *train* split (never the held-out files the `indist` eval set
comes from), tokenised with the pair's shared tokenizer; the verifier continues each one by
sampling at temperature 1 (batched, left-padded, with a KV cache). The dataset is a directory of
shards (`shard_00000.safetensors`, ...): flat token ids, per-sequence offsets and prompt lengths,
plus `meta.json`. Each shard is seeded on its own, so an interrupted run resumes at the first
missing shard and produces the same data as an uninterrupted one.

With `--teacher-top-k K` a shard also caches what distillation and SD² training need from the
verifier, taken from the very forward passes that sampled the answers (no second verifier pass):
the top-K log-probabilities of every answer token's distribution, and the hidden states entering
the three steering layers at each position from the last-but-one prompt token on.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
from safetensors.torch import load_file, save_file

from steerspec.data import corpus, evalsets
from steerspec.errors import UsageError
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.loading import cache_kwarg, load_model, load_tokenizer, resolve_device
from steerspec.steering import parse_layers
from steerspec.train.common import add_device_argument, progress

SHARD_GLOB = "shard_*.safetensors"
META_FILE = "meta.json"


# ----------------------------------------------------------------------------------------- data


@dataclass
class TeacherRecord:
    """What the verifier computed for one sequence's answer of n_ans tokens.

    top_ids/top_logp [n_ans, K]: the top-K of the distribution each answer token was sampled from
    (position P−1+j, j < n_ans). taps [n_ans + 1, 3, d] (or None): the hidden states entering the
    three steering layers at positions P−2 .. n−2 (row 0 is zeros when the prompt is one token).
    """

    top_ids: torch.Tensor
    top_logp: torch.Tensor
    taps: Optional[torch.Tensor] = None


@dataclass
class SyntheticSet:
    """Sequences (prompt + verifier answer), where each answer starts, and optional teacher caches."""

    sequences: List[torch.Tensor]  # LongTensor [n_i]
    prompt_lens: List[int]
    meta: dict
    teacher: Optional[List[TeacherRecord]] = None

    @property
    def tap_layers(self) -> Optional[Tuple[int, ...]]:
        layers = self.meta.get("tap_layers")
        return tuple(int(x) for x in layers) if layers and self.teacher is not None else None

    def __len__(self) -> int:
        return len(self.sequences)

    def response_tokens(self) -> int:
        return sum(len(s) - p for s, p in zip(self.sequences, self.prompt_lens))

    def split(self, val_fraction: float, seed: int) -> "tuple[SyntheticSet, SyntheticSet]":
        """A seeded train/validation split by sequence."""
        order = list(range(len(self)))
        random.Random(seed).shuffle(order)
        n_val = int(round(len(order) * val_fraction)) if val_fraction > 0 else 0
        if val_fraction > 0 and len(order) > 1:
            n_val = min(max(1, n_val), len(order) - 1)
        def pick(idx):
            teacher = [self.teacher[i] for i in idx] if self.teacher is not None else None
            return SyntheticSet([self.sequences[i] for i in idx], [self.prompt_lens[i] for i in idx], self.meta, teacher)

        return pick(sorted(order[n_val:])), pick(sorted(order[:n_val]))


def save_shard(path: Path, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
               teacher: Optional[Sequence[TeacherRecord]] = None) -> None:
    flat = torch.tensor([t for seq in sequences for t in seq], dtype=torch.int32)
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor([len(s) for s in sequences], dtype=torch.int64).cumsum(0)
    tensors = {"ids": flat, "offsets": offsets, "prompt_lens": torch.tensor(list(prompt_lens), dtype=torch.int32)}
    if teacher is not None:
        for seq, plen, rec in zip(sequences, prompt_lens, teacher):
            if rec.top_ids.shape[0] != len(seq) - plen:
                raise ValueError(f"teacher record of {rec.top_ids.shape[0]} rows for an answer of {len(seq) - plen}")
        tensors["top_ids"] = torch.cat([r.top_ids for r in teacher]).to(torch.int32).contiguous()
        tensors["top_logp"] = torch.cat([r.top_logp for r in teacher]).to(torch.float16).contiguous()
        if all(r.taps is not None for r in teacher):
            tensors["taps"] = torch.cat([r.taps for r in teacher]).to(torch.float16).contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def load_synthetic(path) -> SyntheticSet:
    """Read a dataset directory written by `steerspec train synth` (or one shard file)."""
    path = Path(path)
    if path.is_dir():
        shards = sorted(path.glob(SHARD_GLOB))
        meta = json.loads((path / META_FILE).read_text()) if (path / META_FILE).is_file() else {}
    elif path.is_file():
        shards, meta = [path], {}
    else:
        raise UsageError(f"synthetic dataset not found: {path} (make it with `steerspec train synth --out DIR`)")
    if not shards:
        raise UsageError(f"{path} holds no {SHARD_GLOB} files: run `steerspec train synth --out {path}` first")
    sequences, prompt_lens, teacher = [], [], []
    for shard in shards:
        t = load_file(str(shard))
        ids, offsets = t["ids"].long(), t["offsets"].tolist()
        row = tap_row = 0
        for i, plen in enumerate(t["prompt_lens"].tolist()):
            seq = ids[offsets[i] : offsets[i + 1]]
            sequences.append(seq)
            prompt_lens.append(int(plen))
            if "top_ids" in t:
                n_ans = len(seq) - int(plen)
                taps = t["taps"][tap_row : tap_row + n_ans + 1] if "taps" in t else None
                teacher.append(TeacherRecord(t["top_ids"][row : row + n_ans], t["top_logp"][row : row + n_ans], taps))
                row, tap_row = row + n_ans, tap_row + n_ans + 1
    if teacher and len(teacher) != len(sequences):
        raise UsageError(f"{path}: some shards cache the verifier's outputs and some do not; regenerate them")
    return SyntheticSet(sequences, prompt_lens, meta, teacher or None)


# ----------------------------------------------------------------------------------- generation


@torch.no_grad()
def sample_answers(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    eos_id: Optional[int] = None,
    pad_id: int = 0,
    record: Optional[List[TeacherRecord]] = None,
    top_k: int = 0,
    tap_layers: Optional[Sequence[int]] = None,
) -> List[List[int]]:
    """Continue each prompt by sampling from `model` (batched, left-padded, KV cache).

    Returns the answers (without the prompt), each ending at its first EOS (kept) or after
    `max_new_tokens` tokens. Temperature 1 with no top-k/top-p: the verifier's own distribution.
    With `record` (an empty list) and `top_k`, appends one TeacherRecord per prompt, with taps
    when `tap_layers` are given.
    """
    # lazy: transformers takes seconds to import
    from transformers import DynamicCache


    device = next(model.parameters()).device
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((batch, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError("prompts must hold at least one token")
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    cache_arg = {cache_kwarg(model): cache}
    recording = record is not None and top_k > 0
    taps_on = recording and tap_layers is not None
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache_arg,
                logits_to_keep=1, output_hidden_states=taps_on)
    logits = out.logits[:, -1]
    tops: List[tuple] = []  # per step: (ids [B, K], logp [B, K])
    taps: List[torch.Tensor] = []  # per position from P−2: [B, 3, d]
    if taps_on:
        prefill = torch.stack([out.hidden_states[i][:, -2:] for i in tap_layers], dim=2)  # [B, 2, 3, d]
        for i, p in enumerate(prompts):
            if len(p) < 2:
                prefill[i, 0] = 0
        taps += [prefill[:, 0].to(torch.float16), prefill[:, 1].to(torch.float16)]
    next_pos = positions[:, -1:] + 1
    answers: List[List[int]] = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        if recording:
            top = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
            tops.append((top.indices.to(torch.int32), top.values.to(torch.float16)))
        if temperature <= 0:
            tok = logits.argmax(-1)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        for i in torch.nonzero(~done).flatten().tolist():
            answers[i].append(int(tok[i]))
        if eos_id is not None:
            done |= tok == eos_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True, **cache_arg,
                    output_hidden_states=taps_on)
        logits = out.logits[:, -1]
        if taps_on:
            taps.append(torch.stack([out.hidden_states[i][:, -1] for i in tap_layers], dim=1).to(torch.float16))
        next_pos = next_pos + 1
    if recording:
        top_ids, top_logp = torch.stack([t[0] for t in tops], 1), torch.stack([t[1] for t in tops], 1)
        all_taps = torch.stack(taps, 1) if taps_on else None  # [B, steps + 1, 3, d]
        for i, answer in enumerate(answers):
            n = len(answer)
            record.append(TeacherRecord(top_ids[i, :n].cpu(), top_logp[i, :n].cpu(),
                                        all_taps[i, : n + 1].cpu() if taps_on else None))
    return answers


# -------------------------------------------------------------------------------------- prompts


def corpus_prompts(tokenizer, n: int, min_len: int, max_len: int, seed: int, split_seed: Optional[int] = None,
                   per_file: int = 4) -> List[List[int]]:
    """`n` prompts cut from the corpus *train* split, shaped like the eval prompts.

    Most are what `steerspec.data.evalsets` makes of held-out files (a def/class header plus its
    first lines, ending at a line end), taken here from training files; when those run out, token
    windows starting at random line starts fill up. Lengths are clipped to [min_len, max_len].
    """
    split = corpus.stdlib_split(seed=split_seed) if split_seed is not None else corpus.stdlib_split()
    files = list(split.train)
    if not files:
        raise UsageError(f"no training files found under {split.root}")
    rng = random.Random(seed)
    rng.shuffle(files)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    count = lambda text: len(encode(text))
    prompts: List[List[int]] = []
    for rel in files:
        if len(prompts) >= n:
            break
        found = list(evalsets.code_prompts(split.root, rel, count))
        rng.shuffle(found)
        for _, text in found[:per_file]:
            ids = encode(text)
            if len(ids) >= min_len:
                prompts.append(ids[:max_len])
            if len(prompts) >= n:
                break
    attempts = 0
    while len(prompts) < n:  # fill up with random line-start windows
        attempts += 1
        if attempts > 50 * n + 1000:
            raise UsageError("could not cut enough prompts from the training files")
        rel = files[rng.randrange(len(files))]
        text = corpus.read_source(split.root, rel)
        starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        start = starts[rng.randrange(len(starts))]
        ids = encode(text[start : start + 8 * max_len])
        want = rng.randint(min_len, max_len)
        if len(ids) >= want:
            prompts.append(ids[:want])
    rng.shuffle(prompts)
    return prompts


# ------------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="dataset directory (shards + meta.json)")
    parser.add_argument("--verifier", default="verifier", help="verifier checkpoint dir or bundled name")
    parser.add_argument("--samples", type=int, default=2048, help="number of prompts to answer")
    parser.add_argument("--prompt-min", type=int, default=8, help="shortest prompt (tokens)")
    parser.add_argument("--prompt-max", type=int, default=200, help="longest prompt (tokens; eval prompts are 20-200)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="answer length (stops early at EOS)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per generation batch (= per shard)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_device_argument(parser)
    parser.add_argument("--no-resume", action="store_true", help="start over even if shards exist")
    parser.add_argument("--teacher-top-k", type=int, default=0,
                        help="also cache the verifier's top-K log-probs of every answer token and its steering-layer "
                             "hidden states (for `train distill/sd2` without the verifier in the loop); 0 = off")
    parser.add_argument("--tap-layers", default="auto",
                        help="with --teacher-top-k: verifier layers low,mid,high whose input states are cached (SD²'s)")
    parser.add_argument("--worker", default=None, metavar="I/N",
                        help="make only the shards whose index is I mod N, so N processes of one thread each share "
                             "the work (one process with two threads stalls on a busy 2-core machine)")
    parser.add_argument("--shards", type=int, default=None,
                        help="make only the first SHARDS batches of the --samples prompts (rerun with more to extend)")


def run(args) -> int:
    if args.samples < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise UsageError("--samples, --batch-size and --max-new-tokens must be at least 1")
    if not 1 <= args.prompt_min <= args.prompt_max:
        raise UsageError("need 1 <= --prompt-min <= --prompt-max")
    worker, workers = 0, 1
    if args.worker is not None:
        try:
            worker, workers = (int(x) for x in args.worker.split("/"))
        except ValueError:
            raise UsageError(f"--worker must be I/N, e.g. 0/2, got {args.worker!r}") from None
        if not 0 <= worker < workers:
            raise UsageError(f"--worker I/N needs 0 <= I < N, got {args.worker!r}")
    if args.teacher_top_k < 0:
        raise UsageError("--teacher-top-k must be 0 (off) or a positive count")
    torch.set_num_threads(max(1, args.threads))
    vdir = resolve_model_dir(args.verifier)
    device = resolve_device(args.device)
    model = load_model(vdir, device=device)
    tok = load_tokenizer(vdir)
    ctx = int(getattr(model.config, "max_position_embeddings", 512))
    tap_layers = None
    if args.teacher_top_k:
        tap_layers = list(parse_layers(args.tap_layers, int(model.config.num_hidden_layers)))
    if args.prompt_max + args.max_new_tokens > ctx:
        raise UsageError(f"--prompt-max + --max-new-tokens must fit the verifier's context of {ctx} tokens")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.no_resume:
        for f in out.glob(SHARD_GLOB):
            f.unlink()
    meta = dict(
        verifier=str(vdir), samples=args.samples, prompt_min=args.prompt_min, prompt_max=args.prompt_max,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch_size=args.batch_size, seed=args.seed,
        prompts_from="CPython stdlib train split: def/class headers + first lines (as steerspec.data.evalsets), then line-start windows",
    )
    if args.teacher_top_k:
        meta.update(teacher_top_k=args.teacher_top_k, tap_layers=tap_layers)
    meta_path = out / META_FILE
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        same = {k: old.get(k) for k in meta if k != "verifier"} == {k: v for k, v in meta.items() if k != "verifier"}
        if not same and any(out.glob(SHARD_GLOB)):
            raise UsageError(f"{out} holds shards made with other settings; pass --no-resume or another --out")
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    prompts = corpus_prompts(tok, args.samples, args.prompt_min, args.prompt_max, seed=args.seed)
    shards = [(i, prompts[s : s + args.batch_size]) for i, s in enumerate(range(0, len(prompts), args.batch_size))]
    if args.shards is not None:
        if args.shards < 1:
            raise UsageError("--shards must be at least 1")
        shards = shards[: args.shards]
    shards = [(i, b) for i, b in shards if i % workers == worker]
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos or 0)

    # shards holds (index, batch) pairs of this worker only: count finished ones by their index, not position
    done = sum(len(b) for i, b in shards if (out / f"shard_{i:05d}.safetensors").is_file())
    bar = progress(total=sum(len(b) for _, b in shards), initial=done, desc="synth")
    start = time.time()
    new_tokens = 0
    for index, batch in shards:
        path = out / f"shard_{index:05d}.safetensors"
        if path.is_file():
            continue
        gen = torch.Generator(device=device).manual_seed(args.seed * 1_000_003 + index)
        record: Optional[List[TeacherRecord]] = [] if args.teacher_top_k else None
        answers = sample_answers(model, batch, args.max_new_tokens, gen, temperature=args.temperature, eos_id=eos, pad_id=pad,
                                 record=record, top_k=args.teacher_top_k, tap_layers=tap_layers)
        save_shard(path, [list(p) + a for p, a in zip(batch, answers)], [len(p) for p in batch], record)
        new_tokens += sum(len(a) for a in answers)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{new_tokens / max(1e-9, time.time() - start):.0f}")
    bar.close()
    data = load_synthetic(out)
    meta.update(device=str(device), sequences=len(data), response_tokens=data.response_tokens(),
                total_tokens=sum(len(s) for s in data.sequences), seconds_this_run=round(time.time() - start, 1))
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(f"synth: {len(data)} sequences, {data.response_tokens()} answer tokens -> {out}")
    return 0
