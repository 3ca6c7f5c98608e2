"""A serialising resource in a stage (a database write lock): where its blocked threads sit in a state.

A locked stage i with capacity m_i lets at most m_i of its threads progress; a thread started
there while m_i hold the lock keeps its thread (it counts against the thread cap and as a request
in the system) but makes no progress and takes no share of the processor. When a holder leaves
the stage, one blocked thread takes the lock. Which one: a chain over counts cannot keep an
order, so each blocked thread is equally likely (random order of service). While blocked, a
thread's phase is drawn and never looked at, so given the counts every order of the blocked
threads is equally likely and FCFS (the simulator's, and a database's) picks phase d with the same
probability b_d / B: the counts evolve alike, and with them E[W] (Little's law).

A state row of a chain on a model with locks is ``(w, k, b)``: after the waiting counts ``w`` and
the progressing threads ``k`` per coordinate, one column per coordinate of a locked stage with its
blocked threads (its *twin*). Decision rules see ``fold(rows)``: ``(w, k + b)``, the threads per
coordinate whatever they wait for, which is what a sidecar or Apache counts. The MDP's own state
space has no twins: its policies start a thread in a locked stage only while the lock has room
(:class:`~overtake.mdp.statespace.StateSpace`), which loses nothing: a blocked thread only holds a
thread; the same request kept waiting can be started at the lock's release (an event, hence a
decision epoch), and its phase stays the policy's to choose.

>>> import numpy as np
>>> from overtake.mdp import Stage, TandemModel
>>> exp = Stage("preview", np.array([1.0]), np.array([[-1.0]]))
>>> lk = Locks.build(TandemModel(0.5, (exp, exp), locks=(1, None)), n_queues=2)
>>> rows = np.array([[0, 0, 1, 0, 0]])          # one thread holds stage 1's lock
>>> lk.place(rows, 0, np.array([2]))             # two more started there: both blocked
>>> rows.tolist(), lk.fold(rows).tolist(), lk.within(rows).tolist()
([[0, 0, 1, 0, 2]], [[0, 0, 3, 0]], [True])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .errors import ModelError
from .model import TandemModel

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

__all__ = ["Locks"]


@dataclass(frozen=True, eq=False)
class Locks:
    """The columns of a model's locks in state rows with ``n_queues`` waiting counts first."""

    n_queues: int
    n_coords: int
    #: coordinate of each twin column (coordinates of locked stages, in order)
    twin_coord: IntArray
    #: per coordinate, its twin's index (−1: the stage has no lock)
    coord_twin: IntArray
    #: per coordinate, the coordinates of its stage (a view used to count the lock's holders)
    stage_coords: tuple[IntArray, ...]
    #: per coordinate, the lock capacity of its stage (0: no lock)
    coord_cap: IntArray

    @staticmethod
    def build(model: TandemModel, n_queues: int) -> Locks:
        if model.has_readers:
            # a pending commit and the readers it blocks are states a chain over these columns
            # does not hold: only the simulator models them
            raise ModelError("readers: the exact chains do not model a lock's readers (a commit waiting for them); "
                             "evaluate the model with overtake.mdp.simulate, or drop readers")
        cs = model.coord_stage()
        cap = np.array([model.lock_of(int(i)) or 0 for i in cs], dtype=np.int64)
        twin_coord = np.flatnonzero(cap > 0).astype(np.int64)
        coord_twin = np.full(model.n_coords, -1, dtype=np.int64)
        coord_twin[twin_coord] = np.arange(twin_coord.size)
        stage_coords = tuple(np.flatnonzero(cs == cs[d]).astype(np.int64) for d in range(model.n_coords))
        return Locks(n_queues, model.n_coords, twin_coord, coord_twin, stage_coords, cap)

    @property
    def n_twins(self) -> int:
        return int(self.twin_coord.size)

    def twin_col(self, d: int) -> int:
        """The column of coordinate ``d``'s blocked threads (``d`` in a locked stage)."""
        return self.n_queues + self.n_coords + int(self.coord_twin[d])

    def holders(self, rows: IntArray, d: int) -> IntArray:
        """Threads progressing in coordinate ``d``'s stage (the lock's holders, where it has one)."""
        cols = self.n_queues + self.stage_coords[d]
        out: IntArray = rows[:, cols].sum(axis=1)
        return out

    def place(self, rows: IntArray, d: int, n: IntArray) -> None:
        """Start ``n`` threads (per row) in coordinate ``d``, in place: progressing while the stage's
        lock has room, blocked (its twin) beyond."""
        col = self.n_queues + d
        if self.coord_twin[d] < 0:
            rows[:, col] += n
            return
        run = np.minimum(n, np.maximum(self.coord_cap[d] - self.holders(rows, d), 0))
        rows[:, col] += run
        rows[:, self.twin_col(d)] += n - run

    def fold(self, rows: IntArray) -> IntArray:
        """``(w, k + b)``: blocked threads counted in their coordinate, as rules see a state."""
        QD = self.n_queues + self.n_coords
        if rows.shape[1] == QD:
            return rows
        out: IntArray = rows[:, :QD].copy()
        out[:, self.n_queues + self.twin_coord] += rows[:, QD:]
        return out

    def within(self, rows: IntArray) -> BoolArray:
        """Rows whose progressing threads respect every lock's capacity."""
        ok: BoolArray = np.ones(rows.shape[0], dtype=bool)
        firsts = {int(self.stage_coords[d][0]) for d in self.twin_coord}  # one coordinate per locked stage
        for d in sorted(firsts):
            ok &= self.holders(rows, d) <= self.coord_cap[d]
        return ok
