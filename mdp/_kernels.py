"""Compiled inner loops of the solver; the sources are the numba kernels of ``_kernels_jit.py`` and
``_observed_jit.py``.

``python -m overtake.mdp._warmup`` (run at set-up) also compiles them ahead of time into the
extension ``_kernels_aot`` (numba.pycc, for this machine's CPU). It loads at once, while importing
numba and initialising its JIT, even with every kernel in numba's cache, is a large part of the
start-up of each process that solves a large model (BENCHMARKS.md ``cli-table1``). The extension is used only when it was built
from the current sources (a digest recorded beside it) and for the argument types it
was built for (:data:`SIGNATURES`); otherwise the JIT kernels run, from numba's cache.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from overtake import aot

__all__ = ["SIGNATURES", "aot_active", "source_digest"]

_HERE = Path(__file__).resolve().parent
DIGEST_FILE = _HERE / "_kernels_aot.sha256"

_F = "f8[::1]"
_I = "i8[::1]"
_B = "b1[::1]"
_M = "f8[:, ::1]"
#: exported name -> (kernel, signature); the CSR kernels twice, for int32 and int64 sparse indices
SIGNATURES: dict[str, tuple[str, str]] = {
    "rank_rows": ("rank_rows", "b1(i8[:, ::1], i8[:, ::1], i8, i8[::1])"),
    "box_minimum": ("box_minimum", f"void({_F}, {_B}, {_I}, {_I}, f8, {_F}, {_I})"),
    "box_value": ("box_value", f"void({_F}, {_B}, {_I}, {_I}, {_F})"),
    "trim_longest": ("trim_longest", f"void(i8[:, ::1], {_I})"),
    "residual_stats": ("residual_stats", f"UniTuple(f8, 2)({_F}, {_F}, {_F})"),
    "anderson_history": ("anderson_history", f"void({_F}, {_F}, {_F}, {_F}, {_M}, {_M}, i8, i8, {_M})"),
    "anderson_mix": ("anderson_mix", f"void({_F}, {_F}, {_M}, {_F}, {_F})"),
    "anderson_gamma": ("anderson_gamma", f"b1({_M}, i8, {_M}, {_F})"),
}
SIGNATURES["chain_bfs"] = (
    "chain_bfs",
    f"i8({_I}, i8[:, ::1], {_I}, {_I}, i8[:, ::1], {_I}, {_I}, {_F}, i8[:, ::1], i8, i8, i8, {_I}, i8[:, ::1], {_M}, {_F}, {_F}, "
    f"b1, {_I}, {_I}, {_F}, b1, i8, {_I}, {_I}, i4[::1], i8[:, ::1], i8[:, ::1], i8, i8, {_I}, {_I}, {_I})")
SIGNATURES["transition_columns"] = (
    "transition_columns", f"i8({_I}, {_I}, {_F}, {_I}, {_I}, f8, i4[::1], i4[::1], {_F}, {_F})")
SIGNATURES["observed_bfs"] = (
    "observed_bfs",
    f"i8({_I}, i8[:, ::1], {_I}, {_I}, i8[:, ::1], {_I}, {_I}, {_F}, i8[:, ::1], i8, i8, i8, {_I}, i8[:, ::1], {_M}, {_F}, {_F}, "
    f"b1, {_I}, i8, {_I}, {_I}, i8[:, ::1], i8[:, ::1], {_F}, {_I}, i4[::1], i8[:, ::1], i8[:, ::1], i8, i8)")
for _ix in ("i4", "i8"):
    _X = f"{_ix}[::1]"
    SIGNATURES[f"bellman_residual_{_ix}"] = (
        "bellman_residual", f"UniTuple(f8, 2)({_X}, {_X}, {_F}, {_F}, {_F}, {_B}, {_I}, {_I}, {_F}, {_F}, {_F})")
    SIGNATURES[f"rvi_sweeps_{_ix}"] = (
        "rvi_sweeps", f"Tuple((i8, f8, f8, b1))({_X}, {_X}, {_F}, {_F}, {_F}, {_B}, {_I}, {_I}, i8, f8)")
    SIGNATURES[f"event_rows_{_ix}"] = (
        "event_rows", f"i8(i8[:, ::1], {_I}, i4[::1], i8[:, ::1], i8, {_I}, i8[:, ::1], {_M}, {_F}, {_F}, b1, f8, b1, "
                      f"{_X}, {_X}, {_F}, {_F})")
    SIGNATURES[f"reach_mark_{_ix}"] = ("reach_mark", f"i8({_X}, {_X}, {_F}, i8, {_B})")
    SIGNATURES[f"gauss_seidel_{_ix}"] = ("gauss_seidel", f"{_F}({_X}, {_X}, {_F}, {_F}, {_F}, i8)")


def source_digest() -> str:
    """sha256 of the kernels' source and their signatures: what the extension must have been built from."""
    return aot.source_digest((_HERE / "_kernels_jit.py", _HERE / "_observed_jit.py"), SIGNATURES)


def load_aot() -> ModuleType | None:
    return aot.load_current(f"{__package__}._kernels_aot", DIGEST_FILE, source_digest())


_aot = load_aot()
#: set False to run the JIT kernels even where the extension would do (the warm-up fills their cache)
USE_AOT = True


def aot_active() -> bool:
    """True when calls go to the ahead-of-time extension."""
    return USE_AOT and _aot is not None


def _jit(name: str) -> Any:
    from . import _kernels_jit, _observed_jit  # import numba: only without the extension

    return getattr(_observed_jit if name == "observed_bfs" else _kernels_jit, name)


def _call(name: str, args: tuple[Any, ...], index: np.ndarray | None = None) -> Any:
    if USE_AOT and _aot is not None:
        exported = name if index is None else f"{name}_{'i4' if index.dtype == np.int32 else 'i8'}"
        try:
            return getattr(_aot, exported)(*args)
        except (TypeError, ValueError):  # an argument outside the signature (dtype, layout): unboxing
            pass  # fails before the kernel runs, so nothing was written
    return _jit(name)(*args)


def box_minimum(*args: Any) -> Any:
    """G(y) = min of V over y's spawn box and its argmin (_kernels_jit.box_minimum)."""
    return _call("box_minimum", args)


def box_value(*args: Any) -> Any:
    return _call("box_value", args)


def bellman_residual(*args: Any) -> Any:
    """One Bellman step, and the residual (TV − TV(0)) − V; returns (min, max) of TV − V (_kernels_jit.bellman_residual)."""
    return _call("bellman_residual", args, args[0])


def residual_stats(*args: Any) -> Any:
    """f = (TV − TV(0)) − V and (min, max) of TV − V in one pass (_kernels_jit.residual_stats)."""
    return _call("residual_stats", args)


def rvi_sweeps(*args: Any) -> Any:
    return _call("rvi_sweeps", args, args[0])


def rank_rows(*args: Any) -> Any:
    return _call("rank_rows", args)


def trim_longest(*args: Any) -> Any:
    return _call("trim_longest", args)


def event_rows(*args: Any) -> Any:
    """A state space's event matrix in CSR, or its row lengths (_kernels_jit.event_rows)."""
    return _call("event_rows", args, args[13])


def reach_mark(*args: Any) -> Any:
    """Mark the states reachable from a start along positive entries (_kernels_jit.reach_mark)."""
    return _call("reach_mark", args, args[0])


def gauss_seidel(*args: Any) -> Any:
    return _call("gauss_seidel", args, args[0])


def anderson_history(*args: Any) -> Any:
    return _call("anderson_history", args)


def chain_bfs(*args: Any) -> Any:
    """Breadth-first search of a rule's chain (_kernels_jit.chain_bfs); returns its status."""
    return _call("chain_bfs", args)


def transition_columns(*args: Any) -> Any:
    """A search's transitions as P's columns and diagonal (_kernels_jit.transition_columns); returns the entries."""
    return _call("transition_columns", args)


def observed_bfs(*args: Any) -> Any:
    """Breadth-first search of an observation table's chain (_observed_jit.observed_bfs); returns its status."""
    return _call("observed_bfs", args)


def anderson_mix(*args: Any) -> Any:
    return _call("anderson_mix", args)


def anderson_gamma(*args: Any) -> Any:
    """The mixing coefficients of the normal equations; False when singular (_kernels_jit.anderson_gamma)."""
    return _call("anderson_gamma", args)


def build_aot(output_dir: Path = _HERE, cpu: str = "host") -> Path:
    """Compile every kernel into ``_kernels_aot`` (numba.pycc) and record the digest.

    ``cpu`` is LLVM's name of the processor to generate code for: ``host`` (this machine's, the
    fastest) or a baseline every machine of a package's architecture has, e.g. ``x86-64``.
    """
    exports = [(exported, sig, _jit(kernel).py_func) for exported, (kernel, sig) in SIGNATURES.items()]
    return aot.compile_extension("_kernels_aot", exports, output_dir, cpu, DIGEST_FILE, source_digest())
