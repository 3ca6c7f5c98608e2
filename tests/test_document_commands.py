"""The ``overtake`` commands the user documents show parse as written: every line of a ```sh
block in README.md, docs/ and apache-conf/*.md that runs ``overtake`` goes through the CLI's own
argument parser (not run): a renamed or removed flag fails here, naming the document."""

from __future__ import annotations

import contextlib
import io
import re
import shlex

import pytest
from support.documents import ROOT, USER_DOCS

from overtake.api.cli import build_parser

SHELL_END = re.compile(r"^(\||&&|;|&|\d?>.*|>.*|<.*)$")  # where the command's own arguments end


def _commands() -> list[object]:
    out: list[object] = []
    for doc in USER_DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"```(?:sh|bash|console)\n(.*?)```", text, re.S):
            first = text[:m.start()].count("\n") + 2
            for k, line in enumerate(m.group(1).replace("\\\n", " \n").splitlines()):
                line = line.strip().removeprefix("$ ").removeprefix("sudo ")
                if not line.startswith("overtake "):
                    continue
                argv = shlex.split(line, comments=True)
                end = next((i for i, a in enumerate(argv) if SHELL_END.match(a)), len(argv))
                out.append(pytest.param(argv[1:end], id=f"{doc.relative_to(ROOT)}:{first + k}"))
    return out


def test_the_documents_show_commands() -> None:
    assert len(_commands()) >= 10


@pytest.mark.parametrize("argv", _commands())
def test_a_documented_command_parses(argv: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser(only=argv[0]).parse_args(argv)
    except SystemExit:
        pytest.fail(f"overtake {' '.join(argv)}: {err.getvalue().strip()}")
