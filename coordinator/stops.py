"""Stop sequences: a generation's text ends at the first match of any of its stop strings.

    stops = StopText(TextStream(tokenizer), ["\\n\\n", "###"])
    kept_ids, text, matched = stops.push(chunk.token_ids)   # per committed chunk
    tail = stops.flush()                                    # the generation ended without a match: the rest

Text is released as it is detokenised, except a tail that could still grow into a stop string (held back
until it cannot, as vLLM holds it); a match releases the text before it, never the stop string itself, and
keeps the tokens up to the one that completed the match (the rest of that block is dropped).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

MAX_STOPS = 16  # OpenAI allows 4; vLLM any number: a bound that keeps the per-token scan cheap
MAX_STOP_CHARS = 256


def check_stops(stops: Sequence[str]) -> Tuple[str, ...]:
    """The request's stop strings, checked (ValueError naming the problem): at most MAX_STOPS, each non-empty."""
    stops = tuple(str(s) for s in stops)
    if len(stops) > MAX_STOPS:
        raise ValueError(f"stop: at most {MAX_STOPS} stop sequences, got {len(stops)}")
    for stop in stops:
        if not stop:
            raise ValueError("stop: a stop sequence must be a non-empty string")
        if len(stop) > MAX_STOP_CHARS:
            raise ValueError(f"stop: a stop sequence may have at most {MAX_STOP_CHARS} characters, got {len(stop)}")
    return stops


def first_match(text: str, stops: Sequence[str]) -> Optional[int]:
    """Where the earliest stop string starts in `text` (None: none occurs)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string (it may still become one)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest


class StopText:
    """A TextStream (incremental detokeniser, coordinator.server) with stop sequences applied."""

    def __init__(self, stream, stops: Sequence[str] = ()) -> None:
        self.stream = stream
        self.stops = tuple(stops)
        self.pending = ""  # detokenised, not yet released: a possible stop's beginning
        self.text = ""  # released so far
        self.matched = False

    def push(self, token_ids: Sequence[int]) -> Tuple[List[int], str, bool]:
        """Feed one chunk -> (its tokens kept, the text released now, whether a stop matched)."""
        if not self.stops:
            out = self.stream.push(token_ids)
            self.text += out
            return [int(t) for t in token_ids], out, False
        kept: List[int] = []
        for token in token_ids:
            kept.append(int(token))
            self.pending += self.stream.push([token])
            at = first_match(self.pending, self.stops)
            if at is not None:
                out, self.pending, self.matched = self.pending[:at], "", True
                self.text += out
                return kept, out, True
        hold = held_back(self.pending, self.stops)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.text += out
        return kept, out, False

    def flush(self) -> str:
        """The rest of the text when the generation ends without a match: the tail held back as a possible stop's
        beginning, and what the detokeniser held back (an unfinished character) decoded as it stands; a stop found
        in it ends the text there."""
        full = self.stream.text
        tail = full[len(self.text):] if full.startswith(self.text) else self.pending
        at = first_match(tail, self.stops) if self.stops else None
        if at is not None:
            tail, self.matched = tail[:at], True
        self.pending = ""
        self.text += tail
        return tail
