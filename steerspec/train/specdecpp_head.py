"""`steerspec train specdecpp`: train the specdecpp policy's head (see steerspec/train/policy_heads.py)."""

from __future__ import annotations

import argparse

from steerspec.train.policy_heads import add_arguments, run_kind  # noqa: F401


def run(args: argparse.Namespace) -> int:
    return run_kind("specdecpp", args)
