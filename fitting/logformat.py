"""An Apache ``LogFormat`` compiled to a matcher that runs in time linear in the line (RE2).

``apachelogs`` translates a ``LogFormat`` into one regular expression, a group per directive,
and matches it with Python's backtracking ``re``. Many directives match free text: ``%r``,
``%U`` and ``%{NAME}i`` accept any run of characters, spaces included. A format with a dozen
such fields side by side, against a line that almost fits, makes ``re`` try every way of
splitting the line between them: the steps grow by a constant factor per extra word, so one
line of a few dozen words takes seconds to minutes. Here the same expression is compiled by
RE2 (``google-re2``), which runs an automaton: time bounded by pattern size times line length.
Its submatches follow the same leftmost-first preferences as ``re``, so a line that ``re``
accepts yields the same fields.

Only the fields the fit reads are converted: the status, the request path or line and the
duration. A line whose field cannot be converted (a number of 5,000 digits) is unparsable, as
one that does not match. Known differences from ``re`` on the patterns apachelogs builds:
``\\w`` and ``\\d`` (in ``%{...}t`` names and numbers) are ASCII-only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import re2

from .errors import LogFormatError, MissingDependencyError

__all__ = ["MAX_FORMAT_CHARS", "MAX_LINE_CHARS", "LogFormat"]

#: a LogFormat longer than this is refused (the common and combined formats are under 100)
MAX_FORMAT_CHARS = 2048
#: a line longer than this is counted unparsable: Apache caps a request line and each header
#: at 8190 bytes (LimitRequestLine, LimitRequestFieldSize), and the fit reads only a few fields
MAX_LINE_CHARS = 65536


def _options() -> Any:
    opts = re2.Options()
    opts.log_errors = False  # RE2 would also print each refused pattern on stderr
    return opts


_OPTIONS = _options()

Converter = Callable[[str], Any]


class LogFormat:
    """A ``LogFormat`` string, compiled; :meth:`fields` reads the named fields of one line.

    Raises :class:`LogFormatError` for a format apachelogs does not know, one over
    :data:`MAX_FORMAT_CHARS`, or one whose expression is too large for RE2.
    """

    def __init__(self, log_format: str, wanted: frozenset[str]) -> None:
        try:
            from apachelogs import Error as ApacheLogsError
            from apachelogs.directives import format2regex
        except ImportError:
            raise MissingDependencyError("reading Apache logs needs apachelogs: pip install apachelogs") from None
        if len(log_format) > MAX_FORMAT_CHARS:
            raise LogFormatError(f"log format: {len(log_format)} characters, over the limit of {MAX_FORMAT_CHARS}; "
                                 "give the server's LogFormat string (the common format is 22)")
        try:
            groups, pattern = format2regex(log_format)
        except ApacheLogsError as exc:
            raise LogFormatError(f"log format {log_format[:200]!r}: {exc}") from None
        try:
            self._rx = re2.compile(pattern, _OPTIONS)
        except re2.error:
            raise LogFormatError(f"log format {log_format[:200]!r}: too many or too large directives for the "
                                 "linear-time matcher; give only the server's LogFormat string") from None
        # group i+1 of the expression is directive i; keep the wanted ones (first non-None value
        # wins when two directives store one attribute, as apachelogs' LogEntry does)
        self._fields: list[tuple[int, str, Converter]] = [
            (i + 1, name, conv) for i, (name, _, conv) in enumerate(groups)
            if isinstance(name, str) and name in wanted]
        self.format = log_format

    def fields(self, line: str) -> dict[str, Any] | None:
        """The wanted fields of ``line`` (None for ``-``), or None when the line is unparsable."""
        if len(line) > MAX_LINE_CHARS:
            return None
        m = self._rx.fullmatch(line.encode("utf-8", "surrogatepass"))
        if m is None:
            return None
        out: dict[str, Any] = {}
        for group, name, conv in self._fields:
            if out.get(name) is not None:
                continue
            raw = m.group(group)
            if raw is None:  # in an alternative the line did not take
                continue
            try:
                value = conv(raw.decode("utf-8", "surrogatepass"))
            except (ValueError, OverflowError):  # int() of 5,000 digits, an escape beyond Latin-1
                return None
            # apachelogs returns escaped strings as Latin-1 bytes and decodes them so
            out[name] = value.decode("iso-8859-1") if isinstance(value, bytes) else value
        return out
