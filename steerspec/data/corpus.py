"""The training corpus every machine has: the CPython standard library's own source.

Files are found at run time under `sysconfig.get_paths()["stdlib"]`. Test packages, `pydoc_data`
and installed third-party packages are left out of training. Files are split (by file, never by
line) with a seeded SHA-256 of the relative path, so the split is stable across machines and runs:

- held-out: ~`heldout_frac` of the files (the `indist` eval prompts and held-out losses come from here);
- train: the rest, cut again into two disjoint slices, `verifier` and `drafter`, so the drafter is
  pretrained on different text than the verifier, like an independently pretrained drafter.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# Directory names excluded anywhere in the relative path.
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
EXCLUDED_DIRS = frozenset({"pydoc_data", "site-packages", "dist-packages", "__pycache__"}) | TEST_DIRS
DEFAULT_SEED = 1234
DEFAULT_HELDOUT_FRAC = 0.1
ROLES = ("verifier", "drafter")


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stable_unit(seed: int, key: str) -> float:
    """A number in [0, 1) from SHA-256 of `seed:key` (stable everywhere, unlike hash())."""
    digest = hashlib.sha256(f"{seed}:{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_excluded(rel: str) -> bool:
    """True for paths in test packages, pydoc_data, installed packages or caches."""
    parts = rel.split("/")
    return any(part in EXCLUDED_DIRS for part in parts[:-1])


def is_test_file(rel: str) -> bool:
    """True for files inside one of the stdlib's test packages (Lib/test, */tests, idle_test)."""
    return any(part in TEST_DIRS for part in rel.split("/")[:-1]) and not any(
        part in ("site-packages", "dist-packages") for part in rel.split("/")
    )


def all_py_files(root: Path) -> List[str]:
    """All *.py under root (sorted relative posix paths), never descending into installed packages."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        out.extend(prefix + name for name in filenames if name.endswith(".py"))
    return sorted(out)


def list_source_files(root: Optional[Path] = None) -> List[str]:
    """Relative posix paths of the corpus files (sorted), exclusions applied."""
    root = Path(root) if root is not None else stdlib_root()
    return [rel for rel in all_py_files(root) if not is_excluded(rel)]


def list_test_files(root: Optional[Path] = None) -> List[str]:
    """Relative posix paths of the stdlib test-suite files (sorted): out-of-distribution text."""
    root = Path(root) if root is not None else stdlib_root()
    return [rel for rel in all_py_files(root) if is_test_file(rel)]


def read_source(root: Path, rel: str) -> str:
    """A file's text (undecodable bytes replaced); empty string when unreadable."""
    try:
        return (Path(root) / rel).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


@dataclass
class CorpusSplit:
    """Relative file paths per split; `train` = verifier slice + drafter slice (disjoint)."""

    root: Path
    seed: int
    heldout: List[str] = field(default_factory=list)
    train_slices: Dict[str, List[str]] = field(default_factory=dict)

    @property
    def train(self) -> List[str]:
        return sorted(self.train_slices["verifier"] + self.train_slices["drafter"])

    def files_for(self, role: str) -> List[str]:
        if role not in self.train_slices:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        return self.train_slices[role]

    def summary(self) -> Dict[str, int]:
        return {
            "heldout_files": len(self.heldout),
            "train_files": len(self.train),
            "verifier_files": len(self.train_slices["verifier"]),
            "drafter_files": len(self.train_slices["drafter"]),
        }


def split_files(
    files: Sequence[str],
    seed: int = DEFAULT_SEED,
    heldout_frac: float = DEFAULT_HELDOUT_FRAC,
    root: Optional[Path] = None,
) -> CorpusSplit:
    """Assign each file to held-out or to one train slice by seeded hashes of its relative path."""
    if not 0.0 < heldout_frac < 1.0:
        raise ValueError(f"heldout_frac must be in (0, 1), got {heldout_frac}")
    split = CorpusSplit(root=Path(root) if root is not None else stdlib_root(), seed=seed)
    split.train_slices = {role: [] for role in ROLES}
    for rel in sorted(files):
        if stable_unit(seed, "heldout:" + rel) < heldout_frac:
            split.heldout.append(rel)
        else:
            role = "drafter" if stable_unit(seed, "slice:" + rel) < 0.5 else "verifier"
            split.train_slices[role].append(rel)
    return split


def stdlib_split(seed: int = DEFAULT_SEED, heldout_frac: float = DEFAULT_HELDOUT_FRAC, root: Optional[Path] = None) -> CorpusSplit:
    """The corpus split of this machine's standard library."""
    root = Path(root) if root is not None else stdlib_root()
    return split_files(list_source_files(root), seed=seed, heldout_frac=heldout_frac, root=root)


def iter_texts(split: CorpusSplit, files: Sequence[str]):
    """Yield each file's text (skipping empty files), in the given order."""
    for rel in files:
        text = read_source(split.root, rel)
        if text.strip():
            yield text
