"""What a ``SIGHUP`` can change in the stages file while the sidecar runs.

Applied live: ``limits`` (new connections and requests read them; the hard cap and the queue
caps at the next decision), ``passthrough.cap``, each stage's ``queue_cap`` and
``queue_timeout``, and ``classifier.time_unit``, ``history``, ``auto_margin``,
``auto_interval``. Everything that shapes the queues or how requests are read needs a restart:
the stages themselves (names, order, routes, methods, ``next``, ``cpu_exempt``, ``lock``) and ``classifier.mode``,
``header``, ``next_header``; such changes are kept out of the running config and named.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from overtake.controller.sidecar.stages import StagesConfig

__all__ = ["RESTART_CLASSIFIER", "live_merge"]

#: classifier keys a running sidecar cannot change: they decide how requests are read
RESTART_CLASSIFIER = ("mode", "header", "next_header")
#: per-stage keys a running sidecar can change
_LIVE_STAGE = frozenset({"queue_cap", "queue_timeout"})


def _changes(prefix: str, old: BaseModel, new: BaseModel) -> list[str]:
    """``prefix.key: old -> new`` for every field that differs."""
    out = []
    for key in type(old).model_fields:
        a, b = getattr(old, key), getattr(new, key)
        if a != b:
            out.append(f"{prefix}{key}: {_show(a)} -> {_show(b)}")
    return out


def _show(v: Any) -> str:
    return "none" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def _same_shape(old: StagesConfig, new: StagesConfig) -> bool:
    """The stages route the same requests to the same queues (only live keys may differ)."""
    if len(old.stages) != len(new.stages):
        return False
    for a, b in zip(old.stages, new.stages):
        if a.model_copy(update=dict.fromkeys(_LIVE_STAGE)) != b.model_copy(update=dict.fromkeys(_LIVE_STAGE)):
            return False
    return True


def live_merge(old: StagesConfig, new: StagesConfig) -> tuple[StagesConfig, list[str], list[str]]:
    """The config to run after a reload of ``new`` over ``old``, the changes it applies
    (``limits.max_inflight: 60 -> 40``) and the keys that need a restart (left as they were)."""
    restart: list[str] = []
    stages = new.stages
    if not _same_shape(old, new):
        stages = old.stages
        restart.append("stages (names, order, routes, methods, next, cpu_exempt, lock)")
    keep = {k: getattr(old.classifier, k) for k in RESTART_CLASSIFIER if getattr(old.classifier, k) != getattr(
        new.classifier, k)}
    restart += [f"classifier.{k}" for k in keep]
    merged = StagesConfig(stages=stages, passthrough=new.passthrough, limits=new.limits,
                          classifier=new.classifier.model_copy(update=keep))
    applied = _changes("limits.", old.limits, merged.limits) + _changes("passthrough.", old.passthrough,
                                                                           merged.passthrough)
    applied += _changes("classifier.", old.classifier, merged.classifier)
    for a, b in zip(old.stages, merged.stages):
        applied += [f"stages[{a.name}].{c}" for c in _changes("", a, b)]
    return merged, applied, restart
