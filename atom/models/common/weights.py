"""What both families' checkpoint loaders share: the error a user sees for a checkpoint that
does not fit the model."""

from __future__ import annotations


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names each offending tensor."""
