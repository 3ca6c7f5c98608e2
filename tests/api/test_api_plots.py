"""Figures (api/plots.py), the CLI's --plot options and the progress bars (api/progress.py)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib.image import imread
from support.api_helpers import exp2

from overtake.api import plots
from overtake.api.cli import main
from overtake.api.progress import progress_bar, progress_iter
from overtake.mdp import solve
from overtake.mdp.comparison import compare
from overtake.mdp.policy import Policy
from overtake.mdp.scenario import parse_scenario


@pytest.fixture(scope="module")
def exp_policy() -> Policy:
    sc = parse_scenario(exp2(0.3))
    return solve(sc.build_model(), truncation=sc.fixed_truncation(), tol=sc.tolerance).policy


def test_policy_grid_of_exponential_stages_is_one_thread_at_a_time(exp_policy: Policy) -> None:
    g = plots.policy_grid(exp_policy, size=5)
    assert g.stages == ("front", "back")
    assert g.configs[0] == "no thread active"
    total_idle = g.spawn[0].sum(axis=0)
    # pi* = pi(1) (van der Weij et al., "Dynamic thread assignment" §3): an idle processor starts
    # exactly one thread whenever a request waits
    expected = np.ones((6, 6), dtype=np.int64)
    expected[0, 0] = 0
    np.testing.assert_array_equal(total_idle, expected)
    # ... and while the last stage's thread runs, nothing new starts
    assert g.configs[2] == "1 thread at back/phase1"
    assert g.spawn[2].sum() == 0
    # the grid is the policy's own answer, state by state
    for i, j in [(1, 0), (0, 3), (4, 2)]:
        a = exp_policy.action([i, j, 0, 0])
        assert [g.spawn[0, 0, i, j], g.spawn[0, 1, i, j]] == a.tolist()


def test_policy_grid_marks_the_states_the_chain_reaches(exp_policy: Policy) -> None:
    """π* = π(1), the back stage first: a front thread starts only while no request waits at the
    back, and only a front completion adds one there. So while any thread runs the back queue is
    empty (j = 0), and with no thread active (just after a completion) it holds at most the one
    request a front completion has just added (j <= 1); the front queue takes any length."""
    g = plots.policy_grid(exp_policy, size=5)
    assert g.reached is not None
    i, j = np.meshgrid(np.arange(6), np.arange(6), indexing="ij")
    np.testing.assert_array_equal(g.reached[0], j <= 1)
    np.testing.assert_array_equal(g.reached[1], j == 0)
    np.testing.assert_array_equal(g.reached[2], j == 0)
    fig = plots.policy_figure(exp_policy, size=5)
    assert "blank: never reached" in fig.texts[0].get_text()  # the suptitle says what blank means


def test_gains_figure_bars_are_the_mean_response_times() -> None:
    sc = parse_scenario(exp2(0.3))
    doc = compare(sc.build_model(), tol=sc.tolerance, truncation=sc.fixed_truncation())
    fig = plots.gains_figure(doc)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert heights == pytest.approx([m["mean_response_time"] for m in doc["policies"].values()])
    labels = [t.get_text() for t in ax.texts]
    assert labels[0] == "π*" and labels[3] == f"{100 * doc['gains']['pi(inf)']:+.1f}%"
    assert plots.png(fig)[:4] == b"\x89PNG"


def test_distributions_figure_draws_the_ph_density() -> None:
    a, T = np.array([1.0]), np.array([[-2.0]])
    fig = plots.distributions_figure([("s", a, T)], samples={"s": [0.1, 0.5, 0.2]})
    line = fig.axes[0].get_lines()[0]
    x, y = line.get_data()
    np.testing.assert_allclose(y, 2.0 * np.exp(-2.0 * np.asarray(x)), rtol=1e-9)  # exponential pdf, rate 2


@pytest.fixture()
def scenario(tmp_path: Path) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump(exp2(0.3)))
    return p


def test_cli_compare_plot(scenario: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gains.png"
    assert main(["compare", str(scenario), "--plot", str(out)]) == 0
    img = imread(out)
    assert img.shape[0] > 200 and img.shape[1] > 400
    assert capsys.readouterr().err == ""  # not a terminal: no progress output


def test_cli_solve_plot(scenario: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "policy.png"
    assert main(["solve", str(scenario), "--out", str(tmp_path / "p.npz"), "--plot", str(out), "--quiet"]) == 0
    assert imread(out).shape[0] > 300
    assert Policy.load(tmp_path / "p.npz").max_requests == 8


def test_cli_fit_plot(tmp_path: Path) -> None:
    x = np.random.default_rng(2).exponential(0.3, 200)
    np.savetxt(tmp_path / "db.txt", x)
    assert main(["fit", str(tmp_path / "db.txt"), "--order", "1", "--out", str(tmp_path), "--plot"]) == 0
    assert imread(tmp_path / "db.png").shape[0] > 200


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_silent_when_not_a_terminal() -> None:
    pipe = io.StringIO()
    with progress_bar("solve", stream=pipe) as cb:
        assert cb is None
    items = [1, 2]
    assert progress_iter(items, "fit", stream=pipe) is items
    assert pipe.getvalue() == ""


def test_progress_counts_steps_on_a_terminal() -> None:
    tty = _Tty()
    with progress_bar("compare", steps=["pi*", "pi(1)", "pi(inf)"], stream=tty) as cb:
        assert cb is not None
        cb("pi*: cap 10, threads 3: 455 states")
        cb("pi(1): cap 30: E[W] = 2.5")
        mid = tty.getvalue()
        assert "1/3" in mid and "pi(1): cap 30" in mid
    assert "3/3" in tty.getvalue()
    with progress_bar("solve", stream=_Tty(), quiet=True) as cb:
        assert cb is None
