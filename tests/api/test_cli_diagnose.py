"""``overtake diagnose``: the per-stage serialisation verdict from an access log.

The log's lines carry mod_overtake_prio's time split of requests from the exact lock simulation
(tests/support/lock_sim.py): /stage1 holds an exclusive lock, /stage2 shares the core. Known answers:
stage1 serialised with lock capacity 1, stage2 not, grouped by the stages file or by method and
path; input errors are one line naming the option or the missing directive, exit code 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.lock_sim import simulate

from overtake.api.cli import main
from overtake.api.commands import diagnose
from overtake.controller.online import serialisation
from overtake.controller.online.serialisation import TimedRequest

T0 = 1_763_719_200.0
STAGES = """stages:
  - {name: writes, path: "^/stage1$"}
  - {name: reads, path: "^/stage2$"}
"""


def _line(path: str, r: TimedRequest | None) -> str:
    begin = int((T0 + (r.start if r else 0.0)) * 1e6) - 100
    head = (f'127.0.0.1 {begin} "POST {path}?x=1 HTTP/1.1" 200 12 D=20000 msT=20 usT=20000 '
            "stage=- cpu_us=- tid=77 rid=-")
    if r is None:
        return head
    us = [round(x * 1e6) for x in (r.wall, r.cpu, r.wait, r.blocked)]
    return head + f" owall_us={us[0]} ostart_us=100 ocpu_us={us[1]} owait_us={us[2]} oblocked_us={us[3]}"


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    recs = simulate(400, 1, seed=5)
    p = tmp_path_factory.mktemp("diagnose") / "access.log"
    lines = [_line("/stage1", r) for r in recs["A"]] + [_line("/stage2", r) for r in recs["B"]]
    p.write_text("\n".join([*lines, "a foreign line", _line("/stage1", None)]) + "\n")
    return p


def test_the_defaults_are_the_detectors() -> None:
    assert (diagnose.MIN_SAMPLES, diagnose.ALPHA) == (serialisation.MIN_SAMPLES, serialisation.ALPHA)


def test_verdicts_by_stage(log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    st = tmp_path / "stages.yaml"
    st.write_text(STAGES)
    assert main(["diagnose", str(log), "--stages", str(st), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    w, r = doc["stages"]["writes"], doc["stages"]["reads"]
    assert w["serialising"] is True and w["lock_capacity"] == 1 and w["requests"] == 400
    assert r["serialising"] is False and r["lock_capacity"] is None
    assert (doc["lines_unparsed"], doc["lines_without_split"]) == (1, 1)


def test_verdicts_by_method_and_path(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", str(log)]) == 0
    out, err = capsys.readouterr()
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert "SERIALISED" in rows["POST /stage1"] and "not serialised" in rows["POST /stage2"]
    assert "POST /stage1: blocked" in out and "lock capacity 1" in out
    assert "1 lines in no known format, 1 without the request-time split" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--alpha", "2"], "--alpha: must be a level in (0, 1)"),
        (["--min-samples", "1"], "--min-samples: must be an integer >= 2"),
    ],
)
def test_bad_options(log: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", str(log), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_log_without_the_split_names_the_directive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "old.log"
    old.write_text(_line("/stage1", None) + "\n")
    assert main(["diagnose", str(old)]) == 2
    err = capsys.readouterr().err
    assert "no request carries the request-time split" in err and "OvertakeRequestTimes On" in err
    foreign = tmp_path / "foreign.log"
    foreign.write_text("GET / 200\n")
    assert main(["diagnose", str(foreign)]) == 2
    assert "no line matches the sidecar's LOG_FORMAT" in capsys.readouterr().err
    assert main(["diagnose", str(tmp_path / "missing.log")]) == 2
    assert "file not found" in capsys.readouterr().err
