"""An Apache LogFormat is matched in time linear in the line, with the fields apachelogs reads.

The hostile case: twelve ``%{X}i`` fields (free text, spaces allowed) then ``%U %D``, against a
line of words ``"a "`` with no duration at its end. A backtracking matcher tries every way of
splitting the words between the fields: the steps grow by a factor of about 1.7 per word
(seconds at 28 words); without the spaces between the fields, minutes at 10. The calls run in a
subprocess with a 60 s timeout: a linear-time matcher ends in milliseconds, a backtracking one
would take hours, so no timed assertion is needed. On ordinary lines the fields equal
apachelogs' own (cross-checked on a grid of formats and lines).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import apachelogs
import pytest

from overtake.fitting import LogFormatError
from overtake.fitting.io import parse_apache_log
from overtake.fitting.logformat import MAX_FORMAT_CHARS, MAX_LINE_CHARS, LogFormat

HEADERS_SPACED = " ".join(["%{X}i"] * 12) + " %U %D"
HEADERS_ADJACENT = "%{X}i" * 12 + " %U %D"


def _bounded(code: str) -> str:
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                             timeout=60, env={"OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        pytest.fail("a 100-byte log line did not parse within 60 s: the log format is matched by backtracking")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("fmt", [HEADERS_SPACED, HEADERS_ADJACENT])
def test_a_line_that_backtracks_parses_in_linear_time(fmt: str) -> None:
    ok = fmt.replace("%{X}i", "-").replace("%U", "/a")
    out = _bounded(f"""
        from overtake.fitting.io import parse_apache_log
        lines = ["a " * 50, {ok.replace("%D", "1500")!r}, {ok.replace("%D", "2500")!r}]
        res = parse_apache_log(lines, {fmt!r}, {{"a": "^/a"}})
        print(res.garbage, res.stages["a"].tolist())
    """)
    assert out == "1 [0.0015, 0.0025]"  # the hostile line is unparsable, the other two are read


FORMATS = [
    '%h %l %u %t "%r" %>s %b %D',
    '%h %l %u %t "%r" %>s %O "%{Referer}i" "%{User-Agent}i" %D',
    '%v:%p %h %l %u %t "%r" %s %b %{ms}T',
    '%a %t "%m %U%q %H" %>s %{us}T',
    '%h %{%Y-%m-%d %H:%M:%S}t "%r" %<s %>s %T',
    HEADERS_SPACED,
]

VALUES = {
    "%h": ["127.0.0.1", "::1", "host\\x20name"], "%l": ["-"], "%u": ["-", "bob", '""'],
    "%t": ["[21/Nov/2026:08:00:00 +0000]"], "%r": ["GET /stage1?work=2 HTTP/1.1", 'GET /q\\"x HTTP/1.0', "-"],
    "%>s": ["200", "503", "-"], "%s": ["204"], "%<s": ["302"], "%b": ["512", "-"], "%O": ["1024"],
    "%D": ["1500", "0"], "%{ms}T": ["45"], "%{us}T": ["7"], "%T": ["2"], "%v": ["www"], "%p": ["80"],
    "%a": ["10.0.0.1"], "%m": ["POST"], "%U": ["/stage2/a", "/a b"], "%q": ["", "?x=1"], "%H": ["HTTP/1.1"],
    "%{Referer}i": ["-", "http://x/"], "%{User-Agent}i": ["curl/8.0", "Mozilla/5.0 (X11; Linux)"],
    "%{%Y-%m-%d %H:%M:%S}t": ["2026-11-21 08:00:00"], "%{X}i": ["-", "a b", ""],
}


def _lines(fmt: str) -> list[str]:
    """Lines of ``fmt``, each directive cycling through its example values."""
    import re

    directives = re.findall(r"%[<>]?(?:\{[^}]*\})?[a-zA-Z]", fmt)
    out = []
    for k in range(3):
        line = fmt
        for d in directives:
            vals = VALUES[d]
            line = line.replace(d, vals[k % len(vals)], 1)
        out.append(line)
    return out


WANTED = frozenset(("status", "final_status", "original_status", "request_uri", "request_line",
                    "request_duration_microseconds", "request_duration_milliseconds", "request_duration_seconds"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_fields_as_apachelogs(fmt: str) -> None:
    ours, ref = LogFormat(fmt, WANTED), apachelogs.LogParser(fmt)
    for line in [*_lines(fmt), "garbage", fmt]:
        try:
            e = ref.parse(line)
        except apachelogs.Error:
            assert ours.fields(line) is None, line
            continue
        want = {k: getattr(e, k) for k in WANTED if getattr(e, k, None) is not None}
        got = {k: v for k, v in (ours.fields(line) or {}).items() if v is not None}
        assert got == want, line


def test_a_number_too_long_for_int_is_an_unparsable_line_not_an_error() -> None:
    lines = [f'1.2.3.4 [21/Nov/2026:08:00:00 +0000] "GET /a HTTP/1.1" 200 1 {d}' for d in ("1" * 5000, "1500", "2500")]
    res = parse_apache_log(lines, '%h %t "%r" %>s %b %D', {"a": "^/a"})
    assert res.garbage == 1 and res.stages["a"].tolist() == [0.0015, 0.0025]


def test_a_line_over_the_cap_is_unparsable() -> None:
    ok = '1.2.3.4 "GET /a HTTP/1.1" 200 1500'
    long = '1.2.3.4 "GET /a' + "a" * MAX_LINE_CHARS + ' HTTP/1.1" 200 1500'
    res = parse_apache_log([ok, long], '%h "%r" %>s %D', {"a": "^/a"})
    assert (res.lines, res.garbage, res.stages["a"].size) == (2, 1, 1)
    assert len(res.garbage_examples[0]) == 200  # the example is cut, not the whole line


def test_a_format_over_the_cap_is_refused_naming_it() -> None:
    fmt = '%h "%r" %D ' + "%{X}i " * (MAX_FORMAT_CHARS // 6)
    with pytest.raises(LogFormatError, match=rf"log format: {len(fmt)} characters, over the limit of {MAX_FORMAT_CHARS}"):
        parse_apache_log([], fmt, {"a": "^/a"})
