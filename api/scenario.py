"""Reading a scenario: a YAML file or a parsed mapping, its service references resolved, validated.

The one loader of the ``overtake`` command line (``solve``, ``compare``, ``simulate``), the REST
API (``POST /v1/models``), the bench scripts and the demo. The schema is
:class:`overtake.mdp.scenario.Scenario`; this module adds the I/O the solver package does not do.

A stage's ``service`` may say where its phase-type distribution comes from instead of giving it:

* ``{file: fitted.json}``: the JSON ``overtake fit`` writes, relative to the scenario file
  (:func:`file_resolver`, what :func:`load_scenario` uses);
* ``{fit: {id: FIT_ID, stage: NAME}}``: a fit job of the REST API (its resolver reads the store).

A :class:`ServiceResolver` turns such a reference into ``{alpha, T}``; :func:`resolve_scenario`
puts ``{ph: {alpha, T}}`` in its place, then validates. Every error is one
:class:`~overtake.mdp.errors.ModelError` line naming the field (``stages.1.service.file: ...``).
"""

from __future__ import annotations

import copy
import json
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
    data: Any, resolvers: Mapping[str, ServiceResolver] | None = None
) -> tuple[Scenario, TandemModel]:
    """Resolve the service references of a parsed scenario mapping, validate it, build its model.

    Parameters
    ----------
    data
        The scenario as parsed YAML or JSON; not modified.
    resolvers
        Reference key (``"file"``, ``"fit"``) to its resolver. A key without a resolver is left
        in place, so the schema reports it (``unknown key``).

    Returns
    -------
    tuple[Scenario, TandemModel]
        The validated scenario (services as ``ph``) and its model (stability checked).
    """
    if resolvers and isinstance(data, dict) and isinstance(data.get("stages"), list):
        data = copy.deepcopy(data)
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
    sc = parse_scenario(data)
    return sc, sc.build_model()


def file_resolver(base: Path) -> ServiceResolver:
    """Resolver of ``{file: NAME}``: the ``overtake fit`` JSON at ``base / NAME``."""

    def resolve(ref: Any, *, where: str, stage: str) -> Mapping[str, Any]:
        path = base / str(ref)
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelError(f"{where}: {path} does not exist (run `overtake fit` first)") from None
        except json.JSONDecodeError as exc:
            raise ModelError(f"{where}: {path} is not JSON ({exc.msg}, line {exc.lineno})") from None
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
    return resolve_scenario(data, {"file": file_resolver(p.parent)})
