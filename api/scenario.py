"""Reading a scenario: a YAML file or a parsed mapping, its service references resolved, validated.

The one loader of the ``overtake`` command line (``solve``, ``compare``, ``simulate``), the REST
API (``POST /v1/models``), the bench scripts and the demo. The schema is
:class:`overtake.mdp.scenario.Scenario`; this module adds the I/O the solver package does not do.

A stage's ``service`` may say where its phase-type distribution comes from instead of giving it:

* ``{file: fitted.json}``: the JSON ``overtake fit`` writes, relative to the scenario file
  (:func:`file_resolver`, what :func:`load_scenario` uses);
* ``{fit: {id: FIT_ID, stage: NAME}}``: a fit job of the REST API (its resolver reads the store).

The scenario's ``routing`` (coupled stages) may likewise be ``{file: routing.json}``, the file
``overtake fit --paired`` writes next to its stages (:func:`load_scenario` only), or that file's
content (the command line and the REST API).

A :class:`ServiceResolver` turns such a reference into ``{alpha, T}`` (and the fit's ``time_unit``,
seconds per unit); :func:`resolve_scenario` puts ``{ph: {alpha, T}}`` in its place, sets the
scenario's ``time_unit`` to the fits' (which must agree), then validates. Every error is one
:class:`~overtake.mdp.errors.ModelError` line naming the field (``stages.1.service.file: ...``).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml

from overtake.mdp.errors import ModelError
from overtake.mdp.model import TandemModel
from overtake.mdp.scenario import Scenario, parse_scenario

__all__ = ["ServiceResolver", "file_resolver", "load_scenario", "resolve_scenario"]


class ServiceResolver(Protocol):
    """Turns a service reference into a phase-type ``{"alpha": [...], "T": [[...]]}``.

    ``ref`` is the value under the reference's key (a file name, ``{id, stage}``); ``where`` is the
    field path to name in errors (``stages.0.service.fit``); ``stage`` is the stage's name.
    Raise :class:`~overtake.mdp.errors.ModelError` starting with ``where``.
    """

    def __call__(self, ref: Any, *, where: str, stage: str) -> Mapping[str, Any]: ...


def resolve_scenario(
    data: Any, resolvers: Mapping[str, ServiceResolver] | None = None, *, routing_base: Path | None = None
) -> tuple[Scenario, TandemModel]:
    """Resolve the service references of a parsed scenario mapping, validate it, build its model.

    Parameters
    ----------
    data
        The scenario as parsed YAML or JSON; not modified.
    resolvers
        Reference key (``"file"``, ``"fit"``) to its resolver. A key without a resolver is left
        in place, so the schema reports it (``unknown key``).
    routing_base
        Where ``routing: {file: ...}`` is read from (the scenario file's directory); None: such a
        reference is refused (the REST API reads no files; it takes the file's content).

    Returns
    -------
    tuple[Scenario, TandemModel]
        The validated scenario (services as ``ph``) and its model (stability checked).
    """
    data = _routing(data, routing_base)
    if resolvers and isinstance(data, dict) and isinstance(data.get("stages"), list):
        data = copy.deepcopy(data)
        units: list[tuple[str, float]] = []  # (field, seconds per unit) of every resolved fit
        for i, st in enumerate(data["stages"]):
            svc = st.get("service") if isinstance(st, dict) else None
            key = next((k for k in resolvers if isinstance(svc, dict) and k in svc), None)
            if key is None:
                continue
            assert isinstance(svc, dict)
            where = f"stages.{i}.service"
            if len(svc) != 1:
                raise ModelError(f"{where}: give {key} alone, not with {', '.join(sorted(set(svc) - {key}))}")
            ph = resolvers[key](svc[key], where=f"{where}.{key}", stage=str(st.get("name")))
            st["service"] = {"ph": {"alpha": ph["alpha"], "T": ph["T"]}}
            units.append((f"{where}.{key}", _fit_unit(ph, f"{where}.{key}")))
        if units:
            data["time_unit"] = _common_unit(units, data.get("time_unit"))
    sc = parse_scenario(data)
    return sc, sc.build_model()


def _fit_unit(doc: Mapping[str, Any], where: str) -> float:
    """Seconds per unit of a fit document; one without ``time_unit`` is an ``overtake fit``
    output from before it was written, which was in seconds."""
    u = doc.get("time_unit", 1.0)
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u < float("inf"):
        raise ModelError(f"{where}: time_unit must be the seconds per unit of the fit (a number > 0), got {u!r}")
    return float(u)


def _common_unit(units: list[tuple[str, float]], given: Any) -> float:
    """The scenario's unit when stages come from fits: theirs, which must agree with each other
    and with a ``time_unit`` the scenario gives (services written by hand are read in it too)."""
    first_at, first = units[0]
    for at, u in units[1:]:
        if not math.isclose(u, first, rel_tol=1e-9):
            raise ModelError(f"{at}: fitted in units of {u:g} s but {first_at} in units of {first:g} s; "
                             "refit both from data in the same unit (overtake fit writes seconds)")
    if given is None:
        return first
    if isinstance(given, bool) or not isinstance(given, (int, float)) or not math.isclose(float(given), first,
                                                                                          rel_tol=1e-9):
        raise ModelError(f"time_unit: the fitted stages ({first_at}) are in units of {first:g} s but the scenario "
                         f"says {given!r}; remove time_unit (fits carry their unit) or give {first:g}")
    return first


def _read_json(path: Path, where: str, writer: str) -> Any:
    """The JSON document at ``path``; a missing or malformed file is one ModelError naming ``where``."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{where}: {path} does not exist (run `{writer}` first)") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{where}: {path} is not JSON ({exc.msg}, line {exc.lineno})") from None


def file_resolver(base: Path) -> ServiceResolver:
    """Resolver of ``{file: NAME}``: the ``overtake fit`` JSON at ``base / NAME``."""

    def resolve(ref: Any, *, where: str, stage: str) -> Mapping[str, Any]:
        path = base / str(ref)
        doc = _read_json(path, where, "overtake fit")
        if not isinstance(doc, dict) or "alpha" not in doc or "T" not in doc:
            raise ModelError(f"{where}: {path} has no 'alpha' and 'T' (not an `overtake fit` output)")
        return doc

    return resolve


def load_scenario(path: str | Path) -> tuple[Scenario, TandemModel]:
    """Read a scenario YAML file, resolve its ``{file: ...}`` services, validate, build the model.

    Errors are one :class:`~overtake.mdp.errors.ModelError` line naming the file or the field.
    """
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ModelError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return resolve_scenario(data, {"file": file_resolver(p.parent)}, routing_base=p.parent)


def _routing(data: Any, base: Path | None) -> Any:
    """The scenario's ``routing`` as matrices: given as such, as ``{file: routing.json}`` (what
    ``overtake fit --paired`` writes, read from ``base``; None: no file may be read, the REST API),
    or as that file's document itself (``{"routing": [...], ...}``, e.g. sent to the REST API)."""
    ref = data.get("routing") if isinstance(data, dict) else None
    if not isinstance(ref, dict):
        return data
    if "routing" in ref:
        return {**data, "routing": ref["routing"]}
    if set(ref) != {"file"}:
        raise ModelError("routing: give the matrices (a list per pair of stages), {file: routing.json} or that "
                         f"file's content (its 'routing' key), got keys {sorted(ref)}")
    if base is None:
        raise ModelError("routing.file: this server reads no files; send the file's content (the document "
                         "`overtake fit --paired` writes, or its 'routing' list) as routing")
    path = base / str(ref["file"])
    doc = _read_json(path, "routing.file", "overtake fit --paired")
    if not isinstance(doc, dict) or "routing" not in doc:
        raise ModelError(f"routing.file: {path} has no 'routing' (not an `overtake fit --paired` output)")
    return {**data, "routing": doc["routing"]}
