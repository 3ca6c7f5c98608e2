"""The controller: what runs beside Apache, one package per concept.

* :mod:`overtake.controller.sidecar`: the sidecar, an HTTP/1.1 reverse proxy in front of an
  unmodified Apache that enforces a thread-spawn policy (its package docstring maps the modules);
* :mod:`overtake.controller.uplink`: how response bytes leave the server (fair, SRPT, SRRT, app);
* :mod:`overtake.controller.online`: refit, re-solve and swap the policy while the sidecar runs;
* :mod:`overtake.controller.harness`: launchers for a private Apache and Prometheus and a load
  generator, for tests, benches and the demo; it imports the product, no product module imports it;
* :mod:`overtake.controller.errors`: the controller's error tree.

Modules are imported by name (``from overtake.controller.sidecar import gateway``); this package
re-exports only what is listed in ``__all__``.
"""

from __future__ import annotations

__all__: list[str] = []
