"""Reading a scenario file for the CLI: YAML, ``{file: …}`` services resolved, then validated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from overtake.mdp.errors import ModelError
from overtake.mdp.model import TandemModel
from overtake.mdp.scenario import Scenario, parse_scenario


def _resolve_files(data: Any, base: Path) -> Any:
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, list):
        return data
    for i, st in enumerate(stages):
        svc = st.get("service") if isinstance(st, dict) else None
        if isinstance(svc, dict) and "file" in svc:
            if len(svc) != 1:
                raise ModelError(f"stages.{i}.service: give file alone, not with {sorted(set(svc) - {'file'})}")
            path = base / str(svc["file"])
            try:
                doc = json.loads(path.read_text())
            except FileNotFoundError:
                raise ModelError(f"stages.{i}.service.file: {path} does not exist (run `overtake fit` first)") from None
            except json.JSONDecodeError as exc:
                raise ModelError(f"stages.{i}.service.file: {path} is not JSON ({exc.msg}, line {exc.lineno})") from None
            if not isinstance(doc, dict) or "alpha" not in doc or "T" not in doc:
                raise ModelError(f"stages.{i}.service.file: {path} has no 'alpha' and 'T' (not an `overtake fit` output)")
            st["service"] = {"ph": {"alpha": doc["alpha"], "T": doc["T"]}}
    return data


def load_scenario(path: str | Path) -> tuple[Scenario, TandemModel]:
    """Read, resolve and validate a scenario file; errors are one :class:`ModelError` line."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ModelError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    data = _resolve_files(data, p.parent)
    sc = parse_scenario(data)
    return sc, sc.build_model()
