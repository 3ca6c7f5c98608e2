"""The two-layered tandem model of van der Weij, Bhulai and van der Mei, "Dynamic thread assignment", §2.

N stages in tandem share one processor. Stage ``i`` has a phase-type service time
PH(α_i, T_i) with ``M_i`` phases; a request is served at a stage only once a thread has been
spawned for it there, and the thread stays until the stage's service completes. With ``K``
active threads in total every thread progresses at rate ``c(K)/K`` where

    c(K) = min(K, m) / (1 + δ·K),    c(0) = 0,

``m`` = ``cores`` and ``δ`` = ``overhead`` (the paper has m = 1, δ = 0; δ > 0 models the
"too many threads hurts" effect its introduction describes). Arrivals are Poisson(λ) to stage 1.
Time is in seconds (or any unit, consistently); rates are per unit time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from overtake.phases import phase_names

from .errors import ModelError

FloatArray = npt.NDArray[np.float64]

_TOL = 1e-9


@overload
def capacity(k: float, cores: int, overhead: float) -> float: ...
@overload
def capacity(k: npt.NDArray[Any], cores: int, overhead: float) -> FloatArray: ...
def capacity(k: Any, cores: int, overhead: float) -> Any:
    """c(K) = min(K, m)/(1 + δ·K), the processor's total service rate with K active threads.

    The paper's §2 (m = 1, δ = 0 there; δ > 0 is this module's thread-overhead extension). The
    one definition: :meth:`TandemModel.capacity`, the simulator's and the heuristic's compiled
    kernels (through :data:`capacity_compiled`, numba's compilation of this very function) and
    the sidecar's attained-service clock all evaluate it.

    Parameters
    ----------
    k
        Active threads K: a number or an array (element-wise); K <= 0 gives c = 0.
    cores
        m, the processor's cores.
    overhead
        δ >= 0, the per-thread overhead.

    Returns
    -------
    float or ndarray
        c(K), a numpy float (or float array) of ``k``'s shape.
    """
    kk = np.maximum(k, 0)  # c(0) = 0: no thread, no service
    return np.minimum(kk, cores) / (1.0 + overhead * kk)


_compiled: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """``capacity_compiled``: :func:`capacity` compiled by numba for the nopython kernels
    (``_simkernel``, ``heuristic``); the same source, so the kernels cannot drift from it
    (tests/mdp/test_simulate.py compares them). Built on first access (PEP 562): importing numba
    costs a noticeable start-up that a small scenario never needs."""
    if name != "capacity_compiled":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _compiled:
        from overtake.jit import njit

        _compiled[name] = njit(cache=True, inline="always")(capacity)
    return _compiled[name]


def _as_ph(alpha: Any, T: Any, where: str) -> tuple[FloatArray, FloatArray]:
    """Validate a PH representation (α a distribution, T a sub-generator) and return float arrays."""
    a = np.asarray(alpha, dtype=float)
    t = np.asarray(T, dtype=float)
    if a.ndim != 1 or a.size == 0:
        raise ModelError(f"{where}.alpha must be a non-empty list of probabilities, got shape {a.shape}")
    m = a.size
    if t.shape != (m, m):
        raise ModelError(f"{where}.T must be a {m}x{m} matrix to match alpha, got shape {t.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(t))):
        raise ModelError(f"{where}: alpha and T must be finite numbers")
    if np.any(a < -_TOL):
        j = int(np.argmin(a))
        raise ModelError(f"{where}.alpha[{j}] must be >= 0, got {a[j]:g}")
    if abs(a.sum() - 1.0) > 1e-6:
        raise ModelError(f"{where}.alpha must sum to 1 (a distribution over phases), got sum {a.sum():.6g}")
    for j in range(m):
        if t[j, j] >= 0:
            raise ModelError(f"{where}.T[{j},{j}] must be < 0 (a sub-generator), got {t[j, j]:g}")
        off = np.delete(t[j], j)
        if np.any(off < -_TOL):
            raise ModelError(f"{where}.T[{j}] off-diagonal entries must be >= 0, got {off.min():g}")
        if t[j].sum() > _TOL * max(1.0, -t[j, j]):
            raise ModelError(
                f"{where}.T[{j}] row sum must be <= 0 (exit rate >= 0), got {t[j].sum():g}"
            )
    a = np.clip(a, 0.0, None)
    if abs(a.sum() - 1.0) > 1e-12:  # off by rounding only: kept, so that checking a checked law is the identity
        a = a / a.sum()
    t = t.copy()
    off_mask = ~np.eye(m, dtype=bool)
    t[off_mask] = np.clip(t[off_mask], 0.0, None)
    # Absorption must be reachable from every phase, else the mean is infinite.
    try:
        mean_from = np.linalg.solve(-t, np.ones(m))
    except np.linalg.LinAlgError:
        raise ModelError(f"{where}.T is singular: service never completes from some phase") from None
    if not np.all(np.isfinite(mean_from)) or np.any(mean_from <= 0):
        raise ModelError(f"{where}.T: service never completes from some phase (T must be transient)")
    return a, t


@dataclass(frozen=True, eq=False)
class Stage:
    """One request stage: a name and its PH(α, T) service time (rates per unit time)."""

    name: str
    alpha: FloatArray
    T: FloatArray

    def __post_init__(self) -> None:
        a, t = _as_ph(self.alpha, self.T, f"stages[{self.name}]")
        object.__setattr__(self, "alpha", a)
        object.__setattr__(self, "T", t)
        a.setflags(write=False)
        t.setflags(write=False)

    @property
    def phases(self) -> int:
        return int(self.alpha.size)

    @property
    def exit_rates(self) -> FloatArray:
        """t = −T·1, the rate of completing service from each phase."""
        return np.asarray(np.clip(-self.T.sum(axis=1), 0.0, None), dtype=np.float64)

    def mean(self) -> float:
        """E[S] = α(−T)⁻¹1."""
        return float(self.alpha @ np.linalg.solve(-self.T, np.ones(self.phases)))

    def second_moment(self) -> float:
        """E[S²] = 2α(−T)⁻²1."""
        u = np.linalg.solve(-self.T, np.ones(self.phases))
        return float(2.0 * self.alpha @ np.linalg.solve(-self.T, u))

    def phase_means(self) -> FloatArray:
        """Expected remaining service from each phase, (−T)⁻¹1."""
        return np.asarray(np.linalg.solve(-self.T, np.ones(self.phases)), dtype=np.float64)

    def phase_names(self) -> tuple[str, ...]:
        """Each phase's name by index (:func:`overtake.phases.phase_names`: ``short``/``long``
        for two phases, else the rank by mean)."""
        return phase_names(self.T)

    def describe_phases(self) -> list[dict[str, Any]]:
        """``[{"phase": 1, "name": "short", "start": α_1, "mean": m_1}, ...]`` by index; means in
        the model's unit."""
        return [{"phase": j + 1, "name": n, "start": float(a), "mean": float(m)}
                for j, (n, a, m) in enumerate(zip(self.phase_names(), self.alpha, self.phase_means()))]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Stage)
            and self.name == other.name
            and np.array_equal(self.alpha, other.alpha)
            and np.array_equal(self.T, other.T)
        )

    def __hash__(self) -> int:
        return hash((self.name, self.alpha.tobytes(), self.T.tobytes()))


def _checked_locks(locks: Any, n_stages: int) -> tuple[int | None, ...]:
    """``locks`` as a tuple of one capacity (an integer >= 1) or None per stage."""
    out = tuple(locks)
    if len(out) != n_stages:
        raise ModelError(f"locks: one entry per stage ({n_stages}), got {len(out)}; give None for a stage "
                         "without a lock")
    for i, m in enumerate(out):
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1):
            raise ModelError(f"locks[{i}]: the number of requests that may hold the stage's lock at once, an "
                             f"integer >= 1 (1 for a database write lock), or None for no lock; got {m!r}")
    return tuple(None if m is None else int(m) for m in out)


def _checked_readers(readers: Any, retry: Any, locks: tuple[int | None, ...] | None,
                     n_stages: int) -> tuple[tuple[bool, ...] | None, tuple[float, ...] | None]:
    """``readers`` as one bool per stage, ``commit_retry`` as positive floats; both need one lock."""
    rd = None if readers is None else tuple(readers)
    if rd is not None:
        if len(rd) != n_stages or not all(isinstance(x, (bool, np.bool_)) for x in rd):
            raise ModelError(f"readers: one true/false per stage ({n_stages}), true where the stage's threads read "
                             f"under the lock; got {readers!r}")
        rd = tuple(bool(x) for x in rd)
    locked = [i for i, m in enumerate(locks or ()) if m is not None]
    if (rd is not None and any(rd)) or retry is not None:
        if len(locked) != 1 or (locks or ())[locked[0]] != 1:
            raise ModelError("readers, commit_retry: the model needs exactly one stage with a lock of capacity 1 "
                             f"(locks), the writers the readers hold up; got locks {locks!r}")
        if rd is not None and rd[locked[0]]:
            raise ModelError(f"readers[{locked[0]}]: the locked stage's threads are its writers, not its readers; "
                             "set it false")
    if retry is None:
        return rd, None
    try:
        r = tuple(float(x) for x in retry)
    except (TypeError, ValueError):
        raise ModelError(f"commit_retry: a list of sleeps (numbers > 0), got {retry!r}") from None
    if not r or not all(np.isfinite(x) and x > 0 for x in r):
        raise ModelError(f"commit_retry: a non-empty list of sleeps, each a number > 0, got {retry!r}")
    if rd is None or not any(rd):
        raise ModelError("commit_retry: a commit waits only for readers; set readers too (or drop commit_retry)")
    return rd, r


def exit_law(stage: Stage) -> FloatArray:
    """P(a service of ``stage`` ends in phase j) = (α(−T)⁻¹)_j t_j: the phase a request leaves it from."""
    visits = np.linalg.solve(-stage.T.T, stage.alpha)  # α(−T)⁻¹, the mean time spent in each phase
    out = np.clip(visits * stage.exit_rates, 0.0, None)
    return np.asarray(out / out.sum(), dtype=np.float64)


Routing = tuple[tuple[tuple[float, ...], ...], ...]


def _checked_routing(routing: Any, stages: tuple[Stage, ...]) -> Routing:
    """``routing`` as nested float tuples: one row-stochastic M_i × M_{i+1} matrix per pair of
    consecutive stages, whose start law (the exit law of stage i times the matrix) is stage i + 1's α."""
    mats = list(routing)
    if len(mats) != len(stages) - 1:
        raise ModelError(f"routing: one exit-phase x start-phase matrix per pair of consecutive stages "
                         f"({len(stages) - 1}), got {len(mats)}; omit routing for independent stages")
    out = []
    for i, raw in enumerate(mats):
        a, b = stages[i], stages[i + 1]
        try:
            R = np.array(raw, dtype=float)  # a copy: rows are rescaled in place below
        except (TypeError, ValueError):
            raise ModelError(f"routing[{i}]: a {a.phases}x{b.phases} matrix of numbers, got {raw!r}") from None
        if R.shape != (a.phases, b.phases):
            raise ModelError(f"routing[{i}]: must be {a.phases}x{b.phases} (a row per phase of {a.name}, a column "
                             f"per phase of {b.name}), got shape {R.shape}")
        if not np.all(np.isfinite(R)) or np.any(R < 0):
            raise ModelError(f"routing[{i}]: entries must be probabilities >= 0, got {R.tolist()}")
        sums = R.sum(axis=1)
        if np.any(np.abs(sums - 1.0) > 1e-6):
            j = int(np.argmax(np.abs(sums - 1.0)))
            raise ModelError(f"routing[{i}] row {j}: the start law of {b.name} after leaving {a.name} from phase "
                             f"{j + 1} must sum to 1, got {sums[j]:.6g}; normalise the row")
        # rows off by rounding only are kept as given, so that checking a checked routing (a policy
        # file's model read back) is the identity its hash relies on; a division would move the
        # last bits again on each pass
        off = np.abs(sums - 1.0) > 1e-12
        R[off] = R[off] / sums[off, None]
        implied = exit_law(a) @ R
        if np.max(np.abs(implied - b.alpha)) > 1e-6:
            raise ModelError(
                f"routing[{i}]: the start law it implies for {b.name}, exit law of {a.name} x routing = "
                f"{np.round(implied, 6).tolist()}, must equal {b.name}'s alpha {np.round(b.alpha, 6).tolist()} "
                f"(within 1e-6); set that stage's alpha to it, or fix the routing")
        out.append(tuple(tuple(float(x) for x in row) for row in R))
    return tuple(out)


@dataclass(frozen=True)
class TandemModel:
    """The paper's tandem: Poisson(λ) arrivals, N PH stages, one shared processor.

    Parameters
    ----------
    arrival_rate
        λ > 0.
    stages
        The stages in the order requests visit them.
    cores
        ``m`` in c(K) = min(K, m)/(1 + δK); the paper has m = 1.
    overhead
        ``δ`` ≥ 0, the per-thread slowdown; the paper has δ = 0.
    weights
        CPU weight of a thread at each (stage, phase) coordinate: the processor's c(K) is shared
        in proportion to them (discriminatory processor sharing; Fayolle, Mitrani and Iasnogorodski,
        *Sharing a processor among many job classes*, JACM 1980). None: equal shares, the paper's
        processor sharing. With phases that do not move (hyperexponential stages) this is the
        CPU priority by start phase (class priority, :mod:`overtake.mdp.priority_classes`).
        One core only.
    locks
        Per stage, the capacity m of a serialising resource the stage's whole service holds (a
        database write lock: m = 1), or None for a stage without one. At most m requests progress
        in a locked stage; the others started there hold their thread, blocked, using no CPU, and
        take the lock in turn (:mod:`overtake.mdp.lock`). None: no stage has a lock.
    routing
        Coupled stages (a transaction whose stages' costs correlate): ``routing[i][j][l]`` is the
        probability that a request leaving stage i from phase j starts stage i + 1 in phase l.
        Each row is a distribution, and the start law it implies (stage i's exit law times the
        matrix) must be stage i + 1's α, so each stage's own service time is unchanged and only
        the dependence between stages is added. Every row equal to α_{i+1}: the independent
        model (the paper's). None: independent stages. Given the start phase at stage i + 1 the
        rest of the path no longer depends on stage i (the chain is Markov), so a request waiting
        between stages carries its drawn start phase, exactly what the ``full`` layout's
        per-coordinate queues hold: the coupled ``full`` state space is the independent one.
        Phase-blind layouts keep one queue per distinct routing row instead
        (:meth:`overtake.mdp.statespace.Layout.build`).
    """

    arrival_rate: float
    stages: tuple[Stage, ...]
    cores: int = 1
    overhead: float = 0.0
    weights: tuple[float, ...] | None = None
    locks: tuple[int | None, ...] | None = None
    routing: Routing | None = None
    readers: tuple[bool, ...] | None = None
    commit_retry: tuple[float, ...] | None = None
    offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not np.isfinite(self.arrival_rate) or self.arrival_rate <= 0:
            raise ModelError(f"arrival_rate must be a positive number, got {self.arrival_rate!r}")
        if len(self.stages) == 0:
            raise ModelError("stages must list at least one stage")
        if isinstance(self.cores, bool) or not isinstance(self.cores, (int, np.integer)) or self.cores < 1:
            raise ModelError(f"cores must be an integer >= 1, got {self.cores!r}")
        if not np.isfinite(self.overhead) or self.overhead < 0:
            raise ModelError(f"overhead must be >= 0, got {self.overhead!r}")
        object.__setattr__(self, "stages", tuple(self.stages))
        offs = np.concatenate([[0], np.cumsum([s.phases for s in self.stages])]).astype(int)
        object.__setattr__(self, "offsets", tuple(int(o) for o in offs))
        if self.weights is not None:
            w = tuple(float(x) for x in self.weights)
            if len(w) != self.n_coords or not all(np.isfinite(x) and x > 0 for x in w):
                raise ModelError(f"weights: one positive CPU weight per (stage, phase) coordinate ({self.n_coords}), "
                                 f"got {self.weights!r}")
            if self.cores != 1:
                raise ModelError("weights: weighted CPU sharing is modelled on one core; set cores: 1")
            object.__setattr__(self, "weights", w)
        if self.locks is not None:
            object.__setattr__(self, "locks", _checked_locks(self.locks, len(self.stages)))
        if self.routing is not None:
            object.__setattr__(self, "routing", _checked_routing(self.routing, self.stages))
        if self.readers is not None or self.commit_retry is not None:
            rd, retry = _checked_readers(self.readers, self.commit_retry, self.locks, len(self.stages))
            object.__setattr__(self, "readers", rd)
            object.__setattr__(self, "commit_retry", retry)

    @property
    def coupled(self) -> bool:
        """Whether the start phase at a stage depends on the phase the request left the previous one (``routing``)."""
        return self.routing is not None

    def routing_matrix(self, stage: int) -> FloatArray:
        """R_i: the start law at stage i + 1 per exit phase of stage i (rows α_{i+1} when not coupled)."""
        if self.routing is not None:
            return np.asarray(self.routing[stage], dtype=np.float64)
        nxt = self.stages[stage + 1]
        return np.asarray(np.tile(nxt.alpha, (self.stages[stage].phases, 1)), dtype=np.float64)

    def start_law(self, stage: int, phase: int) -> FloatArray:
        """Start-phase law at stage ``stage`` + 1 of a request that left ``stage`` from ``phase``."""
        if self.routing is None:
            return self.stages[stage + 1].alpha
        return np.asarray(self.routing[stage][phase], dtype=np.float64)

    @property
    def has_lock(self) -> bool:
        """Whether some stage holds a serialising resource (``locks``)."""
        return self.locks is not None and any(m is not None for m in self.locks)

    @property
    def has_readers(self) -> bool:
        """Whether some stage reads under the lock, so that a commit waits for readers (``readers``)."""
        return self.readers is not None and any(self.readers)

    def lock_of(self, stage: int) -> int | None:
        """The lock capacity of ``stage`` (None: no lock)."""
        return None if self.locks is None else self.locks[stage]

    # ---- sizes and coordinates -------------------------------------------------------------
    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def n_coords(self) -> int:
        """D = Σ M_i, the number of (stage, phase) coordinates."""
        return self.offsets[-1]

    def coord(self, stage: int, phase: int) -> int:
        return self.offsets[stage] + phase

    def coord_stage(self) -> npt.NDArray[np.int64]:
        """Stage index of every coordinate."""
        return np.repeat(np.arange(self.n_stages), [s.phases for s in self.stages])

    def coord_labels(self) -> list[str]:
        return [f"{s.name}/phase{j + 1}" for s in self.stages for j in range(s.phases)]

    # ---- load and capacity -------------------------------------------------------------------
    def mean_service(self) -> float:
        """Σ E[S_i], the mean total work of a request."""
        return float(sum(s.mean() for s in self.stages))

    @property
    def load(self) -> float:
        """ρ = λ·Σ E[S_i] / m — the processor's utilisation when every thread runs at full speed."""
        return self.arrival_rate * self.mean_service() / self.cores

    def capacity(self, K: npt.ArrayLike) -> FloatArray:
        """c(K) = min(K, m)/(1 + δK), the processor's total service rate with K active threads
        (:func:`capacity` with this model's m and δ)."""
        return capacity(np.asarray(K, dtype=float), self.cores, self.overhead)

    def max_capacity(self, k_max: int) -> float:
        return float(np.max(self.capacity(np.arange(1, max(1, k_max) + 1))))

    def stable_load(self, k_max: int) -> float:
        """λ·ΣE[S]/max_K c(K): the load against the best capacity the thread cap allows."""
        return self.arrival_rate * self.mean_service() / self.max_capacity(k_max)

    def check_stable(self, k_max: int | None = None) -> None:
        """Raise :class:`ModelError` when the offered load cannot be served (ρ ≥ 1)."""
        kk = self.cores if k_max is None else k_max
        rho = self.stable_load(kk)
        if rho >= 1.0:
            raise ModelError(
                f"load must be < 1 for a stable system, got rho = {rho:.4g} "
                f"(arrival_rate {self.arrival_rate:.4g} x mean work {self.mean_service():.4g}"
                f" / capacity {self.max_capacity(kk):.4g}); lower load or arrival_rate"
            )
