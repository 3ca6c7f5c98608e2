"""``overtake fit``: JSON the solver reads, plots, one-line errors with exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from overtake.api.commands import fit as fit_cmd
from overtake.fitting import PhaseType


def _main(argv: list[str]) -> int:
    # the dispatcher's contract (api/cli.py): ValueError -> one line on stderr, exit 2
    parser = argparse.ArgumentParser(prog="overtake")
    fit_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["fit", *argv])
    try:
        return fit_cmd.run(args)
    except ValueError as exc:
        print(f"overtake fit: error: {exc}", file=sys.stderr)
        return 2


@pytest.fixture()
def durations(tmp_path: Path) -> Path:
    x = np.random.default_rng(1).lognormal(-3, 0.8, 1500)
    p = tmp_path / "stage1.txt"
    np.savetxt(p, x)
    return p


def test_file_to_json_and_png(durations: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _main([str(durations), "--order", "3", "--out", str(out), "--plot"]) == 0
    d = json.loads((out / "stage1.json").read_text())
    assert d["order"] == 3 and d["structure"] == "cf1" and d["converged"] in (True, False)
    ph = PhaseType(d["alpha"], d["T"])  # exactly what the solver reads
    x = np.loadtxt(durations)
    assert ph.loglik(x) == pytest.approx(d["loglik"], rel=1e-9)
    assert (out / "stage1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "[stage1] cf1 order 3" in text and "KS distance" in text


def test_fit_writes_phases_ordered_by_mean_in_seconds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # two kinds of request: 90 % short (10 ms), 10 % long (200 ms); the default structure is CF1,
    # whose chain puts the long phase first
    rng = np.random.default_rng(7)
    x = np.where(rng.random(3000) < 0.9, rng.exponential(0.01, 3000), rng.exponential(0.2, 3000))
    src = tmp_path / "search.txt"
    np.savetxt(src, x)
    out = tmp_path / "fits"
    assert _main([str(src), "--order", "2", "--out", str(out)]) == 0
    d = json.loads((out / "search.json").read_text())
    assert d["time_unit"] == 1.0  # seconds
    ph = PhaseType(d["alpha"], d["T"])
    means = ph.phase_means()
    assert means[0] < means[1]  # phase 1 is the short kind
    assert [p["name"] for p in d["phases"]] == ["short", "long"]
    assert [p["mean"] for p in d["phases"]] == pytest.approx(means.tolist())
    assert [p["start"] for p in d["phases"]] == pytest.approx(d["alpha"])
    assert ph.mean() == pytest.approx(float(np.mean(x)), rel=0.05) and d["mean"] == pytest.approx(ph.mean())
    text = capsys.readouterr().out
    assert "phases by mean (as written): 1 short: starts" in text and "2 long: starts" in text


def test_apache_log_stages(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    log = tmp_path / "access.log"
    with log.open("w") as fh:
        for i in range(1200):
            path = "/stage1" if i % 2 else "/stage2"
            fh.write(f'1.2.3.4 [21/Nov/2026:08:00:00 +0000] "GET {path} HTTP/1.1" 200 1 {int(rng.exponential(2000)) + 1}\n')
        fh.write("garbage\n")
    out = tmp_path / "o"
    rc = _main(["--apache-log", str(log), "--log-format", '%h %t "%r" %>s %b %D', "--stage", "a=^/stage1",
                "--stage", "b=^/stage2", "--order", "1", "--out", str(out)])
    assert rc == 0
    for name in ("a", "b"):
        ph = PhaseType.from_json((out / f"{name}.json").read_text())
        assert ph.mean() == pytest.approx(2e-3, rel=0.15)


def test_censor_at(durations: Path, tmp_path: Path) -> None:
    assert _main([str(durations), "--order", "2", "--censor-at", "0.1", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "stage1.json").read_text())
    x = np.loadtxt(durations)
    assert d["mean"] == pytest.approx(x.mean(), rel=0.1)  # the tail beyond the timeout is inferred


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--order", "x"], "--order must be an integer"),
        (["--stage", "oops"], "give FILE"),
        (["--censor-at", "-1"], "--censor-at must be"),
        (["--apache-log", "LOG", "--log-format", "%r %D", "--stage", r"a=^/(x)\1"],
         r"--stage a=^/(x)\1: not supported by the linear-time matcher"),
    ],
)
def test_usage_errors_exit_2(durations: Path, argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = argv if argv[0] in ("--stage", "--apache-log") else [str(durations), *argv]
    assert _main(args) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_hostile_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "s.txt"
    p.write_text("1.0\nnan\n2.0\n")
    assert _main([str(p)]) == 2
    assert "stage 's': x[1] must be finite" in capsys.readouterr().err


def test_auto_order_stays_within_the_state_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = np.random.default_rng(2).gamma(3.0, 0.01, 1500)  # Erlang-3-like: BIC wants about three phases
    p = tmp_path / "s.txt"
    np.savetxt(p, x)
    out = tmp_path / "out"
    # 2,000 states afford two stages of one phase each (1,060 states), not of two (68,355)
    assert _main([str(p), "--order", "auto", "--max-states", "2000", "--out", str(out)]) == 0
    d = json.loads((out / "s.json").read_text())
    bic_best = min(d["selection"], key=lambda r: r["bic"])["order"]
    assert d["order"] == 1 and bic_best > 1
    said = [line for line in capsys.readouterr().out.splitlines() if "over budget" in line]
    assert len(said) == 1 and f"BIC-best order {bic_best}" in said[0] and "--max-states 2,000" in said[0]
    # the default budget affords BIC's choice here: nothing to say
    assert _main([str(p), "--order", "auto", "--out", str(out)]) == 0
    assert json.loads((out / "s.json").read_text())["order"] == bic_best
    assert "over budget" not in capsys.readouterr().out


def test_state_budget_too_small_for_one_phase(durations: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _main([str(durations), "--order", "auto", "--max-states", "100"]) == 2
    assert "--max-states 100: not even order 1 fits" in capsys.readouterr().err


def test_shift_auto_writes_a_floor_the_solver_affords(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from overtake.api.scenario import load_scenario
    from overtake.mdp.budget import DEFAULT_MAX_STATES, check_budget

    rng = np.random.default_rng(5)
    out = tmp_path / "out"
    for name in ("preview", "view"):
        np.savetxt(tmp_path / f"{name}.txt", 0.02 + rng.exponential(0.03, 2000))
        assert _main([str(tmp_path / f"{name}.txt"), "--shift", "auto", "--order", "auto", "--out", str(out)]) == 0
        d = json.loads((out / f"{name}.json").read_text())
        floor = d["shift"]
        assert floor["shift"] == pytest.approx(0.02, abs=1e-3) and floor["body_order"] == 1
        assert floor["erlang_phases"] == 2  # the default budget affords three phases a stage
        ph = PhaseType.from_dict(d)
        assert ph.mean() == pytest.approx(0.05, rel=0.06)
        assert ph.mean() == pytest.approx(floor["shift"] + floor["body_mean"], rel=1e-12)
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  floor ")]
        assert len(said) == 1 and "unshifted cf1 order 3" in said[0]
    sc = tmp_path / "scenario.yaml"
    sc.write_text("load: 0.6\nstages:\n  - name: preview\n    service: {file: out/preview.json}\n"
                  "  - name: view\n    service: {file: out/view.json}\n")
    _, model = load_scenario(str(sc))
    assert [st.phases for st in model.stages] == [3, 3]
    assert check_budget(model, max_states=DEFAULT_MAX_STATES) <= DEFAULT_MAX_STATES


def test_shift_usage_errors(durations: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _main([str(durations), "--shift", "-1"]) == 2
    assert "--shift must be > 0 seconds" in capsys.readouterr().err
    assert _main([str(durations), "--shift", "10"]) == 2
    assert "--shift: shift: 10 s is not below the smallest duration" in capsys.readouterr().err


def test_the_commands_copies_of_the_fitting_constants_agree():
    """`overtake fit` writes the structures and the largest auto order out so that parsing imports
    no EM; they must stay the EM's own."""
    from overtake.fitting import em

    assert fit_cmd.STRUCTURES == em.STRUCTURES
    assert fit_cmd.MAX_AUTO_ORDER == em.MAX_AUTO_ORDER
