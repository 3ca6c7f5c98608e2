"""What :func:`~.lifecycle.start` needs before Apache runs.

The Debian packages (``apache2``, mod_lua, ``liblua5.3-dev``, ``gcc``), a worker account that
can reach the work directory, and the work directory's files: the stage handler, the static
files and ``tcpu.so``, the thread CPU clock for Lua (Lua's ``os.clock()`` is process-wide, so
under mpm_event it counts every concurrent request).
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
from pathlib import Path

from overtake.controller.errors import ApacheInputError, ApacheNotInstalledError
from overtake.controller.harness.apache.config import APACHE_BIN, LUA_INCLUDE_DIR, MODULES_DIR

__all__ = ["INSTALL_HINT", "check_installed", "check_run_user", "compile_tcpu", "install_tree"]

INSTALL_HINT = (
    "install it with `make demo` (runs apache-conf/install-debian-packages.sh) "
    "or `apt-get install apache2 liblua5.3-dev gcc`"
)


def check_installed() -> None:
    """Raise :class:`ApacheNotInstalledError` naming the first missing package and how to install it."""
    if not os.access(APACHE_BIN, os.X_OK):
        raise ApacheNotInstalledError(f"apache2: {APACHE_BIN} not found; {INSTALL_HINT}")
    for mod in ("mod_mpm_event.so", "mod_lua.so", "mod_status.so"):
        if not os.path.exists(os.path.join(MODULES_DIR, mod)):
            raise ApacheNotInstalledError(
                f"apache2: {MODULES_DIR}/{mod} not found (package apache2-bin); {INSTALL_HINT}"
            )
    if shutil.which("gcc") is None:
        raise ApacheNotInstalledError(
            f"gcc: not found (needed to build the thread CPU clock module); {INSTALL_HINT}"
        )
    if not os.path.exists(os.path.join(LUA_INCLUDE_DIR, "lua.h")):
        raise ApacheNotInstalledError(
            f"liblua5.3-dev: {LUA_INCLUDE_DIR}/lua.h not found; {INSTALL_HINT}"
        )


def _searchable_by(path: Path, uid: int, gids: set[int]) -> Path | None:
    """Return the first ancestor of ``path`` that ``uid`` cannot traverse, else None."""
    for d in [*reversed(path.parents), path]:
        st = os.stat(d)
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid in gids:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return d
    return None


def check_run_user(workdir: Path, run_user: str) -> None:
    """As root: ``run_user`` exists and can traverse every ancestor of ``workdir``."""
    if os.geteuid() != 0:
        return  # Apache ignores User/Group and runs workers as us.
    try:
        pw = pwd.getpwnam(run_user)
    except KeyError:
        raise ApacheInputError(
            f"run_user: no account {run_user!r} (Apache's workers cannot run as root); "
            "create it or pass another run_user"
        ) from None
    gids = set(os.getgrouplist(run_user, pw.pw_gid))
    blocked = _searchable_by(workdir, pw.pw_uid, gids)
    if blocked is not None:
        raise ApacheInputError(
            f"workdir: {workdir} is not reachable by the worker user {run_user!r}: "
            f"{blocked} has mode {stat.S_IMODE(os.stat(blocked).st_mode):04o}; it must read "
            f"WORKDIR/lua at request time. Use a workdir under a world-searchable directory "
            f"(e.g. /tmp/overtake-apache) or `chmod o+x {blocked}`"
        )


def compile_tcpu(conf: Path, luac_dir: Path) -> Path:
    """Build ``luac_dir/tcpu.so`` from ``conf/lua/tcpu.c`` unless it is newer than the source."""
    src = conf / "lua" / "tcpu.c"
    out = luac_dir / "tcpu.so"
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    tmp = luac_dir / f".tcpu.{os.getpid()}.so"
    cmd = ["gcc", "-O2", "-Wall", "-shared", "-fPIC", f"-I{LUA_INCLUDE_DIR}", "-o", str(tmp), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ApacheNotInstalledError(
            f"tcpu: compiling {src} failed (rc {proc.returncode}): {proc.stderr.strip()}; "
            f"check gcc and liblua5.3-dev: {INSTALL_HINT}"
        )
    tmp.chmod(0o755)
    os.replace(tmp, out)  # atomic: a running Apache never sees a half-written module
    return out


def install_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` into ``dst`` with world-readable modes (workers run as www-data)."""
    dst.mkdir(parents=True, exist_ok=True)
    dst.chmod(0o755)
    for item in src.iterdir():
        target = dst / item.name
        if item.is_dir():
            install_tree(item, target)
        else:
            shutil.copyfile(item, target)
            target.chmod(0o644)
