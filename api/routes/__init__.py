"""The REST API's routers, one per concern: models, fits, plots, the page, operations."""

from __future__ import annotations

__all__ = ["load_parsers"]


def load_parsers() -> None:
    """Import the routers whose functions run in the parse processes
    (:class:`overtake.api.offload.ParseProcess`'s ``preload``), before their first request."""
    from . import fits, models  # noqa: F401
