"""What a model serves, by content: a tokenizer fingerprint and the shapes a session depends on.

Services report a `ModelIdentity` (in their stats, their registry entry and the session handshake) so
that a coordinator, a drafter and a verifier that would not agree on token ids refuse to pair instead
of printing garbage. Names are for people and never compared: the same model named by bundled name
or by directory, loaded in float32 or bfloat16, has one identity; a tokenizer of the same size with a
permuted vocabulary has another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.loading import load_tokenizer
from steerspec.models.smollm2 import sha256
from steerspec.steering.io import WEIGHTS_FILE, load_steering_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# the parts of a fast tokenizer's serialisation that change how text maps to ids and back
TOKENIZER_SECTIONS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class ModelIdentity:
    """One service's model as sessions see it (0 / "" / () = not known or not applicable)."""

    name: str = ""                       # what the operator named it: shown in messages, never compared
    tokenizer: str = ""                  # sha256 of the tokenizer's canonical content (tokenizer_fingerprint)
    vocab_size: int = 0                  # token ids the model scores (config.vocab_size)
    context_length: int = 0              # max_position_embeddings
    eos_ids: Tuple[int, ...] = ()        # generation config's end-of-sequence ids
    hidden_size: int = 0
    steering: str = ""                   # sha256 of the SD² checkpoint whose head (verifier) or W_s (drafter) runs
    steering_layers: Tuple[int, ...] = ()  # verifier layers the SD² head reads (the drafter's: trained against)
    steering_hidden_size: int = 0        # the verifier hidden size the SD² weights are shaped for
    draft_support: int = 0               # drafter: ids it can draft (a reduced head's support; else vocab_size)

    @property
    def known(self) -> bool:
        return bool(self.tokenizer or self.vocab_size)

    def label(self) -> str:
        """'NAME (tokenizer 1a2b3c4d, vocab N)' for messages."""
        parts = [f"tokenizer {self.tokenizer[:8]}" if self.tokenizer else "tokenizer unknown"]
        if self.vocab_size:
            parts.append(f"vocab {self.vocab_size}")
        return f"'{self.name or '?'}' ({', '.join(parts)})"

    def to_dict(self) -> Dict[str, object]:
        out = asdict(self)
        for key in ("eos_ids", "steering_layers"):
            out[key] = list(out[key])
        return out

    @classmethod
    def from_dict(cls, data: Optional[dict]) -> Optional["ModelIdentity"]:
        """The identity a registry entry carries, or None when it has none."""
        if not isinstance(data, dict):
            return None
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for key in ("eos_ids", "steering_layers"):
            known[key] = tuple(int(x) for x in known.get(key, ()) or ())
        try:
            return cls(**known)
        except TypeError:
            return None


# ---------------------------------------------------------------------------------------------- fingerprints
def _canonical_merges(merges) -> list:
    """BPE merges as [a, b] pairs whichever way this tokenizers version serialises them ("a b" or [a, b])."""
    return [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges or []]


def tokenizer_content(tokenizer) -> Dict[str, object]:
    """The canonical content of a transformers tokenizer: vocabulary, merges, added and special tokens."""
    content: Dict[str, object] = {}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        data = json.loads(backend.to_str())
        for section in TOKENIZER_SECTIONS:
            content[section] = data.get(section)
        model = content.get("model")
        if isinstance(model, dict) and "merges" in model:
            model = dict(model, merges=_canonical_merges(model["merges"]))
            content["model"] = model
    else:  # a slow (Python) tokenizer: its vocabulary, in id order
        vocab = tokenizer.get_vocab()
        content["vocab"] = sorted(((int(i), str(t)) for t, i in vocab.items()))
    content["special"] = {name: _token_id(tokenizer, name) for name in SPECIAL_TOKENS}
    return content


def _token_id(tokenizer, name: str) -> Optional[int]:
    value = getattr(tokenizer, f"{name}_id", None)
    return int(value) if isinstance(value, int) else None


def digest(content: object) -> str:
    """sha256 of `content` serialised canonically (sorted keys, no whitespace)."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's canonical content ("" for None)."""
    return "" if tokenizer is None else digest(tokenizer_content(tokenizer))


def has_tokenizer(path: Union[str, Path]) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_dir(model_dir: Union[str, Path]) -> Optional[Path]:
    """Where a checkpoint's tokenizer lives: beside it, else (a reduced drafter) its verifier's; None if neither."""
    path = Path(model_dir)
    if has_tokenizer(path):
        return path
    config = path / "config.json"
    if config.is_file():
        reduced = json.loads(config.read_text()).get("steerspec_reduced")
        if isinstance(reduced, dict) and reduced.get("verifier"):
            verifier = resolve_model_dir(str(reduced["verifier"]))
            return verifier if has_tokenizer(verifier) else None
    return None


def config_eos(path: Union[str, Path], tokenizer=None) -> Tuple[int, ...]:
    """EOS ids of a checkpoint directory: its generation config, else its config, else the tokenizer's."""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (int(tokenizer.eos_token_id),)
    return ()


def describe(name: Union[str, Path], tokenizer=None, *, steering_dir: Union[str, Path, None] = None,
             role: str = "verifier") -> ModelIdentity:
    """The identity of a bundled name or checkpoint directory (its tokenizer loaded unless given), serving as
    `role` ("verifier" or "drafter"); `steering_dir`: the SD² checkpoint whose head or W_s it runs."""
    path = resolve_model_dir(name)
    config = json.loads((path / "config.json").read_text())
    if tokenizer is None:
        source = tokenizer_dir(path)
        tokenizer = load_tokenizer(source) if source is not None else None
    eos = config_eos(path, tokenizer)
    vocab = int(config.get("vocab_size") or 0)
    reduced = config.get("steerspec_reduced")
    support = int(reduced.get("support_size", 0)) if isinstance(reduced, dict) else 0
    steering = steering_fields(steering_dir)
    return ModelIdentity(name=str(name), tokenizer=tokenizer_fingerprint(tokenizer), vocab_size=vocab,
                         context_length=int(config.get("max_position_embeddings") or 0), eos_ids=eos,
                         hidden_size=int(config.get("hidden_size") or 0),
                         draft_support=(support or vocab) if role == "drafter" else 0,
                         **steering)


def describe_model(model, name: str = "", *, steering=None, role: str = "verifier") -> ModelIdentity:
    """The identity of a loaded model (from the directory it was loaded from, else its config alone).

    `steering`: the SD² module it runs (a verifier's head, a drafter's W_s), loaded by `steering.load_steering`."""
    steering_dir = getattr(steering, "checkpoint", None)
    path = Path(str(getattr(model, "name_or_path", "") or ""))
    if str(path) and (path / "config.json").is_file():
        found = _described(str(path), steering_dir, role, _stamp(path), _stamp(steering_dir))
        return replace(found, name=name or str(path))
    config = model.config
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    return ModelIdentity(name=name, vocab_size=vocab, hidden_size=hidden,
                         context_length=int(getattr(config, "max_position_embeddings", 0) or 0),
                         draft_support=vocab if role == "drafter" else 0,
                         **steering_fields(steering_dir))


@lru_cache(maxsize=64)
def _described(path: str, steering_dir: Optional[str], role: str, *stamps) -> ModelIdentity:
    """`describe`, once per directory content (`stamps`): services and tests start many replicas of one model."""
    return describe(path, steering_dir=steering_dir, role=role)


def _stamp(directory: Union[str, Path, None]) -> Tuple[Tuple[str, int, int], ...]:
    """(name, mtime, size) of a directory's files: a changed checkpoint is described afresh."""
    if directory is None or not Path(directory).is_dir():
        return ()
    return tuple(sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in Path(directory).iterdir()
                        if f.is_file()))


def steering_fields(steering_dir: Union[str, Path, None]) -> Dict[str, object]:
    """The steering part of an identity from an SD² checkpoint directory (empty without one)."""
    if steering_dir is None:
        return {}

    d = Path(steering_dir)  # loaded by `steering.load_steering`, which needs both of its files
    config = load_steering_config(d)
    return {"steering": sha256(d / WEIGHTS_FILE),
            "steering_layers": tuple(int(i) for i in config.verifier_layers),
            "steering_hidden_size": int(config.verifier_hidden_size)}


# ---------------------------------------------------------------------------------------------- agreement
def tokenizer_differences(verifier: ModelIdentity, other: ModelIdentity, role: str) -> List[str]:
    """How `other`'s (a coordinator's or drafter's) token ids differ from the verifier's; [] when they agree
    or a side does not know."""
    out: List[str] = []
    if verifier.tokenizer and other.tokenizer and verifier.tokenizer != other.tokenizer:
        out.append(f"tokenizer {other.tokenizer[:12]} != the verifier's {verifier.tokenizer[:12]} "
                   "(another vocabulary, merges or special tokens)")
    if role == "drafter" and verifier.vocab_size and other.vocab_size > verifier.vocab_size:
        out.append(f"vocabulary of {other.vocab_size} ids > the verifier's {verifier.vocab_size}")
    elif role != "drafter" and verifier.vocab_size and other.vocab_size and other.vocab_size != verifier.vocab_size:
        out.append(f"vocabulary of {other.vocab_size} ids != the verifier's {verifier.vocab_size}")
    return out


def steering_differences(verifier: ModelIdentity, drafter: ModelIdentity) -> List[str]:
    """Why the drafter's SD² weights cannot read the verifier's steering vectors; [] when they pair."""
    if not verifier.steering:
        return ["the verifier runs no SD² steering head"]
    if not drafter.steering:
        return ["the drafter has no SD² steering weights"]
    out: List[str] = []
    if drafter.steering_hidden_size and verifier.hidden_size and drafter.steering_hidden_size != verifier.hidden_size:
        out.append(f"steering shaped for hidden size {drafter.steering_hidden_size}, the verifier's is "
                   f"{verifier.hidden_size}")
    if drafter.steering_layers and verifier.steering_layers and drafter.steering_layers != verifier.steering_layers:
        out.append(f"steering trained on verifier layers {list(drafter.steering_layers)}, the verifier's head reads "
                   f"{list(verifier.steering_layers)}")
    if not out and drafter.steering != verifier.steering:
        out.append(f"the verifier's SD² head ({verifier.steering[:12]}) and the drafter's steering "
                   f"({drafter.steering[:12]}) come from different checkpoints")
    return out


def pair_differences(verifier: ModelIdentity, drafter: ModelIdentity, steering: bool = False) -> List[str]:
    """Everything that keeps `drafter` from drafting for `verifier` (steering: for a steered session)."""
    out = tokenizer_differences(verifier, drafter, "drafter")
    if steering:
        out += steering_differences(verifier, drafter)
    return out


def compatible(verifier: Optional[ModelIdentity], other: Optional[ModelIdentity], role: str,
               steering: bool = False) -> bool:
    """True when nothing known keeps the two apart (an unknown identity is not a mismatch)."""
    if verifier is None or other is None:
        return True
    if role == "drafter":
        return not pair_differences(verifier, other, steering)
    return not tokenizer_differences(verifier, other, role)


def mismatch_message(verifier: ModelIdentity, other: ModelIdentity, role: str, differences: Sequence[str],
                     fix: str) -> str:
    """One line naming both sides, what differs and the fix."""
    return (f"the {role}'s model {other.label()} does not match the verifier's {verifier.label()}: "
            f"{'; '.join(differences)}. {fix}")


DRAFTER_FIX = ("Use a drafter of the verifier's model (same tokenizer): smollm2-sd2 or smollm2-pretrained for "
               "verifier smollm2, pretrained or sd2 for verifier verifier, or one trained on your verifier")
STEERING_FIX = ("Serve the verifier with --steering-head pointing at the drafter's SD² checkpoint directory, or the "
                "drafter with --steering off, or open sessions with steering=false")


def drafter_fix(differences: Sequence[str]) -> str:
    """The fix for a drafter that does not pair: another drafter, or matching SD² weights."""
    return STEERING_FIX if all("steering" in d or "SD²" in d for d in differences) else DRAFTER_FIX

