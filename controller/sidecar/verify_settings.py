"""The options of the live verification (``overtake sidecar --verify ...``, ``verify:`` in the config).

Apart from the verifier (:mod:`overtake.controller.sidecar.verify`) so that the options and the
config read them without the verifier's event-loop machinery.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from overtake.controller.errors import SidecarInputError

__all__ = ["VerifySettings"]


@dataclass(frozen=True)
class VerifySettings:
    """Options of the live verification (``overtake sidecar --verify ...``). Times in seconds."""

    window: float = 30.0  #: length of each window
    settle: float = 5.0  #: leading seconds of a window whose arrivals are not counted
    min_pairs: int = 3  #: pairs before any decision
    max_pairs: int = 20  #: pairs after which a decision is forced
    min_gain: float = 0.02  #: at max_pairs, the estimated gain a policy must show to be kept
    level: float = 0.95  #: confidence over all looks together (verify_stats)
    min_requests: int = 20  #: counted requests a window needs for its pair to count

    def __post_init__(self) -> None:
        checks = (
            ("verify-window", math.isfinite(self.window) and self.window > 0, "a number of seconds > 0, e.g. 30"),
            ("verify-settle", math.isfinite(self.settle) and 0 <= self.settle < self.window,
             f"a number of seconds in [0, --verify-window) = [0, {self.window:g}), e.g. 5"),
            ("verify-min-pairs", self.min_pairs >= 2, "an integer >= 2 (a CI needs two pairs), e.g. 3"),
            ("verify-max-pairs", self.max_pairs >= self.min_pairs,
             f"an integer >= --verify-min-pairs ({self.min_pairs}), e.g. 20"),
            ("verify-min-gain", math.isfinite(self.min_gain) and -1 < self.min_gain < 1,
             "a fraction in (-1, 1), e.g. 0.02"),
            ("verify-level", 0.5 <= self.level < 1, "a confidence in [0.5, 1), e.g. 0.95"),
            ("verify-min-requests", self.min_requests >= 1, "an integer >= 1, e.g. 20"),
        )
        for name, ok, fix in checks:
            if not ok:
                raise SidecarInputError(f"--{name}: must be {fix}")

    def as_dict(self) -> dict[str, float | int]:
        """The settings as ``GET /-/policy``'s ``verify.settings`` shows them."""
        return {"window": self.window, "settle": self.settle, "min_pairs": self.min_pairs, "max_pairs": self.max_pairs,
                "min_gain": self.min_gain, "level": self.level, "min_requests": self.min_requests}
