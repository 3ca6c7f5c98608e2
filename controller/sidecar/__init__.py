"""The sidecar: the HTTP/1.1 reverse proxy in front of Apache that enforces a thread-spawn policy.

Modules are imported by name; this package re-exports nothing (importing one module must not
load the whole proxy, and the online loop imports the policy and stage modules it shares).

* :mod:`.service`: :class:`~.service.Sidecar`, the pieces wired together, started, reloaded,
  drained; :mod:`.options`: :class:`~.options.SidecarOptions`, their bounds, what a reload may
  change; :mod:`.config`: the service's config file, read into them; :mod:`.logs`: JSON log lines;
* the request path: :mod:`.http1` (HTTP/1.1 parsing and writing), :mod:`.gateway` (routing and
  admission per request), :mod:`.forward` (Apache's side and the response relay),
  :mod:`.upstream` (connections to Apache), :mod:`.spool` and :mod:`.budget` (answers held for
  slow clients, bytes held at once), :mod:`.request_log` (the access log);
* admission: :mod:`.stages` (the stages file), :mod:`.classifier` (a request's phase),
  :mod:`.limiter` and :mod:`.tandem` (the queues and threads the policy decides on),
  :mod:`.gate` and :mod:`.gate_key` (Apache's admission gate, mod_overtake_prio);
* the policy: :mod:`.policies` (what a policy answers), :mod:`.policy_archive`,
  :mod:`.policy_loads`, :mod:`.policy_fetch`, :mod:`.policy_source` (loading, bounding, fetching,
  watching), :mod:`.units` (the time unit), :mod:`.auto` (``classifier.mode: auto``),
  :mod:`.stages_reload` (what a reload may change);
* operations: :mod:`.admin` (the control endpoints), :mod:`.metrics` (Prometheus),
  :mod:`.apache_probe` (Apache's status and health);
* :mod:`.virtual`: the limiter on a virtual processor-sharing CPU (tests, benches, the demo).
"""

from __future__ import annotations

__all__: list[str] = []
