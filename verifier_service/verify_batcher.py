"""Batched verification: blocks of concurrent sessions scored in ONE forward pass.

`Batcher` (a `steerspec.serving.batching.WindowBatcher`) collects submitted blocks for at most `window_s`
(ending early as soon as every ready session has submitted, so a lone session never waits) and
hands them to `VerifyRunner.run` on a single compute thread; the event loop keeps reading other
streams meanwhile.

Ragged batches: session i has a cache of L_i tokens and feeds n_i = k_i + 1 new tokens. Fast
caches (FastCachedLM, what sessions get on a CPU) are fed by `packed_extend`: the rows' tokens
packed into one sequence for the projections and MLP, attention per row over its own buffers, no
copies; each cache then rolls back to its accepted positions. Transformers caches are copied
right-padded into [B, H, L_max, D], new tokens right-padded to T = max n_i and placed after
L_max; a 2-D attention mask hides the holes and position ids continue each session's own
sequence (L_i + j); each session then appends its accepted positions to its own cache. A batch of
one uses the session's cache directly. Acceptance runs per session with its own generator, so
seeded sampling does not depend on who shared the batch.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from steerspec.models.kv import FastCachedLM
from steerspec.models.loading import cache_kwarg
from steerspec.models.pass_shape import pass_shape
from steerspec.serving.batching import WindowBatcher
from verifier_service import fast_verify
from verifier_service.cost_probe import anchor_passes
from verifier_service.pass_costs import PassCosts
from verifier_service.verify_jobs import JobResult, VerifyJob
from verifier_service.verify_sessions import VerifierSession


class VerifyRunner:
    """The compute side: prefill and batched verify over one model (called on one thread)."""

    def __init__(self, model, steering_head=None) -> None:
        self.model = model
        self.head = steering_head
        self.device = model.device
        self.config = model.config
        self._cache_arg = cache_kwarg(model)  # the name transformers' forward takes the KV cache by
        # pass time against blocks and rows in the kernel path's units, reported with every result (load-aware sizes)
        self.costs = PassCosts(anchors=anchor_passes(model), shape=pass_shape(model))

    # ------------------------------------------------------------------ helpers
    def steering(self, hidden_states: Sequence[Tensor], rows: Tensor, positions: Tensor) -> Tensor:
        """g [B, d_V] from the hidden states entering the head's layers at (row, position)."""
        head_device = next(self.head.parameters()).device  # layers may sit on several GPUs (--device-map)
        feats = torch.cat([hidden_states[layer][rows, positions].to(head_device, torch.float32)
                           for layer in self.head.layers], dim=-1)
        return self.head(feats).float()

    def initial_steering(self) -> Tensor:
        """g for a one-token prompt (no verifier position yet): the head applied to zeros."""
        return self.head.initial(1)[0].float()

    @torch.inference_mode()
    def prefill_chunk(self, session: VerifierSession, prompt: List[int], start: int, end: int) -> None:
        """Feed prompt[start:end] (a chunk of a long prompt's prefill; the cache is emptied at start 0)."""
        if start == 0:
            session.lm.reset()
        if session.lm.length != start:
            raise RuntimeError(f"prefill chunk at {start} on a cache of {session.lm.length} tokens")
        session.lm.extend(prompt[start:end], logits_to_keep=1)

    @torch.inference_mode()
    def prefill(self, session: VerifierSession, prompt: List[int], start: int = 0) -> Optional[Tensor]:
        """Feed prompt[start:-1] (prompt[:start] is cached already, by `prefill_chunk`); return the
        steering vector for block 1 when the session asked for one."""
        if isinstance(session.lm, FastCachedLM):  # fast/graphed cache, on either path
            return fast_verify.prefill(self, session, prompt, start)
        lm = session.lm
        if start == 0:
            lm.reset()
        feed = prompt[start:-1]
        want = session.steering and self.head is not None
        if not feed:
            return self.initial_steering() if want else None
        if not want:
            lm.extend(feed, logits_to_keep=1)
            return None
        ids = torch.tensor([feed], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, **{self._cache_arg: lm.cache}, use_cache=True, logits_to_keep=1,
                         output_hidden_states=True)
        lm.length += len(feed)
        zero = torch.zeros(1, dtype=torch.long)
        return self.steering(out.hidden_states, zero, zero + len(feed) - 1)[0]

    # ------------------------------------------------------------------ verify
    @torch.inference_mode()
    def run(self, jobs: List[VerifyJob]) -> List[JobResult]:
        """Verify a batch: each block kind's jobs together in its own pass (`BlockKind.verify`); results in job
        order."""
        groups: Dict[str, List[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job.session.kind.name, []).append(i)
        results: List[Optional[JobResult]] = [None] * len(jobs)
        start = time.perf_counter()
        for indices in groups.values():
            kind = jobs[indices[0]].session.kind
            for i, result in zip(indices, kind.verify(self, [jobs[i] for i in indices])):
                results[i] = result
        block_rows = [job.block.k + 1 for job in jobs]  # the pending token and the drafts of every block
        branched = [job.session.kind.branched(job) for job in jobs]
        self.costs.add(block_rows, (time.perf_counter() - start) * 1e3, branched)
        rows = sum(block_rows)
        for result in results:
            result.pass_rows = rows
        return results

    # ------------------------------------------------------------------ machinery the kinds use
    def head_layers(self) -> Optional[List[int]]:
        """The verifier layers whose input hidden states feed the SD² head (None without a head)."""
        return None if self.head is None else [int(layer) for layer in self.head.layers]

    def steering_vectors(self, states: Tensor) -> Tensor:
        """g [B, d_V] from hidden states [B, L, D] entering the head's layers (concatenated in order)."""
        head_device = next(self.head.parameters()).device
        return self.head(states.reshape(states.shape[0], -1).to(head_device, torch.float32)).float()

    def sync(self) -> None:
        """Wait for the device (CUDA) so a pass's time is its own."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward_single(self, session: VerifierSession, feed: List[int], want_hidden: bool):
        """One session's rows through transformers' cache -> (logits [1, n, V], hidden states or None)."""
        lm = session.lm
        if not want_hidden:
            return lm.extend(feed).logits.unsqueeze(0), None
        ids = torch.tensor([feed], dtype=torch.long, device=self.device)
        try:
            out = self.model(input_ids=ids, **{self._cache_arg: lm.cache}, use_cache=True,
                             output_hidden_states=True)
        except BaseException:
            lm.reset()
            raise
        lm.length += len(feed)
        return out.logits, out.hidden_states

    def forward_batch(self, jobs: List[VerifyJob], feeds: List[List[int]], want_hidden: bool):
        """Ragged sessions on transformers' caches, right-padded into one pass -> (logits, hidden, new K/V)."""
        # lazy: transformers takes seconds to import
        from transformers import DynamicCache

        batch = len(jobs)
        lengths = [job.session.lm.length for job in jobs]
        width = max(len(f) for f in feeds)
        l_max = max(lengths)
        device = self.device
        input_ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros(batch, l_max + width, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        for i, (feed, length) in enumerate(zip(feeds, lengths)):
            input_ids[i, : len(feed)] = torch.tensor(feed)
            mask[i, :length] = 1
            mask[i, l_max : l_max + len(feed)] = 1
            positions[i] = length + torch.arange(width)
        cache = DynamicCache(config=self.config)
        if l_max > 0:
            for layer in range(len(jobs[0].session.lm.cache.layers)):
                ref = next(job.session.lm.cache.layers[layer] for job, n in zip(jobs, lengths) if n > 0)
                shape = list(ref.keys.shape)
                shape[0], shape[2] = batch, l_max
                keys = ref.keys.new_zeros(shape)
                values = ref.values.new_zeros(shape)
                for i, (job, n) in enumerate(zip(jobs, lengths)):
                    if n:
                        own = job.session.lm.cache.layers[layer]
                        keys[i, :, :n] = own.keys[0, :, :n]
                        values[i, :, :n] = own.values[0, :, :n]
                cache.update(keys, values, layer)
        out = self.model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                         position_ids=positions.to(device), **{self._cache_arg: cache}, use_cache=True,
                         output_hidden_states=want_hidden)
        new_kv = [(lay.keys[:, :, l_max:], lay.values[:, :, l_max:]) for lay in cache.layers]
        return out.logits, out.hidden_states, new_kv


class Batcher(WindowBatcher[VerifyJob, JobResult]):
    """Blocks of concurrent sessions verified in one forward pass (`VerifyRunner.run`) on one thread."""

    def __init__(self, runner: VerifyRunner, window_s: float, expected: Callable[[], int], max_batch: int = 64,
                 inline: bool = False) -> None:
        super().__init__(runner.run, window_s, expected, max_batch=max_batch, thread_name="verify", inline=inline,
                         rows_of=lambda job: len(job.block.draft_ids) + 1)  # the pending token and the drafts
        self.runner = runner
