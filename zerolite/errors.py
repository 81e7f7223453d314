"""zerolite's own exception types for failures that involve several ranks."""

from __future__ import annotations

__all__ = ["CollectiveTimeout", "RankMismatchError"]


class RankMismatchError(RuntimeError):
    """Ranks disagree on what they build or do (model, optimizer, config, step), or one failed."""


class CollectiveTimeout(RuntimeError):
    """A zerolite collective did not complete: a peer did not join within
    ``ZeroConfig.timeout_s``, or left the group. The message names the operation and step."""
