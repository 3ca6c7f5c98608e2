"""overtake.controller.sidecar.policies, controller.sidecar.stages and controller.sidecar.classifier: known answers, no network.

BaselinePolicy's plain-Python answers are checked against mdp.Baseline.rule (an independent
vectorised implementation); TablePolicy against mdp.Policy.action; the learned classifier against
the Bayes posterior of a hyperexponential with well-separated phases.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from overtake.controller.errors import PolicyLoadError, SidecarInputError
from overtake.controller.sidecar.classifier import BadPhaseHeader, Classifier
from overtake.controller.sidecar.policies import BaselinePolicy, TablePolicy, load_policy
from overtake.controller.sidecar.stages import ClassifierSettings, load_stages
from overtake.mdp import Policy, Stage, TandemModel, Truncation, solve

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def h2_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """π* for two H2 stages (van der Weij et al., "Dynamic thread assignment" Table 1 case 4 shape, small truncation: fast)."""
    def h2() -> Stage:
        p, m = np.array([0.91, 0.09]), np.array([0.55, 5.45])
        return Stage("stage1", p, np.diag(-1.0 / m))

    s1 = h2()
    s2 = Stage("stage2", s1.alpha, s1.T)
    model = TandemModel(arrival_rate=0.6 / (2 * 1.0), stages=(s1, s2))
    opt = solve(model, truncation=Truncation(8, 3))
    path = tmp_path_factory.mktemp("pol") / "h2.npz"
    opt.policy.save(path)
    return path


@pytest.mark.parametrize("spec", ["pi(1)", "pi(3)", "pi(2,1)", "pi(1,4)", "pi(inf)", "passthrough"])
def test_baseline_matches_mdp_rule(spec: str) -> None:
    pol = BaselinePolicy(spec, 2)
    from overtake.mdp import Baseline

    base = Baseline.parse("pi(inf)" if spec == "passthrough" else spec, 2)
    rule = base.rule(np.array([0, 1]), np.array([0, 1]))
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 6, size=(500, 4))
    want = rule(rows)
    got = np.array([pol.action(tuple(int(x) for x in r)) for r in rows])
    np.testing.assert_array_equal(got, want)


def test_pi_k_serves_later_stages_first() -> None:
    pol = BaselinePolicy("pi(2)", 2)
    assert pol.action((5, 5, 0, 0)) == (0, 2)
    assert pol.action((5, 1, 0, 0)) == (1, 1)
    assert pol.action((5, 5, 1, 1)) == (0, 0)


def test_table_policy_matches_artifact(h2_policy: Path) -> None:
    pol = load_policy(str(h2_policy), ("stage1", "stage2"))
    assert isinstance(pol, TablePolicy)
    art = Policy.load(h2_policy)
    assert pol.phases == (2, 2) and pol.per_phase_queues
    assert pol.hash == art.digest()
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 3, size=(300, len(art.columns)))
    for r in rows:
        t = tuple(int(x) for x in r)
        assert pol.action(t) == tuple(int(x) for x in art.action(r))
        assert pol.action(t) == tuple(int(x) for x in art.action(r))  # memoised answer equal


def test_policy_errors_are_one_line(tmp_path: Path, h2_policy: Path) -> None:
    with pytest.raises(PolicyLoadError, match=r"policy: 'nope' is neither a file nor a baseline"):
        load_policy("nope", ("stage1", "stage2"))
    with pytest.raises(PolicyLoadError, match="per-stage caps but the stages file has 2 stages"):
        load_policy("pi(1,2,3)", ("stage1", "stage2"))
    bad = tmp_path / "corrupt.npz"
    bad.write_bytes(h2_policy.read_bytes()[:200])
    with pytest.raises(PolicyLoadError, match="not an overtake policy file"):
        load_policy(str(bad), ("stage1", "stage2"))
    with pytest.raises(
        PolicyLoadError, match=r"solved for stages \['stage1', 'stage2'\] but the stages file defines \['a', 'b'\]"
    ):
        load_policy(str(h2_policy), ("a", "b"))


def _stages(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "stages.yaml"
    p.write_text(text)
    return p


def test_stages_routing_and_defaults(tmp_path: Path) -> None:
    table = load_stages(REPO / "examples" / "sidecar" / "stages.yaml")
    assert table.names == ("stage1", "stage2")
    assert table.route("GET", "/stage1") == (0, "stage1:^/stage1$", None)
    assert table.route("GET", "/stage2") is not None and table.route("GET", "/stage2")[0] == 1
    assert table.route("GET", "/stage3") is None
    t2 = load_stages(_stages(tmp_path, """
stages:
  - name: a
    routes: [{path: "^/x", methods: [post]}, {path: "^/y", phase: 2}]
    queue_cap: 5
"""))
    assert t2.route("GET", "/x") is None and t2.route("POST", "/x1")[0] == 0
    assert t2.route("GET", "/y")[2] == 1
    assert t2.queue_cap(0) == 5 and t2.queue_timeout(0) == 30.0
    assert table.next_stage == (None, None) and t2.next_stage == (None,)
    t3 = load_stages(_stages(tmp_path, """
stages:
  - {name: page, path: "^/page", next: api}
  - {name: api, path: "^/api"}
"""))
    assert t3.next_stage == (1, None) and t3.config.limits.follow_up_timeout == 0.005


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stages: []", r"stages: Tuple should have at least 1 item"),
        ("stages: [{name: a, path: '^/(x'}]", r"stages\[0\]\.path: not a valid regular expression"),
        (
            "stages: [{name: a, path: x}, {name: b, routes: [{path: '^/(?=b)'}]}]",
            r"stages\[1\]\.routes\[0\]\.path: not supported by the linear-time matcher .*rewrite without them",
        ),
        ("stages: [{name: a, path: '^/(a)\\1$'}]", r"stages\[0\]\.path: not supported by the linear-time matcher"),
        ("stages: [{name: a}]", r"stages\[0\]: needs path"),
        ("stages: [{name: a, path: x, colour: red}]", r"stages\[0\]\.colour: unknown key"),
        ("stages: [{name: a, path: x}, {name: a, path: y}]", r"stage names must be unique; 'a' appears twice"),
        (
            "stages: [{name: a, path: x}]\nlimits: {max_inflight: 0}",
            r"limits\.max_inflight: Input should be greater than or equal to 1",
        ),
        (
            "stages: [{name: a, routes: [{path: x, methods: [FETCH]}]}]",
            r"stages\[0\]\.routes\[0\]\.methods: unknown HTTP method 'FETCH'",
        ),
        (
            "stages: [{name: a, path: x}]\nclassifier: {mode: psychic}",
            r"classifier\.mode: Input should be 'explicit', 'learned', 'hidden' or 'auto'",
        ),
        (
            "stages: [{name: a, path: x, next: c}, {name: b, path: y}]",
            r"stage 'a': next must name another stage \(b\), got 'c'",
        ),
        ("stages: [{name: a, path: x, next: a}]", r"stage 'a': next must name another stage"),
        (
            "stages: [{name: a, path: x}]\nlimits: {follow_up_timeout: 0}",
            r"limits\.follow_up_timeout: Input should be greater than 0",
        ),
        ("stages: {", r"not valid YAML"),
        ("- 1", r"must be a mapping with a 'stages' list"),
    ],
)
def test_stages_errors_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SidecarInputError, match=message) as info:
        load_stages(_stages(tmp_path, text))
    assert "\n" not in str(info.value)


def test_explicit_classifier(h2_policy: Path) -> None:
    pol = load_policy(str(h2_policy), ("stage1", "stage2"))
    c = Classifier(ClassifierSettings(mode="explicit"), pol)
    assert c.start_phase(0, "r", b"2", None) == 1
    assert c.start_phase(0, "r", None, 1) == 1  # route rule
    assert c.start_phase(0, "r", None, None) == 0  # prior argmax (0.91)
    assert c.start_phase(0, "r", b"long", None) == 1  # the name of the phase with the longer mean
    with pytest.raises(BadPhaseHeader, match=r"X-Overtake-Phase: must name a phase of stage 1: 1\.\.2 or short, long"):
        c.start_phase(0, "r", b"3", None)
    blind = Classifier(ClassifierSettings(mode="explicit"), BaselinePolicy("pi(1)", 2))
    assert blind.start_phase(0, "r", b"9", None) == 0  # phase-blind policy: the phase is irrelevant
    with pytest.raises(BadPhaseHeader, match=r"must name a phase of stage 1: 1\.\.64 or short, long; got '0'"):
        blind.start_phase(0, "r", b"0", None)  # but it must still name a phase


def test_learned_classifier_follows_the_posterior(h2_policy: Path) -> None:
    pol = load_policy(str(h2_policy), ("stage1", "stage2"))
    c = Classifier(ClassifierSettings(mode="learned", time_unit=0.01, history=8), pol)
    # route "slow" always takes ~5 model units (50 ms), route "fast" ~0.3 units
    for _ in range(8):
        c.observe(0, "slow", 0.05)
        c.observe(0, "fast", 0.003)
    assert c.start_phase(0, "slow", None, None) == 1
    assert c.start_phase(0, "fast", None, None) == 0
    assert c.start_phase(0, "unseen", None, None) == 0
    # posterior by hand: log a_j + sum log(mu_j exp(-mu_j t))
    mu = 1 / np.array([0.55, 5.45])
    score = np.log([0.91, 0.09]) + 8 * (np.log(mu) - mu * 5.0)
    assert int(np.argmax(score)) == 1
    # the window forgets: 8 fast samples replace the slow history
    for _ in range(8):
        c.observe(0, "slow", 0.003)
    assert c.start_phase(0, "slow", None, None) == 0


def test_hidden_classifier_moves_to_the_slow_phase(h2_policy: Path) -> None:
    pol = load_policy(str(h2_policy), ("stage1", "stage2"))
    c = Classifier(ClassifierSettings(mode="hidden", time_unit=0.01), pol)
    assert c.start_phase(0, "r", b"2", None) == 0  # header ignored: prior
    # H2: P(phase 2 | S > a) = 0.09 e^{-a/5.45} / (0.91 e^{-a/0.55} + 0.09 e^{-a/5.45})
    # crosses 1/2 at a* = ln(0.91/0.09) / (1/0.55 - 1/5.45)
    a_star = np.log(0.91 / 0.09) / (1 / 0.55 - 1 / 5.45)
    assert c.current_phase(0, 0, 0.01 * a_star * 0.8) == 0
    assert c.current_phase(0, 0, 0.01 * a_star * 1.25) == 1
