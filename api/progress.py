"""Progress bars for the CLI's long computations (tqdm), silent when stderr is not a terminal.

The solver and fitter report progress as text lines (``Progress = Callable[[str], None]`` in
mdp/). :func:`progress_bar` turns those lines into one tqdm bar: with ``steps`` (line prefixes in
order, e.g. ``["pi*", "pi(1)", ...]``) the bar counts finished steps out of ``len(steps)``;
without, it counts lines. The last line is shown after the bar. In a pipe, a log file or CI the
callback is ``None`` — nothing is written, nothing is paid.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, TypeVar

T = TypeVar("T")

Progress = Callable[[str], None]


def is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


@contextmanager
def progress_bar(desc: str, *, steps: Sequence[str] | None = None, quiet: bool = False,
                 stream: IO[str] | None = None) -> Iterator[Progress | None]:
    """A progress callback drawing a tqdm bar on ``stream`` (stderr), or ``None`` when not a TTY."""
    out = sys.stderr if stream is None else stream
    if quiet or not is_terminal(out):
        yield None
        return
    from tqdm import tqdm

    prefixes = list(steps or ())
    bar = tqdm(total=len(prefixes) or None, desc=desc, file=out, unit="step" if prefixes else "line",
               leave=True, dynamic_ncols=True, bar_format=None if prefixes else "{desc}: {n} {unit}s [{elapsed}]{postfix}")

    def update(message: str) -> None:
        if prefixes:
            # a line from step i means steps 0..i-1 are finished
            idx = next((i for i, p in enumerate(prefixes) if message.startswith(p + ":")), None)
            if idx is not None and idx > bar.n:
                bar.update(idx - bar.n)
        else:
            bar.update(1)
        bar.set_postfix_str(message[:70])

    try:
        yield update
        if prefixes and bar.n < len(prefixes):
            bar.update(len(prefixes) - bar.n)
    finally:
        bar.close()


def progress_iter(items: Iterable[T], desc: str, *, total: int | None = None, quiet: bool = False,
                  stream: IO[str] | None = None) -> Iterable[T]:
    """``items`` wrapped in a tqdm bar on a terminal; ``items`` itself otherwise."""
    out = sys.stderr if stream is None else stream
    if quiet or not is_terminal(out):
        return items
    from tqdm import tqdm

    bar: Iterable[T] = tqdm(items, desc=desc, total=total, file=out, unit="stage", dynamic_ncols=True)
    return bar
