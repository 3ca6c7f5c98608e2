"""Stages as real sites have them: routes on method, path and query; learned keys by query
parameter, body size and the transaction link (controller.sidecar.stages)."""

from __future__ import annotations

from pathlib import Path

import pytest

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.stages import StagesConfig, StageTable, load_stages

# stock MediaWiki: every page is /index.php?title=...; an edit preview is a POST with action=submit
WIKI = {"stages": [
    {"name": "preview", "routes": [{"path": "^/index[.]php$", "query": "(^|&)action=submit(&|$)",
                                    "methods": ["POST"], "key": ["body_size"]}],
     "next": "view"},
    {"name": "view", "routes": [{"path": "^/index[.]php$", "methods": ["GET"], "key": ["link"]},
                                {"path": "^/wiki/", "key": ["path"]}]},
]}


def _table(cfg: dict[str, object]) -> StageTable:
    return StageTable(StagesConfig.model_validate(cfg))


def test_query_regex_routes_requests_of_one_path() -> None:
    t = _table(WIKI)
    assert t.route("POST", "/index.php", "title=Main_Page&action=submit")[0] == 0  # type: ignore[index]
    assert t.route("POST", "/index.php", "action=submitted") is None  # whole parameter, not a prefix
    assert t.route("GET", "/index.php", "title=Main_Page")[0] == 1  # type: ignore[index]
    assert t.route("GET", "/index.php", "title=Main_Page&action=submit")[0] == 1  # type: ignore[index]
    assert t.route("PUT", "/index.php", "action=submit") is None


def test_learned_keys_separate_what_costs_differently() -> None:
    t = _table(WIKI)
    preview = t.route("POST", "/index.php", "title=A&action=submit")[1]  # type: ignore[index]
    small = t.learned_key(preview, "POST", "/index.php", "title=A&action=submit", 3000)
    # half-octave bins: within a factor of about 1.4 alike, a factor 2 apart not
    assert t.learned_key(preview, "POST", "/index.php", "title=B&action=submit", 3500) == small
    assert t.learned_key(preview, "POST", "/index.php", "title=A&action=submit", 6000) != small
    assert t.learned_key(preview, "POST", "/index.php", "title=A&action=submit", None) != small
    view = t.route("GET", "/index.php", "title=A")[1]  # type: ignore[index]
    # the follow-up of a transaction learns under the request it follows, predictable at reservation
    key = t.learned_key(view, "GET", "/index.php", "title=A", None, link=small)
    assert key == t.follow_up_key(1, small) != t.follow_up_key(1, "POST x 30")
    wiki = t.route("GET", "/wiki/Page_1", "")[1]  # type: ignore[index]
    assert t.learned_key(wiki, "GET", "/wiki/Page_1") != t.learned_key(wiki, "GET", "/wiki/Page_2")
    assert t.follow_up_key(0, small) == ""  # stage 0 is not linked


def test_param_key_and_default_key() -> None:
    t = _table({"stages": [{"name": "s", "routes": [{"path": "^/i$", "key": ["param:title"]}]},
                           {"name": "d", "path": "^/d$"}]})
    r = t.route("GET", "/i", "title=A&x=1")[1]  # type: ignore[index]
    assert t.learned_key(r, "GET", "/i", "x=2&title=A") == t.learned_key(r, "GET", "/i", "title=A&x=1")
    assert t.learned_key(r, "GET", "/i", "title=B") != t.learned_key(r, "GET", "/i", "title=A")
    d = t.route("GET", "/d", "q=1")[1]  # type: ignore[index]
    assert t.learned_key(d, "GET", "/d", "q=1") == "GET /d"  # unchanged default: method and path


@pytest.mark.parametrize(("route", "needle"), [
    ({"path": "^/x$", "key": ["size"]}, "stages[0].routes[0].key: unknown key part 'size'"),
    ({"path": "^/x$", "key": ["param:"]}, "param: needs the query parameter's name"),
    ({"path": "^/x$", "key": []}, "an empty key makes every request of the route alike"),
    ({"path": "^/x$", "key": ["path", "path"]}, "a key part appears twice"),
    ({"path": "^/x$", "query": "(a"}, "stages[0].routes[0].query: not a valid regular expression"),
    ({"path": "^/x$", "query": "(a)\\1"}, "stages[0].routes[0].query: not"),
    ({"path": "^/x$", "key": ["link"]}, "key part 'link' needs a stage with next: s"),
])
def test_bad_routes_are_refused_with_the_field_and_the_fix(tmp_path: Path, route: dict[str, object],
                                                           needle: str) -> None:
    import yaml
    f = tmp_path / "stages.yaml"
    f.write_text(yaml.safe_dump({"stages": [{"name": "s", "routes": [route]}]}))
    with pytest.raises(SidecarInputError) as exc:
        load_stages(f)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)
