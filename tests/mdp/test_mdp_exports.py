import overtake.mdp as mdp


def test_all_is_sorted_and_complete():
    assert mdp.__all__ == sorted(mdp.__all__)
    for name in mdp.__all__:
        assert hasattr(mdp, name), name


def test_no_exported_name_is_a_module_name():
    """Importing a submodule sets a package attribute of its name: no function may share it."""
    import pkgutil
    import types

    modules = {m.name for m in pkgutil.iter_modules(mdp.__path__)}
    assert not modules & set(mdp.__all__)
    assert type(mdp) is types.ModuleType  # a plain module: no class that guards its attributes
    import overtake.mdp.comparison
    import overtake.mdp.simulation
    import overtake.mdp.solver  # noqa: F401

    assert mdp.solve is overtake.mdp.solver.solve and mdp.compare is overtake.mdp.comparison.compare
    assert mdp.simulate is overtake.mdp.simulation.simulate



KERNELS = ("overtake.mdp._kernels", "overtake.mdp._kernels_jit", "overtake.mdp._simkernel", "overtake.mdp._heurkernel")
CLI = """
import contextlib, io, sys
from overtake.api.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print(sorted(m for m in sys.modules if m.startswith("overtake.mdp")))
"""
ENTRY = """
import sys
import overtake.mdp as mdp
mdp.solve, mdp.Stage, mdp.TandemModel, mdp.Truncation, mdp.parse_scenario
print(sorted(m for m in sys.modules if m.startswith("overtake.mdp") or m in ("numba", "scipy.sparse.linalg")))
"""


def _modules(code: str, *argv: str) -> list[str]:
    import ast
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True).stdout
    loaded: list[str] = ast.literal_eval(out.strip().splitlines()[-1])
    return loaded


def test_the_cli_start_loads_no_solver_kernels():
    """``overtake fit`` and ``overtake --version`` load nothing of the solver; reaching ``mdp.solve``
    loads neither numba nor the compiled kernels."""
    assert _modules(CLI, "fit", "--help") == []
    assert _modules(CLI, "--version") == []
    from overtake.api.commands.fit import DEFAULT_MAX_STATES
    from overtake.mdp.budget import DEFAULT_MAX_STATES as SOLVER_DEFAULT
    assert DEFAULT_MAX_STATES == SOLVER_DEFAULT
    entry = _modules(ENTRY)
    assert "overtake.mdp.solver" in entry and not {*KERNELS, "numba", "scipy.sparse.linalg"} & set(entry)
