"""The scenario's schema of record (pydantic): its rules, its error messages, its JSON schema.

:func:`overtake.mdp.scenario.parse_scenario` reads most documents without it
(:mod:`overtake.mdp.scenario_spec`: a strict reading that only accepts what these models accept,
with the values they give) and asks these models whenever that reading is unsure: for the
one-line error of a bad document (pydantic's message, :func:`overtake.mdp.scenario.validation_message`)
and for the values of a valid one written in a form the strict reading leaves to them (a number
as a string, a float for an integer). The REST API publishes :class:`Scenario`'s JSON schema. The
fields and rules of the scenario keys are described in :mod:`overtake.mdp.scenario`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from overtake.phases import MAX_PHASES

from .scenario_spec import (
    MAX_ARRIVAL_RATE,
    MAX_CORES,
    MAX_COUNT,
    MAX_ERLANG_ORDER,
    MAX_LOAD,
    MAX_OVERHEAD,
    MAX_STAGES,
    MAX_TIME_UNIT,
    MAX_TOLERANCE,
    MIN_TOLERANCE,
    PROBS_SLACK,
)

__all__ = ["PH", "Erlang", "Exponential", "HyperExponential", "RouteSpec", "Scenario", "Service", "StageSpec",
           "TruncationSpec"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Exponential(_Strict):
    mean: float = Field(gt=0)


class Erlang(_Strict):
    order: int = Field(ge=1, le=MAX_ERLANG_ORDER)
    mean: float = Field(gt=0)


class HyperExponential(_Strict):
    probs: list[float] = Field(min_length=1, max_length=MAX_PHASES)
    means: list[float] = Field(min_length=1, max_length=MAX_PHASES)

    @model_validator(mode="after")
    def _check(self) -> HyperExponential:
        if len(self.probs) != len(self.means):
            raise ValueError(f"probs has {len(self.probs)} entries but means has {len(self.means)}")
        if any(p < 0 for p in self.probs) or abs(sum(self.probs) - 1) > PROBS_SLACK:
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
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_COUNT):
            raise ValueError(f"the number of requests that may hold the stage's lock at once, an integer >= 1 "
                             f"(1 for a database write lock); omit it for a stage without a lock, got {v!r}")
        return v


class TruncationSpec(_Strict):
    max_requests: int = Field(ge=2, le=MAX_COUNT)
    max_threads: int | None = Field(default=None, ge=1, le=MAX_COUNT)


class Scenario(_Strict):
    load: float | None = Field(default=None, gt=0)
    arrival_rate: float | None = Field(default=None, gt=0, le=MAX_ARRIVAL_RATE)
    stages: list[StageSpec] = Field(min_length=1, max_length=MAX_STAGES)
    cores: int = Field(default=1, ge=1, le=MAX_CORES)
    overhead: float = Field(default=0.0, ge=0, le=MAX_OVERHEAD)
    max_threads: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    truncation: TruncationSpec | None = None
    tolerance: float = Field(default=1e-3, ge=MIN_TOLERANCE, lt=MAX_TOLERANCE)
    phase_info: Literal["full", "start", "none", "route"] = "full"
    #: seconds per unit of the service times: a number (1 = the times are seconds, as every
    #: ``overtake fit`` output), or ``model``: an abstract unit (van der Weij et al.'s), which the sidecar's
    #: ``classifier.time_unit`` binds at deployment. Stages from fits set it (api.scenario).
    time_unit: float | Literal["model"] = "model"
    #: coupled stages: per pair of consecutive stages, the exit-phase x start-phase routing matrix
    #: (:attr:`overtake.mdp.model.TandemModel.routing`); omitted: independent stages
    routing: list[list[list[float]]] | None = Field(default=None, min_length=1, max_length=MAX_STAGES - 1)

    @field_validator("time_unit", mode="before")
    @classmethod
    def _unit(cls, v: Any) -> Any:
        if v == "model":
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_TIME_UNIT:
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
