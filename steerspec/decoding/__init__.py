"""Speculative decoding itself: the exact sampler, blocks, trees and their verification (pure, batched torch
functions), and the in-process loops that run them (`engine`, `drafting`, `tree_decoding`, `fastpath`)."""
