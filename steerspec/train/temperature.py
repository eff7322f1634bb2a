"""`steerspec train temperature`: calibrate a drafter's draft temperature (`models/draft_temperature.py`).

The verifier answers prompts cut from the corpus *train* split at T=1 (never the eval sets); on every answer
position the drafter's raw logits, steered as in training validation for an SD² drafter, are scored at each
temperature of the grid by Σ min(p, q_t) over the top-k plus tail that decoding proposes: the probability
that one draft is accepted. The best t is written into the drafter's config.json (with `--write`), where
`load_model` folds it into the head; `draft_temperature.json` beside it records the grid and the command.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch
from torch import Tensor

from steerspec.decoding.sampling import draft_distribution
from steerspec.errors import UsageError
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.draft_temperature import CONFIG_KEY, check
from steerspec.models.loading import context_length, eos_token_ids, load_model, load_tokenizer
from steerspec.observability.run_record import command_line
from steerspec.steering.runtime import maybe_steering
from steerspec.train.common import progress
from steerspec.train.synth import corpus_prompts
from steerspec.train.teacher_forcing import teacher_forced, verifier_answer

REPORT_NAME = "draft_temperature.json"


def acceptance_by_temperature(p: Tensor, logits: Tensor, temperatures: Sequence[float],
                              top_k: int) -> Dict[float, Tensor]:
    """Per position [N], for each t: Σ min(p, q_t) where q_t is what decoding proposes from logits / t
    (its top `top_k` plus the spread tail, `sampling.draft_distribution`); p [N, V] probabilities,
    logits [N, V] the drafter's raw logits."""
    vocab = logits.shape[-1]
    out: Dict[float, Tensor] = {}
    for t in temperatures:
        q = draft_distribution((logits.float() / float(t)).softmax(-1), top_k).to_dense(vocab)
        out[float(t)] = torch.minimum(p.float(), q).sum(-1)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="smollm2", help="verifier checkpoint dir or bundled name")
    parser.add_argument("--drafter", required=True, help="drafter checkpoint dir or bundled name")
    parser.add_argument("--prompts", type=int, default=48, help="train-split prompts the verifier answers")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="length of each verifier answer")
    parser.add_argument("--grid", default="0.5,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95,1.0,1.1",
                        help="comma-separated temperatures to score (1.0 is always added)")
    parser.add_argument("--draft-top-k", type=int, default=64, help="draft support decoding sends")
    parser.add_argument("--k", type=int, default=4, help="δ cycles through 1..k for a steered drafter")
    parser.add_argument("--seed", type=int, default=1, help="prompt and sampling seed (synth's data used 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--write", action="store_true",
                        help="write the best temperature into the drafter's config.json (and the report beside it)")


def parse_grid(text: str) -> List[float]:
    """The sorted temperatures of --grid, 1.0 included; UsageError naming a bad one."""
    try:
        grid = {check(float(x)) for x in text.split(",") if x.strip()}
    except ValueError as exc:
        raise UsageError(f"--grid: {exc}") from None
    return sorted(grid | {1.0})


def verifier_answers(verifier, tok, n: int, max_new_tokens: int, seed: int) -> List[tuple]:
    """(prompt ids, prompt + answer ids) for `n` train-split prompts, answered by the verifier at T=1."""
    prompts = corpus_prompts(tok, n, 16, 96, seed=seed)
    eos, max_len = eos_token_ids(verifier, tok), context_length(verifier)
    return [(ids, verifier_answer(verifier, ids, max_new_tokens, seed * 1_000_003 + i, eos, max_len))
            for i, ids in enumerate(prompts)]


def calibrate(verifier, drafter, steering, pairs, grid: List[float], top_k: int, k: int) -> Dict[float, float]:
    """Mean Σ min(p, q_t) over every answer position of `pairs`, per temperature t of `grid`."""
    sums = {t: 0.0 for t in grid}
    count = 0
    bar = progress(total=len(pairs), desc="calibrate")
    for i, (ids, seq) in enumerate(pairs):
        if len(seq) > len(ids):
            p, logits = teacher_forced(verifier, drafter, steering, seq, len(ids), i % k + 1)
            for t, acc in acceptance_by_temperature(p, logits, grid, top_k).items():
                sums[t] += float(acc.sum())
            count += int(p.shape[0])
        bar.update(1)
    bar.close()
    if not count:
        raise UsageError("the verifier's answers were all empty; use more --prompts")
    return {t: sums[t] / count for t in grid}


def write_config(drafter_dir: Path, temperature: float) -> None:
    """Set the draft temperature in `drafter_dir`/config.json, keeping every other key as it was."""
    path = drafter_dir / "config.json"
    config = json.loads(path.read_text())
    config[CONFIG_KEY] = temperature
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


CARD_HEADING = "## Draft temperature"


def card_section(report: dict) -> str:
    """The model card's section on the calibration (replaced, not appended, by a later calibration)."""
    acc = report["acceptance"]
    return (f"{CARD_HEADING}\n- t = {report['best']:g}: the head's logits are divided by it at load "
            f"(`models/draft_temperature.py`); Σ min(p, q_t) of one draft {acc['1.0']:.4f} at t = 1 → "
            f"{acc[str(report['best'])]:.4f} ({report['gain_over_1']:+.1%}) over {report['positions']:,} answer positions "
            f"of the verifier's T = 1 answers to train-split prompts\n- made by: `{report['command']}`\n")


def write_card(drafter_dir: Path, report: dict) -> None:
    """Put `card_section` into the drafter's MODEL_CARD.md, when it has one."""
    card = drafter_dir / "MODEL_CARD.md"
    if not card.is_file():
        return
    text = card.read_text()
    if CARD_HEADING in text:
        head, _, rest = text.partition(CARD_HEADING)
        tail = rest.split("\n## ", 1)
        text = head + card_section(report) + (("\n## " + tail[1]) if len(tail) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + card_section(report)
    card.write_text(text)


def run(args: argparse.Namespace) -> int:
    if args.prompts < 1 or args.max_new_tokens < 1 or not 1 <= args.k <= 64 or args.draft_top_k < 1:
        raise UsageError("need --prompts >= 1, --max-new-tokens >= 1, --k in [1, 64] and --draft-top-k >= 1")
    grid = parse_grid(args.grid)
    torch.set_num_threads(max(1, args.threads))
    vdir, ddir = resolve_model_dir(args.verifier), resolve_model_dir(args.drafter)
    verifier, tok = load_model(vdir), load_tokenizer(vdir)
    drafter = load_model(ddir, draft_temperature=False)  # the raw logits: the grid is relative to them
    steering = maybe_steering(drafter, ddir)
    started = time.time()
    pairs = verifier_answers(verifier, tok, args.prompts, args.max_new_tokens, args.seed)
    scores = calibrate(verifier, drafter, steering, pairs, grid, args.draft_top_k, args.k)
    best = max(grid, key=lambda t: (round(scores[t], 6), -abs(t - 1.0)))  # ties go to the plainer t
    report = {"command": command_line("steerspec train temperature", args),
              "verifier": str(vdir), "drafter": str(ddir), "positions": sum(len(s) - len(i) for i, s in pairs),
              "acceptance": {str(t): round(v, 5) for t, v in scores.items()}, "best": best,
              "gain_over_1": round(scores[best] / scores[1.0] - 1.0, 5), "elapsed_s": round(time.time() - started, 1)}
    for t in grid:
        print(f"t={t:<5} Σmin(p, q_t) = {scores[t]:.4f}{'  <- best' if t == best else ''}")
    print(f"best draft temperature {best}: {scores[best]:.4f} against {scores[1.0]:.4f} at t=1 "
          f"({report['gain_over_1']:+.1%}) over {report['positions']} answer positions")
    if args.write:
        (ddir / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
        write_config(ddir, best)
        write_card(ddir, report)
        print(f"wrote {ddir / 'config.json'} and {ddir / REPORT_NAME}")
    else:
        print(json.dumps(report))
    return 0
