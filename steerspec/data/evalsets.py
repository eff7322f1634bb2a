"""Eval prompt sets, built deterministically from this machine's CPython stdlib.

- `indist`: function/class headers plus their first lines, from the held-out stdlib modules
  (same distribution as training, unseen files);
- `tests`: the same kind of prefix from the stdlib test suite (out of distribution: never trained on);
- `docs`: the opening lines of the `pydoc_data` topics (English prose: out of distribution);
- `fresh` (hand-written, not rebuilt here): Python written for SteerSpec, published nowhere.

A prompt is a natural prefix (ends at the end of a line, without the newline, so the model
continues it) of 20-200 tokens. `python -m steerspec.data.evalsets --out steerspec/assets/eval`
writes one JSONL per set: {"id", "prompt", "source"}.
"""

from __future__ import annotations

import argparse
import ast
import json
import textwrap
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from steerspec.data.corpus import DEFAULT_SEED, list_test_files, read_source, stable_unit, stdlib_root, stdlib_split
from steerspec.data.tokenizer import load_tokenizer

SETS = ("indist", "tests", "docs")
# Hand-written, not generated: `fresh` is Python written for SteerSpec and published nowhere, so no
# pretrained verifier (smollm2) can have seen it.
HAND_WRITTEN_SETS = ("fresh",)
MIN_TOKENS, MAX_TOKENS = 20, 200
TARGET_TOKENS = 40  # grow a prompt line by line until it has at least this many tokens
PER_SET = 64
PER_SOURCE = 2  # at most this many prompts from one file / topic


def assets_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "eval"


def load_eval_set(name: str, directory: Optional[Path] = None) -> List[Dict[str, str]]:
    """The prompts of a bundled eval set, in file order."""
    if name not in SETS + HAND_WRITTEN_SETS:
        raise ValueError(f"unknown eval set {name!r}; expected one of {SETS + HAND_WRITTEN_SETS}")
    path = Path(directory or assets_dir()) / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _grow(lines: List[str], count_tokens: Callable[[str], int], max_lines: int) -> Optional[str]:
    """Smallest prefix of `lines` (>= 2 lines) with >= TARGET_TOKENS tokens, within bounds."""
    for n in range(2, max_lines + 1):
        text = textwrap.dedent("\n".join(lines[:n])).rstrip()
        tokens = count_tokens(text)
        if tokens > MAX_TOKENS:
            return None
        if tokens >= TARGET_TOKENS:
            return text
    text = textwrap.dedent("\n".join(lines[:max_lines])).rstrip()
    return text if MIN_TOKENS <= count_tokens(text) <= MAX_TOKENS else None


def code_prompts(root: Path, rel: str, count_tokens, tests_only: bool = False) -> Iterator[Tuple[str, str]]:
    """(source, prompt) for each def/class in a file: the header plus its first lines.

    The prompt stops at least 3 lines before the end of the definition, so there is real code to continue.
    """
    text = read_source(root, rel)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if tests_only and not (isinstance(node, ast.ClassDef) or node.name.startswith("test")):
            continue
        start = node.lineno - 1
        room = node.end_lineno - start - 3
        if room < 2:
            continue
        prompt = _grow(lines[start:], count_tokens, min(room, 12))
        if prompt and prompt.strip():
            yield f"{rel}:{node.lineno}", prompt


def doc_prompts(root: Path, count_tokens) -> Iterator[Tuple[str, str]]:
    """(source, prompt) from pydoc_data's topics: the first lines of each topic, and of its second paragraph."""
    rel = "pydoc_data/topics.py"
    tree = ast.parse(read_source(root, rel))
    topics: Dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
    for name in sorted(topics):
        lines = topics[name].splitlines()
        starts = [0] + [i + 1 for i, line in enumerate(lines[:-1]) if not line.strip() and lines[i + 1].strip()]
        for para, start in enumerate(starts[:3]):
            body = lines[start:]
            while body and not body[0].strip():
                body = body[1:]
            if len(body) < 4:
                continue
            prompt = _grow(body, count_tokens, min(len(body) - 2, 10))
            if prompt:
                yield f"{rel}:{name}#{para}", prompt


def select(name: str, candidates: Iterator[Tuple[str, str]], seed: int, per_set: int) -> List[Dict[str, str]]:
    """A seeded, stable choice of `per_set` prompts, at most PER_SOURCE per file/topic."""
    ranked = sorted(candidates, key=lambda c: (stable_unit(seed, f"{name}:{c[0]}"), c[0]))
    chosen, per_file = [], {}
    for source, prompt in ranked:
        key = source.split(":")[0] + (source.split(":")[1].split("#")[0] if name == "docs" else "")
        if per_file.get(key, 0) >= PER_SOURCE:
            continue
        per_file[key] = per_file.get(key, 0) + 1
        chosen.append((source, prompt))
        if len(chosen) == per_set:
            break
    return [{"id": f"{name}-{i:03d}", "prompt": p, "source": s} for i, (s, p) in enumerate(chosen)]


def build_eval_sets(tokenizer, seed: int = DEFAULT_SEED, per_set: int = PER_SET, root: Optional[Path] = None):
    """{set name: list of prompt records}."""
    root = Path(root) if root is not None else stdlib_root()

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    split = stdlib_split(seed=seed, root=root)

    def indist():
        for rel in split.heldout:
            yield from code_prompts(root, rel, count_tokens)

    def tests():
        for rel in list_test_files(root):
            if rel.rsplit("/", 1)[-1].startswith("test"):
                yield from code_prompts(root, rel, count_tokens, tests_only=True)

    return {
        "indist": select("indist", indist(), seed, per_set),
        "tests": select("tests", tests(), seed, per_set),
        "docs": select("docs", doc_prompts(root, count_tokens), seed, per_set),
    }


def write_eval_sets(sets: Dict[str, List[Dict[str, str]]], out: Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, records in sets.items():
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the indist/tests/docs eval prompt sets (JSONL).")
    parser.add_argument("--out", type=Path, default=assets_dir())
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer directory (the bundled BPE)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--per-set", type=int, default=PER_SET)
    args = parser.parse_args(argv)
    sets = build_eval_sets(load_tokenizer(args.tokenizer), seed=args.seed, per_set=args.per_set)
    write_eval_sets(sets, args.out)
    for name, records in sets.items():
        print(f"{name}: {len(records)} prompts -> {args.out / (name + '.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
