"""The shared byte-level BPE tokenizer of the bundled pair, trained on the corpus train split only.

`python -m steerspec.data.tokenizer --out DIR` trains it and saves a `PreTrainedTokenizerFast`
(`AutoTokenizer.from_pretrained(DIR)` loads it). `<|endoftext|>` is the end-of-text token and the
padding token; it separates files in the training stream.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterable, List, Optional

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from steerspec.data.corpus import DEFAULT_HELDOUT_FRAC, DEFAULT_SEED, CorpusSplit, iter_texts, stdlib_split

EOS = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train a byte-level BPE on `texts`; returns a transformers PreTrainedTokenizerFast."""
    # lazy: transformers takes seconds to import
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        bos_token=None,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(out: Path, split: Optional[CorpusSplit] = None, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train on the train split (both slices) and save to `out`."""
    split = split or stdlib_split()
    tok = train_tokenizer(iter_texts(split, split.train), vocab_size=vocab_size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    meta = {"seed": split.seed, "vocab_size": len(tok), "trained_on": "train split (verifier + drafter slices)"}
    meta.update(split.summary())
    (out / "tokenizer_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return tok


def load_tokenizer(path: Path):
    # lazy: transformers takes seconds to import
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def encode_files(tok, split: CorpusSplit, files: List[str]) -> np.ndarray:
    """Token ids of `files` concatenated, each followed by EOS, as uint16 (vocab < 65536)."""
    eos = tok.convert_tokens_to_ids(EOS)
    texts = list(iter_texts(split, files))
    ids: List[int] = []
    batch = 64
    for start in range(0, len(texts), batch):
        for row in tok(texts[start : start + batch], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--heldout-frac", type=float, default=DEFAULT_HELDOUT_FRAC)
    args = parser.parse_args(argv)
    split = stdlib_split(seed=args.seed, heldout_frac=args.heldout_frac)
    tok = build_tokenizer(args.out, split, vocab_size=args.vocab_size)
    print(f"tokenizer: vocab {len(tok)} -> {args.out} ({split.summary()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
