"""`steerspec train base|synth|distill|sd2|sprinter|pacer|specdecpp|smollm2|temperature`: the project's own training pipelines."""

from steerspec.cli.dispatch import register_group

COMMANDS = (
    ("base", "steerspec.train.pretrain", "pretrain the bundled verifier or drafter on the CPython stdlib"),
    ("synth", "steerspec.train.synth", "generate verifier answers at T=1 as a training set"),
    ("distill", "steerspec.train.distill", "distil the drafter on synthetic data (no steering)"),
    ("sd2", "steerspec.train.sd2_joint", "train drafter, W_s and W_hml together (SD²)"),
    ("sprinter", "steerspec.train.sprinter_classifier", "train the SPRINTER acceptance classifier for a drafter (lossy mode)"),
    ("pacer", "steerspec.train.pacer_head", "train the Pacer pre-verification layer for a drafter (draft-length policy)"),
    ("specdecpp", "steerspec.train.specdecpp_head", "train the SpecDec++ rejection head for a drafter (draft-length policy)"),
    ("smollm2", "steerspec.train.smollm2_drafter", "train a reduced drafter for the smollm2 verifier on code"),
    ("temperature", "steerspec.train.temperature",
     "calibrate a drafter's draft temperature (the scale of its logits that maximises acceptance)"),
)


def register(subparsers) -> None:
    register_group(subparsers, "train", "training pipelines", COMMANDS)
