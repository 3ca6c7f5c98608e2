"""The policy artifact: round trip, O(1) lookup, states beyond the truncation, corrupt files."""

from __future__ import annotations

import numpy as np
import pytest

from overtake.mdp.average_cost import policy_iteration
from overtake.mdp.errors import PolicyFileError
from overtake.mdp.policy import Policy
from overtake.mdp.statespace import StateSpace, Truncation


@pytest.fixture
def solved(case4):
    space = StateSpace(case4, Truncation(6, 3))
    res = policy_iteration(space)
    return space, res, Policy.from_decision(space, res.decision, {"note": "test"})


def test_round_trip_and_lookup(solved, tmp_path):
    space, res, pol = solved
    path = tmp_path / "p.npz"
    pol.save(path)
    back = Policy.load(path)
    assert back.digest() == pol.digest()
    for s in range(0, space.size, 11):
        row = space.rows[s]
        post = space.rows[res.decision[s]]
        expect = row[: space.Q] - post[: space.Q]
        np.testing.assert_array_equal(back.action(row), expect)


def test_beyond_truncation_answer_is_defined(solved):
    space, _, pol = solved
    Q = space.Q
    big = np.zeros(Q + space.D, dtype=np.int64)
    big[0] = 50  # far more waiting requests than the cap
    big[Q + 3] = 1
    a = pol.action(big)
    assert a.shape == (Q,) and np.all(a >= 0) and np.all(a <= big[:Q])
    # projection: 50 waiting in queue 0 → cap − 1 waiting there
    proj = big.copy()
    proj[0] = space.cap - 1
    np.testing.assert_array_equal(a, pol.action(proj))
    many_threads = np.zeros_like(big)
    many_threads[Q:] = 2
    many_threads[:Q] = 1
    assert pol.action(many_threads).sum() == 0  # more threads than the policy ever runs: start none


def test_corrupt_or_edited_files_are_refused(solved, tmp_path):
    _, _, pol = solved
    path = tmp_path / "p.npz"
    pol.save(path)
    raw = bytearray(path.read_bytes())
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(PolicyFileError, match="not an overtake policy"):
        Policy.load(tmp_path / "junk.npz")
    raw[len(raw) // 2] ^= 0xFF
    (tmp_path / "bad.npz").write_bytes(bytes(raw))
    with pytest.raises(PolicyFileError):
        Policy.load(tmp_path / "bad.npz")
    pol.spawn[0, 0] += 1  # an edited table no longer matches its hash
    pol.save(tmp_path / "edited.npz")
    z = dict(np.load(tmp_path / "edited.npz"))
    z["spawn"][0, 0] -= 1
    np.savez(tmp_path / "edited2.npz", **z)
    with pytest.raises(PolicyFileError, match="hash"):
        Policy.load(tmp_path / "edited2.npz")


def test_truncated_policy_file_is_refused_without_leaking_a_handle(case4, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A half-written artifact (e.g. a copy cut short) is a clear PolicyFileError; under
    filterwarnings=error a leaked file handle would surface as a ResourceWarning."""
    import gc

    space = StateSpace(case4, Truncation(4, 2))
    res = policy_iteration(space)
    path = tmp_path / "p.npz"
    Policy.from_decision(space, res.decision).save(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(PolicyFileError, match="not an overtake policy file"):
        Policy.load(cut)
    gc.collect()


def test_scalar_rank_equals_vector_rank_and_action_equals_actions(case4) -> None:  # type: ignore[no-untyped-def]
    """Policy.action ranks one state in plain Python (the sidecar and the API call it per
    request); it must agree with the vectorised rank and with Policy.actions everywhere,
    including states beyond the truncation (projected) and above the thread cap."""
    from overtake.mdp.statespace import Ranker

    rng = np.random.default_rng(3)
    rk = Ranker(8, 12)
    rows = rng.integers(0, 4, size=(3000, 8))
    rows = rows[rows.sum(axis=1) <= 12]
    assert [rk.rank_one(r.tolist()) for r in rows] == rk.rank(rows).tolist()
    space = StateSpace(case4, Truncation(6, 3))
    pol = Policy.from_decision(space, policy_iteration(space).decision)
    states = rng.integers(0, 5, size=(500, 8))  # many lie beyond C = 6 or K = 3
    want = pol.actions(states)
    assert all(np.array_equal(pol.action(s), w) for s, w in zip(states, want))
