"""The fitting's compiled kernels, from an ahead-of-time extension when there is a current one.

The sources are the numba kernels of :mod:`overtake.fitting._uniformization` and
:mod:`overtake.fitting._hypererlang`. ``python -m overtake.fitting._kernels`` (run at set-up) compiles
them ahead of time into the extension ``_fitting_aot`` (numba.pycc, for this machine's CPU). Loading
numba and its cached kernels costs a fit more CPU than the EM itself on ten thousand samples, and
pulls in scipy.linalg; the extension loads at once. It is used only when it was built from the
current kernel sources (a digest recorded beside it) and for the argument types it was built for
(:data:`SIGNATURES`); otherwise, or with :data:`USE_AOT` False, the JIT kernels run, from numba's cache.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from overtake import aot

from ._poisson import EM_POISSON_EPS, MAX_STEP, POISSON_EPS

__all__ = ["EM_POISSON_EPS", "MAX_STEP", "POISSON_EPS", "SIGNATURES", "aot_active", "backward", "backward_chain",
           "build_aot", "forward", "forward_chain", "her_em", "source_digest"]

_HERE = Path(__file__).resolve().parent
_SOURCES = ("_uniformization.py", "_hypererlang.py", "_poisson.py")
DIGEST_FILE = _HERE / "_fitting_aot.sha256"

_F, _I, _M = "f8[::1]", "i8[::1]", "f8[:, ::1]"
#: exported name -> (module, kernel, result type, argument types)
SIGNATURES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "forward": ("_uniformization", "forward", f"Tuple(({_M}, {_F}, {_F}))",
                (_F, _F, _I, _I, _F, _F, "f8", _F, "b1", "f8")),
    "backward": ("_uniformization", "backward", f"UniTuple({_F}, 3)",
                 (_F, _F, _I, _I, _F, _F, "f8", _F, _M, _F, _F, _F, "f8")),
    "forward_chain": ("_uniformization", "forward_chain", f"Tuple(({_M}, {_F}))", (_F, _F, _F, "f8", _F, "f8", "f8")),
    "backward_chain": ("_uniformization", "backward_chain", f"UniTuple({_F}, 3)",
                       (_F, _F, _F, _F, "f8", _F, _M, _F, _F, _F, "f8", "f8")),
    "her_em": ("_hypererlang", "her_em", f"Tuple(({_F}, i8, b1))", (_F, _F, _F, _F, _F, "i8", "f8")),
}
#: the arrays each kernel takes: (position, dtype, ndim). The extension's unboxing checks neither dtype
#: nor layout (a float64 array passed for an int64 one is read as int64), so the dispatcher does.
_ARRAYS: dict[str, aot.ArraySpecs] = {name: aot.array_specs(args) for name, (_, _, _, args) in SIGNATURES.items()}


def _signature(name: str) -> str:
    _, _, result, args = SIGNATURES[name]
    return f"{result}({', '.join(args)})"


def source_digest() -> str:
    """sha256 of the kernels' sources and their signatures: what the extension must have been built from."""
    return aot.source_digest((_HERE / name for name in _SOURCES), SIGNATURES)


def load_aot() -> ModuleType | None:
    return aot.load_current(f"{__package__}._fitting_aot", DIGEST_FILE, source_digest())


_aot = load_aot()
#: set False to run the JIT kernels even where the extension would do (the tests compare both)
USE_AOT = True


def aot_active() -> bool:
    """True when calls go to the ahead-of-time extension."""
    return USE_AOT and _aot is not None


def _fits(name: str, args: tuple[Any, ...]) -> bool:
    return aot.arrays_fit(args, _ARRAYS[name])


def _call(name: str, args: tuple[Any, ...]) -> Any:
    if USE_AOT and _aot is not None and _fits(name, args):
        return getattr(_aot, name)(*args)
    module, kernel, _, _ = SIGNATURES[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), kernel)(*args)


def forward(*args: Any) -> Any:
    """Normalised forward vectors over the grid (_uniformization.forward)."""
    return _call("forward", args)


def backward(*args: Any) -> Any:
    """E-step sums over the grid (_uniformization.backward)."""
    return _call("backward", args)


def forward_chain(*args: Any) -> Any:
    """:func:`forward` for a bidiagonal T (_uniformization.forward_chain)."""
    return _call("forward_chain", args)


def backward_chain(*args: Any) -> Any:
    """:func:`backward` for a bidiagonal T (_uniformization.backward_chain)."""
    return _call("backward_chain", args)


def her_em(*args: Any) -> Any:
    """Closed-form hyper-Erlang EM, in place on its ``pi, lam`` (_hypererlang.her_em)."""
    return _call("her_em", args)


def _caller(kernel: Any, n_args: int) -> Any:
    """A function that calls the numba dispatcher ``kernel``: exported, it compiles the kernel with the
    kernel's own options (fastmath for the chain kernels), which exporting its Python source would drop."""
    names = ", ".join(f"a{k}" for k in range(n_args))
    scope: dict[str, Any] = {"kernel": kernel}
    exec(f"def call({names}):\n    return kernel({names})\n", scope)  # numba needs a fixed arity
    return scope["call"]


def build_aot(output_dir: Path = _HERE, cpu: str = "host") -> Path:
    """Compile every kernel into ``_fitting_aot`` (numba.pycc) and record the digest.

    ``cpu`` is LLVM's name of the processor to generate code for: ``host`` (this machine's, the
    fastest) or a baseline every machine of a package's architecture has, e.g. ``x86-64``.
    """
    exports = [(exported, _signature(exported),
                _caller(getattr(importlib.import_module(f"{__package__}.{module}"), kernel), len(args)))
               for exported, (module, kernel, _, args) in SIGNATURES.items()]
    return aot.compile_extension("_fitting_aot", exports, output_dir, cpu, DIGEST_FILE, source_digest())


def main() -> int:
    """Build the extension unless the one present is current; say what was done."""
    if _aot is not None:
        print("fitting: ahead-of-time kernels current")
        return 0
    try:
        build_aot()
    except Exception as exc:  # no C compiler, read-only install: the JIT kernels (cached) still run
        print(f"fitting: ahead-of-time kernels not built ({type(exc).__name__}: {exc}); the JIT kernels will run")
        return 0
    print("fitting: ahead-of-time kernels built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
