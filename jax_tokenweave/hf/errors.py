"""The errors a Hugging Face checkpoint can raise (both ``ValueError`` subclasses)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory or file is missing, truncated, corrupt, or does not fit the model.

    The message names the file (or directory) at fault.
    """


class UnsupportedConfigError(ValueError):
    """``config.json`` describes a model or feature this library does not implement."""
