"""`overtake solve` run as the program ends without Python's teardown (overtake.api.cli.end_now):
the same output, file and exit code, the exit handlers run; main, called by a script, returns."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from overtake.api import cli

CASE1 = Path(__file__).resolve().parents[2] / "examples" / "table1" / "case01.yaml"

# A module-level object whose finalizer speaks at Python's teardown, and an exit handler.
PROBE = """
import atexit, gc, sys

class Teardown:
    def __del__(self):
        sys.stderr.write("teardown ran\\n")

kept = Teardown()
atexit.register(lambda: sys.stderr.write("exit handler ran\\n"))
atexit.register(lambda: sys.stderr.write(f"collector on {gc.isenabled()}, frozen {gc.get_freeze_count()}, "
                                         f"collections {sum(g['collections'] for g in gc.get_stats())}\\n"))
from overtake.api.cli import main, program
how = sys.argv[1]
sys.argv = ["overtake", *sys.argv[2:]]
sys.exit(program() if how == "program" else main())  # a script's main() returns, whatever sys.argv says
"""


def _run(how: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROBE, how, *argv], capture_output=True, text=True, cwd=cwd)


def test_a_solve_run_as_the_program_skips_the_teardown_and_nothing_else(tmp_path):
    argv = ("solve", str(CASE1), "--phase-info", "none", "--quiet", "--out", "p.npz")
    (tmp_path / "program").mkdir()
    (tmp_path / "called").mkdir()
    quick = _run("program", *argv, cwd=tmp_path / "program")
    plain = _run("called", *argv, cwd=tmp_path / "called")
    assert quick.returncode == plain.returncode == 0, (quick.stderr, plain.stderr)
    assert "teardown ran" in plain.stderr and "teardown ran" not in quick.stderr  # the teardown skipped
    assert "exit handler ran" in quick.stderr and "exit handler ran" in plain.stderr
    assert json.loads(quick.stdout) == json.loads(plain.stdout)  # flushed in full, the same document
    assert (tmp_path / "program" / "p.npz").read_bytes() == (tmp_path / "called" / "p.npz").read_bytes()


def _collector(stderr: str) -> tuple[bool, int, int]:
    """Whether the collector was on at exit, the objects frozen, the collections run."""
    line = next(x for x in stderr.splitlines() if x.startswith("collector on "))
    on, rest = line.removeprefix("collector on ").split(", frozen ")
    frozen, runs = rest.split(", collections ")
    return on == "True", int(frozen), int(runs)


@pytest.mark.parametrize("command", [("solve", "--out", "p.npz"), ("compare", "--json")])
def test_the_program_starts_with_the_collector_held_and_runs_the_command_with_it_on(tmp_path, command):
    """Run as the program, a quick command's start-up is frozen out of the collector (overtake.api.cli.started)
    and the command goes on with the collector on; main, called by a script, leaves the collector alone."""
    name, *opts = command
    argv = (name, str(CASE1), "--phase-info", "none", "--quiet", *opts)
    (tmp_path / "program").mkdir()
    (tmp_path / "called").mkdir()
    quick = _run("program", *argv, cwd=tmp_path / "program")
    plain = _run("called", *argv, cwd=tmp_path / "called")
    assert quick.returncode == plain.returncode == 0, (quick.stderr, plain.stderr)
    on, frozen, runs = _collector(quick.stderr)
    assert on and frozen > 10_000, quick.stderr  # numpy's and scipy's objects, at least
    plain_on, plain_frozen, plain_runs = _collector(plain.stderr)
    assert plain_on and plain_frozen == 0, plain.stderr
    assert runs < plain_runs / 2, (runs, plain_runs)  # the start-up's collections (most of them) not run
    docs = [json.loads(res.stdout) for res in (quick, plain)]
    for doc in docs:
        doc.pop("seconds", None)  # compare's wall time
    assert docs[0] == docs[1]


def test_an_input_error_exits_as_before(tmp_path):
    res = _run("program", "solve", str(tmp_path / "missing.yaml"), "--out", "p.npz", cwd=tmp_path)
    assert res.returncode == 2 and "file not found" in res.stderr
    assert "teardown ran" in res.stderr and "exit handler ran" in res.stderr


def test_a_command_that_is_not_quick_keeps_the_teardown(tmp_path):
    res = _run("program", "--version", cwd=tmp_path)
    assert res.returncode == 0 and "teardown ran" in res.stderr
    assert "fit" not in cli.QUICK_EXIT and "sidecar" not in cli.QUICK_EXIT and "api" not in cli.QUICK_EXIT


def test_with_another_thread_running_the_process_is_not_ended(monkeypatch):
    ended: list[int] = []
    handlers: list[bool] = []
    # The runner's own threads (pytest-xdist's) are alive throughout: count from them.
    before = len(threading.enumerate())
    monkeypatch.setattr(cli.threading, "active_count", lambda: len(threading.enumerate()) - before + 1)
    monkeypatch.setattr(cli.os, "_exit", ended.append)
    monkeypatch.setattr(cli.atexit, "_run_exitfuncs", lambda: handlers.append(True))  # not this suite's own
    release = threading.Event()
    worker = threading.Thread(target=release.wait)
    worker.start()
    try:
        cli.end_now(0)  # returns: the thread would be cut off
        assert ended == [] and handlers == []
    finally:
        release.set()
        worker.join()
    cli.end_now(3)  # alone again: the exit handlers, then the end (here, the stand-ins record them)
    assert handlers == [True] and ended == [3]


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_stream_that_does_not_flush_leaves_the_exit_to_python(monkeypatch, stream):
    class Closed:
        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    ended: list[int] = []
    monkeypatch.setattr(cli.os, "_exit", ended.append)
    monkeypatch.setattr(cli.atexit, "_run_exitfuncs", lambda: None)
    monkeypatch.setattr(cli.sys, stream, Closed())
    cli.end_now(0)
    assert ended == []
