"""Scenarios: reading and validating the document shared by the CLI and the REST API.

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

The rules are one schema, :mod:`overtake.mdp.scenario_schema` (pydantic), so the CLI and the API
cannot drift; :func:`parse_scenario` asks it only when the strict reading of
:mod:`overtake.mdp.scenario_spec` is unsure (a command line then imports no pydantic).
Every validation error becomes one :class:`~overtake.mdp.errors.ModelError` line naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ModelError
from .scenario_spec import (
    MAX_LOAD,
    PH,
    Erlang,
    Exponential,
    HyperExponential,
    RouteSpec,
    Scenario,
    Service,
    StageSpec,
    TruncationSpec,
    from_fields,
    read_strict,
    service_from_fields,
)

__all__ = ["MAX_LOAD", "PH", "Erlang", "Exponential", "HyperExponential", "RouteSpec", "Scenario", "Service",
           "StageSpec", "TruncationSpec", "parse_scenario", "parse_service", "validation_message"]


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
    sc = read_strict(data)
    if sc is not None:
        return sc
    from pydantic import ValidationError

    from . import scenario_schema

    try:
        checked = scenario_schema.Scenario.model_validate(data)
    except ValidationError as exc:
        raise ModelError(validation_message(exc.errors())) from None
    return from_fields(checked.model_dump())


def parse_service(data: Any) -> Service:
    """Validate a stage's ``service`` alone with the schema (its errors are pydantic's
    :class:`pydantic.ValidationError`)."""
    from . import scenario_schema

    return service_from_fields(scenario_schema.Service.model_validate(data).model_dump())
