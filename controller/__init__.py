"""The Overtake sidecar: enforces a thread-spawn policy in front of an unmodified Apache.

Modules are imported by name (``from overtake.controller.harness import apache``); this package re-exports
only what is listed in ``__all__``.
"""

from __future__ import annotations

__all__: list[str] = []
