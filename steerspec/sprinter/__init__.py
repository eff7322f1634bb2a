"""SPRINTER (paper 004): lossy, opt-in approximate verification with a drafter-side classifier.

A small head on the drafter's features predicts whether each draft token would be accepted;
kept tokens are committed without the verifier, which is called only when the head predicts a
rejection (or at `max_run`). Its cost in fidelity is bounded by Theorem 1 and always reported.
"""
