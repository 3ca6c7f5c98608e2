"""A validated scenario as plain values, and the strict reading that builds one without pydantic.

:class:`Scenario` and its parts are what :func:`overtake.mdp.scenario.parse_scenario` returns. The
schema of record is :mod:`overtake.mdp.scenario_schema` (pydantic): its models decide what a valid
document is, what a bad one's error says and what the REST API publishes. Importing pydantic and
building those models costs a command line more than reading a scenario, so :func:`read_strict`
reads the common documents itself: only YAML's own types (a dict, a list, an int, a float, a str)
in the form the models would keep, every rule of the models checked. Anything else (a number
written as a string, a float where an integer goes, an unknown key, a broken rule, a value that
is not finite) makes it unsure, and the models decide (:func:`from_fields` then takes their values).
tests/mdp/test_scenario_spec.py holds the two readings to the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

from overtake.phases import MAX_PHASES

from .errors import ModelError
from .model import Stage, TandemModel
from .routes import RouteSplit
from .statespace import Truncation

__all__ = ["MAX_LOAD", "PH", "Erlang", "Exponential", "HyperExponential", "RouteSpec", "Scenario", "Service",
           "StageSpec", "TruncationSpec", "from_fields", "read_strict", "service_from_fields"]

#: the highest load an exact solve takes: its truncation grows like 1/(1 − ρ)
MAX_LOAD = 0.99
# the schema's other bounds, here once for both readings (overtake.mdp.scenario_schema's models
# check the same): an Erlang's order; requests, threads and a lock's holders; the arrival rate;
# stages; cores; overhead; tolerance [lo, hi); seconds per time unit; a hyperexponential's probs'
# distance from a sum of 1
MAX_ERLANG_ORDER = 200
MAX_COUNT = 2000
MAX_ARRIVAL_RATE = 1e9
MAX_STAGES = 16
MAX_CORES = 64
MAX_OVERHEAD = 100
MIN_TOLERANCE, MAX_TOLERANCE = 1e-8, 0.5
MAX_TIME_UNIT = 86400
PROBS_SLACK = 1e-6

PhaseInfo = Literal["full", "start", "none", "route"]
PHASE_INFOS = ("full", "start", "none", "route")


class _Values:
    """``to_dict``: the fields as pydantic's ``model_dump`` gives them (nested values as dicts)."""

    def to_dict(self, *, exclude_none: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = _dump(getattr(self, f.name), exclude_none)
            if v is not None or not exclude_none:
                out[f.name] = v
        return out


def _dump(v: Any, exclude_none: bool) -> Any:
    if isinstance(v, _Values):
        return v.to_dict(exclude_none=exclude_none)
    if isinstance(v, list):
        return [_dump(x, exclude_none) for x in v]
    return v


@dataclass(frozen=True)
class Exponential(_Values):
    mean: float


@dataclass(frozen=True)
class Erlang(_Values):
    order: int
    mean: float


@dataclass(frozen=True)
class HyperExponential(_Values):
    probs: list[float]
    means: list[float]


@dataclass(frozen=True)
class PH(_Values):
    alpha: list[float]
    T: list[list[float]]


@dataclass(frozen=True)
class Service(_Values):
    """A stage's service time: exactly one of the four is given."""

    exponential: Exponential | None = None
    erlang: Erlang | None = None
    hyperexponential: HyperExponential | None = None
    ph: PH | None = None

    def representation(self) -> tuple[np.ndarray, np.ndarray]:
        if self.exponential is not None:
            return np.array([1.0]), np.array([[-1.0 / self.exponential.mean]])
        if self.erlang is not None:
            k, rate = self.erlang.order, self.erlang.order / self.erlang.mean
            T = -rate * np.eye(k) + rate * np.eye(k, k=1)
            a = np.zeros(k)
            a[0] = 1.0
            return a, T
        if self.hyperexponential is not None:
            return np.asarray(self.hyperexponential.probs), np.diag([-1.0 / m for m in self.hyperexponential.means])
        assert self.ph is not None
        return np.asarray(self.ph.alpha, dtype=float), np.asarray(self.ph.T, dtype=float)


@dataclass(frozen=True)
class RouteSpec(_Values):
    name: str
    weight: float
    alpha: list[float]


@dataclass(frozen=True)
class StageSpec(_Values):
    name: str
    service: Service
    routes: list[RouteSpec] | None = None
    #: requests that may hold the stage's serialising resource at once (:mod:`overtake.mdp.lock`)
    lock: int | None = None


@dataclass(frozen=True)
class TruncationSpec(_Values):
    max_requests: int
    max_threads: int | None = None


@dataclass(frozen=True)
class Scenario(_Values):
    """A validated scenario (:mod:`overtake.mdp.scenario` describes its keys)."""

    load: float | None
    arrival_rate: float | None
    stages: list[StageSpec]
    cores: int = 1
    overhead: float = 0.0
    max_threads: int | None = None
    truncation: TruncationSpec | None = None
    tolerance: float = 1e-3
    phase_info: PhaseInfo = "full"
    #: seconds per unit of the service times (1: seconds), or ``model``: an abstract unit
    #: (van der Weij et al.'s), which the sidecar's ``classifier.time_unit`` binds at deployment
    time_unit: float | Literal["model"] = "model"
    #: coupled stages: per pair of consecutive stages, the exit-phase x start-phase routing matrix
    #: (:attr:`overtake.mdp.model.TandemModel.routing`); None: independent stages
    routing: list[list[list[float]]] | None = None

    def build_model(self) -> TandemModel:
        stages = []
        for i, s in enumerate(self.stages):
            a, T = s.service.representation()
            try:
                stages.append(Stage(s.name, a, T))
            except ModelError as exc:
                raise ModelError(f"stages.{i}.service: {exc}") from None
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ModelError(f"stages: names must be unique, got {names}")
        work = sum(s.mean() for s in stages)
        lam = self.arrival_rate if self.arrival_rate is not None else float(self.load) / work  # type: ignore[arg-type]
        locks = tuple(s.lock for s in self.stages) if any(s.lock is not None for s in self.stages) else None
        if self.routing is not None and self.phase_info != "full":
            # a phase-blind policy of coupled stages queues by routing row, which the sidecar does not see
            raise ModelError(f"routing: a scenario with coupled stages is solved with phase_info full, got "
                             f"{self.phase_info!r}; set phase_info: full or drop routing")
        try:
            model = TandemModel(lam, tuple(stages), cores=self.cores, overhead=self.overhead, locks=locks,
                                routing=None if self.routing is None
                                else tuple(tuple(tuple(row) for row in R) for R in self.routing))
        except ModelError as exc:
            if self.routing is None or not str(exc).startswith("routing"):
                raise
            raise ModelError(f"{exc} (scenario key routing: one matrix per pair of consecutive stages, a row per "
                             f"phase of the earlier stage)") from None
        model.check_stable(self.max_threads)
        if self.arrival_rate is not None and model.load > MAX_LOAD:
            raise ModelError(f"arrival_rate: gives load {model.load:.6g} > {MAX_LOAD}; an exact solve's truncation "
                             f"grows like 1/(1 - load): give a lower arrival_rate (load = arrival_rate x total mean "
                             f"service {work:.6g})")
        return model

    def build_routes(self, model: TandemModel) -> RouteSplit | None:
        """The route split of the stages' ``routes`` (None when no stage lists any)."""
        if all(s.routes is None for s in self.stages):
            if self.phase_info == "route":
                raise ModelError("phase_info: 'route' needs routes on at least one stage (stages[].routes)")
            return None
        split = RouteSplit.build(model, [None if s.routes is None else [(r.name, r.weight, r.alpha) for r in s.routes]
                                         for s in self.stages])
        if self.phase_info == "route" and split.trivial:
            raise ModelError("phase_info: 'route' needs a stage with two or more routes (stages[].routes)")
        return split

    def fixed_truncation(self) -> Truncation | None:
        if self.truncation is None:
            return None
        kt = self.truncation.max_threads
        if self.max_threads is not None:
            kt = self.max_threads if kt is None else min(kt, self.max_threads)
        return Truncation(self.truncation.max_requests, kt)


class _Unsure(ModelError):
    """The strict reading cannot vouch for a document: the schema of record decides (never leaves
    :func:`read_strict`)."""


class _Reader:
    """Reads one document's values. ``strict`` (:func:`read_strict`): each value must be of the
    type the schema keeps and obey its rule, else :class:`_Unsure`; not strict
    (:func:`from_fields`): the values are the schema's own, taken as they are."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict

    def keys(self, v: Any, known: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
        if self.strict and (type(v) is not dict or not set(v) <= set(known) or not set(required) <= set(v)):
            raise _Unsure
        return dict(v)

    def number(self, v: Any, gt: float | None = None, ge: float | None = None, lt: float | None = None,
               le: float | None = None) -> float:
        if not self.strict:
            return float(v)
        # an int as the schema's float takes it (exactly, below 2**53); not bool, not a string
        if not (type(v) is float or (type(v) is int and abs(v) <= 2**53)) or not math.isfinite(v):
            raise _Unsure
        x = float(v)
        if (gt is not None and not x > gt) or (ge is not None and not x >= ge) or \
                (lt is not None and not x < lt) or (le is not None and not x <= le):
            raise _Unsure
        return x

    def integer(self, v: Any, ge: int, le: int) -> int:
        if self.strict and (type(v) is not int or not ge <= v <= le):
            raise _Unsure
        return int(v)

    def text(self, v: Any) -> str:
        if self.strict and (type(v) is not str or not v):
            raise _Unsure
        return str(v)

    def items(self, v: Any, lo: int = 0, hi: int | None = None) -> list[Any]:
        if self.strict and (type(v) is not list or len(v) < lo or (hi is not None and len(v) > hi)):
            raise _Unsure
        return list(v)

    def numbers(self, v: Any, lo: int = 0, hi: int | None = None) -> list[float]:
        return [self.number(x) for x in self.items(v, lo, hi)]

    def check(self, ok: bool) -> None:
        """A rule of the schema's validators: broken, the schema gives the error."""
        if self.strict and not ok:
            raise _Unsure


def _service(r: _Reader, v: Any) -> Service:
    d = r.keys(v, ("exponential", "erlang", "hyperexponential", "ph"))
    r.check(sum(d.get(k) is not None for k in ("exponential", "erlang", "hyperexponential", "ph")) == 1)
    if d.get("exponential") is not None:
        e = r.keys(d["exponential"], ("mean",), ("mean",))
        return Service(exponential=Exponential(r.number(e["mean"], gt=0)))
    if d.get("erlang") is not None:
        e = r.keys(d["erlang"], ("order", "mean"), ("order", "mean"))
        return Service(erlang=Erlang(r.integer(e["order"], 1, MAX_ERLANG_ORDER), r.number(e["mean"], gt=0)))
    if d.get("hyperexponential") is not None:
        h = r.keys(d["hyperexponential"], ("probs", "means"), ("probs", "means"))
        probs, means = r.numbers(h["probs"], 1, MAX_PHASES), r.numbers(h["means"], 1, MAX_PHASES)
        r.check(len(probs) == len(means) and all(p >= 0 for p in probs) and abs(sum(probs) - 1) <= PROBS_SLACK
                and all(m > 0 for m in means))
        return Service(hyperexponential=HyperExponential(probs, means))
    p = r.keys(d["ph"], ("alpha", "T"), ("alpha", "T"))
    return Service(ph=PH(r.numbers(p["alpha"], 1, MAX_PHASES), [r.numbers(row) for row in r.items(p["T"], 1, MAX_PHASES)]))


def _stage(r: _Reader, v: Any) -> StageSpec:
    d = r.keys(v, ("name", "service", "routes", "lock"), ("name", "service"))
    routes = None
    if d.get("routes") is not None:
        routes = []
        for x in r.items(d["routes"], 1):
            e = r.keys(x, ("name", "weight", "alpha"), ("name", "weight", "alpha"))
            routes.append(RouteSpec(r.text(e["name"]), r.number(e["weight"], gt=0, le=1), r.numbers(e["alpha"], 1)))
    lock = d.get("lock")
    return StageSpec(r.text(d["name"]), _service(r, d["service"]), routes,
                     None if lock is None else r.integer(lock, 1, MAX_COUNT))


def _scenario(r: _Reader, v: Any) -> Scenario:
    known = tuple(f.name for f in fields(Scenario))
    d = r.keys(v, known, ("stages",))
    opt = {k: d.get(k) for k in known}
    load = None if opt["load"] is None else r.number(opt["load"], gt=0)
    r.check(load is None or not MAX_LOAD < load < 1)
    rate = None if opt["arrival_rate"] is None else r.number(opt["arrival_rate"], gt=0, le=MAX_ARRIVAL_RATE)
    r.check((load is None) != (rate is None))
    tr = opt["truncation"]
    if tr is not None:
        t = r.keys(tr, ("max_requests", "max_threads"), ("max_requests",))
        tr = TruncationSpec(r.integer(t["max_requests"], 2, MAX_COUNT),
                            None if t.get("max_threads") is None else r.integer(t["max_threads"], 1, MAX_COUNT))
    phase_info = d.get("phase_info", "full")
    r.check(type(phase_info) is str and phase_info in PHASE_INFOS)
    unit = d.get("time_unit", "model")
    return Scenario(
        load, rate, [_stage(r, s) for s in r.items(d["stages"], 1, MAX_STAGES)],
        cores=r.integer(d.get("cores", 1), 1, MAX_CORES), overhead=r.number(d.get("overhead", 0.0), ge=0, le=MAX_OVERHEAD),
        max_threads=None if opt["max_threads"] is None else r.integer(opt["max_threads"], 1, MAX_COUNT),
        truncation=tr, tolerance=r.number(d.get("tolerance", 1e-3), ge=MIN_TOLERANCE, lt=MAX_TOLERANCE),
        phase_info=phase_info,
        time_unit="model" if type(unit) is str and unit == "model" else r.number(unit, gt=0, le=MAX_TIME_UNIT),
        routing=None if opt["routing"] is None else [[r.numbers(row) for row in r.items(R)]
                                                     for R in r.items(opt["routing"], 1, MAX_STAGES - 1)])


def read_strict(data: Any) -> Scenario | None:
    """The scenario of ``data`` when the strict reading vouches for it (the schema would accept it
    with these very values), else None: then only the schema can say."""
    try:
        return _scenario(_Reader(strict=True), data)
    except _Unsure:
        return None


def from_fields(fields_: dict[str, Any]) -> Scenario:
    """The scenario of a document the schema accepted, from its fields (``model_dump()``)."""
    return _scenario(_Reader(strict=False), fields_)


def service_from_fields(fields_: dict[str, Any]) -> Service:
    """The service of a ``service`` the schema accepted, from its fields (``model_dump()``)."""
    return _service(_Reader(strict=False), fields_)
