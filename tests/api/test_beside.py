"""Work beside the solve (overtake.api.beside): it runs in another process when there is a second
core, gives the same answer as run here, and its errors reach the caller."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from overtake.api import beside
from overtake.api.commands import solve as solve_command
from overtake.mdp.errors import ModelError

CASE7 = Path(__file__).resolve().parents[2] / "examples" / "table1" / "case07.yaml"


def _pid_and(x: int) -> tuple[int, int]:
    return os.getpid(), 2 * x


def _fails() -> None:
    raise ModelError("stage2: no such thing")



def _count_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions started beside from now on (each start still happens)."""
    started: list[str] = []
    real = beside.start

    def counting(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        started.append(fn.__name__)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(beside, "start", counting)
    return started

def test_with_a_second_core_the_work_runs_in_another_process(monkeypatch):
    monkeypatch.setattr(beside, "_cores", lambda: 2)
    pid, y = beside.start(_pid_and, 21).result()
    assert pid != os.getpid() and y == 42


def test_on_one_core_the_work_runs_here(monkeypatch):
    monkeypatch.setattr(beside, "_cores", lambda: 1)
    assert beside.start(_pid_and, 21).result() == (os.getpid(), 42)


def test_the_workers_error_reaches_the_caller(monkeypatch):
    monkeypatch.setattr(beside, "_cores", lambda: 2)
    pending = beside.start(_fails)
    with pytest.raises(ModelError, match="stage2"):
        pending.result()


@pytest.mark.parametrize("cores", [1, 2])
def test_an_age_solve_records_the_passthrough_computed_beside_as_here(cores, monkeypatch, tmp_path, capsys):
    """`overtake solve --cpu-priority age`: π(∞)'s figure and the thresholds from the worker are the
    ones age_passthrough computes in this process (the same seeds), bit for bit."""
    from overtake.api.cli import main
    from overtake.api.scenario import load_scenario
    from overtake.mdp.priority_prediction import age_passthrough

    monkeypatch.setattr(beside, "_cores", lambda: cores)
    assert main(["solve", str(CASE7), "--out", str(tmp_path / "p.npz"), "--quiet", "--cpu-priority", "age"]) == 0
    age = json.loads(capsys.readouterr().out)["cpu_priority"]["age"]
    here = age_passthrough(load_scenario(str(CASE7))[1])
    assert (age["passthrough"], age["passthrough_ci95"], age["passthrough_seeds"]) == (here.mean, here.ci95, here.runs)
    assert age["thresholds"][0][0] == here.choice.priority.thresholds[0][0]
    assert age["visit_model"] == here.choice.mean_response_time


def _dies_in_a_worker(parent: int) -> int:
    if os.getpid() != parent:
        os._exit(3)  # killed, out of memory: no answer
    return 7


def test_a_worker_that_dies_without_an_answer_is_replaced_by_the_call_here(monkeypatch):
    monkeypatch.setattr(beside, "_cores", lambda: 2)
    assert beside.start(_dies_in_a_worker, os.getpid()).result() == 7


def test_a_cancelled_worker_is_stopped_and_reaped(monkeypatch):
    import time

    monkeypatch.setattr(beside, "_cores", lambda: 2)
    pending = beside.start(time.sleep, 30)
    pid = pending._pid
    assert pid is not None
    pending.cancel()
    with pytest.raises(ChildProcessError):  # reaped: no such child left
        os.waitpid(pid, os.WNOHANG)


KEPT = """load: 0.6
time_unit: model
stages:
  - name: stage1
    service: {exponential: {mean: 1.0}}
  - name: stage2
    service: {hyperexponential: {probs: [0.91, 0.09], means: [0.55, 5.45]}}
"""


@pytest.mark.parametrize("kept", [True, False], ids=["candidate-kept", "candidate-dropped"])
def test_an_age_solve_with_a_second_core_writes_the_file_of_one_core(kept, monkeypatch, tmp_path, capsys):
    """The ladder, the overtaking rules and the paired runs beside the solve, the rules and the
    prediction started on the solve's candidate policy (kept when it is the answer, else dropped
    and started again on the answer): the policy file's record (trace, rules, predictions) and the
    printed document are those of one process."""
    from overtake.api.cli import main
    from overtake.mdp.policy import Policy

    scen = tmp_path / "kept.yaml"
    scen.write_text(KEPT)
    started = _count_starts(monkeypatch)
    # these policies' rules are quick enough to run here; sent beside all the same, to test that path
    monkeypatch.setattr(solve_command, "RULES_BESIDE_MIN_STATES", 0)
    out = {}
    for cores in (1, 2):
        monkeypatch.setattr(beside, "_cores", lambda cores=cores: cores)
        started.clear()
        path = tmp_path / f"p{cores}.npz"
        assert main(["solve", str(scen if kept else CASE7), "--out", str(path), "--quiet", "--cpu-priority", "age"]) == 0
        doc = json.loads(capsys.readouterr().out)
        doc.pop("out")
        pol = Policy.load(path)
        out[cores] = (doc, json.dumps(pol.meta), pol.digest())
        # the rules and the prediction on the candidate; again on the answer when it is another policy
        assert started.count("overtaking_rule") == (1 if kept else 2)
        assert started.count("_cpu_priority_meta") == 1
    assert out[1] == out[2]
    # and those of the plain path: the solve, then its rules and its prediction, in order
    from overtake.api.scenario import load_scenario
    from overtake.mdp import solve
    from overtake.mdp.priority_prediction import predict_priority
    from overtake.mdp.rules import overtaking_rule

    sc, model = load_scenario(str(scen if kept else CASE7))
    opt = solve(model, tol=sc.tolerance)
    meta = json.loads(out[2][1])
    assert meta["rules"] == json.loads(json.dumps(overtaking_rule(opt.solve, opt.policy).to_dict()))
    assert meta["cpu_priority"]["age"] == json.loads(json.dumps(predict_priority(model, opt.policy, "age").to_meta()))


def test_a_small_policys_rules_are_extracted_here_with_the_same_record(monkeypatch, tmp_path, capsys):
    """A policy below RULES_BESIDE_MIN_STATES (Table 1 case 7's, a few thousand states) has its
    overtaking rules extracted here, no worker started for them, on two cores as on one; the
    file's record is the one written with the rules sent beside."""
    from overtake.api.cli import main
    from overtake.mdp.policy import Policy

    started = _count_starts(monkeypatch)
    monkeypatch.setattr(beside, "_cores", lambda: 2)
    out = {}
    for threshold in (solve_command.RULES_BESIDE_MIN_STATES, 0):
        monkeypatch.setattr(solve_command, "RULES_BESIDE_MIN_STATES", threshold)
        started.clear()
        path = tmp_path / f"p{threshold}.npz"
        assert main(["solve", str(CASE7), "--out", str(path), "--quiet", "--phase-info", "full"]) == 0
        doc = json.loads(capsys.readouterr().out)
        doc.pop("out")
        pol = Policy.load(path)
        assert pol.keys.size < solve_command.RULES_BESIDE_MIN_STATES or threshold == 0
        out[threshold] = (doc, json.dumps(pol.meta), pol.digest(), started.count("overtaking_rule"))
    small, forced = out.values()
    assert small[3] == 0 and forced[3] >= 1  # beside only when told to
    assert small[:3] == forced[:3] and "rules" in json.loads(small[1])
