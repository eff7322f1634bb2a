"""The wire codec: fp16 sparse distributions decode identically on both sides; validation; tensors."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import torch

from steerspec.serving import wire
from steerspec.decoding.sampling import SamplingParams, SparseDist, probs_from_logits, sample_sparse, truncate_top_k
from steerspec.v1 import common_pb2

VOCAB = 500


def drafter_dist(k=8, support=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k, VOCAB, generator=gen) * 3
    return truncate_top_k(probs_from_logits(logits, 1.0), support)


def test_fp16_roundtrip_is_what_the_verifier_decodes_bit_for_bit():
    dist = drafter_dist()
    # the drafter quantises one position at a time, the verifier decodes the whole block at once
    rows = [wire.fp16_roundtrip(SparseDist(dist.ids[i : i + 1], dist.probs[i : i + 1]), VOCAB) for i in range(8)]
    drafter_probs = torch.cat([r.probs for r in rows])
    drafter_floor = torch.cat([r.floor for r in rows])
    drafts = dist.ids[:, 0].numpy()
    msg = wire.encode_block(3, 17, drafts.tolist(), SparseDist(dist.ids, drafter_probs), draft_ms=1.5)
    decoded = wire.decode_block(common_pb2.DraftBlock.FromString(msg.SerializeToString()), VOCAB, greedy=False)
    assert decoded.seq == 3 and decoded.committed_length == 17 and decoded.k == 8 and decoded.draft_ms == 1.5
    assert torch.equal(decoded.q.ids, dist.ids)
    assert torch.equal(decoded.q.probs, drafter_probs), "drafter and verifier must use the identical q"
    assert torch.equal(decoded.q.floor, drafter_floor)
    assert torch.allclose(decoded.q.to_dense(VOCAB).sum(-1), torch.ones(8))
    assert torch.allclose(decoded.q.probs, dist.probs, atol=1e-3)
    # re-encoding the decoded distribution gives the same bytes (fp16 round trip is idempotent)
    assert wire.encode_sparse(decoded.q.ids, decoded.q.probs).probs == msg.q.probs


def test_sampling_from_the_wire_distribution_is_seeded():
    dist = wire.fp16_roundtrip(drafter_dist(k=1), VOCAB)
    a = [int(sample_sparse(dist, torch.Generator().manual_seed(5))) for _ in range(3)]
    assert len(set(a)) == 1 and a[0] in dist.ids[0].tolist()


def test_greedy_block_is_ids_only_and_small():
    msg = wire.encode_block(1, 10, [4, 5, 6, 7, 8, 9, 10, 11])
    assert not msg.HasField("q")
    assert msg.ByteSize() < 40
    block = wire.decode_block(msg, VOCAB, greedy=True)
    assert block.q is None and block.draft_ids.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_sprinter_block_fields_and_labels_round_trip():
    from steerspec.sprinter.labels import RunLabels

    msg = wire.encode_block(1, 10, [4, 5, 6])
    msg.kept, msg.head_kept, msg.sprinter_lambda = 2, 3, 1.2
    block = wire.decode_block(msg, VOCAB, greedy=True)
    assert (block.kept, block.head_kept, block.lam) == (2, 3, 1.2)
    msg.head_kept, msg.sprinter_lambda = 0, 0.0  # an older drafter: the kept tokens, lambda 1
    block = wire.decode_block(msg, VOCAB, greedy=True)
    assert (block.head_kept, block.lam) == (2, 1.0)
    for field, value, words in (("head_kept", 4, "head_kept 4 exceeds"), ("sprinter_lambda", -1.0, "sprinter_lambda"),
                                ("sprinter_lambda", math.nan, "sprinter_lambda")):
        bad = common_pb2.DraftBlock()
        bad.CopyFrom(msg)
        setattr(bad, field, value)
        with pytest.raises(wire.ProtocolError, match=words) as info:
            wire.decode_block(bad, VOCAB, greedy=True)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    labels = RunLabels(tp=3, fn=1, fp=2, tn=0, r=1, tv_pq_sum=0.1234567891234, moved_sum=0.75)
    sent = common_pb2.SprinterLabels.FromString(wire.encode_labels(labels).SerializeToString())
    assert wire.decode_labels(sent) == labels and labels.labelled == 6


def test_sampling_block_fits_4kb_at_k8_top64():
    dist = drafter_dist()
    msg = wire.encode_block(1, 100, dist.ids[:, 0].tolist(), dist, draft_ms=2.0)
    assert msg.ByteSize() <= 4096


def test_decoding_is_vectorised_fast_enough():
    import time

    dist = drafter_dist()
    msg = wire.encode_block(1, 100, dist.ids[:, 0].tolist(), dist)
    start = time.perf_counter()
    for _ in range(50):
        wire.decode_block(msg, VOCAB, greedy=False)
    assert (time.perf_counter() - start) / 50 < 0.01  # generous bound for a loaded CI host


@pytest.mark.parametrize("temperature,top_k,top_p,ok", [
    (0.0, 0, 1.0, True), (0.7, 40, 0.9, True), (1.0, 0, 0.0, True),  # top_p 0 = unset = off
    (-0.1, 0, 1.0, False), (float("nan"), 0, 1.0, False), (float("inf"), 0, 1.0, False),
    (101.0, 0, 1.0, False), (1.0, 0, 1.5, False), (1.0, 0, -0.2, False), (1.0, 0, float("nan"), False),
    (1.0, VOCAB + 1, 1.0, False),
])
def test_sampling_params_validation(temperature, top_k, top_p, ok):
    msg = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if ok:
        params = wire.sampling_from_proto(msg, VOCAB)
        assert params.top_p == (top_p or 1.0)
        back = wire.sampling_from_proto(wire.sampling_to_proto(params), VOCAB)
        assert back == params
    else:
        with pytest.raises(wire.ProtocolError) as info:
            wire.sampling_from_proto(msg, VOCAB)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling" in info.value.message


def test_absent_sampling_means_greedy():
    assert wire.sampling_from_proto(None) == SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_tensor_roundtrip(dtype):
    t = torch.randn(3, 16)
    msg = wire.tensor_to_proto(t, dtype)
    assert msg.dtype == dtype and list(msg.shape) == [3, 16]
    back = wire.tensor_from_proto(common_pb2.Tensor.FromString(msg.SerializeToString()), size=48)
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    assert back.dtype == torch.float32
    assert torch.equal(back, t.to(torch_dtype).float())


@pytest.mark.parametrize("msg,fragment", [
    (common_pb2.Tensor(data=b"\0" * 8, dtype="int8", shape=[8]), "dtype"),
    (common_pb2.Tensor(data=b"\0" * 8, dtype="float16", shape=[]), "shape"),
    (common_pb2.Tensor(data=b"\0" * 6, dtype="float16", shape=[8]), "bytes"),
    (common_pb2.Tensor(data=b"\0" * 8, dtype="float16", shape=[2, 2]), "expected 8"),
    (common_pb2.Tensor(data=np.array([np.nan] * 8, "<f2").tobytes(), dtype="float16", shape=[8]), "NaN"),
])
def test_tensor_validation(msg, fragment):
    with pytest.raises(wire.ProtocolError) as info:
        wire.tensor_from_proto(msg, size=8)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.message


def _q(ids, probs):
    return common_pb2.SparseDistribution(ids=ids, probs=np.asarray(probs, "<f2").tobytes(), support=len(ids))


@pytest.mark.parametrize("ids,probs,drafts,fragment", [
    ([1, 2], [0.5, 0.5], [1], None),
    ([1, 1], [0.5, 0.5], [1], "repeats"),
    ([1, VOCAB], [0.5, 0.5], [1], "vocabulary"),
    ([1, -2], [0.5, 0.5], [1], "negative"),
    ([1, 2], [float("nan"), 0.5], [1], "NaN"),
    ([1, 2], [math.inf, 0.5], [1], "NaN or infinity"),
    ([1, 2], [-0.5, 0.5], [1], "negative probability"),
    ([1, 2], [0.0, 0.0], [1], "no probability mass"),
    ([1, 2], [0.0, 1.0], [1], "probability 0"),
    ([1, 2], [0.5, 0.5], [3], "probability 0"),
])
def test_sparse_validation(ids, probs, drafts, fragment):
    block = common_pb2.DraftBlock(seq=1, committed_length=3, draft_ids=drafts, q=_q(ids, probs))
    if fragment is None:
        assert wire.decode_block(block, VOCAB, greedy=False).q.probs.tolist() == [[0.5, 0.5]]
        return
    with pytest.raises(wire.ProtocolError) as info:
        wire.decode_block(block, VOCAB, greedy=False)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.message


@pytest.mark.slow
def test_a_row_below_one_spreads_its_tail_so_unlisted_drafts_are_valid():
    q = wire.encode_sparse(torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.25]]))
    msg = common_pb2.DraftBlock(seq=1, committed_length=5, draft_ids=[7], q=q)
    block = wire.decode_block(msg, VOCAB, greedy=False)
    assert torch.equal(block.q.prob_of(torch.tensor([7])), torch.tensor([0.25 / (VOCAB - 2)], dtype=torch.float32))
    assert block.q.prob_of(torch.tensor([2])).tolist() == [0.25]
    torch.testing.assert_close(block.q.to_dense(VOCAB).sum(-1), torch.ones(1))
