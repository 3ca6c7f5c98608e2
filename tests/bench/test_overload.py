"""bench/overload.py: its summary (doctest), its argument errors, and a short real run whose
requests are conserved (every request sent either ran its handler or was dropped)."""

from __future__ import annotations

import doctest
import json

import pytest
from support.bench import bench_module

overload = bench_module("overload")


def test_doctest() -> None:
    res = doctest.testmod(overload)
    assert res.attempted >= 1 and res.failed == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--arms", "plain,lifo"], "--arms: give some of plain, serve, drop, newest"),
    (["--lifo-after", "0"], "--lifo-after: must be in [0.001, 3600], got 0"),
    (["--patience", "0"], "--patience: must be in [0.1, 60], got 0"),
    (["--cap", "9"], "--cap: must be in 1..8, got 9"),
    (["--runs", "0"], "--runs: must be in 1..20, got 0"),
    (["--mpm", "worker"], "--mpm: give event or prefork, got 'worker'"),
    (["--other-load", "9"], "--other-load: must be in 0..8 busy loops, got 9"),
])
def test_bad_arguments_name_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        overload.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("mpm", ["event", "prefork"])
def test_a_short_run_conserves_requests(apache_available: None, capsys: pytest.CaptureFixture[str], mpm: str) -> None:
    """Three seconds at twice the core's capacity, clients leaving after 0.5 s: with the default
    every request either ran or was dropped, some were; served, none was, and all ran (under
    prefork each held request waits in a process of its own)."""
    assert overload.main(["--rate", "20", "--seconds", "3", "--patience", "0.5", "--runs", "1", "--arms",
                          "serve,drop", "--mpm", mpm, "--json", "--no-write"]) == 0
    res = json.loads(capsys.readouterr().out)
    (serve,), (drop,) = res["runs"]["serve"], res["runs"]["drop"]
    assert serve["sent"] == drop["sent"] == 60
    assert serve["handlers_run"] == 60 and serve["dropped"] == 0
    assert drop["dropped"] > 0 and drop["handlers_run"] + drop["dropped"] == 60
    assert drop["recovery_s"] < serve["recovery_s"]
