"""User-supplied regexes run in linear time: the stage regexes of an access-log fit (the
library, ``overtake fit`` and the API) and the sidecar's stage paths.

The catastrophic case ``^/(a+)+$`` against ``"/" + "a" * 40 + "!"`` takes about 2**40 steps
with a backtracking matcher (hours here). Each call site runs it in a subprocess with a
timeout of minutes: a linear-time matcher ends in milliseconds, a backtracking one would hit
the timeout, so the test needs no timed assertion; the margin covers a machine whose other
jobs starve the test's process. What both engines accept must give the same answers as ``re``
(cross-checked on a grid of patterns and texts); what needs backtracking is refused with one
line naming the fix.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from overtake.regex import LinearRegex, check_pattern

EVIL = r"^/(a+)+$"
EVIL_PATH = "/" + "a" * 40 + "!"
#: seconds: far beyond a loaded machine's start-up of the subprocess, far below 2**40 steps
TIMEOUT = 300


def _bounded(code: str) -> str:
    """Run ``code`` in a fresh interpreter; a backtracking matcher would overrun the timeout by hours."""
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                             timeout=TIMEOUT, env={"OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"{EVIL!r} against {EVIL_PATH!r} did not finish within {TIMEOUT} s: exponential-time matching")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_fit_stage_regex_is_linear() -> None:
    out = _bounded(f"""
        from overtake.fitting.io import parse_apache_log
        line = '1.2.3.4 [21/Nov/2026:08:00:00 +0000] "GET {EVIL_PATH} HTTP/1.1" 200 1 1500'
        res = parse_apache_log([line, line.replace("{EVIL_PATH}", "/aaa")], '%h %t "%r" %>s %b %D',
                               {{"evil": {EVIL!r}}})
        print(res.unmatched, res.stages["evil"].size)
    """)
    assert out == "1 1"  # "/aaa" matches, the evil path does not, as re would say


def test_sidecar_stage_path_is_linear() -> None:
    out = _bounded(f"""
        from overtake.controller.sidecar.stages import StagesConfig, StageTable
        t = StageTable(StagesConfig.model_validate({{"stages": [{{"name": "a", "path": {EVIL!r}}}]}}))
        print(t.route("GET", {EVIL_PATH!r}), t.route("GET", "/aaa"))
    """)
    assert out == "None (0, 'a:^/(a+)+$', None)"


def test_api_fit_stage_regex_is_linear() -> None:
    out = _bounded(f"""
        import io, tempfile, time
        from fastapi.testclient import TestClient
        from overtake.api.app import create_app
        from overtake.api.deps import Settings
        line = '1.2.3.4 - - [21/Nov/2026:08:00:00 +0000] "GET {{}} HTTP/1.1" 200 1 {{}}'
        log = "\\n".join(line.format(p, d) for p, d in [("{EVIL_PATH}", 9), ("/aa", 1500), ("/aaa", 2500)])
        with tempfile.TemporaryDirectory() as d, TestClient(create_app(Settings(db=d + "/a.db"))) as c:
            r = c.post("/v1/fits", data={{"kind": "apache-log", "log_format": '%h %l %u %t "%r" %>s %b %D',
                                          "stage": ["evil={EVIL}"], "order": "1"}},
                       files={{"file": ("a.log", io.BytesIO(log.encode()), "text/plain")}})
            print(r.status_code)
    """)
    assert out == "202"  # parsed (two lines of the stage, the evil one unmatched) and queued


@pytest.mark.parametrize("pattern", [
    r"^/stage1$", r"^/stage1", r"/stage", r"^/(a+)+$", r"^/api/v[0-9]+/", r"(?i)^/STAGE", r"\.php$",
    r"^/(img|css)/.*\.(png|css)$", r"^/a{2,3}$", r"^/x?y*z+", r"[^/]+$", r"^/caf\u00e9", r"^/..$", r"^$", r"",
    r"^/a\Z", r"^/a\\Z", r"[\\Z]", r"^/\U000000e9+$", r"\d$",
])
@pytest.mark.parametrize("text", [
    "/stage1", "/stage10", "/x/stage1", "/STAGE1", "/aaaa", "/aaa!", "/api/v12/x", "/api/v/x", "/index.php",
    "/img/a.png", "/css/a.png", "/aa", "/yz", "/z", "", "/café", "/\u00e9\u00e9", "/é", "/a", "/a\\Z", "/\\", "Z", "/1",
])
def test_same_answers_as_re(pattern: str, text: str) -> None:
    rx, ref = LinearRegex(pattern), re.compile(pattern)
    assert rx.match(text) == (ref.match(text) is not None)
    assert rx.search(text) == (ref.search(text) is not None)


def test_documented_difference_dollar_before_final_newline() -> None:
    # re's $ also matches before a final newline; a URL path or a logged request path has none
    assert re.match(r"^/a$", "/a\n") and not LinearRegex(r"^/a$").match("/a\n")


@pytest.mark.parametrize(("pattern", "message"), [
    (r"^/(a)\1$", "not supported by the linear-time matcher"),
    (r"^/(?=stage)", "not supported by the linear-time matcher"),
    (r"^/(?<!x)y", "not supported by the linear-time matcher"),
    (r"^/(?P<x>a)(?P=x)", "not supported by the linear-time matcher"),
    (r"^/a{2000}", "repeat counts over 1000"),
    (r"^/(x", "not a valid regular expression"),
])
def test_backtracking_features_are_refused_in_one_line(pattern: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_pattern(pattern)
    assert "\n" not in str(info.value)
