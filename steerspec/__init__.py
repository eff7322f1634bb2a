"""SteerSpec: distributed speculative decoding with SD² steering vectors."""

__version__ = "0.1.0"
