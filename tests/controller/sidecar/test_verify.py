"""The live verifier on a real limiter and a real control file, its clock in the test's hand.

Known answers: the arm in force alternates (limiter policy and the control file's thresholds:
the policy's, or the module's largest, which demote nothing); a request queued by the policy
when the default window opens is forwarded at once (nothing lost); requests are counted in the
window they arrived in (not in the settle time), across the switch; windows whose policy is
twice as slow as the default give gain −100 % and a fallback; a new policy is verified afresh;
Apache's default itself needs no verification. The options refuse bad values naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.control_file import ControlPublisher, encode, no_demotion
from overtake.controller.sidecar.limiter import ADMITTED, QUEUED, Limiter, Ticket
from overtake.controller.sidecar.policies import BaselinePolicy
from overtake.controller.sidecar.stages import ClassifierSettings
from overtake.controller.sidecar.verify import Verifier, VerifySettings
from overtake.controller.sidecar.verify_metrics import VerifyCollector

NAMES = ("stage1", "stage2")
UNIT = 0.005  # seconds per model unit
THRESHOLD = 1.5  # model units


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def aged_pi1() -> BaselinePolicy:
    """π(1) carrying age thresholds, as a policy solved with ``--cpu-priority age`` does."""
    p = BaselinePolicy("pi(1)", 2)
    p.priority_predictions = {"age": {"thresholds": [[THRESHOLD], [THRESHOLD]]}}  # type: ignore[attr-defined]
    return p


def rig(tmp_path: Path, settings: VerifySettings, seed: int = 3) -> tuple[Limiter, Verifier, Clock, Path]:
    clock = Clock()
    pol = aged_pi1()
    lim = Limiter(pol, Classifier(ClassifierSettings(mode="hidden"), pol), stage_names=NAMES,  # type: ignore[arg-type]
                  queue_caps=(100, 100), max_inflight=64, passthrough_cap=None, passthrough_queue_cap=100,
                  clock=clock)
    path = tmp_path / "control"
    ver = Verifier(settings, limiter=lim, passthrough=BaselinePolicy("passthrough", 2),
                   control=ControlPublisher(str(path), 2), time_unit=lambda: UNIT, prio_levels=lambda: None,
                   rng=random.Random(seed))
    lim.add_listener(ver)
    return lim, ver, clock, path


def control_rows(path: Path) -> list[list[float]] | None:
    """The thresholds the control file holds (checked byte for byte against the encoder)."""
    key = bytes.fromhex((path.parent / (path.name + ".key")).read_text().strip())
    data = path.read_bytes()
    gen = int.from_bytes(data[8:12], "little")
    for rows in ([[THRESHOLD * UNIT]] * 2, [list(no_demotion(1))] * 2, None):
        if data == encode(key, gen, 2, rows):
            return rows
    raise AssertionError("the control file holds neither the policy's thresholds nor no demotion")


def in_force(lim: Limiter, path: Path) -> str:
    rows = control_rows(path)
    if getattr(lim.policy, "unlimited", False):
        assert rows == [list(no_demotion(1))] * 2  # the default: nothing demoted
        return "default"
    assert rows == [[THRESHOLD * UNIT]] * 2
    return "policy"


def arrive(lim: Limiter, stage: int = 0) -> Ticket:
    t = lim.submit(stage, 0, "/x")
    assert t is not None
    return t


def test_arms_alternate_and_a_slower_policy_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Per window: a request in the settle time (+0.5 s to +1 s, not counted); a, b at +2 s (π(1):
    b waits for a), released at +3 s and +4 s (default: both at +3 s); hog at +9 s and stuck at
    +10 s, still running when the window ends (π(1): stuck queued, forwarded when the default
    opens) and released 1 s into the next window. Policy windows: 1, 2, 2, 1 s (mean 1.5); default
    windows: 1, 1, 2, 1 s (mean 1.25). Every pair's ratio is ln(1.25 / 1.5): the CI is that point,
    below 0."""
    s = VerifySettings(window=3600, settle=1.0, min_pairs=2, max_pairs=4, min_requests=2)
    lim, ver, clock, path = rig(tmp_path, s)
    leftovers: list[Ticket] = []

    async def scenario() -> None:
        ver.start()
        assert ver.state == "verifying"
        for _window in range(6):
            w0 = ver.windows[-1].start
            arm = in_force(lim, path)
            assert ver.arm == arm == ver.windows[-1].arm
            clock.now = w0 + 0.5
            early = arrive(lim)  # settle time: not counted
            clock.now = w0 + 1.0
            for t in leftovers:  # the previous window's, counted there
                lim.release(t, "completed")
            leftovers.clear()
            lim.release(early, "completed")
            clock.now = w0 + 2.0
            a, b = arrive(lim), arrive(lim)
            assert (a.status, b.status) == ((ADMITTED, QUEUED) if arm == "policy" else (ADMITTED, ADMITTED))
            clock.now = w0 + 3.0
            lim.release(a, "completed")
            if arm == "policy":
                assert b.status == ADMITTED
                clock.now = w0 + 4.0
            lim.release(b, "completed")
            clock.now = w0 + 9.0
            hog = arrive(lim)
            clock.now = w0 + 10.0
            stuck = arrive(lim)
            assert stuck.status == (QUEUED if arm == "policy" else ADMITTED)
            leftovers.extend((hog, stuck))
            ver._tick()  # the window ends
            assert stuck.status == ADMITTED or ver.arm == "policy", "a queued request was lost in the switch"
            if ver.state != "verifying":
                break
        for t in leftovers:
            lim.release(t, "completed")
        await asyncio.sleep(0)

    with caplog.at_level(logging.INFO, logger="overtake.sidecar"):
        asyncio.run(scenario())
    arms = [w.arm for w in ver.windows]
    assert all(arms[2 * k] != arms[2 * k + 1] for k in range(len(arms) // 2)), arms  # a pair runs both arms
    assert len(ver.windows) == 5  # pair 2 is complete once its last requests are: at the end of window 5
    assert ver.state == "fell_back" and ver.arm == "default", ver.status()
    assert in_force(lim, path) == "default"
    st = ver.status()
    assert st["reason"] == "worse" and st["pairs"] == 2 and st["void_pairs"] == 0
    assert ver.ratios == [pytest.approx(math.log(1.25 / 1.5))] * 2
    assert st["gain"] == pytest.approx(1 - 1.5 / 1.25) and st["ci"] == pytest.approx([st["gain"]] * 2)
    assert st["last_pair"]["policy_requests"] == 4 == st["last_pair"]["default_requests"]
    decisions = [r for r in caplog.records if getattr(r, "event", "") == "verification_decision"]
    assert len(decisions) == 1 and decisions[0].detail["gain"] == st["gain"]  # type: ignore[attr-defined]
    reg = CollectorRegistry()
    reg.register(VerifyCollector(ver))
    text = generate_latest(reg).decode()
    assert 'overtake_verification_state{state="fell_back"} 1.0' in text
    assert 'overtake_verification_state{state="verifying"} 0.0' in text
    assert 'overtake_verification_arm{arm="default"} 1.0' in text
    assert 'overtake_verification_pairs_total{outcome="used"} 2.0' in text
    assert f"overtake_verification_gain_ratio {st['gain']!r}" in text
    assert 'overtake_verification_decisions_total{reason="worse",state="fell_back"} 1.0' in text


def test_a_new_policy_is_verified_afresh_and_the_default_needs_none(tmp_path: Path) -> None:
    s = VerifySettings(window=3600, settle=0.0, min_pairs=2, max_pairs=2, min_requests=1)
    lim, ver, clock, path = rig(tmp_path, s)

    async def scenario() -> None:
        ver.start()
        ver.windows[0].n, ver.windows[0].total = 5, 5.0
        new = BaselinePolicy("pi(2)", 2)
        lim.swap(new)
        ver.adopt(new)
        assert ver.state == "verifying" and ver.chosen is new and len(ver.windows) == 1
        assert ver.windows[0].n == 0
        default = BaselinePolicy("passthrough", 2)
        lim.swap(default)
        ver.adopt(default)
        assert ver.state == "idle" and ver._timer is None and lim.policy is default
        ver.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"window": 0}, "--verify-window"), ({"window": 10, "settle": 10}, "--verify-settle"),
    ({"min_pairs": 1}, "--verify-min-pairs"), ({"min_pairs": 5, "max_pairs": 4}, "--verify-max-pairs"),
    ({"min_gain": 1.5}, "--verify-min-gain"), ({"level": 1.0}, "--verify-level"),
    ({"min_requests": 0}, "--verify-min-requests"), ({"window": math.nan}, "--verify-window"),
])
def test_bad_settings_name_the_flag(kwargs: dict[str, float], flag: str) -> None:
    with pytest.raises(SidecarInputError, match=f"^{flag}: must be "):
        VerifySettings(**kwargs)  # type: ignore[arg-type]


def test_flags_and_config_keys(tmp_path: Path) -> None:
    from overtake.api.commands.sidecar import options_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    base = ["sidecar", "--policy", "pi(1)", "--apache", "http://127.0.0.1:1", "--listen", "127.0.0.1:2",
            "--stages", "s.yaml"]
    assert options_from_args(parser.parse_args(base))[1].verify is None  # off by default
    opts = options_from_args(parser.parse_args([*base, "--verify", "--verify-window", "4", "--verify-settle", "1"]))[1]
    assert opts.verify == VerifySettings(window=4, settle=1)
    with pytest.raises(SidecarInputError, match="^--verify-window: only with --verify"):
        options_from_args(parser.parse_args([*base, "--verify-window", "4"]))
    with pytest.raises(SidecarInputError, match="^--verify-settle: must be a number of seconds in"):
        options_from_args(parser.parse_args([*base, "--verify", "--verify-window", "4", "--verify-settle", "9"]))
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text("apache: http://127.0.0.1:1\nlisten: 127.0.0.1:2\nstages: s.yaml\npolicy: pi(1)\n"
                   "verify: {window: 6, max_pairs: 10, windw: 3}\n")
    with pytest.raises(SidecarInputError, match=r"verify\.windw: unknown key; known keys: enabled, level, max_pairs"):
        options_from_args(parser.parse_args(["sidecar", "--config", str(cfg)]))
    cfg.write_text("apache: http://127.0.0.1:1\nlisten: 127.0.0.1:2\nstages: s.yaml\npolicy: pi(1)\n"
                   "verify: {window: 6, max_pairs: 10}\n")
    opts = options_from_args(parser.parse_args(["sidecar", "--config", str(cfg), "--verify-min-gain", "0.05"]))[1]
    assert opts.verify == VerifySettings(window=6, max_pairs=10, min_gain=0.05)
    cfg.write_text("apache: http://127.0.0.1:1\nlisten: 127.0.0.1:2\nstages: s.yaml\npolicy: pi(1)\n")
    with pytest.raises(SidecarInputError, match="^--verify-min-gain: only with --verify"):
        options_from_args(parser.parse_args(["sidecar", "--config", str(cfg), "--verify-min-gain", "0.05"]))
    assert options_from_args(parser.parse_args(["sidecar", "--config", str(cfg)]))[1].verify is None
