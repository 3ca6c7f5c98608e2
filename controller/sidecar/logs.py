"""The sidecar's log: JSON lines on stderr (``{"ts":..., "level":..., "event":..., ...}``)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

__all__ = ["JsonFormatter", "configure_logging"]


class JsonFormatter(logging.Formatter):
    """One JSON object per log line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k in ("event", "policy", "hash", "version", "detail", "listen", "apache", "reason", "source",
                     "outcome", "refit", "admin_listen", "drained", "cut", "stage", "verdict", "lock"):
                out[k] = v
        return json.dumps(out, sort_keys=True)


def configure_logging(level: int = logging.INFO) -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    lg = logging.getLogger("overtake")
    lg.handlers[:] = [h]
    lg.setLevel(level)
    lg.propagate = False
