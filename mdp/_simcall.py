"""The simulator's event loop (:func:`overtake.mdp._simkernel.run_kernel`) and the overtaking
heuristic's decision over a block of states (:func:`overtake.mdp._heurkernel.decide_rows`), from an
ahead-of-time extension when there is a current one.

``python -m overtake.mdp._warmup`` (run at set-up) also compiles the event loop ahead of time into
the extension ``_sim_aot`` (numba.pycc, for this machine's CPU). Importing numba and loading the
cached loop from numba's cache costs each process that simulates (``overtake solve --cpu-priority
age``, ``overtake simulate``) more than a short simulation itself; the extension loads at once. The
heuristic's decision is in it too: an observation-policy solve (``phase_info`` none) starts from the
heuristic restricted to the observation, and would otherwise import numba for it alone. Either is
used only when it was built from the current sources (a digest recorded beside it) and for the
argument types it was built for (:data:`ARGS`, :data:`DECIDE_ARGS`); otherwise, or with
:data:`USE_AOT` False, the JIT kernel runs, from numba's cache. The two draw the same random numbers
(numba's own generator, seeded in the loop) and give the same results.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from overtake import aot

__all__ = ["ARGS", "DECIDE_ARGS", "aot_active", "build_aot", "decide_rows", "run_kernel", "source_digest"]

_HERE = Path(__file__).resolve().parent
#: the loop and the compiled functions it calls (the heuristic's decision, the capacity c(K))
_SOURCES = ("_simkernel.py", "_heurkernel.py", "model.py")
DIGEST_FILE = _HERE / "_sim_aot.sha256"
NAME = "run_kernel"

_I, _F, _IM, _FM = "i8[::1]", "f8[::1]", "i8[:, ::1]", "f8[:, ::1]"
#: run_kernel's argument types, in order (every scalar int64 or float64, every array C-contiguous)
ARGS: tuple[str, ...] = (
    "i8", "i8", "i8", "f8", "i8",  # n_total, n_warm, n_meas, lam, seed
    _I, _I, _FM, _F, _FM,  # coord_stage, stage_off, alpha_cum, mu, jump_cum
    "i8", _FM, _IM,  # svc_mode, work, label0
    "i8", "f8",  # cores, overhead
    "i8", "i8", "i8", _I,  # ptype, qmode, base_total, base_caps
    _I, _IM, _IM, "i8", "i8",  # tab_keys, tab_spawn, tab_ntab, tab_C, tab_kmax
    _F, _FM, _FM, _I, "i8",  # h_remaining, h_min_pair, h_wait, h_order, h_variant
    "i8",  # max_slots
    _F, _FM, _I, _F,  # lv_w, lv_thr, lv_start, lv_area
    _FM, _I, _FM,  # route_cum, route_q0, queue_alpha_cum
    _I,  # lock_cap
    _FM,  # start_cum
    _I, "i8", _F,  # read_stage, rd_lock, busy
)
RESULT = f"Tuple(({_F}, {_F}, {_F}, f8, f8, {_F}, f8, i8, b1, i8))"
DECIDE = "decide_rows"
#: decide_rows's argument types: state rows, remaining, min_pair, wait, order, coord_stage, variant,
#: cores, overhead, thread cap
DECIDE_ARGS: tuple[str, ...] = (_IM, _F, _FM, _FM, _I, _I, "i8", "i8", "f8", "i8")
DECIDE_RESULT = _IM
#: (position, dtype, ndim) of each array argument: the extension's unboxing checks neither dtype nor
#: layout (a float64 array passed for an int64 one would be read as int64), so :func:`run_kernel` does
_ARRAYS = aot.array_specs(ARGS)
_DECIDE_ARRAYS = aot.array_specs(DECIDE_ARGS)


def _scalars(types: tuple[str, ...]) -> tuple[tuple[int, tuple[type, ...]], ...]:
    return tuple((k, (float, np.floating) if t == "f8" else (int, np.integer)) for k, t in enumerate(types) if "[" not in t)


_SCALARS = _scalars(ARGS)
_DECIDE_SCALARS = _scalars(DECIDE_ARGS)


def source_digest() -> str:
    """sha256 of the loop's sources and its signature: what the extension must have been built from."""
    return aot.source_digest((_HERE / name for name in _SOURCES),
                             {NAME: (ARGS, RESULT), DECIDE: (DECIDE_ARGS, DECIDE_RESULT)})


def load_aot() -> ModuleType | None:
    return aot.load_current(f"{__package__}._sim_aot", DIGEST_FILE, source_digest())


_aot = load_aot()
#: set False to run the JIT kernel even where the extension would do (the tests compare both)
USE_AOT = True


def aot_active() -> bool:
    """True when calls go to the ahead-of-time extension."""
    return USE_AOT and _aot is not None


def _fits(args: tuple[Any, ...], types: tuple[str, ...] = ARGS, arrays: aot.ArraySpecs = _ARRAYS,
          scalars: tuple[tuple[int, tuple[type, ...]], ...] = _SCALARS) -> bool:
    if len(args) != len(types) or not aot.arrays_fit(args, arrays):
        return False
    # bool is an int in Python but not an int64 to numba; numpy scalars unbox like Python's
    return all(isinstance(args[k], kind) and not isinstance(args[k], bool) for k, kind in scalars)


def run_kernel(*args: Any) -> Any:
    """The event loop (:func:`overtake.mdp._simkernel.run_kernel`): the extension's, or the JIT kernel."""
    if USE_AOT and _aot is not None and _fits(args):
        return getattr(_aot, NAME)(*args)
    from ._simkernel import run_kernel as jit_kernel  # imports numba: only without the extension

    return jit_kernel(*args)


def decide_rows(*args: Any) -> Any:
    """The heuristic's decision for a block of states (:func:`overtake.mdp._heurkernel.decide_rows`):
    the extension's, or the JIT kernel."""
    if USE_AOT and _aot is not None and _fits(args, DECIDE_ARGS, _DECIDE_ARRAYS, _DECIDE_SCALARS):
        return getattr(_aot, DECIDE)(*args)
    from ._heurkernel import decide_rows as jit_kernel  # imports numba: only without the extension

    return jit_kernel(*args)


def build_aot(output_dir: Path = _HERE, cpu: str = "host") -> Path:
    """Compile the event loop and the heuristic's decision into ``_sim_aot`` (numba.pycc) and record the digest.

    ``cpu`` is LLVM's name of the processor to generate code for: ``host`` (this machine's, the
    fastest) or a baseline every machine of a package's architecture has, e.g. ``x86-64``.
    """
    from ._heurkernel import decide_rows as jit_decide
    from ._simkernel import run_kernel as jit_kernel

    exports = [(NAME, f"{RESULT}({', '.join(ARGS)})", jit_kernel.py_func),
               (DECIDE, f"{DECIDE_RESULT}({', '.join(DECIDE_ARGS)})", jit_decide.py_func)]
    return aot.compile_extension("_sim_aot", exports, output_dir, cpu, DIGEST_FILE, source_digest())
