"""The algorithm side of the sidecar: which threads to start in a given state (paper 004, §2-§4).

A :class:`SpawnPolicy` never sees requests (Netflix concurrency-limits' ``Limit``); the
:mod:`overtake.controller.limiter` enforces it. Every policy answers ``action(state)`` in O(1) for the
state vector of :attr:`overtake.mdp.Policy.columns`: waiting requests per queue, then active threads per
(stage, phase) coordinate. Two families share this interface so a hot swap between them runs on
the same code path:

* :class:`TablePolicy` — the solver's artifact (``overtake solve --out P.npz``), looked up via
  :meth:`overtake.mdp.Policy.action` (beyond the truncation it projects, see :mod:`overtake.mdp.policy`), memoised.
* :class:`BaselinePolicy` — π(k) (later stages first, FCFS within a stage), π(k1,…,kN) and
  π(∞) = ``passthrough`` (Apache's default), parsed by :meth:`overtake.mdp.Baseline.parse`. Phase-blind:
  one phase per stage.
"""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from overtake.controller.errors import PolicyLoadError
from overtake.mdp.baselines import Baseline
from overtake.mdp.errors import MDPError
from overtake.mdp.policy import Policy

__all__ = ["BaselinePolicy", "SpawnPolicy", "TablePolicy", "load_policy"]

_MEMO_MAX = 1 << 16  # states remembered per policy; the reachable set is far smaller


class SpawnPolicy(Protocol):
    """What the limiter needs from a policy."""

    name: str  #: e.g. "pi(2)", "passthrough", "case04.npz"
    version: str  #: human-readable version (format version + states, or the baseline name)
    hash: str  #: content hash (16 hex digits)
    phases: tuple[int, ...]  #: phases per stage as the policy sees them
    per_phase_queues: bool  #: True: one waiting queue per (stage, phase); False: per stage
    predicted_wait: float | None  #: model E[W] in model time units, when known
    alpha: tuple[np.ndarray, ...] | None  #: phase priors per stage (None for baselines)
    T: tuple[np.ndarray, ...] | None  #: sub-generators per stage (None for baselines)

    def action(self, state: tuple[int, ...]) -> tuple[int, ...]:
        """Threads to start from each queue."""
        ...


class BaselinePolicy:
    """π(k), π(k1,…,kN) or π(∞), answered in plain Python (equal to :meth:`overtake.mdp.Baseline.rule`)."""

    per_phase_queues = False
    predicted_wait: float | None = None
    alpha: tuple[np.ndarray, ...] | None = None
    T: tuple[np.ndarray, ...] | None = None

    def __init__(self, spec: str, n_stages: int) -> None:
        text = spec.strip()
        try:
            self.baseline = Baseline.parse("pi(inf)" if text == "passthrough" else text, n_stages)
        except MDPError as exc:
            msg = str(exc).replace("the scenario has", "the stages file has")
            raise PolicyLoadError(f"{msg}; or give a policy file from `overtake solve --out`") from None
        self.name = "passthrough" if text == "passthrough" else self.baseline.name
        self.version = self.baseline.name
        self.hash = hashlib.sha256(self.baseline.name.encode()).hexdigest()[:16]
        self.phases = (1,) * n_stages
        self._n = n_stages
        self._total = self.baseline.total
        self._caps = self.baseline.per_stage
        self.unlimited = self._total is None and self._caps is None  # π(∞)

    def action(self, state: tuple[int, ...]) -> tuple[int, ...]:
        n = self._n
        waiting = state[:n]
        threads = state[n:]
        if self._caps is not None:
            return tuple(max(0, min(waiting[i], self._caps[i] - threads[i])) for i in range(n))
        if self._total is None:
            return tuple(waiting)
        room = self._total - sum(threads)
        out = [0] * n
        for i in range(n - 1, -1, -1):  # later stages first (paper 004 §4)
            take = max(0, min(waiting[i], room))
            out[i] = take
            room -= take
        return tuple(out)


class TablePolicy:
    """A solved policy artifact; ``action`` is :meth:`overtake.mdp.Policy.action`, memoised per state."""

    def __init__(self, policy: Policy, name: str) -> None:
        self.policy = policy
        self.name = name
        self.hash = policy.digest()
        self.version = f"v{policy.meta.get('format_version', '?')}-{policy.phase_info}-{int(policy.keys.size)}states"
        self.phases = tuple(int(s.phases) for s in policy.model.stages)
        self.per_phase_queues = policy.phase_info == "full"
        metrics = policy.meta.get("metrics") or {}
        w = metrics.get("mean_response_time") if isinstance(metrics, dict) else None
        self.predicted_wait = float(w) if w is not None else None
        self.alpha: tuple[np.ndarray, ...] | None = tuple(np.asarray(s.alpha, dtype=float) for s in policy.model.stages)
        self.T: tuple[np.ndarray, ...] | None = tuple(np.asarray(s.T, dtype=float) for s in policy.model.stages)
        self.stage_names = tuple(s.name for s in policy.model.stages)
        self._memo: dict[tuple[int, ...], tuple[int, ...]] = {}

    def action(self, state: tuple[int, ...]) -> tuple[int, ...]:
        hit = self._memo.get(state)
        if hit is None:
            hit = tuple(int(x) for x in self.policy.action(state))
            if len(self._memo) >= _MEMO_MAX:
                self._memo.clear()
            self._memo[state] = hit
        return hit


def load_policy(spec: str, stage_names: Sequence[str]) -> SpawnPolicy:
    """Parse ``--policy``: a policy file, ``pi(k)``, ``pi(k1,...,kN)`` or ``passthrough``.

    Raises
    ------
    PolicyLoadError
        Unknown name, corrupt file, or a model whose stages differ from ``stage_names``.
    """
    text = spec.strip()
    if text == "passthrough" or text.replace(" ", "").startswith(("pi(", "π(")):
        return BaselinePolicy(text, len(stage_names))
    path = Path(text)
    if not path.exists():
        raise PolicyLoadError(
            f"policy: {text!r} is neither a file nor a baseline; give P.npz from `overtake solve --out`, "
            "pi(k), pi(k1,...,kN) or passthrough"
        )
    try:
        # Checked here first: np.load leaks its file handle on a truncated archive.
        with zipfile.ZipFile(path) as z:
            broken = z.testzip()
        if broken is not None:
            raise zipfile.BadZipFile(f"bad CRC in member {broken}")
    except (zipfile.BadZipFile, EOFError) as exc:
        raise PolicyLoadError(f"policy: {path}: not an overtake policy file (corrupt archive: {exc})") from None
    except OSError as exc:
        raise PolicyLoadError(f"policy: cannot read {path} ({exc.strerror})") from None
    try:
        pol = Policy.load(path)
    except MDPError as exc:
        raise PolicyLoadError(f"policy: {exc}") from None
    except OSError as exc:
        raise PolicyLoadError(f"policy: cannot read {path} ({exc.strerror})") from None
    table = TablePolicy(pol, path.name)
    if tuple(table.stage_names) != tuple(stage_names):
        raise PolicyLoadError(
            f"policy: {path} was solved for stages {list(table.stage_names)} but the stages file "
            f"defines {list(stage_names)}; rename the stages or solve the matching scenario"
        )
    return table
