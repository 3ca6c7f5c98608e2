"""The strict reading of a scenario (mdp.scenario_spec) against the schema of record (mdp.scenario_schema).

Whenever the strict reading vouches for a document, the pydantic schema must accept it with the
same values; whenever the schema refuses one, the strict reading must be unsure (so the error is
the schema's). Checked on every shipped scenario and on random edits of valid ones.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from overtake.mdp import scenario_schema
from overtake.mdp.errors import ModelError
from overtake.mdp.scenario import parse_scenario, parse_service
from overtake.mdp.scenario_spec import from_fields, read_strict

REPO = Path(__file__).resolve().parents[2]
TABLE1 = sorted((REPO / "examples" / "table1").glob("case*.yaml"))

BASES: list[dict[str, Any]] = [
    {"load": 0.6, "stages": [{"name": "a", "service": {"exponential": {"mean": 1}}},
                             {"name": "b", "service": {"hyperexponential": {"probs": [0.91, 0.09], "means": [0.55, 5.45]}}}]},
    {"arrival_rate": 2, "cores": 2, "overhead": 0.1, "max_threads": 6, "tolerance": 0.01, "phase_info": "route",
     "time_unit": 0.001, "truncation": {"max_requests": 8, "max_threads": 4},
     "stages": [{"name": "s", "lock": 1, "service": {"erlang": {"order": 3, "mean": 0.2}},
                 "routes": [{"name": "r1", "weight": 0.5, "alpha": [1, 0, 0]},
                            {"name": "r2", "weight": 0.5, "alpha": [0, 1, 0]}]},
                {"name": "t", "service": {"ph": {"alpha": [0.5, 0.5], "T": [[-2, 1], [0, -1.5]]}}}]},
    {"load": 0.5, "phase_info": "full", "routing": [[[0.3, 0.7], [1, 0]]], "time_unit": "model",
     "stages": [{"name": "x", "service": {"hyperexponential": {"probs": [0.5, 0.5], "means": [0.5, 2]}}},
                {"name": "y", "service": {"ph": {"alpha": [1, 0], "T": [[-1, 1], [0, -1]]}}}]},
]

#: values a YAML or JSON document may hold where a number, a name or a list goes
ODD = [0, 1, -1, 2, 3, 0.5, 0.995, 1.0, 1.5, 16, 17, 64, 65, 200, 201, 2000, 2001, 86400, 86401, 1e9, 2e9, 2**60,
       10**400, 1e-9, True, False, None, "", "x", "1.5", "model", "full", "none", "blind", [], [1], [0.5, 0.5], [[1]],
       {}, {"mean": 1}, float("nan"), float("inf"), -float("inf"),
       0.9105, 0.91 + 1e-7, 1e-8, 0.49, 0.5 + 1e-12]


def schema_reading(data: Any) -> tuple[str, Any]:
    """('ok', the scenario's fields) or ('error', pydantic's first error location)."""
    try:
        return "ok", from_fields(scenario_schema.Scenario.model_validate(data).model_dump())
    except ValidationError as exc:
        return "error", exc.errors()[0]["loc"]


def check_agree(data: Any) -> None:
    fast = read_strict(data)
    kind, ref = schema_reading(data)
    if fast is None:
        return
    assert kind == "ok", (data, ref)
    assert fast == ref, data
    dumped = scenario_schema.Scenario.model_validate(data)
    assert fast.to_dict() == dumped.model_dump() and fast.to_dict(exclude_none=True) == dumped.model_dump(exclude_none=True)
    # the same types too: a float where the schema keeps a float (equality alone would take 1 == 1.0)
    assert repr(fast.to_dict()) == repr(dumped.model_dump()), data


@pytest.mark.parametrize("path", TABLE1, ids=lambda p: p.name)
def test_every_table1_case_is_read_without_the_schema_and_as_the_schema_reads_it(path):
    data = yaml.safe_load(path.read_text())
    assert read_strict(data) is not None  # the command line's path imports no pydantic
    check_agree(data)


@pytest.mark.parametrize("base", BASES)
def test_the_bases_are_vouched_for_and_agree(base):
    assert read_strict(base) is not None
    check_agree(base)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _edit(doc: Any, path: tuple[Any, ...], how: str, value: Any) -> Any:
    if not path:
        return value if how == "set" else doc
    head, rest = path[0], path[1:]
    copy: Any = dict(doc) if isinstance(doc, dict) else list(doc)
    if not rest and how == "drop":
        del copy[head]
    elif not rest and how == "add" and isinstance(copy, dict):
        copy[head] = doc[head]
        copy["colour" if "colour" not in copy else "shade"] = value
    else:
        copy[head] = _edit(doc[head], rest, how, value)
    return copy


SINGLE_EDITS = [(i, path, how, value) for i, base in enumerate(BASES) for path in _paths(base) if path
                for how, values in (("set", ODD), ("drop", [None]), ("add", [1])) for value in values]


def test_every_single_edit_the_strict_reading_vouches_for_is_valid_with_the_same_values():
    vouched = 0
    for i, path, how, value in SINGLE_EDITS:
        data = _edit(BASES[i], path, how, value)
        check_agree(data)
        vouched += read_strict(data) is not None
    assert vouched > 100  # the edits reach documents the strict reading takes, not only refusals


@st.composite
def edited(draw: Any) -> Any:
    doc: Any = draw(st.sampled_from(BASES))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        how = draw(st.sampled_from(["set", "set", "set", "drop", "add"]))
        doc = _edit(doc, path, how, draw(st.sampled_from(ODD)))
    return doc


@settings(max_examples=600, deadline=None)
@given(edited())
def test_random_edits_the_strict_reading_vouches_for_are_valid_with_the_same_values(data):
    check_agree(data)


def test_a_document_the_strict_reading_leaves_to_the_schema_keeps_its_values():
    """Numbers as strings and whole floats as integers are the schema's to read (it accepts them)."""
    data = {**BASES[1], "cores": 2.0, "tolerance": "0.01"}
    assert read_strict(data) is None
    assert parse_scenario(data) == parse_scenario(BASES[1])


@pytest.mark.parametrize("patch,message", [
    ({"load": "high"}, "load: Input should be a valid number"),
    ({"load": float("nan")}, "load: Input should be greater than 0"),
    ({"cores": 1.5}, "cores: Input should be a valid integer, got a number with a fractional part"),
    ({"stages": []}, "stages: List should have at least 1 item"),
    ({"phase_info": "blind"}, "phase_info: Input should be 'full', 'start', 'none' or 'route'"),
])
def test_errors_are_the_schemas_one_line(patch, message):
    with pytest.raises(ModelError) as exc:
        parse_scenario({**BASES[0], **patch})
    assert str(exc.value).startswith(message)


def test_a_service_alone_is_read_by_the_schema():
    a, T = parse_service({"erlang": {"order": 2, "mean": 1}}).representation()
    assert list(a) == [1.0, 0.0] and T[0, 0] == -2.0 and math.isclose(-1 / T[1, 1] - 1 / T[0, 0], 1.0)
    with pytest.raises(ValidationError):
        parse_service({"erlang": {"order": 0, "mean": 1}})
