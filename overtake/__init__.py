"""Overtake: optimal thread-spawn policies for multi-stage web servers, and uplink SRPT.

One import root for the whole product. The sub-packages live in the repository's top-level
folders and are installed under this name (``setup.cfg``, ``package_dir``), one way down the
data flow::

    overtake.fitting      phase-type distributions and their EM fit     (fitting/)
    overtake.mdp          the tandem MDP, its solvers and baselines     (mdp/)
    overtake.controller   the sidecar in front of Apache                (controller/)
    overtake.api          the ``overtake`` CLI and the REST API         (api/)
    overtake.apache_conf  Apache and tc templates, shipped as data      (apache-conf/)

Every error raised on purpose derives from :class:`overtake.errors.OvertakeError`.
"""

from __future__ import annotations

#: The installed distribution (``overtake`` on PyPI is an unrelated project).
DISTRIBUTION = "overtake-server"

#: The distribution's version, setup.cfg's (tests/test_packaging.py keeps the two equal). A constant, so
#: ``overtake --version`` imports no importlib.metadata (which loads zipfile, email, … at start-up).
__version__ = "0.1.0"

__all__ = ["DISTRIBUTION", "__version__", "install_hint"]


def install_hint(extra: str) -> str:
    """The command that installs an optional feature of the distribution, e.g. ``pip install 'overtake-server[sweep]'``.

    Error messages about a missing optional dependency end with it; ``extra`` must be one of the
    distribution's extras (setup.cfg ``extras_require``).
    """
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        extras = metadata(DISTRIBUTION).get_all("Provides-Extra") or []
    except PackageNotFoundError:  # a checkout that was never installed: nothing to check against
        extras = [extra]
    if extra not in extras:
        raise ValueError(f"{DISTRIBUTION} has no extra {extra!r} (its extras: {', '.join(sorted(extras))})")
    return f"pip install '{DISTRIBUTION}[{extra}]'"
