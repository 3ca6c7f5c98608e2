"""User-supplied regular expressions, matched in time linear in the text (RE2).

Python's ``re`` backtracks: ``^/(a+)+$`` against ``"/" + "a" * 40 + "!"`` takes about 2**40
steps, so a stage regex from a stages file, ``overtake fit --stage`` or the API's fit endpoint
could block a process for hours. RE2 (``google-re2``) runs an automaton instead, bounded by
pattern size times text length, at the price of the features that need backtracking:
backreferences, lookaround, atomic groups and possessive quantifiers, conditionals. Such
patterns are refused with one line that says so. Python's own spellings of what RE2 has under
another name are translated: ``\\Z`` (RE2's ``\\z``), ``\\uXXXX`` and ``\\UXXXXXXXX``
(``\\x{...}``).

A pattern is matched against the UTF-8 encoding of the text, so ``.`` and classes still see
code points, as ``re`` does on the ``str``. Known differences on what both accept: ``\\d``,
``\\w`` and ``\\s`` are ASCII-only, and ``$`` matches only at the very end (``re`` also matches
before a final newline; a URL path has none).
"""

from __future__ import annotations

import re
from typing import Any

import re2

__all__ = ["LinearRegex", "check_pattern"]


def _options() -> Any:
    opts = re2.Options()
    opts.log_errors = False  # RE2 would also print each refused pattern on stderr
    opts.never_capture = True  # only whether it matches is used; no submatch bookkeeping
    return opts


_OPTIONS = _options()


_PY_ESCAPES = {"u": 4, "U": 8}


def _to_re2(pattern: str) -> str:
    """Python's escapes that RE2 spells differently, rewritten; the rest copied as is.

    A backslash escapes the next character in both syntaxes, inside classes too, so pairing
    them from the left finds every escape (``\\\\Z`` is a backslash then ``Z``).
    """
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c != "\\" or i + 1 == n:
            out.append(c)
            i += 1
            continue
        e = pattern[i + 1]
        width = _PY_ESCAPES.get(e, 0)
        if e == "Z":
            out.append("\\z")
        elif width:  # re.compile has already checked the hex digits
            out.append("\\x{" + pattern[i + 2:i + 2 + width] + "}")
            i += width
        else:
            out.append(c + e)
        i += 2
    return "".join(out)


def _compile(pattern: str) -> Any:
    """The RE2 program, or ValueError whose message is the fix (see :func:`check_pattern`)."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression ({exc}); e.g. '^/stage1$'") from None
    except (OverflowError, RecursionError):
        raise ValueError("not a valid regular expression (too large or too deeply nested)") from None
    try:
        return re2.compile(_to_re2(pattern), _OPTIONS)
    except re2.error as exc:
        why = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(
            f"not supported by the linear-time matcher (RE2: {why}): no backreferences, lookaround, "
            f"atomic groups or repeat counts over 1000; rewrite without them"
        ) from None


def check_pattern(pattern: str) -> str:
    """Return ``pattern`` if :class:`LinearRegex` accepts it, else raise ValueError.

    The message is one line without the field's name, for the caller to prefix: ``not a valid
    regular expression (...)`` for what ``re`` refuses too, ``not supported by the linear-time
    matcher (...)`` for a valid pattern that needs backtracking.
    """
    _compile(pattern)
    return pattern


class LinearRegex:
    """A compiled user-supplied pattern: ``search``/``match`` as ``re``'s, returning a bool."""

    __slots__ = ("_rx", "pattern")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._rx = _compile(pattern)

    def search(self, text: str) -> bool:
        """Does the pattern match anywhere in ``text`` (``re.search``)?"""
        # bytes: the wrapper's str path maps byte offsets back to characters, which costs more
        return self._rx.search(text.encode("utf-8", "surrogatepass")) is not None

    def match(self, text: str) -> bool:
        """Does the pattern match at the start of ``text`` (``re.match``)?"""
        return self._rx.match(text.encode("utf-8", "surrogatepass")) is not None

    def __repr__(self) -> str:
        return f"LinearRegex({self.pattern!r})"
