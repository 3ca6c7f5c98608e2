"""``overtake compare``/``solve`` on fits the MDP cannot afford: one line and exit 2, before any
allocation. Run in a child with its address space capped, so a regression fails instead of
exhausting the machine."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from overtake.fitting import fit

#: far below what the order-12 model's state space would take; above what refusing it takes
ADDRESS_SPACE = 3 << 30


def _cap() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.fixture(scope="module")
def order12(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two stages fitted as CF1 of order 12 (what ``fit --order auto`` gave on a service floor)."""
    d = tmp_path_factory.mktemp("order12")
    rng = np.random.default_rng(3)
    for name, floor, mean in (("preview", 0.02, 0.03), ("view", 0.03, 0.035)):
        x = floor + rng.exponential(mean, 600)
        res = fit(x, structure="cf1", order=12, max_iter=20)
        assert res.ph.order == 12
        (d / f"{name}.json").write_text(res.to_json())
    sc = d / "scenario.yaml"
    sc.write_text("load: 0.6\nstages:\n  - name: preview\n    service: {file: preview.json}\n"
                  "  - name: view\n    service: {file: view.json}\n")
    return sc


@pytest.mark.parametrize("argv", [["compare"], ["solve", "--out", "policy.npz"]])
def test_order_12_is_refused_in_one_line(order12: Path, argv: list[str]) -> None:
    cmd = [sys.executable, "-m", "overtake.api.cli", argv[0], str(order12), "--quiet", *argv[1:]]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=_cap, cwd=order12.parent)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(lines) == 1, p.stderr[-2000:]
    assert "states" in lines[0] and "--max-states 4,000,000" in lines[0]
    assert "--order 3 or fewer" in lines[0] and "12+12" in lines[0]
    assert not (order12.parent / "policy.npz").exists()
