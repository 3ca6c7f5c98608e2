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
