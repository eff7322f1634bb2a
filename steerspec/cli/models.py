"""`steerspec models`: the bundled models with their parameter counts and paths."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

from rich.console import Console
from rich.table import Table
from safetensors import safe_open

from steerspec.models import smollm2
from steerspec.models.checkpoints import ALIASES, BUNDLED_NAMES, MODELS_DIR
from steerspec.models.draft_temperature import CONFIG_KEY
from steerspec.models.reduced import REDUCED_KEY


def register(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list the bundled models", description=__doc__.strip())
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(func=run)


def count_parameters(path: Path) -> int:
    """Parameters stored in a checkpoint's safetensors files (read from headers, no weights loaded)."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                numel = 1
                for dim in handle.get_slice(name).get_shape():
                    numel *= dim
                total += numel
    return total


def describe() -> List[Dict[str, object]]:
    rows = []
    aliases = {v: k for k, v in ALIASES.items()}
    for name in BUNDLED_NAMES:
        path = MODELS_DIR / name
        installed = (path / "config.json").is_file()
        config = json.loads((path / "config.json").read_text()) if installed else {}
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) if installed else 0
        rows.append({
            "name": name,
            "alias": aliases.get(name),
            "installed": installed,
            "parameters": count_parameters(path) if installed else None,
            "architecture": (config.get("architectures") or ["?"])[0] if installed else None,
            "layers": config.get("num_hidden_layers"),
            "hidden_size": config.get("hidden_size"),
            "context": config.get("max_position_embeddings"),
            "size_mb": round(size / 1e6, 2) if installed else None,
            "path": str(path),
        })
    rows.append(smollm2_row())
    rows += [reduced_row(path) for path in sorted(MODELS_DIR.glob("smollm2-*")) if (path / "config.json").is_file()]
    return rows


def reduced_row(path: Path) -> Dict[str, object]:
    """A bundled reduced drafter: its own parameters (the embedding and head rows it reads from its
    verifier at load time are not counted) and its draft vocabulary."""
    config = json.loads((path / "config.json").read_text())
    reduced = config[REDUCED_KEY]
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    temperature = config.get(CONFIG_KEY)
    return {
        "name": path.name, "alias": None, "installed": True,
        "parameters": count_parameters(path) - int(reduced["support_size"]),  # less the stored support ids
        "architecture": f"{(config.get('architectures') or ['?'])[0]}, {reduced['support_size']:,}-token head"
                        + ("" if temperature is None else f", draft temperature {temperature}"),
        "draft_temperature": temperature,
        "layers": config.get("num_hidden_layers"), "hidden_size": config.get("hidden_size"),
        "context": config.get("max_position_embeddings"), "size_mb": round(size / 1e6, 2),
        "path": f"{path} (+ embedding and head rows of {reduced['verifier']})",
    }


def smollm2_row() -> Dict[str, object]:
    """The real verifier `smollm2`: its source package and version, license, size and cache location."""
    info = smollm2.describe()
    path = Path(str(info["path"]))
    converted = bool(info["converted"])
    config = json.loads((path / "config.json").read_text()) if converted else {}
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) if converted else 0
    return {
        "name": smollm2.NAME, "alias": None, "installed": converted,
        "parameters": count_parameters(path) if converted else None,  # tied head: stored once
        "architecture": (config.get("architectures") or ["?"])[0] if converted else None,
        "layers": config.get("num_hidden_layers"), "hidden_size": config.get("hidden_size"),
        "context": config.get("max_position_embeddings"), "size_mb": round(size / 1e6, 2) if converted else None,
        "path": str(path), "source": f"{info['package']} {info['package_version'] or '(not installed)'}",
        "license": info["license"], "available": info["available"], "install_hint": info["install_hint"],
    }


def run(args: argparse.Namespace) -> int:
    rows = describe()
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0

    table = Table(title="bundled models")
    for column in ("name", "parameters", "architecture", "layers", "hidden", "context", "MB", "path"):
        table.add_column(column, justify="right" if column in ("parameters", "layers", "hidden", "context", "MB") else "left")
    for row in rows:
        name = row["name"] + (f" ({row['alias']})" if row["alias"] else "")
        if row.get("source") and not row["installed"]:
            state = "converted on first use" if row["available"] else "not installed"
            table.add_row(name, "-", state, "", "", "", "", f"{row['path']} ({row['source']}, {row['license']})")
            continue
        if row.get("source"):
            table.add_row(name, f"{row['parameters']:,}", str(row["architecture"]), str(row["layers"]),
                          str(row["hidden_size"]), str(row["context"]), f"{row['size_mb']:.1f}",
                          f"{row['path']} ({row['source']}, {row['license']})")
            continue
        if not row["installed"]:
            table.add_row(name, "-", "not installed", "", "", "", "", row["path"])
            continue
        table.add_row(name, f"{row['parameters']:,}", str(row["architecture"]), str(row["layers"]),
                      str(row["hidden_size"]), str(row["context"]), f"{row['size_mb']:.1f}", row["path"])
    Console(width=200).print(table)
    hint = next(r for r in rows if r["name"] == "smollm2").get("install_hint")
    if hint:
        sys.stdout.write(f"smollm2: not installed; install it with: {hint}\n")
    return 0
