"""The smollm2 drafters' code corpus records what it read (library and packages with versions)."""

from __future__ import annotations

import json
from argparse import Namespace

import numpy as np

from steerspec.data.code_corpus import build_token_arrays, package_manifest
from steerspec.train.smollm2_drafter import model_card


class ByteTokenizer:
    """One id per character: enough to count what the corpus holds."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) % 250 + 3 for c in text]}


def fake_tree(tmp_path):
    stdlib = tmp_path / "lib"
    for i in range(6):
        (stdlib / f"mod{i}").mkdir(parents=True)
        (stdlib / f"mod{i}" / "__init__.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    (stdlib / "test").mkdir()
    (stdlib / "test" / "test_mod.py").write_text("assert True\n")  # a test package: never in the corpus
    site = tmp_path / "site"
    (site / "fakepkg").mkdir(parents=True)
    (site / "fakepkg" / "core.py").write_text("class Core:\n    pass\n")
    (site / "fakepkg" / "dup.py").write_text("def f0(x):\n    return x + 0\n")  # same text as a stdlib file
    info = site / "fakepkg-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.2.3\n")
    return stdlib, site


def test_the_corpus_summary_names_its_packages_and_the_card_records_them(tmp_path):
    stdlib, site = fake_tree(tmp_path)
    assert package_manifest(site) == ["fakepkg==1.2.3"]
    out = tmp_path / "corpus"
    summary = build_token_arrays(ByteTokenizer(), out, stdlib=stdlib, packages=site, eos_id=0)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["packages"] == ["fakepkg==1.2.3"] and summary["stdlib"] == str(stdlib)
    files = summary["train"]["files"] + summary["heldout"]["files"]
    assert files == 7  # six stdlib modules and core.py; the duplicate and the test package are left out
    tokens = np.load(out / "train.npy").size + np.load(out / "heldout.npy").size
    assert tokens == summary["train"]["tokens"] + summary["heldout"]["tokens"]

    args = Namespace(synthetic=None, init_layers="0,1", support=8192, device="cpu", seed=1234, lr=1e-3)
    card = model_card(args, {"step": 3}, 60.0, 1000, corpus=summary)
    assert "fakepkg==1.2.3" in card and f"{summary['train']['files']:,} training files" in card
    assert "fakepkg" not in model_card(args, {"step": 3}, 60.0, 1000)  # a corpus built before the record
