"""Wire codec: steerspec.v1 protos <-> plain steerspec dataclasses and tensors.

Rules (proto/steerspec/v1/common.proto):
- Sparse draft distributions travel as int32 ids and little-endian float16 probs, row-major
  [k, support]. A row means: each listed id has its prob, and the mass left below 1 is spread
  evenly over the vocab − support unlisted ids (a row summing above 1 is scaled to 1). Both sides
  derive that distribution from the same fp16 values (`sampling.wire_dist`), so the drafter
  samples from exactly the q the verifier tests against; a sampling drafter must therefore
  sample from `fp16_roundtrip(dist, vocab)` (what `sampling.draft_distribution` returns).
- Dense tensors (SD² steering vectors) travel as raw little-endian bytes + dtype + shape.
- proto3 cannot tell an unset float from 0: a SamplingParams with top_p == 0 means "top-p off"
  (1.0); an absent SamplingParams message means greedy (temperature 0).

Decoding validates everything a peer could get wrong and raises `ProtocolError(code, message)`
with the gRPC status code the servers answer with. Translation is vectorised (numpy/torch
frombuffer); there are no per-element Python loops on probability arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import grpc
import numpy as np
import torch
from torch import Tensor

from steerspec.decoding.sampling import (
    SamplingParams,
    SparseDist,
    fp16_roundtrip,  # noqa: F401 (re-exported: what a sampling drafter must send)
    wire_dist,
)
from steerspec.decoding.trees import node_q_rows
from steerspec.serving.identity import ModelIdentity
from steerspec.sprinter.labels import RunLabels
from steerspec.v1 import common_pb2

WIRE_DTYPES = {"float16": (np.dtype("<f2"), torch.float16), "bfloat16": (None, torch.bfloat16),
               "float32": (np.dtype("<f4"), torch.float32)}
MAX_TEMPERATURE = 100.0


class ProtocolError(Exception):
    """A message a peer got wrong: carries the gRPC status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ProtocolError({self.code.name}, {self.message!r})"


def code_number(code: grpc.StatusCode) -> int:
    """The integer value of a grpc.StatusCode (what StreamError.code carries)."""
    return int(code.value[0])


def invalid(message: str) -> ProtocolError:
    return ProtocolError(grpc.StatusCode.INVALID_ARGUMENT, message)


# --------------------------------------------------------------------------- sampling parameters


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=float(params.temperature), top_k=int(params.top_k),
                                     top_p=float(params.top_p))


def _f32(value: float) -> float:
    return float(f"{value:.7g}") if math.isfinite(value) else float(value)


def sampling_from_proto(msg: Optional[common_pb2.SamplingParams], vocab_size: Optional[int] = None) -> SamplingParams:
    """Validated SamplingParams; None (field absent) means greedy. top_p 0 means off (1.0)."""
    if msg is None:
        return SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    # proto floats are float32: recover the shortest decimal (0.9, not 0.8999999761581421)
    temperature, top_p, top_k = _f32(msg.temperature), _f32(msg.top_p), int(msg.top_k)
    if top_p == 0.0:
        top_p = 1.0
    if math.isnan(temperature) or math.isinf(temperature):
        raise invalid(f"sampling.temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if math.isnan(top_p):
        raise invalid("sampling.top_p must be in (0, 1] (0 or unset = off), got nan")
    if vocab_size is not None and top_k > vocab_size:
        raise invalid(f"sampling.top_k must be at most the vocabulary size {vocab_size} (0 = off), got {top_k}")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    try:
        params.validate()
    except ValueError as exc:
        raise invalid(f"sampling: {exc}") from None
    return params


# --------------------------------------------------------------------------- token ids


def ids_array(values: Sequence[int]) -> np.ndarray:
    """A repeated int32 field as an int64 numpy array (one C-level copy)."""
    return np.asarray(values, dtype=np.int64) if len(values) else np.zeros(0, dtype=np.int64)


def check_ids(ids: np.ndarray, vocab_size: int, what: str) -> None:
    """INVALID_ARGUMENT unless every id is in [0, vocab_size)."""
    if ids.size == 0 or int(ids.view(np.uint64).max()) < vocab_size:  # one pass: negatives wrap to huge
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise invalid(f"{what} contains a negative token id ({lo}); ids must be in [0, {vocab_size})")
    if hi >= vocab_size:
        raise invalid(f"{what} contains token id {hi}, outside the vocabulary [0, {vocab_size})")


# --------------------------------------------------------------------------- sparse distributions


def encode_sparse(ids: Tensor, probs: Tensor) -> common_pb2.SparseDistribution:
    """ids/probs [k, S] (probs float32 or float16) -> SparseDistribution with fp16 bytes."""
    support = int(ids.shape[-1]) if ids.dim() else 0
    ids_np = ids.reshape(-1).to(device="cpu", dtype=torch.int32).numpy()
    probs16 = probs.reshape(-1).to(device="cpu", dtype=torch.float16).numpy().astype("<f2", copy=False)
    return common_pb2.SparseDistribution(ids=ids_np.tolist(), probs=probs16.tobytes(), support=support)


def decode_sparse(msg: common_pb2.SparseDistribution, k: int, vocab_size: int,
                  draft_ids: Optional[np.ndarray] = None, draft_rows: Optional[Sequence[int]] = None) -> SparseDist:
    """Validate and decode a SparseDistribution of k rows -> SparseDist [k, S] float32.

    Checks: support in [1, vocab], ids/probs sizes match [k, support], ids in vocabulary and not
    repeated within a row, probs finite and >= 0 with a positive row sum, and (when `draft_ids`
    is given) that each draft token has probability > 0 under its row (listed, or in the spread tail):
    row i, or row `draft_rows[i]` when given (a tree block's rows are one per parent).
    """
    support = int(msg.support)
    if support < 1:
        raise invalid("q.support must be >= 1 (the number of ids per draft position)")
    if support > vocab_size:
        raise invalid(f"q.support {support} exceeds the vocabulary size {vocab_size}")
    if len(msg.ids) != k * support:
        raise invalid(f"q.ids has {len(msg.ids)} entries; expected k * support = {k} * {support} = {k * support}")
    if len(msg.probs) != 2 * k * support:
        raise invalid(f"q.probs has {len(msg.probs)} bytes; expected 2 * k * support = {2 * k * support} "
                      "(little-endian float16, row-major [k, support])")
    ids = ids_array(msg.ids).reshape(k, support)
    probs = np.frombuffer(msg.probs, dtype="<f2").reshape(k, support).astype(np.float32)
    if not _sparse_ok(ids, probs, vocab_size):
        _explain_sparse(ids, probs, vocab_size)
    q = wire_dist(torch.from_numpy(ids), torch.from_numpy(probs), vocab_size)
    if draft_ids is not None and k:
        rows = q if draft_rows is None else q.map(lambda t: t[list(draft_rows)])
        mass = rows.prob_of(torch.from_numpy(draft_ids))
        if not bool((mass > 0).all()):
            i = int(torch.nonzero(mass <= 0)[0, 0])
            raise invalid(f"draft token {int(draft_ids[i])} at position {i} has probability 0 under its q row "
                          "(a drafter can only propose tokens from its own distribution)")
    return q


def _sparse_ok(ids: np.ndarray, probs: np.ndarray, vocab_size: int) -> bool:
    """Every check of `_explain_sparse` in a few array passes (the hot path of each verify hop)."""
    if int(ids.view(np.uint64).max()) >= vocab_size:
        return False
    if ids.shape[1] > 1:
        srt = np.sort(ids, axis=-1)
        if (srt[:, 1:] == srt[:, :-1]).any():
            return False
    if not probs.min() >= 0:  # also False for NaN
        return False
    sums = probs.sum(-1)
    return bool(sums.min() > 0 and sums.max() < np.inf)


def _explain_sparse(ids: np.ndarray, probs: np.ndarray, vocab_size: int) -> None:
    """Raise INVALID_ARGUMENT naming the first check a SparseDistribution fails."""
    k, support = ids.shape
    check_ids(ids, vocab_size, "q.ids")
    if support > 1:
        srt = np.sort(ids, axis=-1)
        if bool((srt[:, 1:] == srt[:, :-1]).any()):
            row = int(np.nonzero((srt[:, 1:] == srt[:, :-1]).any(-1))[0][0])
            raise invalid(f"q row {row} repeats a token id; each row must list distinct ids")
    if not np.isfinite(probs).all():
        raise invalid("q.probs contains NaN or infinity; probabilities must be finite")
    if (probs < 0).any():
        raise invalid("q.probs contains a negative probability")
    empty = probs.sum(-1) <= 0
    if empty.any():
        raise invalid(f"q row {int(np.nonzero(empty)[0][0])} has no probability mass (all zeros)")


# --------------------------------------------------------------------------- dense tensors


def tensor_to_proto(t: Tensor, dtype: str = "float16") -> common_pb2.Tensor:
    """A tensor as little-endian bytes of `dtype` (float16 by default)."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {dtype!r}")
    torch_dtype = WIRE_DTYPES[dtype][1]
    flat = t.detach().to(device="cpu", dtype=torch_dtype).contiguous()
    if dtype == "bfloat16":
        data = flat.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    else:
        data = flat.numpy().astype(WIRE_DTYPES[dtype][0], copy=False).tobytes()
    return common_pb2.Tensor(data=data, dtype=dtype, shape=list(t.shape))


def tensor_from_proto(msg: common_pb2.Tensor, size: Optional[int] = None, what: str = "steering") -> Tensor:
    """Validate and decode a Tensor -> float32 torch tensor of its shape.

    `size` (when given) is the number of values the receiver expects (e.g. d_V)."""
    if msg.dtype not in WIRE_DTYPES:
        raise invalid(f"{what}.dtype {msg.dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
    shape = [int(s) for s in msg.shape]
    if not shape or any(s <= 0 for s in shape):
        raise invalid(f"{what}.shape {shape} must be non-empty with positive sizes")
    count = math.prod(shape)  # Python ints: a numpy product would wrap around for huge sizes
    if size is not None and count != size:
        raise invalid(f"{what} has {count} values (shape {shape}); expected {size}")
    itemsize = 4 if msg.dtype == "float32" else 2
    if len(msg.data) != count * itemsize:
        raise invalid(f"{what}.data has {len(msg.data)} bytes; shape {shape} of {msg.dtype} needs {count * itemsize}")
    if msg.dtype == "bfloat16":
        raw = torch.from_numpy(np.frombuffer(msg.data, dtype="<i2").copy()).view(torch.bfloat16)
        out = raw.float()
    else:
        out = torch.from_numpy(np.frombuffer(msg.data, dtype=WIRE_DTYPES[msg.dtype][0]).astype(np.float32))
    if not bool(torch.isfinite(out).all()):
        raise invalid(f"{what} contains NaN or infinity")
    return out.reshape(shape)


def has_tensor(msg: common_pb2.Tensor) -> bool:
    """True when a Tensor field carries data (an empty Tensor means 'none')."""
    return bool(msg.data) or bool(msg.dtype) or len(msg.shape) > 0


# --------------------------------------------------------------------------- blocks and results


@dataclass
class WireBlock:
    """A decoded DraftBlock: draft ids [k] (int64), q SparseDist [k, S] or None (greedy)."""

    seq: int
    committed_length: int
    draft_ids: np.ndarray
    q: Optional[SparseDist]
    draft_ms: float = 0.0
    kept: int = 0  # SPRINTER: leading drafts kept by the drafter's classifier (accepted without a test)
    head_kept: int = 0  # SPRINTER: drafts the classifier kept, the run's last one included (>= kept)
    lam: float = 1.0  # SPRINTER: the λ of the verifier's labels (q(x)/p(x) <= λ is acceptable)

    @property
    def k(self) -> int:
        return int(self.draft_ids.shape[0])


def encode_block(seq: int, committed_length: int, draft_ids: Sequence[int], q: Optional[SparseDist] = None,
                 draft_ms: float = 0.0) -> common_pb2.DraftBlock:
    """A DraftBlock message; q ids/probs [k, S] (probs are sent as fp16)."""
    msg = common_pb2.DraftBlock(seq=seq, committed_length=committed_length, draft_ids=list(draft_ids),
                                draft_ms=draft_ms)
    if q is not None:
        msg.q.CopyFrom(encode_sparse(q.ids, q.probs))
    return msg


def tree_q_rows(shape, q: common_pb2.SparseDistribution) -> Tuple[int, Optional[List[int]]]:
    """(rows, each node's row or None) of a tree block's q: one row per node (its parent's distribution), or one
    per parent in `trees.q_parents` order, which siblings share (what the drafter service sends)."""
    support = int(q.support)
    if support < 1 or len(q.ids) % support:
        return shape.size, None  # decode_sparse names the bad support or size
    try:
        node_rows = node_q_rows(shape, len(q.ids) // support)
    except ValueError as exc:
        raise invalid(f"{exc} of {support} ids each") from None
    return (shape.size if node_rows is None else max(node_rows) + 1), node_rows


def decode_block(msg: common_pb2.DraftBlock, vocab_size: int, greedy: bool, shape=None) -> WireBlock:
    """Validate the parts of a DraftBlock that need no session state but its tree; decode ids and q. `shape`:
    the tree of the block's nodes (a tree session), whose q may carry one row per parent (`tree_q_rows`)."""
    ids = ids_array(msg.draft_ids)
    check_ids(ids, vocab_size, "draft_ids")
    k = int(ids.shape[0])
    q = None
    if msg.HasField("q"):
        if greedy:
            raise invalid("this session is greedy (temperature 0): send draft ids only, without q")
        if k == 0:
            raise invalid("q is set but the block has no draft ids")
        rows, draft_rows = (k, None) if shape is None else tree_q_rows(shape, msg.q)
        q = decode_sparse(msg.q, rows, vocab_size, draft_ids=ids, draft_rows=draft_rows)
    elif not greedy and k > 0:
        raise invalid("this session samples (temperature > 0): every block with drafts must carry q, "
                      "the drafter's sparse distributions")
    if not math.isfinite(msg.draft_ms) or msg.draft_ms < 0:
        raise invalid(f"draft_ms must be a finite time >= 0, got {msg.draft_ms}")
    if msg.kept > k:
        raise invalid(f"kept {msg.kept} exceeds the block's {k} draft tokens")
    if msg.head_kept > k:
        raise invalid(f"head_kept {msg.head_kept} exceeds the block's {k} draft tokens")
    if not math.isfinite(msg.sprinter_lambda) or msg.sprinter_lambda < 0:
        raise invalid(f"sprinter_lambda must be a finite λ > 0 (0 = 1.0), got {msg.sprinter_lambda}")
    return WireBlock(seq=int(msg.seq), committed_length=int(msg.committed_length), draft_ids=ids, q=q,
                     draft_ms=float(msg.draft_ms), kept=int(msg.kept), head_kept=max(int(msg.head_kept), int(msg.kept)),
                     lam=float(msg.sprinter_lambda) or 1.0)


def encode_labels(labels) -> common_pb2.SprinterLabels:
    """A run's `sprinter.labels.RunLabels` as VerifyResult.sprinter."""
    return common_pb2.SprinterLabels(tp=labels.tp, fn=labels.fn, fp=labels.fp, tn=labels.tn, r=labels.r,
                                     tv_pq_sum=labels.tv_pq_sum, moved_sum=labels.moved_sum)


def decode_labels(msg: common_pb2.SprinterLabels):
    """VerifyResult.sprinter -> `sprinter.labels.RunLabels`."""
    return RunLabels(tp=int(msg.tp), fn=int(msg.fn), fp=int(msg.fp), tn=int(msg.tn), r=int(msg.r),
                     tv_pq_sum=float(msg.tv_pq_sum), moved_sum=float(msg.moved_sum))


# --------------------------------------------------------------------------- draft trees


def check_path(shape, path: Sequence[int], accepted: int, seq: int) -> None:
    """INVALID_ARGUMENT unless VerifyResult.path is a root-down path of `shape` (the block's tree) with
    `accepted` nodes."""
    if len(path) != accepted:
        raise invalid(f"result for block {seq} accepts {accepted} tokens but its path has {len(path)} nodes")
    parent = -1
    for node in path:
        if not 0 <= node < shape.size or shape.parents[node] != parent:
            raise invalid(f"result.path {list(path)} is not a path from the root of block {seq}'s tree "
                          f"({shape.size} nodes, parents {list(shape.parents)})")
        parent = node


def identity_to_proto(identity) -> common_pb2.ModelIdentity:
    """A `models.identity.ModelIdentity` on the wire (None: an empty message, "unknown")."""
    if identity is None:
        return common_pb2.ModelIdentity()
    return common_pb2.ModelIdentity(
        name=identity.name, tokenizer=identity.tokenizer, vocab_size=identity.vocab_size,
        context_length=identity.context_length, eos_ids=list(identity.eos_ids), hidden_size=identity.hidden_size,
        steering=identity.steering, steering_layers=list(identity.steering_layers),
        steering_hidden_size=identity.steering_hidden_size, draft_support=identity.draft_support)


def identity_from_proto(msg: Optional[common_pb2.ModelIdentity]):
    """A ModelIdentity from the wire, or None when the message is unset or empty (an older peer)."""
    if msg is None or not (msg.tokenizer or msg.vocab_size):
        return None
    return ModelIdentity(name=msg.name, tokenizer=msg.tokenizer, vocab_size=int(msg.vocab_size),
                         context_length=int(msg.context_length), eos_ids=tuple(int(e) for e in msg.eos_ids),
                         hidden_size=int(msg.hidden_size), steering=msg.steering,
                         steering_layers=tuple(int(i) for i in msg.steering_layers),
                         steering_hidden_size=int(msg.steering_hidden_size), draft_support=int(msg.draft_support))
