"""What the in-process benchmark scripts beside this file share: their --seeds / --ks / --trees lists, parsed
with one clear line on bad input, and the pair they measure, loaded once (cached models, tokenizer, EOS ids,
an SD² drafter's steering weights)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple


def parse_lists(args, prog: str) -> Optional[Tuple[List[int], List[int], List[str]]]:
    """(seeds, ks, tree specs normalised) from comma-separated --seeds and --ks ('' for none) and ';'-separated
    --trees; None after printing one line to stderr when one is malformed (the caller exits 2)."""
    from steerspec.decoding.trees import parse_tree

    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        ks = [int(k) for k in args.ks.split(",") if k.strip()]
        trees = [parse_tree(t).spec() for t in args.trees.split(";") if t.strip()]
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    return seeds, ks, trees


@dataclass
class Pair:
    """A verifier and drafter ready for the in-process engines."""

    verifier: Any  # cached (steerspec.models.backends.cached_lm)
    drafter: Any
    tokenizer: Any
    eos: Tuple[int, ...]
    weights: Any  # the drafter's SD² steering weights, or None

    def steering(self):
        """A context giving the SD² hooks for one generation (None for an unsteered drafter)."""
        from steerspec.steering.runtime import SD2Steering

        return SD2Steering(self.drafter, self.weights) if self.weights is not None else contextlib.nullcontext()


def load_pair(verifier_name: str, drafter_name: str, threads: int) -> Pair:
    """Load both models (the verifier's thread count applied), wrap them in KV caches, read the EOS ids and the
    drafter's steering weights."""
    from steerspec.models.backends import cached_lm
    from steerspec.models.loading import apply_threads, eos_token_ids, load_model, load_tokenizer
    from steerspec.models.checkpoints import resolve_model_dir
    from steerspec.steering.runtime import maybe_steering_weights

    verifier, drafter = load_model(verifier_name), load_model(drafter_name)
    tokenizer = load_tokenizer(verifier_name)
    apply_threads(threads, verifier)
    return Pair(cached_lm(verifier), cached_lm(drafter), tokenizer, eos_token_ids(verifier, tokenizer),
                maybe_steering_weights(drafter, resolve_model_dir(drafter_name)))
