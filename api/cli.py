"""The ``overtake`` command line.

Each sub-command lives in :mod:`overtake.api.commands` and only parses options, calls one library
function and prints. Input errors are reported as one line naming the field, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from overtake import DISTRIBUTION, __version__

# Sub-command modules, imported lazily so `overtake fit` does not pay for the solver's imports.
COMMANDS: dict[str, str] = {
    "fit": "overtake.api.commands.fit",
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

EXIT_USAGE = 2


def _named_command(argv: Sequence[str]) -> str | None:
    """The sub-command ``argv`` names (its first word that is not an option), if it is one of ours."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or with ``only`` a parser that registers just that sub-command.

    ``overtake compare …`` then imports one command module instead of ten (the fitting, the
    sidecar and the Apache tooling cost about a second of imports); ``overtake --help`` and an
    unknown command still see every sub-command.
    """
    parser = argparse.ArgumentParser(
        prog="overtake",
        description="Choose and enforce thread policies for multi-stage web servers.",
    )
    parser.add_argument("--version", action="version", version=f"overtake {__version__} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
