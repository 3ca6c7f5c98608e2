"""``X-Overtake-Phase`` through the sidecar: a number 1..M or the phase's name, else 400.

Known answers: under a policy solved for two-phase stages ``1``, ``2``, ``short`` and ``LONG``
are accepted (``short`` is the phase with the smaller mean, whatever its index), ``0``, ``9``,
``abc`` are answered 400 with the header's name and the accepted values and never reach Apache.
Under ``pi(1)`` from the start no model says how many phases a stage has: any number a model
could have (1..64) or a name is accepted, as clients may send the phases of the policy to come
(the online loop's); ``0``, ``abc``, ``65`` and non-ASCII digits are still 400. After a solved
policy ran, a baseline keeps its phases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.service_helpers import SidecarProc, StubApache
from test_time_unit import STAGES_2, policy_file

from overtake.controller.sidecar.classifier import BadPhaseHeader, Classifier
from overtake.controller.sidecar.policies import BaselinePolicy, load_policy
from overtake.controller.sidecar.stages import ClassifierSettings
from overtake.phases import parse_phase, phase_names

BAD = [b"0", b"65", b"abc", b"-1", b"1.0", "\u0663".encode(), "\u00b2".encode(), b"1" * 40, b"", b"medium"]


def _get(s: SidecarProc, value: bytes) -> tuple[int, bytes]:
    code, _, body = s.request("GET", "/stage2", headers={"X-Overtake-Phase": value.decode("latin-1")})
    return code, body


def test_invalid_phase_headers_are_400_under_a_baseline(tmp_path: Path, stub: StubApache) -> None:
    s = SidecarProc(tmp_path, ["--policy", "pi(1)", "--apache", stub.url], stages=STAGES_2)
    try:
        before = stub.hits["/stage2"]
        for value in BAD:
            code, body = _get(s, value)
            assert code == 400, (value, body)
            assert body.startswith(b"X-Overtake-Phase: must name a phase of stage 2: 1..64 or short, long; got "), body
        assert stub.hits["/stage2"] == before  # none reached Apache
        for value in (b"1", b" 1 ", b"9", b"64", b"long"):
            assert _get(s, value)[0] == 200, value
        assert s.request("GET", "/stage2")[0] == 200  # no header: fine
        # once a solved policy ran, its phases stand under a baseline too
        pol = policy_file(tmp_path / "h2b.npz", time_unit=1.0)
        assert s.request("PUT", "/-/policy", body=str(pol).encode())[0] == 200
        assert s.request("PUT", "/-/policy", body=b"pi(1)")[0] == 200
        assert _get(s, b"2")[0] == 200 and _get(s, b"9")[0] == 400
    finally:
        assert s.stop() == 0


def test_phase_names_and_numbers_under_a_two_phase_policy(tmp_path: Path, stub: StubApache) -> None:
    pol = policy_file(tmp_path / "h2.npz", time_unit=0.01)
    s = SidecarProc(tmp_path, ["--policy", str(pol), "--apache", stub.url], stages=STAGES_2)
    try:
        for value in (b"1", b"2", b"short", b"LONG", b" long"):
            assert _get(s, value)[0] == 200, value
        for value in (b"0", b"3", b"9", b"abc", b"medium", "\u0663".encode()):
            code, body = _get(s, value)
            assert code == 400 and body.startswith(b"X-Overtake-Phase: must name a phase of stage 2: 1..2 or short, "
                                                   b"long; got "), body
        info = json.loads(s.request("GET", "/-/policy")[2])
        assert info["phases"] == [2, 2] and info["phase_names"] == [["short", "long"], ["short", "long"]]
    finally:
        assert s.stop() == 0


def test_names_follow_the_means_not_the_index(tmp_path: Path) -> None:
    import numpy as np

    T_long_first = np.diag([-1 / 5.45, -1 / 0.55])  # phase 1 is the long kind here
    assert phase_names(T_long_first) == ("long", "short")
    assert parse_phase(b"short", 2, phase_names(T_long_first)) == 1
    assert parse_phase(b"1", 2, phase_names(T_long_first)) == 0  # a number is the position
    assert phase_names(np.diag([-3.0, -2.0, -1.0])) == ("1", "2", "3")
    assert phase_names(np.diag([-1.0, -3.0, -2.0])) == ("3", "1", "2")
    # a baseline after a solved policy keeps that policy's phases: a fallback to pi(k) must not
    # turn valid headers into 400s
    pol = load_policy(str(policy_file(tmp_path / "p.npz", time_unit=0.01)), ("stage1", "stage2"))
    clf = Classifier(ClassifierSettings(mode="explicit"), pol)
    assert clf.start_phase(0, "", b"long", None) == 1
    clf.bind(BaselinePolicy("pi(2)", 2))
    assert clf.start_phase(0, "", b"long", None) == 0  # accepted; a baseline has one queue per stage
    with pytest.raises(BadPhaseHeader, match="must name a phase of stage 1: 1..2 or short, long; got '3'"):
        clf.start_phase(0, "", b"3", None)
