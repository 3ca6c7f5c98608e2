"""numba's ``njit`` for the package's kernels, with an on-disk cache numba can always write.

numba keeps a compiled kernel beside its source (``__pycache__``) or, failing that, in the user's
cache directory (``$XDG_CACHE_HOME/numba`` or ``~/.cache/numba``). Where neither is writable (a
read-only install run by a service user whose home is not writable, as systemd's
``ProtectSystem=strict`` and ``ProtectHome=`` arrange) it refuses to define a kernel at all:
``cannot cache function ...: no locator available``. :func:`njit` checks both places before the
first kernel of a folder is defined and otherwise points numba at one it can write: the service's
cache directory (``$CACHE_DIRECTORY``, systemd's ``CacheDirectory=``), else a private folder of
this user under the temporary directory. A ``NUMBA_CACHE_DIR`` set by the user always wins.

Only the kernels that have no ahead-of-time build go through numba at run time: a solve with the
extension of :mod:`overtake.mdp._kernels` present imports no numba.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overtake.errors import OvertakeError

__all__ = ["CACHE_ENV", "cache_dir", "njit"]

#: numba's own setting; when set, numba caches every kernel there and this module stays out of the way
CACHE_ENV = "NUMBA_CACHE_DIR"

_decided: dict[Path, Path | None] = {}


def _writable(folder: Path) -> bool:
    """numba's own test of a cache folder: create it, then a temporary file in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def _user_wide() -> Path:
    # numba's user-wide cache folder on Linux (numba.misc.appdirs.user_cache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "numba"


def _private_tmp() -> Path:
    """A folder under the temporary directory that only this user can write.

    numba's cache files are pickles, loaded as code: a folder another user created or can write
    is never used (a fresh one is made instead).
    """
    folder = Path(tempfile.gettempdir()) / f"overtake-numba-{os.getuid()}"
    try:
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # ours from an earlier process, or planted: checked next
            pass
        st = folder.lstat()
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022 and _writable(folder):
            return folder
        return Path(tempfile.mkdtemp(prefix="overtake-numba-"))
    except OSError as exc:
        raise OvertakeError(f"no writable folder for numba's compiled kernels ({exc}); "
                            f"set {CACHE_ENV} to a folder this user can write") from None


def cache_dir(source_folder: Path) -> Path | None:
    """The folder numba should cache the kernels of ``source_folder`` in, or None where its own choice works.

    None when ``NUMBA_CACHE_DIR`` is set or numba can write beside the source or in the user's
    cache folder; otherwise ``$CACHE_DIRECTORY/numba`` when writable, else a private folder under
    the temporary directory.
    """
    if os.environ.get(CACHE_ENV) or _writable(source_folder / "__pycache__") or _writable(_user_wide()):
        return None
    service = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]  # systemd lists one per CacheDirectory=
    if service and _writable(Path(service) / "numba"):
        return Path(service) / "numba"
    return _private_tmp()


def _prepare(source_folder: Path) -> None:
    if source_folder in _decided:
        return
    folder = _decided[source_folder] = cache_dir(source_folder)
    if folder is not None:
        import numba

        # numba reads the variable when imported and again whenever a NUMBA_* variable changes
        os.environ[CACHE_ENV] = str(folder)
        vars(numba.config)["CACHE_DIR"] = str(folder)  # untyped for mypy (numba ships no stubs for config)


def njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(**options)``; with ``cache=True`` first makes sure numba has a cache folder it can write.

    The result is numba's dispatcher (untyped, as numba ships no stubs), called like the function.
    """

    def compile_(func: Callable[..., Any]) -> Any:
        import numba

        if options.get("cache"):
            _prepare(Path(func.__code__.co_filename).resolve().parent)
        return numba.njit(**options)(func)

    return compile_
