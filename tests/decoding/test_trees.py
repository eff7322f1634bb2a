"""Draft trees: the pure tree helpers, the tree-masked KV pass and its compaction, and tree decoding's
output (greedy: the verifier's greedy output, token for token; T = 1: the verifier's distribution)."""

from __future__ import annotations

import pytest
import torch

from steerspec.decoding.engine import DecodeConfig, speculative_generate
from steerspec.models import FastCachedLM, cached_lm, load_model, resolve_model_dir
from steerspec.policies import FixedK
from steerspec.decoding.sampling import SamplingParams
from steerspec.decoding.trees import DEFAULT_TREE, ancestor_mask, chain, greedy_walk, parse_tree
from steerspec.decoding.tree_decoding import tree_generate


def test_parse_orders_breadth_first_and_links_parents():
    shape = parse_tree("00,1,0,000,10")
    assert shape.spec() == "0,1,00,10,000"
    assert shape.parents == (-1, -1, 0, 1, 2) and shape.depths == (1, 1, 2, 2, 3) and shape.ranks == (0, 1, 0, 0, 0)
    assert shape.children(-1) == [0, 1] and shape.ancestors(4) == [0, 2] and shape.depth == 3
    assert parse_tree("default").spec() == parse_tree(DEFAULT_TREE).spec()
    assert chain(3).spec() == "0,00,000"


@pytest.mark.parametrize("spec,fix", [("", "rank paths"), ("0,a", "ranks 0-9"), ("0,11", "needs its parent 1"),
                                      ("0,0", "repeats"), (",".join(str(i) for i in range(10)) + ","
                                       + ",".join(f"{i}{j}" for i in range(10) for j in range(6)), "at most 64")])
def test_a_bad_spec_is_refused_with_the_fix(spec, fix):
    with pytest.raises(ValueError, match=fix):
        parse_tree(spec)


def test_ancestor_mask_and_greedy_walk():
    shape = parse_tree("0,1,00,10,000")
    mask = ancestor_mask(shape, range(5), range(5), with_root=True)
    assert mask.tolist()[4] == [True, True, False, True, False, True]  # root, 0, 00, itself
    assert mask.tolist()[3] == [True, False, True, False, True, False]  # root, 1, itself
    tokens = [7, 8, 9, 5, 6]  # nodes 0, 1, 00, 10, 000
    # the verifier picks 8 (node 1), then 5 (node 10), then 3: two accepted, next token from node 10's row
    argmax = [8, 1, 5, 2, 3, 4]
    assert greedy_walk(shape, tokens, argmax) == ([1, 3], 4)
    assert greedy_walk(shape, tokens, [4, 0, 0, 0, 0, 0]) == ([], 0)  # nothing accepted: the root's choice
    assert greedy_walk(shape, tokens, [7, 9, 0, 6, 0, 2]) == ([0, 2, 4], 5)  # the whole deepest path


@pytest.fixture(scope="module")
def tiny(tiny_pair):
    verifier_dir, drafter_dir = tiny_pair
    return load_model(verifier_dir), load_model(drafter_dir)


def test_a_tree_pass_scores_each_node_as_its_own_chain_and_keep_compacts_the_path(tiny):
    verifier, _ = tiny
    lm = cached_lm(verifier)
    assert isinstance(lm, FastCachedLM)
    prefix, pending = [5, 17, 42, 9, 33], 11
    shape = parse_tree("0,1,00,10,000,11")
    tokens = [21, 22, 23, 24, 25, 26]
    lm.extend(prefix)
    start = lm.length
    among = ancestor_mask(shape, range(shape.size), range(shape.size), with_root=True)
    root = torch.zeros(1, shape.size + 1, dtype=torch.bool)
    root[0, 0] = True
    visible = torch.cat([torch.ones(shape.size + 1, start, dtype=torch.bool), torch.cat([root, among])], dim=1)
    positions = start + torch.tensor((0,) + shape.depths)
    tree_logits = lm.extend_tree([pending] + tokens, positions, visible).logits
    ref = cached_lm(verifier)
    for node in range(shape.size):
        path = [tokens[a] for a in shape.ancestors(node)] + [tokens[node]]
        ref.reset()
        chain_logits = ref.extend(prefix + [pending] + path).logits[-1]
        torch.testing.assert_close(tree_logits[1 + node], chain_logits, atol=1e-4, rtol=1e-4)
    # keep the path 1 -> 10 (nodes 1, 3): the cache is then prefix + pending + those two tokens
    lm.keep(start + 1, [start + 1 + 1, start + 1 + 3])
    assert lm.length == start + 3
    ref.reset()
    expected = ref.extend(prefix + [pending, tokens[1], tokens[3], 7]).logits[-1]
    torch.testing.assert_close(lm.extend([7]).logits[-1], expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cannot keep"):
        lm.keep(2, [1])


@pytest.mark.parametrize("spec", ["default", "0,1,00,000", "0,1,2,3,4,5"])
@pytest.mark.slow
def test_tree_decoding_writes_the_verifiers_greedy_output(loaded_pair, pair_greedy, spec):
    verifier, drafter, _ = loaded_pair
    prompts, config, expected = pair_greedy
    v, d = cached_lm(verifier), cached_lm(drafter)
    accepted = 0
    for ids, want in zip(prompts, expected):
        result = tree_generate(v, d, ids, config, spec)
        assert result.token_ids == want
        accepted += result.accepted
    assert accepted > 0, "no node was ever accepted: the test would prove little"


@pytest.mark.slow
def test_a_chain_tree_is_plain_speculative_decoding(loaded_pair, pair_greedy):
    """The tree 0,00,000 commits exactly what fixed k = 3 commits, block by block."""
    verifier, drafter, _ = loaded_pair
    prompts, config, _ = pair_greedy
    v, d = cached_lm(verifier), cached_lm(drafter)
    for ids in prompts[:6]:
        tree = tree_generate(v, d, ids, config, chain(3))
        plain = speculative_generate(v, d, ids, config, FixedK(3))
        assert tree.token_ids == plain.token_ids and tree.block_accepted == plain.block_accepted


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_a_small_budget_prunes_the_tree_and_stays_exact(loaded_pair, pair_greedy, budget):
    verifier, drafter, _ = loaded_pair
    prompts, config, expected = pair_greedy
    small = DecodeConfig(max_new_tokens=budget, eos_token_ids=config.eos_token_ids, max_length=config.max_length)
    for ids, want in list(zip(prompts, expected))[:4]:
        result = tree_generate(cached_lm(verifier), cached_lm(drafter), ids, small, "default")
        assert result.token_ids == want[:budget]


def test_a_steered_sd2_drafter_stays_exact_on_a_tree():
    from steerspec.decoding.engine import autoregressive_generate
    from steerspec.models import load_tokenizer
    from steerspec.steering.runtime import maybe_steering

    tok = load_tokenizer(resolve_model_dir("verifier"))
    verifier, drafter = cached_lm(load_model("verifier")), cached_lm(load_model("sd2"))
    config = DecodeConfig(max_new_tokens=24, eos_token_ids=(tok.eos_token_id,))
    for text in ("def fibonacci(n):\n", "import os\n\n\ndef main():\n"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        want = autoregressive_generate(verifier, ids, config).token_ids
        with maybe_steering(drafter, resolve_model_dir("sd2")) as steering:
            assert steering is not None
            assert tree_generate(verifier, drafter, ids, config, "default", steering=steering).token_ids == want


def test_the_slow_backend_is_refused(tiny):
    verifier, drafter = tiny
    with pytest.raises(ValueError, match="fast KV backend"):
        tree_generate(cached_lm(verifier, "hf"), cached_lm(drafter, "hf"), [1, 2, 3], DecodeConfig(max_new_tokens=4))


def _cli(capsys, argv):
    from steerspec.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_run_with_a_tree_writes_the_verifiers_greedy_output_and_says_so(capsys):
    import json

    pair = ["--verifier", "verifier", "--drafter", "pretrained", "--max-new-tokens", "20", "--json"]
    code, out, err = _cli(capsys, ["run", "def fibonacci(n):", "--tree", "0,1,00", "--transport", "inproc"] + pair)
    assert code == 0, err
    tree = json.loads(out)
    code, out, err = _cli(capsys, ["run", "def fibonacci(n):", "--mode", "autoregressive", "--transport", "inproc"] + pair)
    assert code == 0, err
    assert tree["token_ids"] == json.loads(out)["token_ids"]
    assert tree["tree"] == "0,1,00" and tree["policy"] is None and tree["rounds"] <= 20


def test_run_with_a_tree_and_block_verification_walks_it_by_traversal(capsys):
    """`--verification block --tree`: in process, the tokens of `tree_generate` with acceptance "block"."""
    import json

    from steerspec.decoding.engine import DecodeConfig
    from steerspec.models import load_model, load_tokenizer, resolve_model_dir
    from steerspec.models.backends import cached_lm
    from steerspec.decoding.sampling import SamplingParams
    from steerspec.decoding.tree_decoding import tree_generate

    argv = ["run", "def fibonacci(n):", "--verifier", "verifier", "--drafter", "pretrained", "--max-new-tokens", "20",
            "--json", "--transport", "inproc", "--tree", "0,1,00", "--verification", "block", "--temperature", "1",
            "--seed", "5"]
    code, out, err = _cli(capsys, argv)
    assert code == 0, err
    got = json.loads(out)
    tokenizer = load_tokenizer(resolve_model_dir("verifier"))
    ids = tokenizer("def fibonacci(n):", add_special_tokens=False)["input_ids"]
    verifier, drafter = (cached_lm(load_model(resolve_model_dir(name))) for name in ("verifier", "pretrained"))
    config = DecodeConfig(max_new_tokens=20, sampling=SamplingParams(temperature=1.0), seed=5,
                          eos_token_ids=tuple(got.get("eos_token_ids") or ()), acceptance="block")
    want = tree_generate(verifier, drafter, ids, config, "0,1,00")
    assert got["token_ids"] == want.token_ids and got["rounds"] == want.rounds
    assert got["verification"] == "block" and got["lossy"] is False


@pytest.mark.parametrize("extra,fix", [
    (["--tree", "0,11"], "needs its parent"),
    (["--tree", "0,1", "--k", "3"], "drop --k, and --policy unless it sizes trees"),
    (["--tree", "0,1", "--mode", "autoregressive"], "--mode speculative"),
    (["--tree", "0,1", "--verification", "sprinter"], "lossless --verification (exact or block)"),
])
def test_run_refuses_a_tree_it_cannot_run_in_one_line(capsys, extra, fix):
    argv = ["run", "def f():", "--verifier", "verifier", "--drafter", "pretrained", "--transport", "inproc"] + extra
    code, out, err = _cli(capsys, argv)
    assert code == 2 and fix in err and len(err.strip().splitlines()) == 1, err


def test_sampled_walk_accepts_by_the_ratio_and_resamples_the_residual():
    """Two children of the root, both token 1, q = (0.5, 0.5, 0), p = (0, 0.25, 0.75): each child is
    accepted with p(1) / q(1) = 1/2 at first, then never (the residual p - q puts no mass on 1), so
    P(accept) = 1/2 and a rejection always ends in token 2."""
    from collections import Counter

    from steerspec.decoding.trees import sampled_walk

    shape = parse_tree("0,1")
    p_rows = torch.tensor([[0.0, 0.25, 0.75], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
    q_at = {-1: torch.tensor([0.5, 0.5, 0.0])}
    g = torch.Generator().manual_seed(0)
    outcomes = Counter()
    for _ in range(2000):
        path, token, row = sampled_walk(shape, [1, 1], p_rows, q_at, g, distinct=False)
        outcomes[(tuple(path), token if not path else "bonus")] += 1
        assert (path == [] and token == 2 and row == 0) or (path == [0] and row == 1)
    assert abs(outcomes[((), 2)] / 2000 - 0.5) < 0.05


@pytest.mark.parametrize("distinct", [True, False])
@pytest.mark.slow
def test_walk_over_three_siblings_gives_exactly_p(distinct):
    """Three children of the root drawn from q (without replacement when `distinct`, by _fill itself),
    the walk's output token (accepted child, or the residual's draw) is distributed as p: chi-square over
    8 tokens, 20,000 trials, q and p far apart (p puts mass where q has none)."""
    from collections import Counter

    from scipy.stats import chisquare

    from steerspec.decoding.sampling import SamplingParams as Params
    from steerspec.decoding.tree_decoding import _fill, dense
    from steerspec.decoding.trees import sampled_walk

    shape = parse_tree("0,1,2")
    q_logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -30.0, -30.0])
    p = torch.tensor([0.05, 0.30, 0.05, 0.20, 0.10, 0.05, 0.15, 0.10])
    p_rows = p.expand(4, 8)
    config = DecodeConfig(sampling=Params(temperature=1.0), draft_top_k=0)
    g = torch.Generator().manual_seed(3)
    counts = Counter()
    n = 20000
    for _ in range(n):
        tokens, q_at = [0, 0, 0], {}
        _fill(shape, -1, q_logits, tokens, q_at, config, g, distinct)
        if distinct:
            assert len(set(tokens)) == 3
        path, token, row = sampled_walk(shape, tokens, p_rows, {-1: dense(q_at[-1])}, g, distinct)
        counts[tokens[path[0]] if path else token] += 1
    observed = [counts[i] for i in range(8)]
    assert chisquare(observed, (p * n).tolist()).pvalue > 1e-3, observed


@pytest.mark.slow
def test_distinct_siblings_accept_more_than_iid_ones():
    """With a peaked q, i.i.d. siblings repeat its top token and add little; drawn without replacement
    they cover the next tokens, so a tree of three siblings accepts a child more often."""
    from steerspec.decoding.sampling import SamplingParams as Params
    from steerspec.decoding.tree_decoding import _fill, dense
    from steerspec.decoding.trees import sampled_walk

    shape = parse_tree("0,1,2")
    q_logits = torch.tensor([4.0, 2.0, 2.0, 0.0, 0.0, 0.0])
    p_rows = torch.tensor([0.2, 0.4, 0.3, 0.05, 0.05, 0.0]).expand(4, 6)
    config = DecodeConfig(sampling=Params(temperature=1.0), draft_top_k=0)
    rates = {}
    for distinct in (True, False):
        g = torch.Generator().manual_seed(0)
        hits = 0
        for _ in range(4000):
            tokens, q_at = [0, 0, 0], {}
            _fill(shape, -1, q_logits, tokens, q_at, config, g, distinct)
            hits += bool(sampled_walk(shape, tokens, p_rows, {-1: dense(q_at[-1])}, g, distinct)[0])
        rates[distinct] = hits / 4000
    assert rates[True] > rates[False] + 0.1, rates


@pytest.mark.slow
def test_sampling_on_a_tree_is_the_verifiers_distribution(loaded_pair, eval_prompts):
    """1,000 samples of the first two tokens at T = 1 through tree decoding (each node's children drawn
    i.i.d. from a sparse top-8 drafter, multi-step speculative sampling): the first token's marginal and
    the pairs match the verifier's exact distribution (chi-square), with acceptances and rejections both
    frequent."""
    from collections import Counter

    from distribution_helpers import P_MIN, first_two_p_values, pick_prompt

    verifier, drafter, tok = loaded_pair
    params = SamplingParams(temperature=1.0)
    ids = pick_prompt(verifier, drafter, tok, eval_prompts, params)
    v, d = cached_lm(verifier), cached_lm(drafter)
    n = 1000
    counts: Counter = Counter()
    accepted = 0
    for seed in range(n):
        config = DecodeConfig(max_new_tokens=2, sampling=params, draft_top_k=8, seed=7919 * seed + 11)
        result = tree_generate(v, d, ids, config, "0,1,2,00,10,000")  # three siblings, depth 3
        counts[tuple(result.token_ids)] += 1
        accepted += result.accepted
    assert 0.05 * n < accepted < 1.9 * n, accepted
    p_first, p_joint = first_two_p_values(verifier, ids, params, counts, n)
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)


@pytest.mark.parametrize("change,tree", [
    ({}, DEFAULT_TREE), ({"k": 3}, None), ({"policy": "latency"}, None), ({"mode": "autoregressive"}, None),
    ({"device": "cuda"}, None), ({"lossy": True}, None), ({"coordinator": "10.0.0.5:50051"}, None),
])
def test_run_drafts_the_default_tree_only_where_one_can_run(change, tree):
    """`steerspec run` without --tree, --policy or --k drafts the default tree on a CPU; --k, --policy,
    autoregressive and lossy runs, and GPUs (trees unmeasured there) keep chains."""
    import argparse

    from steerspec.cli.run import default_tree

    fields = {"verifier": "verifier", "drafter": "pretrained", "policy": None, "k": None, "mode": "speculative",
              "device": "cpu", "tree": None, "coordinator": None, **change}
    lossy = fields.pop("lossy", False)
    args = argparse.Namespace(**fields)
    shape = default_tree(args, lossy)
    assert (shape.spec() if shape else None) == tree and args.tree == tree
