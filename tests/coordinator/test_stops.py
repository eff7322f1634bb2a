"""Stop sequences on the detokenised stream (coordinator/stops.py), with a real tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from coordinator.server import TextStream
from coordinator.stops import StopText, check_stops, first_match, held_back


def test_matching_and_holding_back():
    assert first_match("abcabc", ["ca", "bc"]) == 1
    assert first_match("abc", ["x"]) is None
    assert held_back("hello wo", ["world", "xyz"]) == 2
    assert held_back("hello", ["world"]) == 0
    assert held_back("aaa", ["aab"]) == 2
    with pytest.raises(ValueError, match="non-empty"):
        check_stops([""])
    with pytest.raises(ValueError, match="at most"):
        check_stops(["a"] * 17)


def test_stop_text_releases_everything_before_the_match_and_never_the_stop(tiny_pair):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    ids = tokenizer("def fibonacci(n):\n    return n", add_special_tokens=False)["input_ids"]
    full = tokenizer.decode(ids)
    stop = "(n)"
    text = StopText(TextStream(tokenizer), [stop])
    released, kept = "", []
    for i in range(0, len(ids), 3):  # blocks of 3 tokens
        tokens, out, matched = text.push(ids[i:i + 3])
        kept += tokens
        released += out
        if matched:
            break
    assert matched and released == full[:full.index(stop)] == text.text
    assert stop in tokenizer.decode(kept) and stop not in tokenizer.decode(kept[:-1])  # cut at the completing token
    plain = StopText(TextStream(tokenizer), ["zzz"])
    out = "".join(plain.push(ids[i:i + 2])[1] for i in range(0, len(ids), 2)) + plain.flush()
    assert out == full and not plain.matched
