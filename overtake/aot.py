"""Ahead-of-time kernel extensions (numba.pycc) shared by :mod:`overtake.mdp._kernels` and
:mod:`overtake.fitting._kernels`: the digest an extension must have been built from, loading it
only when current, and compiling it.

An extension is used only when the digest recorded beside it matches the kernels' sources and
signatures now: a stale build would run old code.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["ArraySpecs", "array_specs", "arrays_fit", "compile_extension", "load_current", "source_digest"]

#: (position, dtype, ndim) of each array argument of a kernel
ArraySpecs = tuple[tuple[int, "np.dtype[Any]", int], ...]


def array_specs(types: Iterable[str]) -> ArraySpecs:
    """The array arguments among a signature's numba types (``f8[::1]``, ``i8[:, ::1]``, scalars)."""
    return tuple((k, np.dtype(np.float64 if t.startswith("f8") else np.int64), t.count(",") + 1)
                 for k, t in enumerate(types) if "[" in t)


def arrays_fit(args: tuple[Any, ...], specs: ArraySpecs) -> bool:
    """Whether every array argument has the dtype, dimensions and C layout the extension was built
    for. Its unboxing checks none of them (a float64 array passed for an int64 one is read as
    int64), so the dispatcher must, and falls back to the JIT kernel otherwise."""
    for k, dtype, ndim in specs:
        a = args[k]
        if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == ndim and a.flags.c_contiguous):
            return False
    return True


def source_digest(sources: Iterable[Path], signatures: Mapping[str, Any]) -> str:
    """sha256 of the kernels' source files and their exported signatures."""
    h = hashlib.sha256()
    for path in sources:
        h.update(path.read_bytes())
    h.update(repr(sorted(signatures.items())).encode())
    return h.hexdigest()


def load_current(module: str, digest_file: Path, digest: str) -> ModuleType | None:
    """The extension ``module`` when ``digest_file`` records ``digest``; None when absent or stale."""
    try:
        if digest_file.read_text().strip() != digest:
            return None  # built from other kernels: stale
        return importlib.import_module(module)
    except (OSError, ImportError):
        return None


def compile_extension(name: str, exports: Iterable[tuple[str, str, Callable[..., Any]]], output_dir: Path,
                      cpu: str, digest_file: Path, digest: str) -> Path:
    """Compile ``exports`` (exported name, numba signature, Python function) into the extension
    ``name`` in ``output_dir`` for LLVM processor ``cpu`` (``host``, or a baseline such as
    ``x86-64`` for a package), and record ``digest`` in ``output_dir / digest_file.name``."""
    import numba.pycc

    make_cc: Any = vars(numba.pycc)["CC"]  # untyped, and not re-exported for mypy (numba ships no stubs)
    cc = make_cc(name)
    cc.output_dir = str(output_dir)
    cc.target_cpu = cpu
    cc.verbose = False
    for exported, sig, func in exports:
        cc.export(exported, sig)(func)
    cc.compile()
    (output_dir / digest_file.name).write_text(digest + "\n")
    return output_dir
