"""The algorithm side of the sidecar: which threads to start in a given state (van der Weij et al.,
"Dynamic thread assignment", §2-§4).

A :class:`SpawnPolicy` never sees requests (Netflix concurrency-limits' ``Limit``); the
:mod:`overtake.controller.sidecar.limiter` enforces it. Every policy answers ``action(state)`` in O(1) for the
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
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from overtake.controller.errors import PolicyLoadError
from overtake.controller.sidecar.policy_archive import MAX_ARRAY_BYTES, MAX_INFLATED_BYTES, check_archive
from overtake.controller.sidecar.units import UNITLESS, policy_unit
from overtake.mdp.baselines import Baseline
from overtake.mdp.errors import MDPError
from overtake.mdp.policy import Policy

__all__ = [
    "MAX_ARRAY_BYTES",
    "MAX_INFLATED_BYTES",
    "MAX_POLICY_BYTES",
    "BaselinePolicy",
    "PolicySet",
    "SpawnPolicy",
    "TablePolicy",
    "check_archive",
    "class_levels",
    "load_policy",
    "load_policy_bytes",
    "read_policy_file",
]

_MEMO_MAX = 1 << 16  # states remembered per policy; the reachable set is far smaller


class SpawnPolicy(Protocol):
    """What the limiter needs from a policy."""

    name: str  #: e.g. "pi(2)", "passthrough", "case04.npz"
    version: str  #: human-readable version (format version + states, or the baseline name)
    hash: str  #: content hash (16 hex digits)
    phases: tuple[int, ...]  #: labels per stage as the policy sees them: phases, or route classes
    per_phase_queues: bool  #: True: one waiting queue per (stage, label); False: per stage
    threads_per_stage: bool  #: True: the state counts threads per stage (observation policies)
    phase_info: str  #: what the policy was solved to see: full, start, none, route (baselines: none)
    predicted_wait: float | None  #: model E[W] in model time units, when known
    passthrough_wait: float | None  #: model E[W] of π(∞) for the same model, when known
    alpha: tuple[np.ndarray, ...] | None  #: phase priors per stage (None for baselines)
    T: tuple[np.ndarray, ...] | None  #: sub-generators per stage (None for baselines)
    #: per stage, the start-phase prior of each label (labels x phases) and the labels' weights:
    #: route classes for ``route`` policies, the identity and α for phase policies; None for baselines
    labels: tuple[tuple[np.ndarray, np.ndarray], ...] | None
    #: seconds per model time unit, or "model", "unrecorded", "unitless" (controller.sidecar.units)
    time_unit: float | str
    #: per stage, its model phases' names by index (overtake.phases), what a phase header may
    #: name; None without a model (baselines)
    model_phases: tuple[tuple[str, ...], ...] | None

    def action(self, state: tuple[int, ...]) -> tuple[int, ...]:
        """Threads to start from each queue."""
        ...


class BaselinePolicy:
    """π(k), π(k1,…,kN) or π(∞), answered in plain Python (equal to :meth:`overtake.mdp.Baseline.rule`)."""

    per_phase_queues = False
    threads_per_stage = False
    phase_info = "none"  # phase-blind: counts per stage
    predicted_wait: float | None = None
    passthrough_wait: float | None = None
    alpha: tuple[np.ndarray, ...] | None = None
    T: tuple[np.ndarray, ...] | None = None
    labels: tuple[tuple[np.ndarray, np.ndarray], ...] | None = None
    time_unit: float | str = UNITLESS  # no model times to convert
    model_phases: tuple[tuple[str, ...], ...] | None = None

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
        for i in range(n - 1, -1, -1):  # later stages first (van der Weij et al. §4)
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
        stages = policy.model.stages
        self.phase_info: str = policy.phase_info
        # observation policies (mdp.observation) see waiting per stage (none) or per (stage, route
        # class) (route), and threads per stage; their labels are route classes, not phases
        self.threads_per_stage = policy.observed
        if policy.phase_info == "none":
            self.phases = (1,) * len(stages)
        elif policy.phase_info == "route" and policy.routes is not None:
            self.phases = tuple(len(rs) for rs in policy.routes.stages)
        else:
            self.phases = tuple(int(s.phases) for s in stages)
        self.per_phase_queues = policy.phase_info in ("full", "route")
        metrics = policy.meta.get("metrics") or {}
        w = metrics.get("mean_response_time") if isinstance(metrics, dict) else None
        self.predicted_wait = float(w) if w is not None else None
        base = policy.meta.get("baselines")
        #: Apache's default π(∞), exactly evaluated at solve time (``overtake solve`` writes it)
        self.passthrough_wait = float(base["pi(inf)"]) if isinstance(base, dict) and "pi(inf)" in base else None
        self.alpha: tuple[np.ndarray, ...] | None = tuple(np.asarray(s.alpha, dtype=float) for s in policy.model.stages)
        self.T: tuple[np.ndarray, ...] | None = tuple(np.asarray(s.T, dtype=float) for s in policy.model.stages)
        self.labels: tuple[tuple[np.ndarray, np.ndarray], ...] | None
        if policy.phase_info == "route" and policy.routes is not None:
            self.labels = tuple((np.array([r.alpha for r in rs], dtype=float), np.array([r.weight for r in rs]))
                                for rs in policy.routes.stages)
        else:
            self.labels = tuple((np.eye(int(s.phases)), np.asarray(s.alpha, dtype=float)) for s in stages)
        self.stage_names = tuple(s.name for s in policy.model.stages)
        #: seconds per model time unit (controller.sidecar.units): what the sidecar converts its times with
        self.time_unit: float | str = policy_unit(policy.meta, name)
        self.model_phases: tuple[tuple[str, ...], ...] | None = tuple(s.phase_names() for s in stages)
        #: simulated predictions with mod_overtake_prio's CPU priority (``overtake solve --cpu-priority``):
        #: kind -> {"mean_response_time", "passthrough", "thresholds", ...} (mdp.priority_prediction)
        lv = policy.meta.get("cpu_priority")
        self.priority_predictions: dict[str, dict[str, Any]] = {
            k: v for k, v in lv.items() if isinstance(v, dict) and isinstance(v.get("mean_response_time"), float)
        } if isinstance(lv, dict) else {}
        #: "class": solved with short-first CPU classes in force (``overtake solve --cpu-priority
        #: class``): its predictions hold only with them
        self.solved_priority = "class" if policy.model.weights is not None else "off"
        #: the classes it was solved with (mdp.priority_classes.choose_classes): 1 where a phase's CPU weight
        #: is below the highest; the sidecar sends these rather than short-first
        self.class_start_levels: tuple[tuple[int, ...], ...] | None = None
        w = policy.model.weights
        if w is not None and policy.phase_info == "full":
            top, at, rows = max(w), 0, []
            for st in stages:
                rows.append(tuple(int(x < top) for x in w[at:at + st.phases]))
                at += st.phases
            self.class_start_levels = tuple(rows)
        self._memo: dict[tuple[int, ...], tuple[int, ...]] = {}

    def action(self, state: tuple[int, ...]) -> tuple[int, ...]:
        hit = self._memo.get(state)
        if hit is None:
            hit = tuple(int(x) for x in self.policy.action(state))
            if len(self._memo) >= _MEMO_MAX:
                self._memo.clear()
            self._memo[state] = hit
        return hit


class PolicySet:
    """Candidate policies for ``classifier.mode: auto`` (:mod:`overtake.controller.sidecar.auto`): every
    ``.npz`` of a directory given as ``--policy``, or one file. It acts as the member chosen last
    (:meth:`adopt`; π(∞) until the sidecar chooses), so the limiter enforces that one."""

    def __init__(self, members: Sequence[SpawnPolicy], name: str, n_stages: int) -> None:
        self.members = tuple(members)
        self.name = name
        self.hash = hashlib.sha256("".join(sorted(m.hash for m in self.members)).encode()).hexdigest()[:16]
        self.version = f"auto over {len(self.members)} policies"
        self.passthrough: SpawnPolicy = BaselinePolicy("passthrough", n_stages)
        self.passthrough_wait = next((m.passthrough_wait for m in self.members if m.passthrough_wait is not None), None)
        # a phase header may name any phase of the members' models (the chosen one may be a baseline)
        with_model = [m.model_phases for m in self.members if m.model_phases is not None]
        self.model_phases: tuple[tuple[str, ...], ...] | None = (
            tuple(max(per, key=len) for per in zip(*with_model)) if with_model else None)
        self.adopt(self.passthrough, "not chosen yet", None)

    def adopt(self, policy: SpawnPolicy, reason: str, gain: float | None) -> None:
        """Act as ``policy`` from now on (the limiter re-reads the layout on its next swap)."""
        self.chosen, self.reason, self.predicted_gain = policy, reason, gain
        self.phases: tuple[int, ...] = policy.phases
        self.per_phase_queues: bool = policy.per_phase_queues
        self.threads_per_stage: bool = policy.threads_per_stage
        self.phase_info: str = policy.phase_info
        self.predicted_wait: float | None = policy.predicted_wait
        self.alpha: tuple[np.ndarray, ...] | None = policy.alpha
        self.T: tuple[np.ndarray, ...] | None = policy.T
        self.labels: tuple[tuple[np.ndarray, np.ndarray], ...] | None = policy.labels
        self.class_start_levels: tuple[tuple[int, ...], ...] | None = getattr(policy, "class_start_levels", None)
        self.time_unit: float | str = policy.time_unit  # the set's own unit: controller.sidecar.units.units_of

    def action(self, state: tuple[int, ...]) -> tuple[int, ...]:
        return self.chosen.action(state)


def class_levels(policy: SpawnPolicy) -> tuple[tuple[int, ...], ...] | None:
    """Short-first CPU classes for mod_overtake_prio's class header, per stage and label
    (a phase, or a route class): 0 where the label's expected work α_k(−T)⁻¹1 is at most the
    stage's mean, 1 otherwise (:func:`overtake.mdp.priority.short_first_levels` for phases).
    None where the policy knows no labels (baselines, ``phase_info: none``): no class to send.
    A policy solved with classes (``overtake solve --cpu-priority class``) gets its own."""
    solved: tuple[tuple[int, ...], ...] | None = getattr(policy, "class_start_levels", None)
    if solved is not None:
        return solved
    if policy.alpha is None or policy.T is None or policy.labels is None or policy.phase_info == "none":
        return None
    out = []
    for alpha, T, (rows, _) in zip(policy.alpha, policy.T, policy.labels):
        m = np.linalg.solve(-T, np.ones(len(alpha)))  # expected remaining work per phase
        mean = float(alpha @ m)
        out.append(tuple(int(float(r @ m) > mean * (1 + 1e-9)) for r in rows))
    return tuple(out)


#: ``policy_max_bytes``: the largest policy file read (a server-side path, a download)
MAX_POLICY_BYTES = 64 << 20


def read_policy_file(path: str | Path, *, max_bytes: int = MAX_POLICY_BYTES) -> bytes:
    """The bytes of a policy file, refusing anything but a regular file of at most ``max_bytes``.

    The file is opened non-blocking (a FIFO opens at once instead of waiting for a writer) and
    checked with ``fstat`` on that descriptor, so a path swapped for a device or a pipe between
    the check and the read is refused too.

    Raises
    ------
    PolicyLoadError
        Missing, unreadable, not a regular file (``/dev/zero``, a FIFO, a directory), or too large.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise PolicyLoadError(f"policy: cannot read {path} ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "special")
            raise PolicyLoadError(f"policy: {path} is not a regular file ({kind}); give a policy file "
                                  "from `overtake solve --out`")
        if st.st_size > max_bytes:
            raise PolicyLoadError(f"policy: {path} has {st.st_size} bytes, more than policy_max_bytes = "
                                  f"{max_bytes}; raise policy_max_bytes or check the file")
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise PolicyLoadError(f"policy: cannot read {path} ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while we read it
        raise PolicyLoadError(f"policy: {path} is larger than policy_max_bytes = {max_bytes}")
    return data


def load_policy(spec: str, stage_names: Sequence[str], *, max_bytes: int = MAX_POLICY_BYTES,
                max_array_bytes: int = MAX_ARRAY_BYTES, max_inflated_bytes: int = MAX_INFLATED_BYTES) -> SpawnPolicy:
    """Parse ``--policy``: a policy file, a directory of them (:class:`PolicySet`, for
    ``classifier.mode: auto``), ``pi(k)``, ``pi(k1,...,kN)`` or ``passthrough``.

    A file is read by :func:`read_policy_file` (regular files of at most ``max_bytes`` only) and
    checked by :func:`~overtake.controller.sidecar.policy_archive.check_archive` (each member at most
    ``max_array_bytes`` inflated, all of them ``max_inflated_bytes``) before it is loaded.

    Raises
    ------
    PolicyLoadError
        Unknown name, corrupt file, or a model whose stages differ from ``stage_names``.
    """
    text = spec.strip()
    if text == "passthrough" or text.replace(" ", "").startswith(("pi(", "π(")):
        return BaselinePolicy(text, len(stage_names))
    if os.path.isdir(text):
        files = sorted(Path(text).glob("*.npz"))
        if not files:
            raise PolicyLoadError(f"policy: directory {text} holds no .npz policy; put the files of "
                                  "`overtake solve --phase-info full|none|route --out DIR/NAME.npz` there")
        members = [load_policy_bytes(read_policy_file(f, max_bytes=max_bytes), f.name, stage_names,
                                     max_array_bytes=max_array_bytes, max_inflated_bytes=max_inflated_bytes,
                                     shown=str(f)) for f in files]
        return PolicySet(members, Path(text).name or text, len(stage_names))
    if not os.path.lexists(text):
        raise PolicyLoadError(
            f"policy: {text!r} is neither a file nor a baseline; give P.npz from `overtake solve --out`, "
            "pi(k), pi(k1,...,kN) or passthrough"
        )
    data = read_policy_file(text, max_bytes=max_bytes)
    return load_policy_bytes(data, Path(text).name, stage_names, max_array_bytes=max_array_bytes,
                             max_inflated_bytes=max_inflated_bytes, shown=text)


def load_policy_bytes(data: bytes, name: str, stage_names: Sequence[str], *, max_array_bytes: int = MAX_ARRAY_BYTES,
                      max_inflated_bytes: int = MAX_INFLATED_BYTES, shown: str | None = None) -> TablePolicy:
    """A policy from the bytes of its ``.npz`` (an upload, a download); ``name`` names it.

    Raises
    ------
    PolicyLoadError
        As :func:`load_policy`; messages name ``shown`` (default ``name``).
    """
    label = shown or name
    check_archive(data, label, max_array_bytes=max_array_bytes, max_inflated_bytes=max_inflated_bytes)
    with tempfile.TemporaryDirectory(prefix="overtake-policy-") as tmp:
        path = Path(tmp) / (Path(name).name or "policy.npz")
        path.write_bytes(data)
        try:
            pol = Policy.load(path)
        except MDPError as exc:
            raise PolicyLoadError(f"policy: {str(exc).replace(str(path), label)}") from None
        except OSError as exc:
            raise PolicyLoadError(f"policy: cannot read {label} ({exc.strerror})") from None
    table = TablePolicy(pol, path.name)
    if tuple(table.stage_names) != tuple(stage_names):
        raise PolicyLoadError(
            f"policy: {label} was solved for stages {list(table.stage_names)} but the stages file "
            f"defines {list(stage_names)}; rename the stages or solve the matching scenario"
        )
    return table
