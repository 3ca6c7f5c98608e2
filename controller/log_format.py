"""The Apache access-log format the online loop reads service demands from (``--access-log``).

Apache logs each request with it (``LogFormat``; the private Apache of
:mod:`overtake.controller.harness.apache` renders it into its ``httpd.conf``), and
:class:`overtake.controller.online.estimators.AccessLogTail` parses it back.
"""

from __future__ import annotations

__all__ = ["LOG_FORMAT"]

#: ``D`` = microseconds from reading the request line to logging (sojourn in Apache);
#: ``cpu_us`` = thread CPU burnt by the stage handler (``-`` for other URLs);
#: ``begin`` = request start, microseconds since the epoch; ``rid`` = X-Request-Id header.
LOG_FORMAT = (
    '%h %{begin:usec}t "%r" %>s %b D=%D msT=%{ms}T usT=%{us}T '
    "stage=%{stage}n cpu_us=%{stage_cpu_us}n tid=%{tid}P rid=%{X-Request-Id}i"
)
