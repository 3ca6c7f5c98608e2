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

from importlib.metadata import PackageNotFoundError, version

#: The installed distribution (``overtake`` on PyPI is an unrelated project).
DISTRIBUTION = "overtake-server"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["DISTRIBUTION", "__version__"]
