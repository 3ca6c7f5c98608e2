"""``--cpu-priority class`` by predicted size (controller.sidecar.size_class).

Known answers: with a fixed threshold a key learned above it is sent low, one below or unseen
is not; with the quantile threshold, predictions cycling over 1..100 ms put the threshold at the
quantile of what was seen and demote the keys above it (the largest tenth); locked, unkeyed and
exempt stages are never demoted. On a real Apache with mod_overtake_prio on one core, a request
whose key was learned large starts at SCHED_IDLE and a later one of the same work whose key was
learned small finishes first (under processor sharing the earlier one would), and an exempt
POST gets no class.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter
from support.service_helpers import SidecarProc

from overtake.controller.errors import SidecarInputError
from overtake.controller.harness import apache
from overtake.controller.harness.apache.cpu_priority import fetch_prio_status
from overtake.controller.sidecar.policies import BaselinePolicy
from overtake.controller.sidecar.policy_in_force import PolicyInForce
from overtake.controller.sidecar.size_class import MIN_PREDICTIONS, SizeClass
from overtake.controller.sidecar.stages import StagesConfig, StageTable, load_stages


def _table(extra: str = "") -> StageTable:
    import yaml
    doc = yaml.safe_load(f"""stages:
  - {{name: preview, routes: [{{path: "^/p$", key: [body_size]}}], next: view, lock: 1}}
  - {{name: view, routes: [{{path: "^/v$", key: [link]}}]{extra}}}
  - {{name: plain, path: "^/x$"}}
""")
    return StageTable(StagesConfig.model_validate(doc))


def test_a_fixed_threshold_demotes_the_keys_learned_above_it() -> None:
    sc = SizeClass.from_table(_table(", class_threshold: 0.05"))
    assert [sc.eligible(i) for i in range(3)] == [False, True, False]  # locked, keyed, unkeyed
    for s in (0.01, 0.03):
        sc.learn(1, "<small", s)
    for s in (0.04, 0.2):
        sc.learn(1, "<big", s)
    assert sc.predict(1, "<small") == pytest.approx(0.02) and sc.predict(1, "<big") == pytest.approx(0.12)
    assert [sc.level(1, k) for k in ("<small", "<big", "<unseen")] == [0, 1, 0]
    assert sc.level(0, "<big") is None and sc.level(2, "<big") is None  # stages it never decides
    assert sc.info()["view"] == {"threshold_seconds": 0.05, "source": "class_threshold", "decided": 3, "low": 1,
                                 "keys_learned": 2}


def test_the_quantile_threshold_demotes_the_largest_tenth() -> None:
    sc = SizeClass.from_table(_table())
    keys = [f"<k{i}" for i in range(1, 101)]
    for i, k in enumerate(keys, 1):
        sc.learn(1, k, i / 1000)
    first = [sc.level(1, k) for k in keys[:MIN_PREDICTIONS - 1]]
    assert first == [0] * (MIN_PREDICTIONS - 1)  # not before MIN_PREDICTIONS predictions are in
    for _ in range(6):
        last = [sc.level(1, k) for k in keys]
    th = sc.info()["view"]["threshold_seconds"]
    assert 0.088 <= th <= 0.093  # 0.9 quantile of predictions spread evenly over 1..100 ms
    assert last == [int(i / 1000 > th) for i in range(1, 101)] and 8 <= sum(last) <= 12


def test_the_decision_skips_exempt_requests_and_counts_the_low_ones() -> None:
    table = _table(", class_threshold: 0.05, cpu_exempt: [DELETE]")
    pif = PolicyInForce.__new__(PolicyInForce)
    reg = CollectorRegistry()
    pif.limiter = SimpleNamespace(policy=BaselinePolicy("passthrough", 3))  # type: ignore[assignment]
    pif._class_key, pif.table, pif.size_class = None, table, SizeClass.from_table(table)
    pif.metrics = SimpleNamespace(class_low=Counter("overtake_class_low", "", ["stage"], registry=reg))  # type: ignore[assignment]
    pif.size_class.learn(1, "<big", 0.2)
    assert pif._cpu_class(1, 0, "<big", "GET") == 1
    assert pif._cpu_class(1, 0, "<big", "DELETE") is None  # cpu_exempt covers it: no class at all
    assert pif._cpu_class(0, 0, "<big", "POST") is None  # the locked stage
    assert reg.get_sample_value("overtake_class_low_total", {"stage": "view"}) == 1.0


@pytest.mark.parametrize(("field", "value", "message"), [
    ("class_threshold", "-0.1", "greater than 0"), ("class_threshold", ".inf", "finite"),
    ("class_quantile", "1.5", "less than 1"), ("class_quantile", "0", "greater than 0")])
def test_bad_class_settings_are_refused_naming_the_field(tmp_path: Path, field: str, value: str, message: str) -> None:
    f = tmp_path / "stages.yaml"
    f.write_text(f'stages:\n  - {{name: s, path: "^/s$", {field}: {value}}}\n')
    with pytest.raises(SidecarInputError, match=rf"stages\[0\]\.{field}") as err:
        load_stages(f)
    assert message in str(err.value)


# ---- on a real Apache with mod_overtake_prio ----------------------------------------------------

SIZE_STAGES = """stages:
  - {name: stage1, routes: [{path: "^/stage1$", key: ["param:k"]}], class_threshold: 0.02}
  - {name: stage2, routes: [{path: "^/stage2$", key: ["param:k"]}], class_threshold: 0.02, cpu_exempt: unsafe}
limits: {max_inflight: 8, queue_cap: 200, queue_timeout: 30}
classifier: {mode: explicit, time_unit: 1}
"""


def _class_low(side: SidecarProc) -> float:
    """``overtake_class_low_total{stage="stage1"}`` (0 before the first low start)."""
    m = re.search(r'^overtake_class_low_total\{stage="stage1"\} (\S+)$', side.request("GET", "/-/metrics")[2].decode(),
                  re.MULTILINE)
    return 0.0 if m is None else float(m[1])


@pytest.mark.parametrize("asked", ["class", "auto"])  # auto: keyed stages without a lock choose the class
def test_a_request_predicted_large_starts_low_and_a_small_one_overtakes_it(prio_apache: apache.ApacheInstance,
                                                                           work: Path, asked: str) -> None:
    side = SidecarProc(work, ["--policy", "passthrough", "--apache", prio_apache.base_url, "--cpu-priority", asked,
                              "--status-interval", "0.2"], stages=SIZE_STAGES)
    try:
        host, port = apache.parse_listen(prio_apache.listen)
        # learned: unseen keys go at 0. Four of each, so that a slow first request (a fresh Apache on
        # a busy machine) does not lift the small key's mean over the 20 ms threshold
        for path in ("/stage1?k=small&work=0.001",) * 4 + ("/stage1?k=big&work=0.06",):
            assert side.request("GET", path)[0] == 200
        before = fetch_prio_status(host, port)
        low_before = _class_low(side)
        done: dict[str, float] = {}

        def go(name: str, path: str, delay: float) -> None:
            time.sleep(delay)
            assert side.request("GET", path)[0] == 200
            done[name] = time.monotonic()

        # equal work, the small-keyed one sent second: under processor sharing the first ends first
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(go, "big", "/stage1?k=big&work=0.3", 0.0),
                      pool.submit(go, "small", "/stage1?k=small&work=0.3", 0.05)]:
                f.result()
        mid = fetch_prio_status(host, port)
        assert done["small"] < done["big"], (done, side.request("GET", "/-/policy")[2].decode()[-1500:])
        assert mid.demotions_class[1] - before.demotions_class[1] == 1  # the big one only
        # an exempt request learned large keeps its priority: no class header
        for _ in range(2):
            assert side.request("POST", "/stage2?k=big&work=0.06", body=b"")[0] == 200
        after = fetch_prio_status(host, port)
        assert after.demotions_class[1] == mid.demotions_class[1]
        assert after.exempt_header - mid.exempt_header == 2
        text = side.request("GET", "/-/metrics")[2].decode()
        assert _class_low(side) - low_before == 1, text[-3000:]
        assert 'overtake_class_low_total{stage="stage2"}' not in text
        info = side.request("GET", "/-/policy")[2].decode()
        assert '"size_class"' in info and f'"low": {int(low_before) + 1}' in info, info
    finally:
        side.stop()


def test_the_quantile_is_recomputed_every_few_predictions() -> None:
    rng = np.random.default_rng(3)
    sc = SizeClass(("s",), (True,), ((None, 0.8),))
    vals = rng.lognormal(-3, 1, 300)
    for i, v in enumerate(vals):
        sc.learn(0, f"k{i}", float(v))
    for i in range(300):
        sc.level(0, f"k{i}")
    # first at MIN_PREDICTIONS, then every 32: the last computation saw the first 274 predictions
    assert sc.info()["s"]["threshold_seconds"] == pytest.approx(float(np.quantile(vals[:274], 0.8)))
