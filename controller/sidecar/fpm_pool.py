"""PHP-FPM's pool against the policy's cap: admission that reaches the pool, or a queue behind it.

Behind ``proxy_fcgi`` the Apache worker that forwards a request to PHP-FPM counts as running in
its stage until FPM has answered; so the count table of module mode (and the sidecar's limiter)
is admission against FPM's pool, *if* the pool has a worker for every request the policy lets
run. FPM's ``pm.max_children`` caps its workers; what arrives beyond them waits in the pool's
listen queue, first come first served, where no policy orders it. :func:`pool_size` reads the
field from the pool's configuration (``fpm_pool_config``), :func:`pool_warning` says when the
policy's total cap exceeds it.
"""

from __future__ import annotations

import configparser
import glob
from pathlib import Path
from typing import Any

from overtake.controller.errors import SidecarInputError

__all__ = ["pool_size", "pool_warning", "total_cap"]


def _read(path: Path, seen: set[Path]) -> list[tuple[str, dict[str, str]]]:
    """The sections of ``path`` and of the files its ``include`` lines name, in order."""
    if path in seen:
        return []
    seen.add(path)
    parser = configparser.RawConfigParser(strict=False, interpolation=None, inline_comment_prefixes=(";",))
    try:
        text = path.read_text()
    except OSError as exc:
        raise SidecarInputError(f"fpm_pool_config: cannot read {path} ({exc.strerror}); give the PHP-FPM pool file "
                                "Apache forwards the stages to (e.g. /etc/php/8.2/fpm/pool.d/www.conf)") from None
    try:
        parser.read_string("[global]\n" + text if not text.lstrip().startswith("[") else text, str(path))
    except configparser.Error as exc:
        raise SidecarInputError(f"fpm_pool_config: {path} is not a PHP-FPM configuration ({exc.message})") from None
    out: list[tuple[str, dict[str, str]]] = []
    for name in parser.sections():
        items = dict(parser.items(name))
        out.append((name, items))
        include = items.get("include")
        if include:
            where = Path(include) if Path(include).is_absolute() else path.parent / include
            for f in sorted(glob.glob(str(where))):
                out += _read(Path(f), seen)
    return out


def pool_size(path: str | Path) -> tuple[str, int]:
    """The pool defined in ``path`` (a pool file, or php-fpm.conf with its ``include``) and its
    ``pm.max_children``.

    Raises
    ------
    SidecarInputError
        Unreadable, no pool, several pools, or a pool without a positive ``pm.max_children``,
        each naming ``fpm_pool_config`` and the fix.
    """
    pools = [(n, s) for n, s in _read(Path(path), set()) if n != "global"]
    if not pools:
        raise SidecarInputError(f"fpm_pool_config: {path} defines no pool ([name] section); give the pool file "
                                "Apache forwards the stages to")
    if len(pools) > 1:
        raise SidecarInputError(f"fpm_pool_config: {path} defines the pools {', '.join(n for n, _ in pools)}; give "
                                "the file of the one pool Apache forwards the stages to")
    name, settings = pools[0]
    raw = settings.get("pm.max_children", "").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise SidecarInputError(f"fpm_pool_config: pool [{name}] in {path} has pm.max_children = {raw or '(unset)'}; "
                                "PHP-FPM needs a positive integer there")
    return name, int(raw)


def total_cap(policy: Any) -> int | None:
    """The most requests ``policy`` lets run at once, all stages together (None: no cap, π(∞)).
    A policy set answers for its chosen member."""
    chosen = getattr(policy, "chosen", policy)
    inner = getattr(chosen, "policy", None)
    if inner is not None and hasattr(inner, "max_threads"):
        return int(inner.max_threads)
    base = getattr(chosen, "baseline", None)
    if base is None or getattr(chosen, "unlimited", False):
        return None
    if base.total is not None:
        return int(base.total)
    return int(sum(base.per_stage)) if base.per_stage is not None else None


def pool_warning(policy: Any, pool: str, max_children: int) -> str | None:
    """What to tell the operator when ``policy`` may run more requests than the pool has
    workers (None: the pool holds them all, so FPM's own queue stays empty)."""
    cap = total_cap(policy)
    if cap is None or cap <= max_children:
        return None
    return (f"pm.max_children = {max_children} in PHP-FPM pool [{pool}] is below the {cap} requests policy "
            f"{getattr(policy, 'name', '?')} lets run at once: the other {cap - max_children} wait in FPM's "
            f"first-come-first-served queue, out of the policy's order; raise pm.max_children to {cap} (or solve "
            f"with max_threads {max_children})")
