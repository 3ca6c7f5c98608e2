"""Discrete-event simulation of the tandem under any policy — the independent second method.

The simulated system is the MDP's (van der Weij et al., "Dynamic thread assignment", §2) exactly:
Poisson(λ) arrivals, N stages, one processor shared by the K active threads at total rate c(K) =
min(K, m)/(1 + δK), a thread kept until its stage completes, and the policy consulted at every
arrival, phase change and completion with the state the MDP sees (waiting per queue, threads per
(stage, phase) coordinate). The event loop is compiled with numba (:mod:`overtake.mdp._simkernel`,
processor sharing in virtual time).

Policies: a :class:`~overtake.mdp.policy.Policy` artifact, the overtaking heuristic
(:mod:`overtake.mdp.heuristic`), or a baseline π(k) / π(k1,…,kN) / π(∞) (later stages first, FCFS in a
stage).

Service: the model's PH (phases simulated, the policy sees the true phase), or any sampler per
stage — a scipy.stats frozen distribution or an empirical sample (see :func:`service_from_spec`).
For non-PH service the policy still needs a phase label; ``phase="oracle"`` draws the starting
label from the fitted PH's posterior given the request's actual work, P(J₀ = j | S = s) ∝
α_j (e^{Ts} t)_j; ``phase="prior"`` draws it from α (all a server knows at arrival).

CPU priority (``cpu_priority``, :class:`~overtake.mdp.priority.CpuPriority`): the active threads
share the CPU by per-level weights, PS within a level, a thread's level set by its attained
service at the stage and its starting class (:mod:`overtake.mdp.priority`). Without it the CPU is
plain PS, exactly as before.

Output: mean response time with a 95% confidence interval by batch means (``batches``
consecutive batches of measured requests in arrival order, Student t), per-stage sojourn and
waiting, time-average threads and requests in system, and response-time percentiles.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
from scipy.special import stdtrit

from ._simcall import run_kernel
from .baselines import Baseline
from .errors import ModelError, PolicyFileError
from .heuristic import OvertakingHeuristic, overtaking_heuristic
from .model import Stage, TandemModel
from .policy import Policy
from .priority import CpuPriority
from .routes import RouteSplit

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
PhaseMode = Literal["oracle", "prior"]

PERCENTILES = (50.0, 95.0, 99.0, 99.9)


class Sampler(Protocol):
    """Anything that draws i.i.d. service times: ``rvs(size, random_state) -> array``."""

    def rvs(self, size: int, random_state: np.random.Generator) -> FloatArray: ...


@dataclass(frozen=True)
class ServiceSampler:
    """A named service-time sampler: a scipy.stats frozen distribution or an empirical sample."""

    name: str
    dist: Any = None
    sample: FloatArray | None = None
    factor: float = 1.0

    def rvs(self, size: int, random_state: np.random.Generator) -> FloatArray:
        if self.sample is not None:
            x = random_state.choice(self.sample, size=size, replace=True)
        else:
            x = np.asarray(self.dist.rvs(size=size, random_state=random_state), dtype=float)
        return x * self.factor

    def mean(self) -> float:
        m = float(np.mean(self.sample)) if self.sample is not None else float(self.dist.mean())
        return m * self.factor


_SPEC = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$")


def _kwargs(body: str, spec: str) -> dict[str, float]:
    out: dict[str, float] = {}
    if not body.strip():
        return out
    for part in body.split(","):
        if "=" not in part:
            raise ModelError(f"service spec {spec!r}: arguments must be key=value, got {part.strip()!r}")
        k, v = part.split("=", 1)
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise ModelError(f"service spec {spec!r}: {k.strip()} must be a number, got {v.strip()!r}") from None
    return out


class _Bimodal:
    """Mixture of two lognormals (shape ``s``): weight ``p`` at median 1, 1 − p at median ``ratio``."""

    def __init__(self, p: float, ratio: float, s: float) -> None:
        if not 0 < p < 1 or ratio <= 0 or s <= 0:
            raise ModelError("service spec bimodal: need 0 < p < 1, ratio > 0, s > 0")
        self.p, self.ratio, self.s = p, ratio, s

    def rvs(self, size: int, random_state: np.random.Generator) -> FloatArray:
        base = random_state.lognormal(0.0, self.s, size)
        hi = random_state.random(size) >= self.p
        return np.where(hi, base * self.ratio, base)

    def mean(self) -> float:
        return (self.p + (1 - self.p) * self.ratio) * math.exp(self.s**2 / 2)


def service_from_spec(spec: str, mean: float | None = None) -> ServiceSampler:
    """Parse ``--service-from``: a file of durations, or ``NAME(k=v, …)``.

    * a path to a file of durations (one per line or comma-separated; ``#`` comments): an
      empirical sample, resampled with replacement and used as is;
    * any ``scipy.stats`` continuous distribution by name with its shape keywords, e.g.
      ``lognorm(s=1.0)``, ``weibull_min(c=0.5)``, ``pareto(b=2.5)``, ``truncpareto(b=1.2, c=1000)``
      (bounded Pareto), ``expon``; ``bimodal(p=0.9, ratio=10, s=0.25)`` is a two-lognormal
      mixture. Without ``scale`` the distribution is rescaled to ``mean`` (the stage's mean).
    """
    p = Path(spec)
    m = _SPEC.match(spec)
    if p.exists() or m is None:
        if not p.exists():
            raise ModelError(f"--service-from: file {spec} does not exist")
        text = p.read_text()
        vals = [v for line in text.splitlines() for v in line.split("#", 1)[0].replace(",", " ").split()]
        try:
            x = np.asarray([float(v) for v in vals], dtype=float)
        except ValueError:
            raise ModelError(f"--service-from: {spec} must hold numbers (durations), one per line") from None
        if x.size < 2 or np.any(~np.isfinite(x)) or np.any(x <= 0):
            raise ModelError(f"--service-from: {spec} needs at least 2 positive finite durations")
        return ServiceSampler(f"empirical({p.name}, n={x.size})", sample=x)
    name, kw = m.group(1), _kwargs(m.group(2) or "", spec)
    dist: Any
    if name == "bimodal":
        try:
            dist = _Bimodal(kw.pop("p", 0.9), kw.pop("ratio", 10.0), kw.pop("s", 0.25))
        except TypeError:
            raise ModelError(f"--service-from: {spec!r}: bimodal takes p, ratio, s") from None
        if kw:
            raise ModelError(f"--service-from: {spec!r}: bimodal takes p, ratio, s, not {sorted(kw)}")
        scaled = True
    else:
        import scipy.stats as st  # lazy: scipy.stats costs seconds to import, only specs need it

        gen = getattr(st, name, None)
        if not isinstance(gen, st.rv_continuous):
            raise ModelError(f"--service-from: {name!r} is not a scipy.stats continuous distribution")
        scaled = "scale" not in kw
        try:
            dist = gen(**kw)
            dmean = float(dist.mean())
        except (TypeError, ValueError) as exc:
            raise ModelError(f"--service-from: {spec!r}: {exc}") from None
        if not np.isfinite(dmean) or dmean <= 0:
            raise ModelError(f"--service-from: {spec!r} has no finite positive mean (pick shape parameters with one)")
        if float(dist.support()[0]) < 0:
            raise ModelError(f"--service-from: {spec!r} can be negative; service times must be >= 0")
    factor = 1.0
    if scaled and mean is not None:
        factor = mean / float(dist.mean())
    label = spec.strip() + (f" x{factor:.4g}" if factor != 1.0 else "")
    return ServiceSampler(label, dist=dist, factor=factor)


@dataclass(frozen=True)
class StageFigures:
    """Per-stage results: mean sojourn (waiting + service), mean waiting, time-average threads."""

    name: str
    mean_sojourn: float
    mean_waiting: float
    mean_threads: float


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of one simulation run (times in the model's unit)."""

    policy: str
    service: str
    phase_info: str
    requests: int
    warmup: int
    seed: int
    mean_response_time: float
    ci95: float
    batches: int
    percentiles: dict[str, float]
    stages: tuple[StageFigures, ...]
    mean_threads: float
    mean_in_system: float
    arrival_rate: float
    events: int
    seconds: float
    method: str = "event-driven, processor sharing in virtual time, numba-compiled; CI by batch means"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def little_residual(self) -> float:
        """(E[N] − λ E[W]) / E[N]: Little's law on the measured window (≈ 0 up to noise)."""
        return (self.mean_in_system - self.arrival_rate * self.mean_response_time) / self.mean_in_system

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [asdict(s) for s in self.stages]
        d["little_residual"] = self.little_residual
        return d


def _cum(p: FloatArray) -> FloatArray:
    c = np.cumsum(p)
    c[-1] = 1.0 + 1e-12  # guard against rounding: the last bin always catches u < 1
    return c


def _tables(model: TandemModel) -> tuple[IntArray, IntArray, FloatArray, FloatArray, FloatArray]:
    N, D = model.n_stages, model.n_coords
    cs = model.coord_stage().astype(np.int64)
    off = np.asarray(model.offsets, dtype=np.int64)
    mmax = max(s.phases for s in model.stages)
    alpha_cum = np.ones((N, mmax)) * (1.0 + 1e-12)
    mu = np.zeros(D)
    jump_cum = np.zeros((D, D + 1))
    for i, s in enumerate(model.stages):
        alpha_cum[i, : s.phases] = _cum(s.alpha)
        o = model.offsets[i]
        for j in range(s.phases):
            rate = -s.T[j, j]
            mu[o + j] = rate
            p = np.zeros(D + 1)
            for l in range(s.phases):
                if l != j:
                    p[o + l] = s.T[j, l] / rate
            p[D] = s.exit_rates[j] / rate
            jump_cum[o + j] = _cum(p / p.sum())
    return cs, off, alpha_cum, mu, jump_cum


def _start_tables(model: TandemModel) -> FloatArray:
    """Per coordinate d = (i, j): the cumulative start law at stage i + 1 of a request leaving d
    (:meth:`TandemModel.start_law`; ones for the last stage, never drawn)."""
    mmax = max(s.phases for s in model.stages)
    out = np.ones((model.n_coords, mmax)) * (1.0 + 1e-12)
    for i, st in enumerate(model.stages[:-1]):
        for j in range(st.phases):
            out[model.coord(i, j), : model.stages[i + 1].phases] = _cum(np.array(model.start_law(i, j), dtype=float))
    return out


def posterior_labels(stage: Stage, work: FloatArray, rng: np.random.Generator) -> IntArray:
    """Draw the starting phase J₀ from P(J₀ = j | S = s) ∝ α_j (e^{Ts} t)_j for each work s."""
    M = stage.phases
    if M == 1:
        return np.zeros(work.size, dtype=np.int64)
    with np.errstate(divide="ignore"):
        log_a = np.log(stage.alpha)
    if np.allclose(stage.T, np.diag(np.diag(stage.T))):
        mu = -np.diag(stage.T)
        logf = np.log(mu)[None, :] - work[:, None] * mu[None, :]
    else:
        from overtake.fitting import PhaseType  # general T: uniformization, robust in the tail

        logf = np.empty((work.size, M))
        for j in range(M):
            e = np.zeros(M)
            e[j] = 1.0
            logf[:, j] = PhaseType(e, stage.T).logpdf(work)
    lp = log_a[None, :] + logf
    lp -= lp.max(axis=1, keepdims=True)
    p = np.exp(lp)
    cum = np.cumsum(p, axis=1)
    u = rng.random(work.size) * cum[:, -1]
    starts: IntArray = np.minimum((cum < u[:, None]).sum(axis=1), M - 1).astype(np.int64)
    return starts


PolicyLike = Policy | OvertakingHeuristic | Baseline | str


def _ntab(L: int, C: int) -> IntArray:
    n = np.zeros((L + 2, C + 1), dtype=np.int64)
    for r in range(L + 2):
        for b in range(C + 1):
            n[r, b] = math.comb(b + r, r)
    return n


def _resolve(model: TandemModel, policy: PolicyLike) -> PolicyLike:
    if isinstance(policy, str):
        name = policy.strip()
        if name.startswith("heuristic"):
            m = re.fullmatch(r"heuristic(?:\((\w+)\))?", name)
            if not m:
                raise ModelError(f"policy {name!r}: use heuristic, heuristic(lookahead) or heuristic(literal)")
            return overtaking_heuristic(model, variant=m.group(1) or "pairwise")
        return Baseline.parse(name, model.n_stages)
    return policy


def _route_tables(pol: Policy) -> tuple[FloatArray, IntArray, FloatArray]:
    """Cumulative route weights per stage, first queue of each stage, cumulative priors per queue."""
    model = pol.model
    split = pol.routes if pol.routes is not None else RouteSplit.single(model)
    rmax = max(len(rs) for rs in split.stages)
    mmax = max(s.phases for s in model.stages)
    route_cum = np.ones((model.n_stages, rmax)) * (1.0 + 1e-12)
    q0 = np.zeros(model.n_stages + 1, dtype=np.int64)
    alpha_cum = np.ones((split.n_queues, mmax)) * (1.0 + 1e-12)
    q = 0
    for i, rs in enumerate(split.stages):
        q0[i] = q
        route_cum[i, : len(rs)] = _cum(np.array([r.weight for r in rs]))
        for r in rs:
            alpha_cum[q, : r.alpha.size] = _cum(np.asarray(r.alpha, dtype=float))
            q += 1
    q0[-1] = q
    return route_cum, q0, alpha_cum


def policy_name(policy: PolicyLike) -> str:
    if isinstance(policy, Policy):
        return f"policy file ({policy.phase_info} phase info, {policy.keys.size} states)"
    if isinstance(policy, (OvertakingHeuristic, Baseline)):
        return policy.name
    return str(policy)


@dataclass(frozen=True)
class _CpuLevels:
    """The kernel's CPU-priority tables: level weights, attained-service thresholds, start levels."""

    priority: CpuPriority | None
    weights: FloatArray
    thresholds: FloatArray
    start: IntArray


def _check_run(requests: int, warmup: float, batches: int, phase: str) -> None:
    if requests < batches * 10:
        raise ModelError(f"requests must be >= {batches * 10} (10 per batch), got {requests}")
    if not 0 <= warmup < 10:
        raise ModelError(f"warmup must be a fraction in [0, 10), got {warmup}")
    if batches < 2:
        raise ModelError(f"batches must be >= 2, got {batches}")
    if phase not in ("oracle", "prior"):
        raise ModelError(f"phase must be 'oracle' or 'prior', got {phase!r}")


def _cpu_levels(model: TandemModel, cpu_priority: CpuPriority | None) -> _CpuLevels:
    N, D = model.n_stages, model.n_coords
    if model.weights is not None:
        # weights by phase are class priority by start phase while no phase moves to another
        if cpu_priority is not None or any(np.count_nonzero(st.T - np.diag(np.diag(st.T))) for st in model.stages):
            raise ModelError("weights: the simulator shares the CPU by cpu_priority=; weights by phase translate "
                             "only for stages whose phases do not move and without another cpu_priority")
        ws = sorted(set(model.weights), reverse=True)
        cpu_priority = CpuPriority(tuple(w / ws[0] for w in ws), tuple((math.inf,) * (len(ws) - 1) for _ in range(N)),
                                   tuple(tuple(ws.index(model.weights[model.coord(i, j)]) for j in range(st.phases))
                                         for i, st in enumerate(model.stages)), "weights by phase")
    if cpu_priority is None:
        return _CpuLevels(None, np.ones(1), np.zeros((N, 0)), np.zeros(D, dtype=np.int64))
    if not isinstance(cpu_priority, CpuPriority):
        raise ModelError(f"cpu_priority must be a CpuPriority, got {type(cpu_priority).__name__}")
    start = cpu_priority.coord_start(model)  # checks the levels fit the model before they are shaped to it
    return _CpuLevels(cpu_priority, np.asarray(cpu_priority.weights, dtype=float),
                      np.asarray(cpu_priority.thresholds, dtype=float).reshape(N, cpu_priority.levels - 1), start)


def _check_coupling(model: TandemModel, policy: PolicyLike, service: Sequence[Sampler] | None) -> None:
    if model.coupled and service is not None:
        raise ModelError("routing: the simulator runs coupled stages on the model's PH service (the routing links "
                         "their phases); drop service= (--service-from) or the routing")
    if model.coupled and isinstance(policy, Policy) and policy.phase_info != "full":
        raise ModelError(f"routing: the simulator runs a coupled model's policy table with phase_info full (its "
                         f"queues are per coordinate); got a {policy.phase_info} policy")
    if model.has_lock and service is not None:
        raise ModelError("locks: the simulator runs a stage with a lock on the model's PH service; drop service= "
                         "(--service-from) or the lock")


@dataclass(frozen=True)
class _Service:
    """The kernel's service input: mode 0 simulates the PH phases, mode 1 replays drawn work."""

    mode: int
    work: FloatArray
    label0: IntArray
    name: str
    phase_used: str


def _service_draws(model: TandemModel, service: Sequence[Sampler] | None, phase: PhaseMode, n_total: int,
                   rng: np.random.Generator) -> _Service:
    if service is None:
        return _Service(0, np.zeros((1, 1)), np.zeros((1, 1), dtype=np.int64), "phase-type (model)", "true phase")
    N = model.n_stages
    if len(service) != N:
        raise ModelError(f"service: give one sampler per stage ({N}), got {len(service)}")
    work = np.empty((n_total, N))
    label0 = np.empty((n_total, N), dtype=np.int64)
    for i, (s, stg) in enumerate(zip(service, model.stages)):
        x = np.asarray(s.rvs(n_total, rng), dtype=float)
        if x.shape != (n_total,) or np.any(~np.isfinite(x)) or np.any(x < 0):
            raise ModelError(f"service[{i}]: sampler must return {n_total} finite durations >= 0")
        work[:, i] = x
        if phase == "oracle":
            label0[:, i] = posterior_labels(stg, x, rng)
        else:
            label0[:, i] = np.minimum(
                np.searchsorted(np.cumsum(stg.alpha), rng.random(n_total), side="right"), stg.phases - 1)
    return _Service(1, work, label0, ", ".join(getattr(s, "name", type(s).__name__) for s in service), phase)


@dataclass
class _PolicyTables:
    """The kernel's policy input: type (0 total cap, 1 caps per stage, 2 table, 3 heuristic), queue mode,
    and the tables of whichever type it is (the others stay empty)."""

    ptype: int = 0
    qmode: int = 0
    base_total: int = -1
    base_caps: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tab_keys: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tab_spawn: IntArray = field(default_factory=lambda: np.zeros((1, 1), dtype=np.int64))
    tab_ntab: IntArray = field(default_factory=lambda: np.zeros((1, 1), dtype=np.int64))
    tab_C: int = 0
    tab_kmax: int = 0
    h_rem: FloatArray = field(default_factory=lambda: np.zeros(0))
    h_min: FloatArray = field(default_factory=lambda: np.zeros((1, 1)))
    h_wait: FloatArray = field(default_factory=lambda: np.zeros((1, 1)))
    h_order: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    h_var: int = 0
    route_cum: FloatArray = field(default_factory=lambda: np.ones((1, 1)))
    route_q0: IntArray | None = None
    queue_alpha_cum: FloatArray = field(default_factory=lambda: np.ones((1, 1)))

    def decision_args(self) -> tuple[Any, ...]:
        return (self.ptype, self.qmode, self.base_total, self.base_caps,
                self.tab_keys, self.tab_spawn, self.tab_ntab, self.tab_C, self.tab_kmax,
                self.h_rem, self.h_min, self.h_wait, self.h_order, self.h_var)


def _policy_tables(model: TandemModel, pol: PolicyLike, service: Sequence[Sampler] | None) -> _PolicyTables:
    t = _PolicyTables(route_q0=np.zeros(model.n_stages + 1, dtype=np.int64))
    if isinstance(pol, Baseline):
        if pol.per_stage is not None:
            t.ptype, t.base_caps = 1, np.asarray(pol.per_stage, dtype=np.int64)
        else:
            t.base_total = -1 if pol.total is None else int(pol.total)
    elif isinstance(pol, Policy):
        if [s.phases for s in pol.model.stages] != [s.phases for s in model.stages]:
            raise PolicyFileError(
                f"policy file has stages with {[s.phases for s in pol.model.stages]} phases but the scenario "
                f"has {[s.phases for s in model.stages]}; solve the policy for this scenario")
        t.ptype = 2
        t.qmode = 1 if pol.phase_info == "full" else (2 if pol.observed else 0)
        if pol.observed:
            if pol.routes is not None and service is not None:
                raise ModelError("a route policy needs the model's PH service (routes set the start phases); "
                                 "drop --service-from or use a policy without routes")
            t.route_cum, t.route_q0, t.queue_alpha_cum = _route_tables(pol)
        t.tab_keys = np.ascontiguousarray(pol.keys, dtype=np.int64)
        t.tab_spawn = np.ascontiguousarray(pol.spawn, dtype=np.int64)
        t.tab_ntab = _ntab(pol.Q + pol.D, pol.max_requests)
        t.tab_C, t.tab_kmax = int(pol.max_requests), int(pol.max_threads)
    elif isinstance(pol, OvertakingHeuristic):
        if pol.model.n_coords != model.n_coords:
            raise ModelError("heuristic was built for a different model")
        t.ptype, t.qmode = 3, 1
        t.h_rem, t.h_min, t.h_order, t.h_var = pol.remaining, np.ascontiguousarray(pol.min_pair), pol.order, pol.variant_code
        t.h_wait = np.ascontiguousarray(pol.wait)
    else:
        raise ModelError(f"policy must be a Policy, heuristic, baseline or name, got {type(pol).__name__}")
    return t


def _result(out: tuple[Any, ...], model: TandemModel, pol: PolicyLike, svc: _Service, levels: _CpuLevels,
            lv_area: FloatArray, n_warm: int, n_meas: int, seed: int, batches: int, max_threads: int,
            seconds: float) -> SimulationResult:
    """The kernel's raw sums as figures: batch-means interval, percentiles, per-stage time averages."""
    resp, stage_soj, stage_wait, area_K, area_N, area_ks, window, events, overflow, done = out
    if overflow:
        raise ModelError(f"more than {max_threads} concurrent threads: the run is unstable under this policy "
                         "(or raise max_threads)")
    if done < n_meas:
        raise ModelError(f"simulation stopped with {done} of {n_meas} requests done (no further events)")
    bm = resp[: (n_meas // batches) * batches].reshape(batches, -1).mean(axis=1)
    half = float(stdtrit(batches - 1, 0.975) * bm.std(ddof=1) / math.sqrt(batches))  # Student t quantile
    pct = np.percentile(resp, PERCENTILES)
    stages = tuple(
        StageFigures(s.name, float(stage_soj[i] / n_meas), float(stage_wait[i] / n_meas), float(area_ks[i] / window))
        for i, s in enumerate(model.stages)
    )
    extra: dict[str, Any] = {}
    if levels.priority is not None:
        extra["cpu_priority"] = levels.priority.to_dict()
        extra["mean_threads_per_level"] = [float(a / window) for a in lv_area]
    return SimulationResult(
        policy=policy_name(pol), service=svc.name, phase_info=svc.phase_used, requests=n_meas, warmup=n_warm,
        seed=int(seed), mean_response_time=float(resp.mean()), ci95=half, batches=batches,
        percentiles={f"p{p:g}": float(v) for p, v in zip(PERCENTILES, pct)}, stages=stages,
        mean_threads=float(area_K / window), mean_in_system=float(area_N / window),
        arrival_rate=float(model.arrival_rate), events=int(events), seconds=seconds,
        extra=extra,
    )


def _reader_args(model: TandemModel) -> tuple[IntArray, int, FloatArray]:
    """The kernel's readers: per stage whether it reads under the lock, the locked stage (-1: no
    readers) and the committing holder's busy-handler sleeps (empty: it commits at once)."""
    if not model.has_readers or model.readers is None:
        return np.zeros(model.n_stages, dtype=np.int64), -1, np.zeros(0)
    rd_lock = next(i for i in range(model.n_stages) if model.lock_of(i) is not None)
    return (np.array(model.readers, dtype=np.int64), rd_lock,
            np.array(model.commit_retry if model.commit_retry is not None else (), dtype=float))


def simulate(
    model: TandemModel,
    policy: PolicyLike,
    *,
    requests: int = 100_000,
    seed: int = 0,
    warmup: float = 0.1,
    batches: int = 30,
    service: Sequence[Sampler] | None = None,
    phase: PhaseMode = "oracle",
    max_threads: int = 8192,
    cpu_priority: CpuPriority | None = None,
) -> SimulationResult:
    """Simulate ``requests`` measured requests (after ``warmup``·requests discarded ones).

    Parameters
    ----------
    policy
        A :class:`Policy` artifact, an :class:`OvertakingHeuristic`, a :class:`Baseline`, or a
        name: ``"pi(k)"``, ``"pi(k1,...,kN)"``, ``"pi(inf)"``, ``"heuristic"``.
    service
        One sampler per stage (non-PH service); ``None`` simulates the model's PH stages.
    phase
        Non-PH service only: where the policy's phase labels come from (module docstring).
    max_threads
        Concurrent-thread slots of the simulator; exceeding them is an error (an unstable run).
    cpu_priority
        Priority levels on the CPU (weights, attained-service thresholds per stage, starting
        levels per phase); ``None`` is plain processor sharing.
    """
    t0 = time.perf_counter()
    _check_run(requests, warmup, batches, phase)
    pol = _resolve(model, policy)
    levels = _cpu_levels(model, cpu_priority)
    lv_area = np.zeros(levels.weights.size)
    _check_coupling(model, policy, service)
    n_warm = int(round(warmup * requests))
    n_meas = int(requests)
    n_total = n_warm + n_meas + max(1000, n_meas // 50)  # arrivals keep coming while the last measured finish
    svc = _service_draws(model, service, phase, n_total, np.random.default_rng(seed))
    tabs = _policy_tables(model, pol, service)
    out = run_kernel(
        n_total, n_warm, n_meas, float(model.arrival_rate), int(seed) % (2**32),
        *_tables(model),
        svc.mode, svc.work, svc.label0,
        int(model.cores), float(model.overhead),
        *tabs.decision_args(),
        int(max_threads),
        levels.weights, np.ascontiguousarray(levels.thresholds), levels.start, lv_area,
        tabs.route_cum, tabs.route_q0, tabs.queue_alpha_cum,
        np.array([(1 << 62) if model.lock_of(i) is None else model.lock_of(i) for i in range(model.n_stages)],
                 dtype=np.int64),
        _start_tables(model),
        *_reader_args(model),
    )
    return _result(out, model, pol, svc, levels, lv_area, n_warm, n_meas, seed, batches, max_threads,
                   time.perf_counter() - t0)
