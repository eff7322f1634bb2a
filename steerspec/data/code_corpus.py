"""The code corpus for the smollm2 drafters: Python sources available offline on every machine.

Sources: the standard library (its test packages left out, so the `tests` eval set stays unseen)
and the `.py` files of installed packages (site-packages of this interpreter). Files are
deduplicated by content hash and split by file: the stdlib files in `corpus.py`'s held-out split
(where the `indist` prompts come from) stay held out, and a seeded hash of the content puts ~5% of
the package files there too. Nothing is written to the repository: token arrays go to a cache dir.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from steerspec.data.corpus import (
    DEFAULT_SEED,
    all_py_files,
    is_excluded,
    read_source,
    stable_unit,
    stdlib_root,
    stdlib_split,
)

PACKAGE_HELDOUT_FRAC = 0.05
MAX_FILE_CHARS = 200_000  # generated tables and vendored blobs teach nothing about code


@dataclass(frozen=True)
class CodeFile:
    """One deduplicated source file: where it came from, its split and its text."""

    origin: str
    split: str  # "train" | "heldout"
    text: str


def site_packages_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _package_files(root: Path) -> List[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if any(p in ("tests", "test", "__pycache__") for p in parts[:-1]) or parts[0].endswith(".dist-info"):
            continue
        out.append(rel)
    return out


def package_manifest(root: Path) -> List[str]:
    """`name==version` of every distribution installed under `root`, sorted: what a corpus built from
    `root` holds, recorded so that a rebuild can tell whether it read the same packages."""
    found = {f"{dist.metadata['Name']}=={dist.version}" for dist in metadata.distributions(path=[str(root)])
             if dist.metadata['Name']}
    return sorted(found, key=str.lower)


def iter_code_files(seed: int = DEFAULT_SEED, include_packages: bool = True,
                    stdlib: Optional[Path] = None, packages: Optional[Path] = None) -> Iterator[CodeFile]:
    """Every usable source file once (first occurrence of each content wins), with its split."""
    seen = set()
    root = Path(stdlib) if stdlib is not None else stdlib_root()
    split = stdlib_split(seed=seed, root=root)
    heldout = set(split.heldout)
    sources: List[Tuple[str, Path, Sequence[str]]] = [("stdlib", root, [r for r in all_py_files(root) if not is_excluded(r)])]
    if include_packages:
        proot = Path(packages) if packages is not None else site_packages_root()
        sources.append(("site", proot, _package_files(proot)))
    for kind, base, files in sources:
        for rel in files:
            text = read_source(base, rel)
            if not text.strip() or len(text) > MAX_FILE_CHARS:
                continue
            digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            if kind == "stdlib":
                part = "heldout" if rel in heldout else "train"
            else:
                part = "heldout" if stable_unit(seed, "code:" + digest) < PACKAGE_HELDOUT_FRAC else "train"
            yield CodeFile(origin=f"{kind}:{rel}", split=part, text=text)


def build_token_arrays(tokenizer, out_dir: Path, seed: int = DEFAULT_SEED, max_train_chars: int = 40_000_000,
                       max_heldout_chars: int = 2_000_000, eos_id: int = 0, stdlib: Optional[Path] = None,
                       packages: Optional[Path] = None) -> dict:
    """Tokenise the corpus into `train.npy` / `heldout.npy` (uint16, files joined by EOS) under out_dir, and
    write `summary.json` beside them: the counts, the Python whose library it read and the packages."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    buffers = {"train": [], "heldout": []}
    chars = {"train": 0, "heldout": 0}
    limits = {"train": max_train_chars, "heldout": max_heldout_chars}
    files = {"train": 0, "heldout": 0}
    # Interleave by a seeded order so a character cap keeps a mix of stdlib and packages.
    packages = Path(packages) if packages is not None else site_packages_root()
    all_files = sorted(iter_code_files(seed=seed, stdlib=stdlib, packages=packages), key=lambda f: stable_unit(seed, "order:" + f.origin))
    for item in all_files:
        if chars[item.split] >= limits[item.split]:
            continue
        ids = tokenizer(item.text, add_special_tokens=False)["input_ids"]
        buffers[item.split].append(np.asarray(ids + [eos_id], dtype=np.uint16))
        chars[item.split] += len(item.text)
        files[item.split] += 1
    summary = {}
    for part, chunks in buffers.items():
        arr = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
        np.save(out_dir / f"{part}.npy", arr)
        summary[part] = {"files": files[part], "chars": chars[part], "tokens": int(arr.size)}
    summary["stdlib"] = f"Python {platform.python_version()}" if stdlib is None else str(stdlib)
    summary["packages"] = package_manifest(packages)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
