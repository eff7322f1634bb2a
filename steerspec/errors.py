"""Errors a person can act on: the CLI prints them as one line and exits 2."""


class UsageError(ValueError):
    """Bad input from a user (flag, prompt, model path): reported as one line, exit code 2."""
