"""Scenario schema (pydantic), shared by the CLI and the REST API so they cannot drift.

A scenario is the YAML of ``overtake solve|compare``: ``load`` (ρ = λ·Σ E[S_i] with exact means)
or ``arrival_rate``; ``stages`` (``{name, service}``, service one of ``exponential``, ``erlang``,
``hyperexponential``, ``ph``; ``{file: fitted.json}`` is resolved to ``ph`` by the caller, which
does the I/O); optional ``cores``, ``overhead``, ``max_threads``, ``truncation``, ``tolerance``,
``phase_info`` (what the policy may see: ``full``, ``start``, ``none`` or ``route``), ``routing``
(coupled stages: per pair of consecutive stages a matrix, row j the start law of the later stage
after leaving the earlier one from phase j; :class:`~overtake.mdp.model.TandemModel`) and, per stage,
``routes`` (``{name, weight, alpha}``: observable route classes with their own start-phase prior,
:mod:`overtake.mdp.routes`), ``lock`` (requests that may hold the stage's serialising resource at
once, :mod:`overtake.mdp.lock`) and ``time_unit`` (seconds per unit of the service times, or ``model``:
:attr:`Scenario.time_unit`, which ``overtake solve`` stores in the policy for the sidecar).
Every validation error becomes one :class:`~overtake.mdp.errors.ModelError` line naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from overtake.phases import MAX_PHASES

from .errors import ModelError
from .model import Stage, TandemModel
from .routes import RouteSplit
from .statespace import Truncation


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Exponential(_Strict):
    mean: float = Field(gt=0)


class Erlang(_Strict):
    order: int = Field(ge=1, le=200)
    mean: float = Field(gt=0)


class HyperExponential(_Strict):
    probs: list[float] = Field(min_length=1, max_length=MAX_PHASES)
    means: list[float] = Field(min_length=1, max_length=MAX_PHASES)

    @model_validator(mode="after")
    def _check(self) -> HyperExponential:
        if len(self.probs) != len(self.means):
            raise ValueError(f"probs has {len(self.probs)} entries but means has {len(self.means)}")
        if any(p < 0 for p in self.probs) or abs(sum(self.probs) - 1) > 1e-6:
            raise ValueError(f"probs must be >= 0 and sum to 1, got {self.probs}")
        if any(m <= 0 for m in self.means):
            raise ValueError(f"means must be > 0, got {self.means}")
        return self


class PH(_Strict):
    alpha: list[float] = Field(min_length=1, max_length=MAX_PHASES)
    T: list[list[float]] = Field(min_length=1, max_length=MAX_PHASES)


class Service(_Strict):
    exponential: Exponential | None = None
    erlang: Erlang | None = None
    hyperexponential: HyperExponential | None = None
    ph: PH | None = None

    @model_validator(mode="after")
    def _one(self) -> Service:
        given = [k for k in ("exponential", "erlang", "hyperexponential", "ph") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of exponential, erlang, hyperexponential, ph or file"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self

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


class RouteSpec(_Strict):
    name: str = Field(min_length=1)
    weight: float = Field(gt=0, le=1)
    alpha: list[float] = Field(min_length=1)


class StageSpec(_Strict):
    name: str = Field(min_length=1)
    service: Service
    routes: list[RouteSpec] | None = Field(default=None, min_length=1)
    #: requests that may hold the stage's serialising resource at once (:mod:`overtake.mdp.lock`)
    lock: int | None = None

    @field_validator("lock", mode="before")
    @classmethod
    def _lock(cls, v: Any) -> Any:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 2000):
            raise ValueError(f"the number of requests that may hold the stage's lock at once, an integer >= 1 "
                             f"(1 for a database write lock); omit it for a stage without a lock, got {v!r}")
        return v


class TruncationSpec(_Strict):
    max_requests: int = Field(ge=2, le=2000)
    max_threads: int | None = Field(default=None, ge=1, le=2000)


#: the highest load an exact solve takes: its truncation grows like 1/(1 − ρ)
MAX_LOAD = 0.99


class Scenario(_Strict):
    load: float | None = Field(default=None, gt=0)
    arrival_rate: float | None = Field(default=None, gt=0, le=1e9)
    stages: list[StageSpec] = Field(min_length=1, max_length=16)
    cores: int = Field(default=1, ge=1, le=64)
    overhead: float = Field(default=0.0, ge=0, le=100)
    max_threads: int | None = Field(default=None, ge=1, le=2000)
    truncation: TruncationSpec | None = None
    tolerance: float = Field(default=1e-3, ge=1e-8, lt=0.5)
    phase_info: Literal["full", "start", "none", "route"] = "full"
    #: seconds per unit of the service times: a number (1 = the times are seconds, as every
    #: ``overtake fit`` output), or ``model``: an abstract unit (van der Weij et al.'s), which the sidecar's
    #: ``classifier.time_unit`` binds at deployment. Stages from fits set it (api.scenario).
    time_unit: float | Literal["model"] = "model"
    #: coupled stages: per pair of consecutive stages, the exit-phase x start-phase routing matrix
    #: (:attr:`overtake.mdp.model.TandemModel.routing`); omitted: independent stages
    routing: list[list[list[float]]] | None = Field(default=None, min_length=1, max_length=15)

    @field_validator("time_unit", mode="before")
    @classmethod
    def _unit(cls, v: Any) -> Any:
        if v == "model":
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
            raise ValueError(f"seconds per unit of the service times (a number > 0, e.g. 1 for seconds, 0.001 for "
                             f"milliseconds) or model (an abstract unit), got {v!r}")
        return float(v)

    @field_validator("load")
    @classmethod
    def _load(cls, v: float | None) -> float | None:
        # load >= 1 is refused by the model's stability check, with the message the CLI has always given
        if v is not None and MAX_LOAD < v < 1:
            raise ValueError(f"at most {MAX_LOAD} for an exact solve (its truncation grows like 1/(1 - load)), "
                             f"got {v:.10g}; lower the load")
        return v

    @model_validator(mode="after")
    def _rate(self) -> Scenario:
        if (self.load is None) == (self.arrival_rate is None):
            raise ValueError("give exactly one of load or arrival_rate")
        return self

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


def validation_message(errors: Sequence[Mapping[str, Any]], *, root: str = "scenario") -> str:
    """pydantic's errors as the project's one line: ``<field>: <rule>`` and how many more.

    The field is the error's location joined by dots (``stages.0.service.exponential.mean``),
    without ``body``, the root a web framework puts first for a request body; ``root`` names
    an empty location (the document as a whole).
    """
    err = errors[0]
    loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or root
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown key; remove it or check its spelling"
    elif err.get("type") == "missing":
        msg = "required field is missing"
    extra = f" ({len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc}: {msg}{extra}"


def parse_scenario(data: Any) -> Scenario:
    """Validate a scenario mapping; raise :class:`ModelError` with one line naming the field."""
    if not isinstance(data, dict):
        raise ModelError(f"scenario must be a mapping of keys to values, got {type(data).__name__}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ModelError(validation_message(exc.errors())) from None
