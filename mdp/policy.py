"""The policy artifact: one versioned file the sidecar and the API load (``overtake solve --out``).

Contents (a NumPy ``.npz`` archive): ``meta`` — JSON with the format version, the model, the
truncation, the state layout (column labels), the readable rules and the metrics; ``keys`` — the
sorted lexicographic ranks of the truncated states; ``spawn`` — for each state the number of
threads to start from each queue. ``action(state)`` is a rank computation and one dict lookup.

States beyond the truncation get a defined answer (:meth:`Policy.action`):

1. more active threads than the truncation's ``max_threads``: start nothing;
2. more requests than ``max_requests``: remove waiting requests one at a time from the longest
   queue (lowest index on ties) until the state fits, and answer for that state — the spawn counts
   are then at most the real waiting counts.

Observation policies (below) instead remove one from the largest count, waiting or active (the
first on ties), until the state fits, then apply rule 1 to what is left.

In the phase-at-start layout a spawn reveals a phase, so the answer starts at most one thread; ask
again once its phase is known.

Observation policies (``phase_info`` ``none`` or ``route``, :mod:`overtake.mdp.observation`) key
their table by the *observation*: waiting per queue (per stage, or per (stage, route)), then active
threads per stage. Their answer is started at once, and only at arrivals and completions; a
``route`` policy carries its route split (``meta["routes"]``).
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import ModelError, PolicyFileError
from .model import Stage, TandemModel
from .routes import RouteSplit
from .statespace import Layout, PhaseInfo, Ranker, StateSpace

IntArray = npt.NDArray[np.int64]

#: :meth:`Policy.lookup_tables` keeps a position per rank up to this many ranks (16 MB of int32)
DENSE_RANKS = 4_000_000

FORMAT = "overtake-policy"
FORMAT_VERSION = 1


def model_to_dict(model: TandemModel) -> dict[str, Any]:
    return {
        "arrival_rate": model.arrival_rate,
        "cores": model.cores,
        "overhead": model.overhead,
        "stages": [{"name": s.name, "alpha": s.alpha.tolist(), "T": s.T.tolist()} for s in model.stages],
        **({"weights": list(model.weights)} if model.weights is not None else {}),
        **({"locks": list(model.locks)} if model.has_lock and model.locks is not None else {}),
        **({"routing": [[list(r) for r in R] for R in model.routing]} if model.routing is not None else {}),
    }


def model_from_dict(d: dict[str, Any]) -> TandemModel:
    return TandemModel(
        arrival_rate=float(d["arrival_rate"]),
        stages=tuple(Stage(s["name"], np.asarray(s["alpha"]), np.asarray(s["T"])) for s in d["stages"]),
        cores=int(d.get("cores", 1)),
        overhead=float(d.get("overhead", 0.0)),
        weights=tuple(float(x) for x in d["weights"]) if d.get("weights") is not None else None,
        locks=tuple(d["locks"]) if d.get("locks") is not None else None,
        routing=d.get("routing"),
    )


def _trim_longest(w: IntArray, excess: IntArray) -> IntArray:
    """Remove ``excess`` requests one at a time from the longest queue (lowest index on ties).

    Closed form of that loop: every queue is cut to a level T, the least with
    Σ_q max(w_q − T, 0) ≤ excess, and the r = excess − that sum remaining removals take one more
    from the r lowest-indexed queues still at T. Requires excess ≤ Σ w.
    """
    if "overtake.mdp._kernels" in sys.modules:  # loaded by a large solve: the plain loop, compiled
        from . import _kernels

        trimmed: IntArray = np.array(w, dtype=np.int64, copy=True)
        _kernels.trim_longest(trimmed, np.asarray(excess, dtype=np.int64))
        return trimmed
    lo = np.zeros(w.shape[0], dtype=np.int64)  # the least feasible T lies in [lo, hi]
    hi = w.max(axis=1)
    while np.any(lo < hi):  # least T in [0, max w] with cut(T) <= excess
        mid = (lo + hi) // 2
        ok = np.maximum(w - mid[:, None], 0).sum(axis=1) <= excess
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid + 1)
    T = hi
    out = np.minimum(w, T[:, None])
    r = excess - (w - out).sum(axis=1)
    at = out == T[:, None]
    take = at & (np.cumsum(at, axis=1) <= r[:, None])
    out -= take
    result: IntArray = out
    return result


@dataclass
class Policy:
    """A solved thread policy on a truncated state space, answering ``action(state)``."""

    model: TandemModel
    phase_info: PhaseInfo
    max_requests: int
    max_threads: int
    keys: IntArray
    spawn: npt.NDArray[np.int16]
    meta: dict[str, Any] = field(default_factory=dict)
    routes: RouteSplit | None = None

    def __post_init__(self) -> None:
        if self.phase_info == "route":
            if self.routes is None:
                raise PolicyFileError("a route policy needs its route split (routes)")
            self.layout = self.routes.layout(self.model)
        else:
            self.layout = Layout.build(self.model, self.phase_info)
        self.Q = self.layout.n_queues
        # observation policies see threads per stage, the others threads per (stage, phase)
        self.D = self.model.n_stages if self.observed else self.model.n_coords
        self.ranker = Ranker(self.Q + self.D, self.max_requests)
        self._lookup: dict[int, int] | None = None
        self._tables: tuple[IntArray, npt.NDArray[np.int32], IntArray] | None = None

    # ---- construction ----------------------------------------------------------------------
    @staticmethod
    def from_decision(space: StateSpace, decision: IntArray, meta: dict[str, Any] | None = None) -> Policy:
        """Turn a solver's decision array into spawn counts per state."""
        Q = space.Q
        if space.layout.deterministic:
            spawn = space.rows[:, :Q] - space.rows[decision, :Q]
        else:
            spawn = np.zeros((space.size, Q), dtype=np.int64)
            go = decision >= 0
            spawn[np.flatnonzero(go), decision[go]] = 1
        if np.any(spawn < 0):
            raise PolicyFileError("decision removes threads; it is not a spawn decision")
        return Policy(
            space.model, space.layout.phase_info, space.cap, space.k_max, space.keys.copy(),
            spawn.astype(np.int16), dict(meta or {}),
        )

    # ---- queries ---------------------------------------------------------------------------
    @property
    def observed(self) -> bool:
        """True for observation policies (counts only: ``none``, ``route``)."""
        return self.phase_info in ("none", "route")

    @property
    def columns(self) -> list[str]:
        """Labels of the state vector's components: waiting per queue, then threads per coordinate
        (per stage for observation policies)."""
        labels = self.model.coord_labels()
        if self.phase_info == "full":
            w = [f"waiting:{x}" for x in labels]
        elif self.routes is not None:
            w = [f"waiting:{x}" for x in self.routes.queue_labels(self.model)]
        else:
            w = [f"waiting:{s.name}" for s in self.model.stages]
        if self.observed:
            return w + [f"threads:{s.name}" for s in self.model.stages]
        return w + [f"threads:{x}" for x in labels]

    def _project(self, rows: IntArray) -> tuple[IntArray, npt.NDArray[np.bool_]]:
        rows = np.array(rows, dtype=np.int64, copy=True)
        Q = self.Q
        if self.observed:
            # counts only: shrink the largest count, waiting or active (first column on ties), so
            # a table that starts every request (π(∞)-like) still does so beyond its cap
            excess = rows.sum(axis=1) - self.max_requests
            while np.any(excess > 0):
                sel = np.flatnonzero(excess > 0)
                rows[sel, np.argmax(rows[sel], axis=1)] -= 1
                excess[sel] -= 1
            return rows, rows[:, Q:].sum(axis=1) > self.max_threads
        over_threads = rows[:, Q:].sum(axis=1) > self.max_threads
        excess = np.where(over_threads, 0, rows.sum(axis=1) - self.max_requests)
        sel = np.flatnonzero(excess > 0)
        if sel.size:
            rows[sel, :Q] = _trim_longest(rows[sel, :Q], excess[sel])
        return rows, over_threads

    def actions(self, rows: IntArray) -> IntArray:
        """Vectorised :meth:`action`: threads to start per queue for each state row."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 2 or rows.shape[1] != self.Q + self.D:
            raise PolicyFileError(f"state rows must have {self.Q + self.D} columns: {self.columns}")
        if np.any(rows < 0):
            raise PolicyFileError("state counts must be >= 0")
        proj, over = self._project(rows)
        out = np.zeros((rows.shape[0], self.Q), dtype=np.int64)
        ok = np.flatnonzero(~over)
        if ok.size:
            keys = self.ranker.rank(proj[ok])
            idx = np.minimum(np.searchsorted(self.keys, keys), self.keys.size - 1)
            hit = self.keys[idx] == keys
            out[ok] = np.where(hit[:, None], self.spawn[idx].astype(np.int64), 0)
        out = np.minimum(out, rows[:, : self.Q])
        if self.observed and self.model.has_lock:
            self._hold_at_locks(rows, out)
        return out

    def _hold_at_locks(self, rows: IntArray, out: IntArray) -> None:
        """Clip the starts in each locked stage to its lock's free places, in place: a table over
        counts never starts a thread into a full lock (:mod:`overtake.mdp.observation`), and the
        projection beyond its cap keeps that (a state it maps to may show fewer threads there)."""
        qs_of = self.layout.queue_stage
        for i, m in enumerate(self.model.locks or ()):
            if m is None:
                continue
            left = np.maximum(m - rows[:, self.Q + i], 0)
            for q in np.flatnonzero(qs_of == i):
                out[:, q] = np.minimum(out[:, q], left)
                left = left - out[:, q]

    def lookup_tables(self) -> tuple[IntArray, npt.NDArray[np.int32], IntArray]:
        """(keys, position of each rank, spawn counts as int64): the table in the form the compiled
        chain builder reads it (chain.py). The positions by rank (−1: not in the table) are an
        array over every rank of the truncation, kept when it has at most ``DENSE_RANKS`` entries
        (Table 1 case 8's π* on C = 13: 203,490), else empty (a binary search on ``keys`` then)."""
        if self._tables is None:
            total = int(self.ranker.counts[self.ranker.length, self.ranker.cap])  # vectors with sum <= cap
            dense = np.zeros(0, dtype=np.int32)
            if total <= DENSE_RANKS:
                dense = np.full(total, -1, dtype=np.int32)
                dense[self.keys] = np.arange(self.keys.size, dtype=np.int32)
            self._tables = (np.ascontiguousarray(self.keys, dtype=np.int64), dense,
                            np.ascontiguousarray(self.spawn, dtype=np.int64))
        return self._tables

    def action(self, state: npt.ArrayLike) -> IntArray:
        """Threads to start from each queue in ``state`` (waiting per queue, then threads per coordinate)."""
        row = np.asarray(state, dtype=np.int64).reshape(1, -1)
        if row.shape[1] != self.Q + self.D:
            raise PolicyFileError(f"state must have {self.Q + self.D} entries: {self.columns}")
        vals = row[0].tolist()
        if sum(vals) <= self.max_requests and sum(vals[self.Q :]) <= self.max_threads and min(vals) >= 0:
            if self._lookup is None:
                self._lookup = {int(k): i for i, k in enumerate(self.keys)}
            i = self._lookup.get(self.ranker.rank_one(vals))
            if i is not None:
                known: IntArray = np.minimum(self.spawn[i].astype(np.int64), row[0, : self.Q])
                return known
        first: IntArray = self.actions(row)[0]
        return first

    def rule(self):  # type: ignore[no-untyped-def]
        return self.actions

    # ---- files -----------------------------------------------------------------------------
    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps(model_to_dict(self.model), sort_keys=True).encode())
        h.update(self.keys.tobytes())
        h.update(self.spawn.tobytes())
        if self.routes is not None:
            h.update(json.dumps(self.routes.to_dict(), sort_keys=True).encode())
        return h.hexdigest()[:16]

    def save(self, path: str | Path) -> None:
        meta = dict(self.meta)
        meta.update(
            format=FORMAT, format_version=FORMAT_VERSION, model=model_to_dict(self.model),
            phase_info=self.phase_info, max_requests=self.max_requests, max_threads=self.max_threads,
            columns=self.columns, states=int(self.keys.size), hash=self.digest(),
        )
        if self.routes is not None:
            meta["routes"] = self.routes.to_dict()
        buf = io.BytesIO()
        np.savez_compressed(buf, keys=self.keys, spawn=self.spawn, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        Path(path).write_bytes(buf.getvalue())

    @staticmethod
    def load(path: str | Path) -> Policy:
        p = Path(path)
        try:
            # open the file ourselves: np.load leaks its handle when the zip is truncated
            with p.open("rb") as fh, np.load(fh, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                keys = z["keys"].astype(np.int64)
                spawn = z["spawn"].astype(np.int16)
        except FileNotFoundError:
            raise
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
            raise PolicyFileError(f"{p}: not an overtake policy file ({exc.__class__.__name__}: {exc})") from None
        if meta.get("format") != FORMAT:
            raise PolicyFileError(f"{p}: not an overtake policy file (format {meta.get('format')!r})")
        if meta.get("format_version") != FORMAT_VERSION:
            raise PolicyFileError(
                f"{p}: policy format version {meta.get('format_version')} is not supported "
                f"(this overtake reads version {FORMAT_VERSION}); re-run `overtake solve`"
            )
        try:
            model = model_from_dict(meta["model"])
            routes = RouteSplit.from_dict(model, meta["routes"]) if meta["phase_info"] == "route" else None
            pol = Policy(model, meta["phase_info"], int(meta["max_requests"]), int(meta["max_threads"]), keys, spawn,
                         meta, routes=routes)
        except (KeyError, TypeError, ValueError, ModelError) as exc:
            raise PolicyFileError(f"{p}: policy metadata is invalid ({exc})") from None
        if keys.ndim != 1 or spawn.shape != (keys.size, pol.Q) or np.any(np.diff(keys) <= 0):
            raise PolicyFileError(f"{p}: policy tables are corrupt (shape or order)")
        if meta.get("hash") != pol.digest():
            raise PolicyFileError(f"{p}: policy hash mismatch: the file is corrupt or was edited")
        return pol
