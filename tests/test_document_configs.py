"""The sidecar configurations, stages files and scenarios the user documents show load as written:
every ```yaml block of README.md, docs/ and apache-conf/ that is a sidecar config (it has
``apache`` or ``enforce``) goes through the sidecar's own loader, every stages file (a ``stages``
list of ``path``/``routes`` entries) through its schema, every scenario (``load`` or
``arrival_rate``) through the scenario loader, its fitted services (``{file: ...}``) stood in for
by an exponential. A renamed key, or a key a mode no longer needs
but still demands, fails here before a user meets it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.documents import ROOT, USER_DOCS

from overtake.controller.sidecar.config import load_config, to_options
from overtake.controller.sidecar.stages import StagesConfig

BLOCK = re.compile(r"```yaml\n(.*?)```", re.S)


def _blocks(kind: str) -> list[Any]:
    out = []
    for doc in USER_DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            data = yaml.safe_load(m.group(1))
            if _kind(data) == kind:
                line = text[:m.start()].count("\n") + 1
                out.append(pytest.param(m.group(1), id=f"{doc.relative_to(ROOT)}:{line}"))
    return out


def _kind(data: object) -> str:
    if not isinstance(data, dict):
        return "other"
    if "load" in data or "arrival_rate" in data:
        return "scenario"
    if "apache" in data or "enforce" in data:
        return "sidecar"
    stages = data.get("stages")
    if isinstance(stages, list) and stages and all(isinstance(s, dict) and ("path" in s or "routes" in s)
                                                   for s in stages):
        return "stages"
    return "other"


def test_the_documents_show_every_kind() -> None:
    assert len(_blocks("sidecar")) >= 3 and len(_blocks("stages")) >= 2 and len(_blocks("scenario")) >= 2


@pytest.mark.parametrize("block", _blocks("sidecar"))
def test_a_documented_sidecar_config_loads(block: str, tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text(block, encoding="utf-8")
    opts = to_options(load_config(path, {}))
    assert opts.endpoints.apache.startswith("http://")


@pytest.mark.parametrize("block", _blocks("scenario"))
def test_a_documented_scenario_builds_its_model(block: str) -> None:
    from overtake.api.scenario import resolve_scenario

    def exponential(ref: object, *, where: str, stage: str) -> dict[str, object]:
        return {"alpha": [1.0], "T": [[-1.0]]}

    _, model = resolve_scenario(yaml.safe_load(block), {"file": exponential})
    assert model.n_stages >= 1


@pytest.mark.parametrize("block", _blocks("stages"))
def test_a_documented_stages_file_validates(block: str) -> None:
    assert StagesConfig.model_validate(yaml.safe_load(block)).stages


def test_the_configuration_reference_has_a_row_for_every_key() -> None:
    """Every key the sidecar's config file takes is named in the first cell of a row of the
    reference's key table (``online.``/``verify.`` keys under their section's prefix)."""
    from overtake.controller.sidecar.config import OnlineConfig, SidecarConfig, VerifyConfig

    text = (ROOT / "docs" / "reference" / "configuration.md").read_text(encoding="utf-8")
    table = text[text.index("## The sidecar's configuration file"):]
    named = {k for row in re.findall(r"^\| ([^|]+) \|", table, re.M) for k in re.findall(r"`([a-z_.]+)`", row)}
    keys = {*SidecarConfig.model_fields, *(f"online.{k}" for k in OnlineConfig.model_fields),
            *(f"verify.{k}" for k in VerifyConfig.model_fields)}
    assert not keys - named, f"configuration.md has no row for {sorted(keys - named)}"


def test_the_stages_file_reference_names_every_key() -> None:
    """The reference's annotated stages file (and the text after it, up to the time unit) names
    every key of the stages file's schema."""
    from pydantic import BaseModel

    from overtake.controller.sidecar.stages import StagesConfig

    text = (ROOT / "docs" / "reference" / "configuration.md").read_text(encoding="utf-8")
    part = text[text.index("## The stages file"):text.index("## The time unit")]
    missing = []

    def walk(model: type[BaseModel], where: str) -> None:
        for name, field in model.model_fields.items():
            if f"`{name}`" not in part and f"{name}:" not in part:
                missing.append(where + name)
            for sub in getattr(field.annotation, "__args__", (field.annotation,)):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    walk(sub, f"{where}{name}.")

    walk(StagesConfig, "")
    assert not missing, f"configuration.md's stages file names no {missing}"


def test_every_documented_overtake_log_format_is_the_one_the_sidecar_reads() -> None:
    """A ``LogFormat "..." overtake`` line a user copies is, once Apache's escapes are undone,
    exactly the format the online loop and ``overtake diagnose`` parse: a drifted copy would
    leave every line unread."""
    from overtake.controller.log_format import LOG_FORMAT

    found = []
    for doc in USER_DOCS:
        for m in re.finditer(r'^LogFormat "((?:[^"\\]|\\.)*)" overtake$', doc.read_text(encoding="utf-8"), re.M):
            found.append(doc.relative_to(ROOT))
            assert re.sub(r"\\(.)", r"\1", m.group(1)) == LOG_FORMAT, doc
    assert found, "no user document shows the sidecar's LogFormat"
