"""StallRestart (mdp/anderson.py): the mixer's history is dropped exactly when the error has not
set a new best for more than ``patience`` steps, and the count starts again from that error.

Known answer by hand, patience 2: errors 5, 4, 4, 4, 4 — new bests at 5 and 4, then three steps
without one: the third (the fifth error) is one more than the patience, so one restart, there.
After it the best is that error (4): 3 is a new best, then 3, 3, 3 restart once more.
"""

from __future__ import annotations

import numpy as np

from overtake.mdp.anderson import AndersonMixer, StallRestart


class CountingMixer(AndersonMixer):
    def __init__(self) -> None:
        super().__init__(3, 2)
        self.resets = 0

    def reset(self) -> None:
        super().reset()
        self.resets += 1


def test_restarts_after_more_than_patience_steps_without_a_new_best() -> None:
    mixer = CountingMixer()
    stall = StallRestart(mixer, 2)
    at = []
    for k, err in enumerate([5.0, 4.0, 4.0, 4.0, 4.0, 3.0, 3.0, 3.0, 3.0]):
        before = mixer.resets
        stall.observe(err)
        if mixer.resets > before:
            at.append(k)
    assert at == [4, 8]
    assert (stall.best, stall.stale) == (3.0, 0)


def test_restart_forgets_the_best_and_drops_the_history() -> None:
    mixer = CountingMixer()
    stall = StallRestart(mixer, 1)
    stall.observe(1.0)
    x = np.zeros(3)
    mixer.step(x, np.ones(3))
    stall.restart()
    assert mixer.resets == 1 and stall.best == np.inf and stall.stale == 0
    # the next step is a plain fixed-point step: x + f
    assert np.array_equal(mixer.step(np.ones(3), np.full(3, 2.0)), np.full(3, 3.0))
