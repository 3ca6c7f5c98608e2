"""Readers: text/CSV durations and Apache access logs (garbage counted, not fatal)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from overtake.fitting import LogFormatError
from overtake.fitting.io import parse_apache_log, read_durations

FMT_D = '%h %t "%r" %>s %b %D'
FMT_MS = '%h %t "%r" %>s %b %{ms}T'


def _line(path: str, status: int, dur: str) -> str:
    return f'10.0.0.1 [21/Nov/2026:08:00:00 +0000] "GET {path} HTTP/1.1" {status} 512 {dur}'


def test_apache_maps_stages_drops_non_2xx_and_counts_garbage() -> None:
    lines = [
        _line("/stage1?work=0.1", 200, "1500"),
        _line("/stage1", 204, "2500"),
        _line("/stage2/a", 200, "1000000"),
        _line("/stage2/a", 503, "99"),
        _line("/other", 200, "7"),
        "this is not a log line",
        _line("/stage1", 200, "0"),
        "",
    ]
    res = parse_apache_log(lines, FMT_D, {"s1": r"^/stage1", "s2": r"^/stage2"})
    assert res.stages["s1"].tolist() == pytest.approx([1.5e-3, 2.5e-3, 0.5e-6])
    assert res.stages["s2"].tolist() == pytest.approx([1.0])
    assert (res.lines, res.garbage, res.non_2xx, res.unmatched, res.zero_durations) == (7, 1, 1, 1, 1)
    assert res.garbage_examples == ("this is not a log line",)
    assert "1 unparsable" in res.report()[0]


def test_apache_milliseconds_directive() -> None:
    res = parse_apache_log([_line("/x", 200, "45")], FMT_MS, {"x": "/x"})
    assert res.stages["x"].tolist() == pytest.approx([0.045])


@pytest.mark.parametrize(
    ("fmt", "stages", "match"),
    [
        ('%h %t "%r" %>s %b', {"x": "."}, "no duration directive"),
        ("%h %t %>s %D", {"x": "."}, "no request line"),
        ("%Q{", {"x": "."}, "log format"),
        (FMT_D, {}, "at least one stage"),
        (FMT_D, {"x": "("}, "stage 'x': regex '\\(': not a valid regular expression"),
        (FMT_D, {"x": r"(?<=/)x"}, "stage 'x': .* not supported by the linear-time matcher"),
        (FMT_D, {"a/b": "."}, "stage name"),
    ],
)
def test_apache_bad_configuration(fmt: str, stages: dict[str, str], match: str) -> None:
    with pytest.raises(LogFormatError, match=match):
        parse_apache_log([], fmt, stages)


def test_read_plain_and_csv(tmp_path: Path) -> None:
    p = tmp_path / "d.txt"
    p.write_text("# durations\n0.5\n\n1.5\n")
    assert read_durations(p).tolist() == [0.5, 1.5]
    assert read_durations(p, scale=1e-3).tolist() == pytest.approx([5e-4, 1.5e-3])
    c = tmp_path / "d.csv"
    c.write_text("id,ms\n1,12\n2,30\n")
    assert read_durations(c, column="ms").tolist() == [12.0, 30.0]
    assert read_durations(c, column=1).tolist() == [12.0, 30.0]
    with pytest.raises(LogFormatError, match="no column 'sec'"):
        read_durations(c, column="sec")
    with pytest.raises(LogFormatError, match=r"d.csv:1: not a number.*--column"):
        read_durations(c)
    # a digit of another script is a column name, not an index ('٣' would have been column 3)
    for col in ("\u0663", "\u00b2"):
        with pytest.raises(LogFormatError, match=f"no column '{col}'"):
            read_durations(c, column=col)


def test_read_bad_value_names_line(tmp_path: Path) -> None:
    p = tmp_path / "d.txt"
    p.write_text("0.5\nabc\n")
    with pytest.raises(LogFormatError, match=r"d.txt:2: not a number: 'abc'"):
        read_durations(p)
    assert isinstance(np.zeros(1), np.ndarray)
