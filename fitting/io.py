"""Readers for measured durations: plain text, CSV and Apache access logs.

The only module of :mod:`overtake.fitting` that touches files. Everything it returns is in seconds.

Apache logs are parsed from the server's ``LogFormat`` string (``apachelogs``' translation, matched
in linear time by :class:`overtake.fitting.logformat.LogFormat`). The duration
comes from ``%D`` (microseconds), ``%{us}T``, ``%{ms}T`` or ``%T``/``%{s}T`` (whole seconds:
coarse), first match in that order. Each request line (``%r``, or ``%U`` if present) is mapped to
the first stage whose regex matches its URL path (``re.search``, run in linear time by
:class:`overtake.regex.LinearRegex`); non-2xx responses are dropped. Lines that do
not parse are counted and a few kept as examples, never fatal. A logged duration of 0 (below the
clock tick) is replaced by half a tick, since a phase-type density has no atom at 0; such
replacements are counted.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from overtake.regex import LinearRegex

from .errors import LogFormatError
from .logformat import LogFormat

__all__ = ["ApacheSamples", "parse_apache_log", "read_apache_log", "read_durations", "read_pairs"]

FloatArray = npt.NDArray[np.float64]

# directive -> (apachelogs attribute, seconds per unit)
_DURATIONS = (
    ("%D", "request_duration_microseconds", 1e-6),
    ("%{us}T", "request_duration_microseconds", 1e-6),
    ("%{ms}T", "request_duration_milliseconds", 1e-3),
    ("%{s}T", "request_duration_seconds", 1.0),
    ("%T", "request_duration_seconds", 1.0),
)
#: what a line's fields are read for: the status, the request path and the duration
_FIELDS = frozenset(("status", "final_status", "request_uri", "request_line", *(a for _, a, _ in _DURATIONS)))


def read_pairs(path: str | Path, *, scale: float = 1.0) -> tuple[FloatArray, FloatArray]:
    """Paired durations, one transaction a line: its stage-1 and stage-2 times, separated by a comma
    or blanks (a header line of names is skipped; blank lines and ``#`` comments too).

    Raises
    ------
    LogFormatError
        A line without exactly two numbers (the message names file and line).
    """
    p = Path(path)
    first: list[float] = []
    second: list[float] = []
    with p.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            s = line.split("#", 1)[0].strip()
            if not s:
                continue
            parts = s.replace(",", " ").split()
            try:
                vals = [float(v) for v in parts]
            except ValueError:
                if lineno == 1 or not first:  # a header of column names
                    continue
                raise LogFormatError(f"{p}:{lineno}: not two numbers: {s[:60]!r}") from None
            if len(vals) != 2:
                raise LogFormatError(f"{p}:{lineno}: a transaction is two durations (stage 1, stage 2), got "
                                     f"{len(vals)} values: {s[:60]!r}")
            first.append(vals[0])
            second.append(vals[1])
    return np.asarray(first, dtype=np.float64) * scale, np.asarray(second, dtype=np.float64) * scale


def read_durations(path: str | Path, *, column: str | int | None = None, scale: float = 1.0) -> FloatArray:
    """Durations from a text file (one per line) or from one column of a CSV file.

    Parameters
    ----------
    path : str or Path
        Plain text (blank lines and ``#`` comments skipped) or CSV.
    column : str or int, optional
        CSV column by header name or 0-based index; without it the file must hold one number
        per line.
    scale : float
        Multiplier to seconds (e.g. 1e-3 for milliseconds).

    Raises
    ------
    LogFormatError
        A value that is not a number (the message names file, line and text), or a missing column.
    """
    p = Path(path)
    with p.open(newline="") as fh:
        if column is None:
            return np.asarray(_plain_values(fh, p), dtype=np.float64) * scale
        reader = csv.reader(fh)
        try:
            header = next(reader)
        except StopIteration:
            return np.zeros(0)
        idx, rows = _csv_column(p, header, reader, column)
        return np.asarray(_column_values(p, rows, idx, column), dtype=np.float64) * scale


def _plain_values(fh: Iterable[str], p: Path) -> list[float]:
    """One number per line, blank lines and ``#`` comments skipped; a line that is not a number
    names the file and line (with a hint when the file looks like a CSV)."""
    out = []
    for lineno, line in enumerate(fh, start=1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            out.append(float(s))
        except ValueError:
            hint = " (a CSV? choose the column with --column)" if "," in s or lineno == 1 else ""
            raise LogFormatError(f"{p}:{lineno}: not a number: {s[:60]!r}{hint}") from None
    return out


def _csv_column(p: Path, header: list[str], reader: Iterator[list[str]],
                column: str | int) -> tuple[int, Iterable[list[str]]]:
    """The column's index and the data rows: a name from the header, or a 0-based index (then a
    first row that is numeric is data, not a header)."""
    index = isinstance(column, str) and column.isascii() and column.isdigit()  # not '²' or '٣'
    if isinstance(column, int) or (index and column not in header):
        idx = int(column)
        rows: Iterable[list[str]] = reader
        if idx >= len(header):
            raise LogFormatError(f"{p}: column index {idx} out of range (the file has {len(header)} columns)")
        try:
            float(header[idx])
            rows = [header, *reader]  # no header row
        except ValueError:
            pass
        return idx, rows
    if column not in header:
        raise LogFormatError(f"{p}: no column {column!r}; the header has {header}")
    return header.index(column), reader


def _column_values(p: Path, rows: Iterable[list[str]], idx: int, column: str | int) -> list[float]:
    """The column's numbers, rows without a value there skipped; a value that is not a number
    names the file and line."""
    vals = []
    for lineno, row in enumerate(rows, start=2):
        if not row or idx >= len(row) or not row[idx].strip():
            continue
        try:
            vals.append(float(row[idx]))
        except ValueError:
            raise LogFormatError(f"{p}:{lineno}: column {column!r} is not a number: {row[idx][:60]!r}") from None
    return vals


@dataclass(frozen=True)
class ApacheSamples:
    """Durations per stage from an access log, with counts of what was dropped."""

    stages: dict[str, FloatArray]
    lines: int
    garbage: int
    non_2xx: int
    unmatched: int
    no_duration: int
    zero_durations: int
    tick: float
    garbage_examples: tuple[str, ...] = field(default=())

    def report(self) -> list[str]:
        """One-line summaries for the CLI."""
        out = [
            f"{self.lines} lines: {sum(v.size for v in self.stages.values())} kept, {self.garbage} unparsable, "
            f"{self.non_2xx} non-2xx, {self.unmatched} matched no stage, {self.no_duration} without duration"
        ]
        if self.zero_durations:
            out.append(f"{self.zero_durations} durations of 0 replaced by half a tick ({self.tick / 2:g} s)")
        for ex in self.garbage_examples:
            out.append(f"unparsable: {ex[:100]!r}")
        return out


def _compile_stages(stages: Mapping[str, str]) -> list[tuple[str, LinearRegex]]:
    if not stages:
        raise LogFormatError("at least one stage NAME=REGEX is needed")
    out = []
    for name, rx in stages.items():
        if not name or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise LogFormatError(f"stage name must be letters, digits, '_', '.', '-' (used as a file name), got {name!r}")
        try:
            out.append((name, LinearRegex(rx)))
        except ValueError as exc:
            raise LogFormatError(f"stage {name!r}: regex {rx!r}: {exc}") from None
    return out


def parse_apache_log(lines: Iterable[str], log_format: str, stages: Mapping[str, str]) -> ApacheSamples:
    """Map access-log lines to per-stage durations (seconds); see the module docstring."""
    parser = LogFormat(log_format, _FIELDS)
    dur = next(((d, attr, unit) for d, attr, unit in _DURATIONS if d in log_format), None)
    if dur is None:
        raise LogFormatError(f"log format {log_format[:200]!r} has no duration directive: add %D (microseconds) "
                             "or %{ms}T")
    if "%r" not in log_format and "%U" not in log_format:
        raise LogFormatError(f"log format {log_format[:200]!r} has no request line: add %r (or %U) to map "
                             "requests to stages")
    _, attr, unit = dur
    compiled = _compile_stages(stages)
    has_status = "%>s" in log_format or "%s" in log_format
    found: dict[str, list[float]] = {name: [] for name, _ in compiled}
    n = garbage = non2xx = unmatched = nodur = zeros = 0
    examples: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        n += 1
        e = parser.fields(line)
        if e is None:
            garbage += 1
            if len(examples) < 3:
                examples.append(line[:200])
            continue
        if has_status:
            status = e.get("final_status") or e.get("status")
            if status is None or not 200 <= int(status) < 300:
                non2xx += 1
                continue
        path = e.get("request_uri")
        if path is None:
            req = e.get("request_line") or ""
            parts = req.split()
            path = parts[1] if len(parts) >= 2 else req
        stage = next((name for name, rx in compiled if rx.search(path)), None)
        if stage is None:
            unmatched += 1
            continue
        d = e.get(attr)
        if d is None:
            nodur += 1
            continue
        v = float(d) * unit
        if v <= 0:
            zeros += 1
            v = 0.5 * unit
        found[stage].append(v)
    return ApacheSamples({k: np.asarray(v, dtype=np.float64) for k, v in found.items()}, n, garbage, non2xx,
                         unmatched, nodur, zeros, unit, tuple(examples))


def read_apache_log(path: str | Path, log_format: str, stages: Mapping[str, str]) -> ApacheSamples:
    """:func:`parse_apache_log` over a file (undecodable bytes count as garbage lines)."""
    with Path(path).open(encoding="utf-8", errors="replace") as fh:
        return parse_apache_log(fh, log_format, stages)
