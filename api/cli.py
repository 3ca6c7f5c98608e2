"""The ``overtake`` command line.

Each sub-command lives in :mod:`overtake.api.commands` and only parses options, calls one library
function and prints. Input errors are reported as one line naming the field, exit code 2.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import sys
import threading
from collections.abc import Sequence

from overtake import DISTRIBUTION, __version__

# Sub-command modules, imported lazily so `overtake fit` does not pay for the solver's imports.
COMMANDS: dict[str, str] = {
    "fit": "overtake.api.commands.fit",
    "diagnose": "overtake.api.commands.diagnose",
    "solve": "overtake.api.commands.solve",
    "compare": "overtake.api.commands.compare",
    "sweep": "overtake.api.commands.sweep",
    "simulate": "overtake.api.commands.simulate",
    "apache": "overtake.api.commands.apache",
    "sidecar": "overtake.api.commands.sidecar",
    "uplink": "overtake.api.commands.uplink",
    "api": "overtake.api.commands.api",
    "prometheus": "overtake.api.commands.prometheus",
}

# One line per sub-command for `overtake --help`, which then imports none of them (each module
# registers the same line as its parser's help: tests/api/test_cli_startup.py checks they agree).
SUMMARIES: dict[str, str] = {
    "fit": "fit phase-type service-time distributions from durations or an Apache log",
    "diagnose": "find stages that a lock serialises, from an access log with the request-time split",
    "solve": "solve the optimal thread policy and write it as a file",
    "compare": "compare the optimal policy with pi(1), pi(4), pi(inf), pi(1,1)",
    "sweep": "solve pi* and the baselines on a grid of scenarios with Dask",
    "simulate": "simulate a policy: mean response time with 95%% CI, per stage, tails",
    "apache": "start/stop a private Apache with the CPU stage handler and mod_status",
    "sidecar": "reverse proxy that releases requests to Apache exactly when the policy starts a thread "
               "(or, in module mode, the controller beside Apache)",
    "uplink": "install/show/remove the priority qdisc for uplink SRPT (HTB or TBF+pfifo_fast)",
    "api": "serve the REST API and its HTML page",
    "prometheus": "private Prometheus (Debian package) scraping the sidecar and the API",
}

EXIT_USAGE = 2

#: Commands that compute, write their files, print and end. Run as the program (:func:`program`:
#: ``overtake``, ``python -m overtake``), such a process ends without Python's teardown: freeing every object
#: and clearing each of the six hundred modules a solve imports (numpy, scipy, pydantic) is a
#: noticeable part of a small solve's wall time and changes nothing the command did.
QUICK_EXIT = frozenset({"solve", "compare", "simulate"})


def _named_command(argv: Sequence[str]) -> str | None:
    """The sub-command ``argv`` names (its first word that is not an option), if it is one of ours."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(only: str | None = None, *, full: bool = False) -> argparse.ArgumentParser:
    """The parser: the sub-command ``only`` registered by its module, every other one a placeholder
    that carries only its one-line summary (``full``: every module registers its own).

    ``overtake compare …`` then imports one command module instead of ten (the fitting, the
    sidecar and the Apache tooling cost about a second of imports), and ``overtake --version``,
    ``overtake --help`` and an unknown command import none.
    """
    parser = argparse.ArgumentParser(
        prog="overtake",
        description="Choose and enforce thread policies for multi-stage web servers.",
    )
    parser.add_argument("--version", action="version", version=f"overtake {__version__} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        if full or name == only:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=SUMMARIES[name], add_help=False)
    return parser


def end_now(code: int) -> None:
    """End the process with ``code`` as Python's exit would, less the teardown (:data:`QUICK_EXIT`):
    the standard streams flushed and the exit handlers run (``atexit``: logging's, the temporary
    folders' finalizers). Returns instead where the teardown may matter: another thread still
    running, or a stream that does not flush (a closed pipe: Python's own exit reports it)."""
    if threading.active_count() > 1:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(code)


#: set by :func:`program` while a :data:`QUICK_EXIT` command starts with the cyclic collector off
_held = False


def program() -> int:
    """The ``overtake`` program (the console script, ``python -m overtake``): :func:`main` on this
    process's arguments, a :data:`QUICK_EXIT` command that succeeded ending the process itself.

    Such a command's start-up (numpy, scipy, the solver's modules: tens of thousands of objects, kept
    for the life of the process) runs with the cyclic collector off: its collections would traverse
    them again and again for nothing. The command calls :func:`started` once it has them."""
    global _held
    if _named_command(sys.argv[1:]) in QUICK_EXIT:
        gc.disable()
        _held = True
    return main(end=True)


def started() -> None:
    """A :data:`QUICK_EXIT` command has imported what it needs and read its input: the objects made
    so far leave the collector's generations for good (``gc.freeze``: later collections do not
    traverse them, and a worker forked to the second core, :mod:`overtake.api.beside`, shares their
    pages untouched, as Python's documentation of ``gc.freeze`` recommends), and the collector runs
    again. Nothing happens unless :func:`program` held the collector (a script that calls
    :func:`main` keeps its own)."""
    global _held
    if _held:
        _held = False
        gc.freeze()
        gc.enable()


def main(argv: Sequence[str] | None = None, *, end: bool = False) -> int:
    """The ``overtake`` command on ``argv`` (default: this process's arguments); its exit code.

    With ``end`` (:func:`program`) a :data:`QUICK_EXIT` command that succeeded ends the process
    (:func:`end_now`); otherwise (tests, scripts that call it) it always returns."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_named_command(argv))
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command])
    try:
        code: int = module.run(args)
    except ValueError as exc:  # every input error in the project subclasses ValueError
        print(f"overtake {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as exc:
        print(f"overtake {args.command}: error: file not found: {exc.filename}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    if end and code == 0 and args.command in QUICK_EXIT:
        end_now(code)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(program())
