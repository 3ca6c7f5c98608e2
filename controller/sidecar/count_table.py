"""The count table: a blind policy as mod_overtake_prio enforces it inside Apache (module mode).

A policy that sees counts, not phases (``phase_info: none``, and the baselines π(k), π(k1,…,kN))
answers, for the waiting and running requests of every stage, how many waiting requests of each
stage to start. Within caps on those counts the module holds exactly that answer in a table (the
control file's stage section, ``apache-conf/mod_overtake_prio/os_table.h``), keyed by the stage
names of its ``OvertakeStage`` directives, and looks it up at every arrival and completion.

Layout (version 1), little-endian: ``n`` (stages), a reserved word, then per stage a 32-byte
NUL-padded name and the caps ``wcap`` (waiting) and ``kcap`` (running), then one cell of ``n``
bytes per observation ``(w_1..w_n, k_1..k_n)`` in row-major order, ``k_n`` fastest.

Beyond the caps the module answers conservatively: a waiting count above its cap reads as the cap;
a running count above its cap starts nothing. The caps chosen here (:func:`from_policy`) cover the
running counts the policy can reach (its thread limit), and as many waiting counts as fit
:data:`MAX_CELLS`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MAX_CAP", "MAX_CELLS", "MAX_STAGES", "CountTable", "from_policy", "module_blocker"]

MAX_STAGES = 8  # OS_MAX_TSTAGES
MAX_CAP = 255  # OS_MAX_CAP
MAX_CELLS = 1 << 20  # OS_MAX_CELLS
NAME_BYTES = 32
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,31}")
_CHUNK = 1 << 16  # observations per vectorised policy call


@dataclass(frozen=True)
class CountTable:
    """Per stage its name and caps; ``actions[cell, i]`` = requests of stage i to start."""

    names: tuple[str, ...]
    wcap: tuple[int, ...]
    kcap: tuple[int, ...]
    actions: npt.NDArray[np.uint8]

    def __post_init__(self) -> None:
        n = len(self.names)
        if not 1 <= n <= MAX_STAGES:
            raise ValueError(f"count table: {n} stages; the module takes 1..{MAX_STAGES}")
        for name in self.names:
            if not _NAME.fullmatch(name):
                raise ValueError(f"count table: stage name {name!r} is not 1..31 letters, digits, '_', '.', '-' "
                                 "(what OvertakeStage takes); rename the stage in the stages file")
        if len(set(self.names)) != n:
            raise ValueError(f"count table: stage names repeat: {list(self.names)}")
        for cap in (*self.wcap, *self.kcap):
            if not 0 <= cap <= MAX_CAP:
                raise ValueError(f"count table: cap {cap} not in 0..{MAX_CAP}")
        if self.actions.shape != (self.cells, n):
            raise ValueError(f"count table: actions of shape {self.actions.shape}, expected {(self.cells, n)}")

    @property
    def cells(self) -> int:
        return _cells(self.wcap, self.kcap)

    def observations(self) -> npt.NDArray[np.int64]:
        """Every observation (w_1..w_n, k_1..k_n) in cell order."""
        return _observations(self.wcap, self.kcap)

    def encode(self) -> bytes:
        """The control file's stage section."""
        head = struct.pack("<II", len(self.names), 0)
        entries = b"".join(name.encode().ljust(NAME_BYTES, b"\0") + struct.pack("<II", w, k)
                           for name, w, k in zip(self.names, self.wcap, self.kcap))
        return head + entries + np.ascontiguousarray(self.actions, dtype=np.uint8).tobytes()

    def lookup(self, waiting: Sequence[int], running: Sequence[int]) -> tuple[int, ...]:
        """The module's answer (``os_lookup``), including its default beyond the caps."""
        n = len(self.names)
        if any(k > c for k, c in zip(running, self.kcap)):
            return (0,) * n
        idx = 0
        for w, c in zip(waiting, self.wcap):
            idx = idx * (c + 1) + min(w, c)
        for k, c in zip(running, self.kcap):
            idx = idx * (c + 1) + k
        return tuple(int(a) for a in self.actions[idx])


def module_blocker(policy: Any) -> str | None:
    """Why ``policy`` cannot be enforced by the module (None: it can): the module sees counts
    per stage only, so phase headers (``full``, ``start``), route classes and uplink SRPT need the
    sidecar in the request path."""
    chosen = getattr(policy, "chosen", policy)
    info = getattr(chosen, "phase_info", "none")
    if info != "none" or getattr(chosen, "per_phase_queues", False):
        return (f"policy {getattr(chosen, 'name', '?')} sees phase_info {info!r}: the module sees only counts "
                "per stage (phase_info none, or a baseline pi(k)); keep enforce: sidecar for phase headers "
                "and route classes")
    return None


def _caps(policy: Any, n: int) -> tuple[list[int], list[int]] | None:
    """(wcap, kcap) before the cell budget; None for a policy that never holds (π(∞))."""
    inner = getattr(policy, "policy", None)
    if inner is not None and hasattr(inner, "max_threads"):
        k = min(int(inner.max_threads), MAX_CAP)
        return [min(int(inner.max_requests), MAX_CAP)] * n, [k] * n
    if getattr(policy, "unlimited", False):
        return None
    base = policy.baseline  # a BaselinePolicy: pi(k) (a total) or pi(k1,...,kN) (per stage)
    caps, total = base.per_stage, base.total
    if caps is None and total is None:
        return None
    kc = [min(int(c), MAX_CAP) for c in caps] if caps is not None else [min(int(total), MAX_CAP)] * n
    # pi(k): a stage starts min(waiting, room) with room <= its cap, so waiting beyond the cap
    # answers as at the cap (the module's default there)
    return list(kc), kc


def _fit(wcap: list[int], kcap: list[int], max_cells: int) -> list[int]:
    """Lower the waiting caps (the largest first) until the table has at most max_cells cells."""
    w = list(wcap)
    while _cells(w, kcap) > max_cells:
        i = max(range(len(w)), key=lambda j: w[j])
        if w[i] == 0:
            raise ValueError(f"count table: the running caps {kcap} alone exceed {max_cells} cells; "
                             "solve with fewer threads (max_threads) or fewer stages")
        w[i] -= 1
    return w


def from_policy(policy: Any, names: Sequence[str], *, max_cells: int = MAX_CELLS) -> CountTable | None:
    """The count table of a blind policy (a :class:`~overtake.controller.sidecar.policies.TablePolicy`
    with ``phase_info`` none, a :class:`BaselinePolicy`, or a :class:`PolicySet`'s chosen member)
    for the stages ``names`` (the stages file's order); None for π(∞), which holds nothing.

    Raises
    ------
    ValueError
        The policy sees phases or route classes (:func:`module_blocker`), a stage name the module
        does not take, or caps that do not fit ``max_cells``.
    """
    why = module_blocker(policy)
    if why is not None:
        raise ValueError(why)
    chosen = getattr(policy, "chosen", policy)
    n = len(names)
    caps = _caps(chosen, n)
    if caps is None:
        return None
    kcap = caps[1]
    wcap = _fit(caps[0], kcap, max_cells)
    obs = _observations(wcap, kcap)
    acts = _actions(chosen, obs, n)
    return CountTable(tuple(names), tuple(wcap), tuple(kcap), np.minimum(acts, obs[:, :n]).astype(np.uint8))


def _cells(wcap: Sequence[int], kcap: Sequence[int]) -> int:
    out = 1
    for a, b in zip(wcap, kcap):
        out *= (a + 1) * (b + 1)
    return out


def _observations(wcap: Sequence[int], kcap: Sequence[int]) -> npt.NDArray[np.int64]:
    radices = [w + 1 for w in wcap] + [k + 1 for k in kcap]
    return np.ascontiguousarray(np.indices(radices).reshape(len(radices), -1).T, dtype=np.int64)


def _actions(policy: Any, obs: npt.NDArray[np.int64], n: int) -> npt.NDArray[np.int64]:
    inner = getattr(policy, "policy", None)
    if inner is not None and hasattr(inner, "actions"):
        parts = [np.asarray(inner.actions(obs[i:i + _CHUNK]), dtype=np.int64) for i in range(0, len(obs), _CHUNK)]
        return np.concatenate(parts) if parts else np.zeros((0, n), dtype=np.int64)
    out = np.empty((len(obs), n), dtype=np.int64)
    for i, row in enumerate(obs.tolist()):
        out[i] = policy.action(tuple(row))
    return out
