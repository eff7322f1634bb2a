"""The block-kind seam proven: a fourth kind, defined only here (one class plus `@register_kind`), runs in process and
through the real services (gRPC on 127.0.0.1) and gives the verifier's greedy output; and no round outside the kind
modules branches on the kind.

The test kind drafts the drafter's argmax for k tokens whatever the session samples with (a block of greedy
drafts), and counts the blocks it drafted and verified, so the test knows the services ran it and not a chain."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from coordinator.local import LocalCluster
from steerspec.blocks.block_kind import register_kind
from steerspec.blocks.block_mode import ModeError, parse_mode
from steerspec.blocks.chain_kind import ChainKind
from steerspec.blocks.kinds import kind_of, known_kinds
from steerspec.decoding.engine import DecodeConfig, RoundOut, autoregressive_generate, draft_block, run_rounds, \
    verify_block
from steerspec.decoding.generation_result import GenerationResult
from steerspec.decoding.rounds import block_k, make_generators
from steerspec.decoding.sampling import SamplingParams
from steerspec.models import load_model, resolve_model_dir
from steerspec.models.backends import as_cached

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[4, 57, 310, 12, 96], [88, 23, 7]]
NEW_TOKENS = 19
GREEDY = DecodeConfig(sampling=SamplingParams(temperature=0.0))


@register_kind
class ArgmaxChain(ChainKind):
    """k argmax drafts per block; verified, cut and committed as a chain."""

    name = "test-argmax"
    drafted = 0
    verified = 0

    def draft(self, drafter, sessions):
        outs = []
        for session in sessions:
            start = time.perf_counter()
            block = draft_block(session.lm, session.committed, drafter.block_length(session), GREEDY)
            outs.append(drafter.output(block, start))
        ArgmaxChain.drafted += len(sessions)
        return outs

    def verify(self, runner, jobs):
        ArgmaxChain.verified += len(jobs)
        return super().verify(runner, jobs)

    def generate(self, verifier, drafter, prompt_ids, config, mode, *, policy=None, steering=None, tokenizer=None,
                 on_round=None, head=None):
        verifier, drafter = as_cached(verifier), as_cached(drafter)
        _, g_verify = make_generators(config.seed, drafter.device, verifier.device)

        def one_round(committed, room, layers):
            t0 = time.perf_counter()
            block = draft_block(drafter, committed, block_k(mode.k, room), GREEDY)
            t1 = time.perf_counter()
            outcome, hidden = verify_block(verifier, committed[-1], block, config, g_verify, layers)
            ArgmaxChain.drafted, ArgmaxChain.verified = ArgmaxChain.drafted + 1, ArgmaxChain.verified + 1
            return RoundOut(block, int(outcome.accepted[0]), int(outcome.next_tokens[0]), hidden, t1 - t0,
                            time.perf_counter() - t1)

        result = GenerationResult(token_ids=[], mode="speculative", prompt_tokens=len(prompt_ids))
        return run_rounds(verifier, drafter, list(prompt_ids), config, result, one_round, steering, None, tokenizer,
                          on_round)


@pytest.fixture(scope="module")
def pair():
    return load_model(resolve_model_dir("verifier")), load_model(resolve_model_dir("pretrained"))


def test_the_test_kind_is_registered_and_parsed_by_name():
    assert "test-argmax" in known_kinds()
    mode = parse_mode(k=3, block_kind="test-argmax")
    assert kind_of(mode) is known_kinds()["test-argmax"] and mode.custom == "test-argmax" and mode.block_limit == 3
    with pytest.raises(ModeError, match="unknown block kind 'nope'"):
        parse_mode(block_kind="nope")
    with pytest.raises(ModeError, match="drafts no tree"):
        parse_mode(block_kind="test-argmax", tree="0,1")


def test_a_kind_defined_in_a_test_runs_in_process(pair):
    verifier, drafter = pair
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    mode = parse_mode(k=3, block_kind="test-argmax")
    before = ArgmaxChain.verified
    for ids in PROMPTS:
        got = kind_of(mode).generate(verifier, drafter, ids, config, mode)
        assert got.token_ids == autoregressive_generate(verifier, ids, config).token_ids
        assert got.generated / got.rounds > 1.0
    assert ArgmaxChain.verified > before


async def test_a_kind_defined_in_a_test_runs_through_the_services(pair):
    """Greedy and sampled sessions alike: the argmax blocks are verified exactly, greedy output is the verifier's."""
    verifier, drafter = pair
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    expected = [autoregressive_generate(verifier, ids, config).token_ids for ids in PROMPTS]
    drafted, verified = ArgmaxChain.drafted, ArgmaxChain.verified
    async with LocalCluster(verifier=verifier, drafter=drafter, tokenizer=None, eos_ids=()) as cluster:
        for ids, want in zip(PROMPTS, expected):
            got = await cluster.generate(ids, max_new_tokens=NEW_TOKENS, k=3, block_kind="test-argmax")
            assert list(got.token_ids) == want
            assert got.generated / got.rounds > 1.0
    assert ArgmaxChain.drafted > drafted and ArgmaxChain.verified > verified


# -- no branch on the kind outside the kind modules ---------------------------------------------------------------
ROUND_MODULES = sorted([ROOT / "coordinator" / "loop.py", *(ROOT / "drafter_service").glob("*.py"),
                        *(ROOT / "verifier_service").glob("*.py")])
KIND_ATTRIBUTES = {"tree", "sprinter", "lossy", "fed", "custom"}  # what told kinds apart before the seam
KIND_NAMES = {"TREE", "CHAIN", "SPRINTER_RUN", "VERIFIER_ALONE", "TreeKind", "ChainKind", "SprinterKind", "AloneKind"}


def _branches(tree: ast.AST):
    """Every expression a branch decides on: if / while / ternary tests, boolean operands, comparisons."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs
        elif isinstance(node, (ast.BoolOp, ast.Compare)):
            yield node


def kind_branches(source: str):
    """The lines of a module's source that branch on the block kind."""
    found = set()
    for test in _branches(ast.parse(source)):
        for node in ast.walk(test):
            if (isinstance(node, ast.Attribute) and node.attr in KIND_ATTRIBUTES) or \
                    (isinstance(node, ast.Name) and node.id in KIND_NAMES):
                found.add(test.lineno)
    return sorted(found)


def test_the_check_finds_the_branches_it_looks_for():
    sample = "if session.tree is None:\n    pass\nx = a if mode.lossy else b\nok = s.mode.kind\n" \
             "y = [j for j in jobs if j.kind is TreeKind]\n"
    assert kind_branches(sample) == [1, 3, 5]


@pytest.mark.parametrize("path", ROUND_MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_round_branches_on_the_block_kind(path):
    source = path.read_text(encoding="utf-8")
    assert [(line, source.splitlines()[line - 1].strip()) for line in kind_branches(source)] == []
