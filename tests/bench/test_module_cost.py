"""bench/module_cost.py's readers of callgrind's output: known answers (its doctests), the two
readers agreeing on a real run (the functions' exclusive costs add up to the file's totals), and
its argument errors."""

from __future__ import annotations

import doctest
import shutil
import subprocess
from pathlib import Path

import pytest
from support.bench import bench_module

module_cost = bench_module("module_cost")


def test_doctest() -> None:
    res = doctest.testmod(module_cost)
    assert res.attempted >= 3 and res.failed == 0


def test_the_functions_costs_add_up_to_the_totals_of_a_real_run(tmp_path: Path) -> None:
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        pytest.skip("valgrind not installed (apache-conf/install-debian-packages.sh installs it)")
    out = tmp_path / "cg.out"
    subprocess.run(["valgrind", "--tool=callgrind", "--cache-sim=yes", "--branch-sim=yes",
                    f"--callgrind-out-file={out}", "/bin/ls", "/"], check=True, capture_output=True)
    totals = module_cost.callgrind_totals(out)
    assert set(module_cost.EVENTS) <= set(totals) and totals["Ir"] > 10_000
    annotated = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", "--auto=no",
                                f"--show={','.join(module_cost.EVENTS)}", str(out)],
                               capture_output=True, text=True, check=True).stdout
    costs = module_cost.function_costs(annotated, module_cost.EVENTS)
    assert any(obj.startswith("libc.so") for obj, _ in costs)
    for i, e in enumerate(module_cost.EVENTS):
        assert sum(v[i] for v in costs.values()) == totals[e], e


@pytest.mark.parametrize(("argv", "message"), [
    (["--kinds", "age,turbo"], "--kinds: turbo is not one of class, age, module-mode"),
    (["--seconds", "5"], "--seconds: must exceed the short window (5 s)"),
])
def test_bad_arguments_name_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        module_cost.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
