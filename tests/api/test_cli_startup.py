"""Start-up of `overtake compare` on a small scenario: what it must not import.

A fresh process pays for every module it loads; numba (0.3-0.5 s) and scipy's sparse solvers
(0.2 s) serve only large models. Checked in a child process so this suite's imports do not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CASE1 = Path(__file__).resolve().parents[2] / "examples" / "table1" / "case01.yaml"

PROBE = """
import contextlib, io, json, sys
from overtake.api.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["compare", sys.argv[1], "--json", "--quiet"])
doc = json.loads(out.getvalue())
heavy = [m for m in ("numba", "scipy.sparse.linalg", "scipy.sparse.csgraph") if m in sys.modules]
print(json.dumps({"code": code, "states": doc["states"], "heavy": heavy}))
"""


def test_small_compare_imports_neither_numba_nor_scipy_solvers():
    proc = subprocess.run([sys.executable, "-c", PROBE, str(CASE1)], capture_output=True, text=True, check=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["code"] == 0 and res["states"] < 5_000  # below bellman.KERNEL_MIN_STATES: numpy passes
    assert res["heavy"] == []


SOLVE_PROBE = """
import contextlib, io, json, sys
from overtake.api.cli import main
from overtake.mdp import _kernels, _simcall
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(sys.argv[1:])
doc = json.loads(out.getvalue())
print(json.dumps({"code": code, "states": doc["states"], "numba": "numba" in sys.modules,
                  "pydantic": "pydantic" in sys.modules, "aot": _kernels.aot_active() and _simcall.aot_active()}))
"""


@pytest.mark.parametrize("argv", [
    ["solve", str(CASE1), "--phase-info", "none", "--quiet", "--out", "p.npz"],
    ["solve", str(CASE1), "--phase-info", "full", "--quiet", "--out", "p.npz"],
    ["compare", str(CASE1), "--phase-info", "none", "--json", "--quiet"],
])
def test_a_solve_with_the_extensions_imports_no_numba(argv, tmp_path):
    """No solve of case 1 imports pydantic (its scenario is read strictly, mdp.scenario_spec). With the
    solver's and the simulator's extensions current (the set-up builds both) no solve of a Table 1
    case imports numba, whose start costs more than solving case 1: the ``none``
    solve's starting tables include the restricted heuristic, whose decision comes from the
    simulator's extension (:mod:`overtake.mdp._simcall`)."""
    proc = subprocess.run([sys.executable, "-c", SOLVE_PROBE, *argv], capture_output=True, text=True, check=True,
                          cwd=tmp_path)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["code"] == 0 and res["states"] > 0, res
    # a scenario written as the examples are is read without the schema's models (mdp.scenario_spec)
    assert res["pydantic"] is False, res
    if not res["aot"]:
        pytest.skip("the ahead-of-time extensions are not built (python -m overtake.mdp._warmup builds them)")
    assert res["numba"] is False, res


def test_compare_method_option_reaches_every_solver(capsys):
    """`overtake compare --method`: each solver answers Table 1 case 7 (H2 stages) with the same π*.

    The policies may differ only where two actions tie, so π*'s exact E[W] agrees to far inside the
    scenario's tolerance; the document names the solver used."""
    from overtake.api.cli import main

    case7 = CASE1.with_name("case07.yaml")
    ew = {}
    for method in ("anderson", "pi", "rvi"):
        assert main(["compare", str(case7), "--json", "--quiet", "--method", method]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["method"] == method
        ew[method] = doc["policies"]["pi*"]["mean_response_time"]
    assert ew["pi"] == pytest.approx(ew["rvi"], rel=1e-6)
    assert ew["anderson"] == pytest.approx(ew["rvi"], rel=1e-6)


HEAVY_PROBE = """
import contextlib, io, json, sys
from overtake.api.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
heavy = sorted(m for m in ("numpy", "numba", "scipy", "scipy.linalg", "scipy.stats", "scipy.sparse", "pandas",
                           "fastapi", "pydantic", "yaml", "dask", "importlib.metadata",
                           "overtake.fitting.em", "overtake.mdp.solver", "overtake.controller.sidecar.service")
               if any(k == m or k.startswith(m + ".") for k in sys.modules))
solver = sorted(k for k in sys.modules if k.startswith("overtake.mdp"))
commands = sorted(k for k in sys.modules if k.startswith("overtake.api.commands"))
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(), "heavy": heavy, "solver": solver,
                  "commands": commands}))
"""


def _probe(argv: list[str], cwd: Path | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", HEAVY_PROBE, *argv], capture_output=True, text=True, check=True,
                          cwd=cwd)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["no-such-command"], []])
def test_version_help_and_a_bad_command_import_nothing_heavy(argv):
    res = _probe(argv)
    assert res["heavy"] == [] and res["commands"] == [], res
    if argv == ["--version"]:
        assert res["code"] == 0 and "overtake-server" in res["out"]
    elif argv == ["--help"]:
        assert res["code"] == 0
        from overtake.api.cli import COMMANDS
        assert all(name in res["out"] for name in COMMANDS)  # every sub-command still listed
        assert "95% CI" in res["out"]
    else:
        assert res["code"] == 2 and res["err"]


def test_the_help_summaries_are_the_commands_own():
    """`overtake --help` shows SUMMARIES without importing the commands; each must be what the
    command's own parser registers, or the two drift apart."""
    from overtake.api.cli import SUMMARIES, build_parser

    parser = build_parser(full=True)
    sub = next(a for a in parser._actions if a.dest == "command")
    registered = {c.dest: c.help for c in sub._choices_actions}
    assert registered == SUMMARIES


def test_a_named_command_gets_its_full_parser():
    from overtake.api.cli import build_parser

    parser = build_parser("compare")
    args = parser.parse_args(["compare", "x.yaml", "--json"])
    assert args.command == "compare" and args.json is True


@pytest.mark.parametrize("command", ["fit", "diagnose", "solve", "compare", "simulate", "sweep", "sidecar", "uplink", "apache",
                                     "api", "prometheus"])
def test_a_commands_help_imports_nothing_heavy(command):
    res = _probe([command, "--help"])
    assert res["code"] == 0 and res["heavy"] == [], res


@pytest.mark.parametrize("argv", [
    ["solve"],  # the scenario missing
    ["solve", str(CASE1), "--phase-info", "blind"],
    ["solve", str(CASE1), "--max-states", "many"],
    ["compare", str(CASE1), "--method", "newton"],
    ["simulate", str(CASE1), "--requests", "lots"],
    ["fit", "--order", "x"],
    ["fit", "durations.txt", "--order", "x"],
    ["fit", "durations.txt", "--max-iter", "0"],
    ["fit", "durations.txt", "--shift", "soon"],
    ["fit", "durations.txt", "--censor-at", "-1"],
    ["fit", "durations.txt", "--apache-log", "access.log"],
    ["diagnose", "durations.txt", "--alpha", "2"],
    ["sweep", "grid.yaml", "--out", "results.txt"],
    ["uplink", "install", "--dev", "eth0", "--mode", "cake"],
    ["sidecar", "--loop", "trio"],
])
def test_an_argument_error_imports_nothing_heavy(argv, tmp_path):
    (tmp_path / "durations.txt").write_text("1.0\n2.0\n3.0\n")
    res = _probe(argv, cwd=tmp_path)
    assert res["code"] == 2 and res["err"].strip(), res
    assert res["heavy"] == [], res


def test_a_fit_loads_nothing_of_the_solver(tmp_path):
    """`overtake fit` pays for the EM, not for the solver: no overtake.mdp module, none of scipy's
    sparse solvers or statistics; with the kernels' extension, no numba either (whose start loads yaml,
    scipy and scipy.linalg)."""
    x = [0.1 * (1 + (7 * k) % 13) for k in range(200)]
    (tmp_path / "d.txt").write_text("\n".join(map(str, x)) + "\n")
    res = _probe(["fit", "d.txt", "--out", "out"], cwd=tmp_path)
    assert res["code"] == 0 and (tmp_path / "out" / "d.json").is_file(), res
    assert res["solver"] == [], res
    assert not [m for m in res["heavy"] if m in ("scipy.stats", "scipy.sparse", "pandas", "fastapi", "pydantic",
                                                 "dask")], res
    from overtake.fitting import _kernels

    if _kernels.aot_active():  # the fitting kernels' extension: neither numba nor what its start loads
        assert not {"numba", "scipy", "yaml"} & set(res["heavy"]), res


def test_the_commands_copies_of_library_constants_agree():
    """Options shown by `--help` carry a few library constants written out (so parsing imports no
    library); each must stay the library's own."""
    from overtake.api.commands import defaults, sidecar, uplink
    from overtake.controller.uplink import bands, qdisc
    from overtake.mdp import budget

    assert uplink.MODES == qdisc.MODES
    assert sidecar.TOP_FRACTION == bands.TOP_FRACTION
    assert defaults.DEFAULT_MAX_STATES == budget.DEFAULT_MAX_STATES
