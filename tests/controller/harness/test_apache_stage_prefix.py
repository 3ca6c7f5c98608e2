"""Module mode with stages declared at server level (``OvertakeStagePrefix PREFIX STAGE [METHOD]``),
on a private Apache with mod_overtake_prio: no ``<Location>`` section says which request is of
which stage.

- A request is counted in the stage of the longest prefix its path starts with, at a segment
  boundary (``/stage1`` covers ``/stage1`` and ``/stage1/r2``, not ``/stage10``); of two equal
  prefixes, the one naming the request's method; ``none`` takes a subtree out of a shorter prefix;
  a path under no prefix is in no stage (no stage's count moves).
- A section's ``OvertakeStage`` wins over every prefix.
- A virtual host matches the main server's prefixes and its own, its own replacing the main
  server's of the same prefix.
- A bad prefix, a bad method and a repeated prefix are refused by ``apache2 -t`` with the
  directive, the value and the fix (the repeat: AH90304, naming both lines).
"""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prio_helpers import refusal
from support.control_apache import control_apache
from support.module_stages import prio_status, settled

from overtake.controller.harness import apache
from overtake.controller.harness.apache.config import DEFAULT_CONF_DIR

NAMES = ("files", "hello", "work", "posted", "sect")
PREFIXES = (("files", "/static"), ("hello", "/static/hello.txt"), ("none", "/static/none"),
            ("work", "/stage1"), ("posted", "/stage1", "POST"))


@pytest.fixture(scope="module")
def prefixed(apache_available: None) -> Iterator[tuple[apache.ApacheInstance, str]]:
    with control_apache("stage-prefix", levels=(0.5,), nice=("idle",), mpm="event", stage_prefixes=PREFIXES,
                        stages=(("sect", "^/static/16k"),)) as served:
        yield served


def _requests(inst: apache.ApacheInstance) -> dict[str, float]:
    st = settled(inst, NAMES)
    return {s: st[f'overtake_stage_requests_total{{stage="{s}"}}'] for s in NAMES}


#: appended to the template: a virtual host with its own prefixes (the first one is the default host)
VHOSTS = """
<VirtualHost @LISTEN@>
    ServerName main.test
</VirtualHost>
<VirtualHost @LISTEN@>
    ServerName other.test
    OvertakeStagePrefix /static vfiles
    OvertakeStagePrefix /static/hello.txt none
</VirtualHost>
"""


@pytest.fixture(scope="module")
def vhosted(apache_available: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[apache.ApacheInstance]:
    conf = tmp_path_factory.mktemp("vhost-conf") / "apache-conf"
    shutil.copytree(DEFAULT_CONF_DIR, conf, ignore=shutil.ignore_patterns(".libs", "*.o", "*.lo", "*.slo", "*.la"))
    (conf / "httpd.conf.in").write_text((conf / "httpd.conf.in").read_text() + VHOSTS)
    with control_apache("stage-prefix-vhost", levels=(0.5,), nice=("idle",), mpm="event", conf_dir=str(conf),
                        stage_prefixes=(("files", "/static"), ("work", "/stage1"))) as (inst, _):
        yield inst


def _send(inst: apache.ApacheInstance, path: str, method: str = "GET", host: str | None = None) -> None:
    req = urllib.request.Request(inst.base_url + path, method=method, data=b"" if method == "POST" else None,
                                 headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
    except urllib.error.HTTPError as e:  # a path with no file: 404, still counted (or not) by its stage
        e.read()


@pytest.mark.parametrize(
    ("path", "method", "stage"),
    [
        ("/static/1k.txt", "GET", "files"),         # the shorter prefix
        ("/static/hello.txt", "GET", "hello"),      # the longest prefix wins
        ("/static/16k.txt", "GET", "sect"),         # a section wins over every prefix
        ("/stage1?work=0", "GET", "work"),
        ("/stage1/r2?work=0", "GET", "work"),       # under the prefix, past a segment boundary
        ("/stage1?work=0", "POST", "posted"),       # equal prefixes: the one naming the method
        ("/stage10?work=0", "GET", None),           # not a segment boundary: no stage
        ("/stage2?work=0", "GET", None),            # under no prefix
        ("/static/none/x.txt", "GET", None),        # none: out of /static's stage
        ("/server-status?auto", "GET", None),
    ],
)
def test_a_request_is_counted_in_the_stage_of_its_longest_prefix(
        prefixed: tuple[apache.ApacheInstance, str], path: str, method: str, stage: str | None) -> None:
    inst, _ = prefixed
    before = _requests(inst)
    for _ in range(3):
        _send(inst, path, method)
    after = _requests(inst)
    assert {s: after[s] - before[s] for s in NAMES} == {s: 3.0 if s == stage else 0.0 for s in NAMES}


@pytest.mark.parametrize(
    ("host", "path", "stage"),
    [
        ("main.test", "/static/1k.txt", "files"),
        ("other.test", "/static/1k.txt", "vfiles"),    # its own prefix replaces the main server's
        ("other.test", "/static/hello.txt", None),     # its own none, longer
        ("other.test", "/stage1?work=0", "work"),      # the main server's, not repeated there
    ],
)
def test_a_virtual_host_has_the_main_servers_prefixes_and_its_own(
        vhosted: apache.ApacheInstance, host: str, path: str, stage: str | None) -> None:
    names = ("files", "vfiles", "work")
    before = {s: settled(vhosted, names)[f'overtake_stage_requests_total{{stage="{s}"}}'] for s in names}
    _send(vhosted, path, host=host)
    after = {s: settled(vhosted, names)[f'overtake_stage_requests_total{{stage="{s}"}}'] for s in names}
    assert {s: after[s] - before[s] for s in names} == {s: 1.0 if s == stage else 0.0 for s in names}


def test_prefix_stages_are_published_like_section_stages(prefixed: tuple[apache.ApacheInstance, str]) -> None:
    st = prio_status(prefixed[0])
    assert {s for s in NAMES if f'overtake_stage_next{{stage="{s}",next=""}}' in st} == set(NAMES)
    assert 'overtake_stage_next{stage="none",next=""}' not in st  # none names no stage


@pytest.mark.parametrize(
    ("directives", "message"),
    [
        ("OvertakeStagePrefix static/ s", "OvertakeStagePrefix: 'static/' must be a literal URL path"),
        ("OvertakeStagePrefix ^/static/ s", "for a pattern use OvertakeStage in a <LocationMatch>"),
        ("OvertakeStagePrefix /a?b=1 s", "has no query"),
        ("OvertakeStagePrefix /a/ s get", "OvertakeStagePrefix: 'get' is not an HTTP method"),
        ("OvertakeStagePrefix /a/ b/c", "OvertakeStagePrefix: 'b/c' is not a stage name"),
        ("OvertakeStagePrefix /a/", "OvertakeStagePrefix takes two or three arguments"),
        ("<Location /x>\nOvertakeStagePrefix /a/ s\n</Location>", "OvertakeStagePrefix not allowed in <Location> context"),
    ],
)
def test_a_bad_prefix_directive_is_refused_with_the_fix(
        prefixed: tuple[apache.ApacheInstance, str], tmp_path: Path, directives: str, message: str) -> None:
    assert message in refusal(prefixed[0].workdir, tmp_path, directives)


def test_a_repeated_prefix_is_refused_naming_both_lines(
        prefixed: tuple[apache.ApacheInstance, str], tmp_path: Path) -> None:
    said = refusal(prefixed[0].workdir, tmp_path,
                   "OvertakeStagePrefix /api/ a POST\nOvertakeStagePrefix /api/ b\nOvertakeStagePrefix /api/ c POST")
    conf = tmp_path / "t.conf"
    lines = conf.read_text().splitlines()
    first, third = (lines.index(f"OvertakeStagePrefix /api/ {s} POST") + 1 for s in ("a", "c"))
    assert "AH90304" in said
    assert f"OvertakeStagePrefix /api/ POST (stage c) at {conf}:{third} repeats the one at {conf}:{first} " \
           "(stage a); keep one of the two lines" in said
