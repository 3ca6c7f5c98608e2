"""Compile every numba kernel of overtake.mdp once, into numba's on-disk cache, and ahead of time.

    python -m overtake.mdp._warmup

Run by the Makefile when the virtual environment is set up (and again when a kernel's source
changes), so the first solve of a fresh install loads machine code instead of compiling it.
It then builds the solver kernels' extension ``_kernels_aot`` and the simulator's ``_sim_aot``
(numba.pycc, needs a C compiler) unless the ones present are current: with them a solve, and the
simulations of an age-priority prediction, import no numba at all (:mod:`overtake.mdp._kernels`,
:mod:`overtake.mdp._simcall`). Each kernel is reached through the
code that calls it in production, on a model just large enough to take the compiled paths, so
the cached signatures are the real ones (int32 sparse indices, int64 state indices, float64 values).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .model import TandemModel

__all__ = ["build_extension", "kernel_cache_misses", "warm_up"]


def _model() -> TandemModel:
    from .model import Stage, TandemModel

    def h2(name: str) -> Stage:
        return Stage(name, np.array([0.91, 0.09]), np.diag([-1 / 0.55, -1 / 5.45]))

    return TandemModel(0.3, (h2("s1"), h2("s2")))


def warm_up() -> float:
    """Call every JIT kernel once; returns the seconds it took (compiling or loading)."""
    t0 = time.perf_counter()
    from . import _kernels, _simcall

    use_aot, _kernels.USE_AOT = _kernels.USE_AOT, False  # the JIT versions, whose cache this fills
    sim_aot, _simcall.USE_AOT = _simcall.USE_AOT, False
    try:
        _calls(_kernels)
    finally:
        _kernels.USE_AOT = use_aot
        _simcall.USE_AOT = sim_aot
    return time.perf_counter() - t0


def build_extension(cpu: str = "host") -> str:
    """Build ``_kernels_aot`` and ``_sim_aot`` for ``cpu`` unless the ones present were built from the
    current kernels; says what it did."""
    from . import _kernels, _simcall

    return "; ".join(_build_one(what, module, cpu) for what, module in
                     (("ahead-of-time kernels", _kernels), ("ahead-of-time simulator", _simcall)))


def _build_one(what: str, module: Any, cpu: str) -> str:
    try:
        if module.DIGEST_FILE.read_text().strip() == module.source_digest() and module.load_aot() is not None:
            return f"{what} current"
    except OSError:
        pass
    t0 = time.perf_counter()
    try:
        module.build_aot(cpu=cpu)
    except Exception as exc:  # no C compiler, read-only install: the JIT kernels (cached) still run
        return f"{what} not built ({type(exc).__name__}: {exc}); the JIT kernels will run"
    return f"{what} built ({time.perf_counter() - t0:.1f} s)"


def _calls(_kernels: Any) -> None:
    from .average_cost import anderson_rvi, induced_matrix, relative_value_iteration
    from .bellman import KERNEL_MIN_STATES, ActionIndex
    from .evaluate import stationary_distribution
    from .heuristic import overtaking_heuristic
    from .simulation import simulate
    from .statespace import Layout, StateSpace, Truncation

    model = _model()
    space = StateSpace(model, Truncation(8, 3))  # 6,435 states: above every kernel threshold
    assert space.size >= KERNEL_MIN_STATES
    space.ranker.rank(space.rows)
    space.compiled_event_matrix(force=True)
    ActionIndex(space).box_minimum(np.zeros(space.size))
    relative_value_iteration(space, max_iter=2)
    res = anderson_rvi(space, max_iter=3)  # the second step on mixes (anderson.py kernels)
    P = induced_matrix(space, res.decision).tocsc()
    x = np.ones(space.size)
    _kernels.gauss_seidel(P.indptr, P.indices, P.data, P.diagonal(), x, 1)
    _kernels.trim_longest(np.ones((1, 2), dtype=np.int64), np.ones(1, dtype=np.int64))
    stationary_distribution(induced_matrix(space, res.decision))
    from .baselines import Baseline
    from .chain import build_chain
    from .policy import Policy

    pol = Policy.from_decision(space, res.decision)
    build_chain(model, space.layout, pol.actions, max_requests=10, max_threads=3, compiled=True)
    start = Layout.build(model, "start")
    build_chain(model, start, Baseline.parse("pi(2)", 2).rule(start.queue_stage, model.coord_stage()), max_requests=10,
                max_threads=2, compiled=True)
    from .observation import ObservationSpace
    from .observed_chain import observed_chain

    none = Layout.build(model, "none")
    osp = ObservationSpace(model, Truncation(5), none)
    observed_chain(model, none, osp.policy(osp.table(lambda o: o[:, :osp.Q])).actions, max_requests=8, compiled=True)
    overtaking_heuristic(model).actions(space.rows[:10])
    simulate(model, "pi(1)", requests=1000, seed=0)


def kernel_cache_misses() -> int:
    """Compilations (cache misses) so far of this package's solver kernels in this process."""
    from . import _kernels_jit as _kernels
    from . import _observed_jit

    total: int = sum(_observed_jit.observed_bfs.stats.cache_misses.values())
    for name in ("box_minimum", "box_value", "rvi_sweeps", "bellman_residual", "residual_stats", "rank_rows",
                 "gauss_seidel", "anderson_history", "anderson_mix", "trim_longest", "chain_bfs", "reach_mark", "event_rows",
                 "transition_columns"):
        total += sum(getattr(_kernels, name).stats.cache_misses.values())
    return total


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m overtake.mdp._warmup", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", default="host",
                        help="processor the ahead-of-time kernels are built for (LLVM's name): host (default) or, "
                             "for a package other machines install, a baseline such as x86-64")
    parser.add_argument("--aot-only", action="store_true",
                        help="build the extension only; leave numba's cache alone (a package's read-only tree)")
    args = parser.parse_args(argv)
    if args.aot_only:
        print(f"overtake.mdp: {build_extension(args.cpu)}", file=sys.stderr)
        return 0
    seconds = warm_up()
    print(f"overtake.mdp kernels ready ({seconds:.1f} s); {build_extension(args.cpu)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
