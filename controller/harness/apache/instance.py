"""The running instance as recorded in ``WORKDIR/instance.json``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from overtake.controller.errors import ApacheError, ApacheInputError, ApacheNotRunningError
from overtake.controller.harness.apache.config import connect_host, format_listen, parse_listen

__all__ = ["ApacheInstance", "existing_workdir", "load_instance"]


@dataclass(frozen=True)
class ApacheInstance:
    """A running private Apache, as recorded in ``WORKDIR/instance.json``."""

    workdir: str  #: absolute instance directory
    listen: str  #: ``IP:PORT`` it listens on
    pid: int  #: PID of the root parent process
    child_pids: tuple[int, ...]  #: worker child processes at start (one for the config used)
    cpu: int | None  #: core Apache is pinned to, or None
    max_workers: int  #: ``MaxRequestWorkers``
    #: nice value written to the autogroup; None when not raised (not requested, not root, or a
    #: kernel without autogroups)
    autogroup_nice: int | None
    mpm: str = "event"  #: the MPM it runs (event or prefork)

    @property
    def base_url(self) -> str:
        """``http://host:port`` for clients."""
        host, port = parse_listen(self.listen)
        return f"http://{format_listen(connect_host(host), port)}"

    @property
    def access_log(self) -> Path:
        """Path of the access log (format :data:`LOG_FORMAT`)."""
        return Path(self.workdir) / "logs" / "access.log"

    @property
    def error_log(self) -> Path:
        """Path of the error log."""
        return Path(self.workdir) / "logs" / "error.log"


def existing_workdir(workdir: str | os.PathLike[str]) -> Path:
    """``workdir`` made absolute; it must be a directory."""
    path = Path(workdir).resolve()
    if not path.is_dir():
        raise ApacheInputError(
            f"workdir: {path} does not exist or is not a directory; was "
            f"`overtake apache start --workdir {workdir}` run?"
        )
    return path


def load_instance(workdir: Path) -> ApacheInstance:
    """The :class:`ApacheInstance` that :func:`~.lifecycle.start` recorded in ``workdir``."""
    try:
        data = json.loads((workdir / "instance.json").read_text())
        data["child_pids"] = tuple(data["child_pids"])
        return ApacheInstance(**data)
    except FileNotFoundError:
        raise ApacheNotRunningError(
            f"workdir: {workdir} has no instance.json; start Apache with "
            f"`overtake apache start --workdir {workdir} --listen 127.0.0.1:PORT`"
        ) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ApacheError(f"workdir: {workdir}/instance.json is corrupt ({exc}); stop and restart") from None
