"""`draft_block` and `verify_block` with sampling on the device and one device→host copy per block.

The host path samples with `torch.multinomial` and branches on tensor values, so a GPU block
waits on the device several times per token. Here each draft step stays on the device (graphed
one-token step on CUDA, `device_sampling.draft_step`), and the block's tokens and sparse q come
to the host in one packed copy; verification scores [pending, d_1..d_k] (graphed per k+1 bucket),
accepts/rejects on the device and copies (accepted, next token, bonus) once. Greedy blocks give
exactly the host path's tokens; sampled ones the same distribution from other draws.

STEERSPEC_DEVICE_SAMPLING: `auto` (default: on for CUDA models), `1` (also on a CPU, as the tests
run it) or `0` (never). Policies that stop inside a block need per-token host values and keep the
host path (`applies`).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from steerspec.decoding import device_sampling as ds
from steerspec.decoding.rounds import DecodeConfig
from steerspec.decoding.sampling import SparseDist
from steerspec.decoding.speculative import DraftBlock, VerifyOutcome
from steerspec.models.batched import batched_extend, first_logits, packed_extend
from steerspec.models.graphed import can_graph, graphed_extend, upload
from steerspec.models.kv import CachedLM


def enabled(device: torch.device) -> bool:
    """Whether device-side sampling serves models on `device` (STEERSPEC_DEVICE_SAMPLING)."""
    mode = os.environ.get("STEERSPEC_DEVICE_SAMPLING", "auto").lower()
    if mode in ("1", "on", "true"):
        return True
    if mode in ("0", "off", "false"):
        return False
    return device.type == "cuda"


def applies(lm: CachedLM, policy=None) -> bool:
    """True when this block can take the device path (enabled, and no per-token stopping policy)."""
    return enabled(lm.device) and not (policy is not None and getattr(policy, "stops_early", False))


def _uniforms(rows: int, cols: int, generator: Optional[torch.Generator], device: torch.device) -> Tensor:
    """Uniforms on `device` from the generator wherever it lives (one draw per block)."""
    gen_device = device if generator is None else generator.device
    u = ds.uniforms(rows, cols, generator, gen_device)
    return upload(u, device)


def pack(tensors: Sequence[Tensor]) -> Tensor:
    """Flatten tensors into one float32 vector (ids < 2^24 are exact) for a single host copy."""
    return torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])


def unpack(flat: Tensor, shapes: Sequence[Tuple[Tuple[int, ...], torch.dtype]]) -> List[Tensor]:
    """Split a packed host vector back into tensors of the given shapes and dtypes."""
    out, offset = [], 0
    for shape, dtype in shapes:
        size = 1
        for d in shape:
            size *= d
        out.append(flat[offset : offset + size].view(shape).to(dtype))
        offset += size
    return out


@torch.inference_mode()
def draft_block(drafter: CachedLM, committed: Sequence[int], k: int, config: "DecodeConfig",
                generator: Optional[torch.Generator] = None) -> DraftBlock:
    """`engine.draft_block` without a stopping policy: k drafts sampled on the device; the
    DraftBlock (tokens [1, k], q ids/probs [1, k, S], floor [1, k]) arrives on the host at once."""
    params = config.sampling
    greedy = params.greedy
    device = drafter.device
    if k <= 0:
        return DraftBlock(tokens=torch.zeros(1, 0, dtype=torch.long), lengths=torch.tensor([0]))
    u = None if greedy else _uniforms(k, 2, generator, device)
    # a pageable non-blocking copy: no wait for the stream (torch.tensor(..., device=) would)
    feed: Tensor = upload(torch.tensor(list(committed[drafter.length:]), dtype=torch.long), device)
    tokens: List[Tensor] = []
    dists: List[SparseDist] = []
    for i in range(k):
        logits = drafter.extend(feed, logits_to_keep=1).logits  # [1, V]
        token, dist = ds.draft_step(logits, greedy, params.temperature, params.top_k, params.top_p,
                                    config.draft_top_k, config.draft_tail, None if u is None else u[i : i + 1])
        tokens.append(token)
        if dist is not None:
            dists.append(dist)
        feed = token
    block_tokens = torch.cat(tokens)
    if greedy:
        return DraftBlock(tokens=block_tokens.cpu().view(1, k), lengths=torch.tensor([k]))
    q = SparseDist.stack(dists, dim=1)  # [1, k, S]
    support = q.ids.shape[-1]
    host = pack([block_tokens, q.ids, q.probs, q.floor]).cpu()  # the block's one device→host copy
    tok, ids, probs, floor = unpack(host, [((1, k), torch.long), ((1, k, support), torch.long),
                                           ((1, k, support), torch.float32), ((1, k), torch.float32)])
    return DraftBlock(tokens=tok, lengths=torch.tensor([k]), q=SparseDist(ids=ids, probs=probs, floor=floor,
                                                                          vocab=q.vocab))


@torch.inference_mode()
def verify_block(verifier: CachedLM, pending: int, block: DraftBlock, config: "DecodeConfig",
                 generator: Optional[torch.Generator] = None,
                 hidden_layers: Optional[Sequence[int]] = None) -> Tuple[VerifyOutcome, Optional[Tensor]]:
    """`engine.verify_block` with acceptance and the recovered/bonus token decided on the device;
    the outcome (host tensors) costs one device→host copy. Hidden states stay on the device."""
    start = verifier.length
    device = verifier.device
    width = int(block.tokens.shape[1])
    feed = torch.cat([torch.tensor([pending], dtype=torch.long), block.tokens[0].cpu()]) \
        if block.tokens.device.type == "cpu" else \
        torch.cat([torch.tensor([pending], dtype=torch.long, device=block.tokens.device), block.tokens[0]])
    out = verifier.extend(upload(feed, device), hidden_layers)
    logits = out.logits.unsqueeze(0)  # [1, k+1, V]
    on_device = DraftBlock(upload(block.tokens, device), upload(block.lengths, device),
                           None if block.q is None else block.q.map(lambda t: upload(t, device)))
    params = config.sampling
    if params.greedy:
        outcome = ds.greedy_verify_device(logits, on_device.tokens, on_device.lengths)
    else:
        probs = ds.warp_probs(logits[0], params.temperature, params.top_k, params.top_p).unsqueeze(0)
        outcome = ds.rejection_sample_device(probs, on_device, _uniforms(1, width + 1, generator, device))
    host = torch.stack([outcome.accepted, outcome.next_tokens, outcome.is_bonus.long()]).cpu()  # one copy
    accepted = int(host[0, 0])
    verifier.rollback(start + 1 + accepted)
    hidden = out.hidden[:, accepted] if hidden_layers else None
    return VerifyOutcome(accepted=host[0], next_tokens=host[1], is_bonus=host[2].bool()), hidden


def _extend_rows(lms: Sequence[CachedLM], feeds: Tensor, counts: Sequence[int],
                 hidden_layers: Optional[Sequence[int]]) -> Tuple[Tensor, Optional[Tensor]]:
    """Feed feeds[b, :counts[b]] to lms[b]: one graphed pass when the rows share a static pool,
    else one packed pass (`packed_extend`; per-row extends where it cannot run). Returns logits
    [B, W, V] and hidden [L, B, W, D] (zero-padded)."""
    layers = tuple(hidden_layers or ())
    width = int(feeds.shape[1])
    if len(lms) > 1 and can_graph(lms, width):
        logits, hidden = graphed_extend(lms, feeds, counts, layers)
        return logits[:, :width], None if hidden is None else hidden[:, :, :width]
    outs = packed_extend(lms, [feeds[b, : counts[b]] for b in range(len(lms))], layers or None)
    logits = torch.zeros(len(lms), width, outs[0].logits.shape[-1], dtype=outs[0].logits.dtype,
                         device=outs[0].logits.device)
    hidden = None
    if layers:
        hidden = torch.zeros(len(layers), len(lms), width, outs[0].hidden.shape[-1], dtype=outs[0].hidden.dtype,
                             device=outs[0].hidden.device)
    for b, out in enumerate(outs):
        logits[b, : counts[b]] = out.logits
        if hidden is not None:
            hidden[:, b, : counts[b]] = out.hidden
    return logits, hidden


@torch.inference_mode()
def verify_blocks(lms: Sequence[CachedLM], pendings: Sequence[int], blocks: Sequence[DraftBlock],
                  params: Sequence, generators: Sequence[Optional[torch.Generator]],
                  hidden_layers: Optional[Sequence[int]] = None) -> Tuple[List[Tuple[int, int, bool]], Optional[Tensor]]:
    """Batched `verify_block` over sessions (each its own cache, batch-1 block, SamplingParams and
    generator): one forward pass (graphed when the caches share a pool), acceptance on the device,
    one device→host copy for every row. Returns [(accepted, next token, is bonus)] and the hidden
    states [B, L, D] at each row's new-pending position (None without hidden_layers)."""
    batch = len(lms)
    device = lms[0].device
    ks = [int(block.tokens.shape[1]) for block in blocks]
    width = max(ks) + 1
    starts = [lm.length for lm in lms]
    feeds = torch.zeros(batch, width, dtype=torch.long)
    for b, (pending, block) in enumerate(zip(pendings, blocks)):
        feeds[b, 0] = int(pending)
        feeds[b, 1 : ks[b] + 1] = block.tokens[0].cpu()
    logits, hidden = _extend_rows(lms, upload(feeds, device), [k + 1 for k in ks], hidden_layers)
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_tokens = torch.zeros(batch, dtype=torch.long, device=device)
    is_bonus = torch.zeros(batch, dtype=torch.bool, device=device)
    groups: dict = {}
    for b, (block, p) in enumerate(zip(blocks, params)):
        key = ("greedy",) if p.greedy else ("sample", None if block.q is None else int(block.q.ids.shape[-1]))
        groups.setdefault(key, []).append(b)
    lengths = upload(torch.tensor(ks), device)
    tokens = upload(feeds[:, 1:].contiguous(), device)
    for key, rows in groups.items():
        index = upload(torch.tensor(rows), device)
        sub_logits, sub_tokens, sub_lengths = logits[index], tokens[index, : width - 1], lengths[index]
        if key[0] == "greedy":
            outcome = ds.greedy_verify_device(sub_logits, sub_tokens, sub_lengths)
        else:
            temps = torch.tensor([params[b].temperature for b in rows], dtype=torch.float32)
            top_ks = torch.tensor([params[b].top_k for b in rows])
            top_ps = torch.tensor([params[b].top_p for b in rows], dtype=torch.float32)
            per_pos = lambda t: upload(t.repeat_interleave(width), device)  # noqa: E731
            probs = ds.warp_probs(sub_logits.reshape(-1, sub_logits.shape[-1]), per_pos(temps), per_pos(top_ks),
                                  per_pos(top_ps), filter_top_k=bool((top_ks > 0).any()),
                                  filter_top_p=bool((top_ps < 1).any())).view(sub_logits.shape)
            q = None
            if key[1] is not None:
                q = SparseDist.stack([_pad_q(blocks[b].q, width - 1, device) for b in rows], dim=0)
            u = torch.zeros(len(rows), width, device=device)
            for r, b in enumerate(rows):
                u[r, : ks[b] + 1] = _uniforms(1, ks[b] + 1, generators[b], device)[0]
            outcome = ds.rejection_sample_device(probs, DraftBlock(sub_tokens, sub_lengths, q), u)
        accepted[index], next_tokens[index], is_bonus[index] = outcome.accepted, outcome.next_tokens, outcome.is_bonus
    host = torch.stack([accepted, next_tokens, is_bonus.long()]).cpu().tolist()  # the batch's one copy
    results = [(host[0][b], host[1][b], bool(host[2][b])) for b in range(batch)]
    for lm, start, (acc, _, _) in zip(lms, starts, results):
        lm.rollback(start + 1 + acc)
    states = None
    if hidden is not None:  # [L, B, W, D] -> [B, L, D] at each row's accepted position
        states = hidden[:, torch.arange(batch, device=device), accepted].transpose(0, 1)
    return results, states


def _pad_q(q: SparseDist, width: int, device: torch.device) -> SparseDist:
    """A batch-1 block's q [1, k, S] as [width, S] on `device` (padding rows: probability 0)."""
    k = q.ids.shape[1]
    ids = torch.zeros(width, q.ids.shape[-1], dtype=torch.long)
    probs = torch.zeros(width, q.ids.shape[-1], dtype=torch.float32)
    floor = torch.zeros(width, dtype=torch.float32)
    ids[:k], probs[:k] = q.ids[0].cpu(), q.probs[0].float().cpu()
    if q.floor is not None:
        floor[:k] = q.floor[0].float().cpu()
    return SparseDist(ids=ids, probs=probs, floor=floor, vocab=q.vocab).map(lambda t: upload(t, device))


def applies_any(rows: Sequence) -> bool:
    """True when some row of a batched draft can take the device path."""
    return any(applies(row.lm, row.policy) for row in rows)


def draft_blocks_split(rows: Sequence, host_draft_blocks) -> List[DraftBlock]:
    """Rows that can take the device path draft there together; the others (stopping policies)
    through `host_draft_blocks`. A session's block never depends on who shares its batch."""
    device_rows = [i for i, row in enumerate(rows) if applies(row.lm, row.policy)]
    host_rows = [i for i, row in enumerate(rows) if not applies(row.lm, row.policy)]
    blocks: List[Optional[DraftBlock]] = [None] * len(rows)
    for i, block in zip(device_rows, draft_blocks([rows[i] for i in device_rows])):
        blocks[i] = block
    if host_rows:
        for i, block in zip(host_rows, host_draft_blocks([rows[i] for i in host_rows])):
            blocks[i] = block
    return blocks  # type: ignore[return-value]


@torch.inference_mode()
def draft_blocks(rows: Sequence) -> List[DraftBlock]:
    """`drafting.draft_blocks` (rows: lm, committed, k, config, generator, policy, first_logits)
    without stopping policies: one batched step per position (graphed when the caches share a
    pool), sampling on the device from each row's generator, one host copy for all blocks."""
    device = rows[0].lm.device
    ks = [max(int(row.k), 0) for row in rows]
    u = [None if row.config.greedy or k == 0 else _uniforms(k, 2, row.generator, device)
         for row, k in zip(rows, ks)]
    tokens: List[List[Tensor]] = [[] for _ in rows]
    dists: List[List[SparseDist]] = [[] for _ in rows]
    active = [i for i, k in enumerate(ks) if k > 0]
    logits = first_logits(rows, active) if active else None
    step = 0
    while active:
        chosen = torch.empty(len(active), dtype=torch.long, device=device)
        groups: dict = {}
        for a, i in enumerate(active):
            config = rows[i].config
            p = config.sampling
            key = None if config.greedy else (p.temperature, p.top_k, p.top_p, config.draft_top_k, config.draft_tail)
            groups.setdefault(key, []).append(a)
        for key, members in groups.items():
            index = upload(torch.tensor(members), device) if len(members) < len(active) else None
            sub = logits if index is None else logits[index]
            if key is None:
                tok = sub.argmax(-1)
            else:
                temperature, top_k, top_p, draft_top_k, tail = key
                uu = torch.stack([u[active[a]][step] for a in members])  # type: ignore[index]
                tok, dist = ds.draft_step(sub, False, temperature, top_k, top_p, draft_top_k, tail, uu)
                for r, a in enumerate(members):
                    dists[active[a]].append(dist.map(lambda t, r=r: t[r : r + 1]))
            if index is None:
                chosen = tok
            else:
                chosen[index] = tok
        for a, i in enumerate(active):
            tokens[i].append(chosen[a : a + 1])
        keep = [a for a, i in enumerate(active) if len(tokens[i]) < ks[i]]
        if not keep:
            break
        feed = chosen if len(keep) == len(active) else chosen[upload(torch.tensor(keep), device)]
        active = [active[a] for a in keep]
        logits = batched_extend([rows[i].lm for i in active], feed)
        step += 1
    return _to_host(rows, ks, tokens, dists)


def _to_host(rows: Sequence, ks: List[int], tokens: List[List[Tensor]], dists: List[List[SparseDist]]) -> List[DraftBlock]:
    """Every row's tokens and q in one packed device→host copy, as batch-1 DraftBlocks."""
    parts: List[Tensor] = []
    shapes: List[Tuple[Tuple[int, ...], torch.dtype]] = []
    for k, toks, ds_ in zip(ks, tokens, dists):
        if k == 0:
            continue
        parts.append(torch.cat(toks))
        shapes.append(((1, k), torch.long))
        if ds_:
            q = SparseDist.stack(ds_, dim=1)
            support = q.ids.shape[-1]
            parts += [q.ids, q.probs, q.floor]
            shapes += [((1, k, support), torch.long), ((1, k, support), torch.float32), ((1, k), torch.float32)]
    host = unpack(pack(parts).cpu(), shapes) if parts else []
    blocks, at = [], 0
    for row, k, ds_ in zip(rows, ks, dists):
        if k == 0:
            blocks.append(DraftBlock(tokens=torch.zeros(1, 0, dtype=torch.long), lengths=torch.tensor([0])))
            continue
        tok = host[at]
        at += 1
        q = None
        if ds_:
            q = SparseDist(ids=host[at], probs=host[at + 1], floor=host[at + 2], vocab=ds_[0].vocab)
            at += 3
        blocks.append(DraftBlock(tokens=tok, lengths=torch.tensor([k]), q=q))
    return blocks
