"""The harness room: the real parts that tests, benchmarks and the demo run against.

* :mod:`.apache`: a private Apache httpd with the CPU-burning stage handler and mod_status
  (``overtake apache start|stop|status``);
* :mod:`.prometheus`: a private Prometheus scraping the sidecar and the API
  (``overtake prometheus start|stop``).

Import the launchers by name (``from overtake.controller.harness import apache``): both have a
``start`` and a ``stop``, so this package re-exports nothing.
"""

from __future__ import annotations

__all__: list[str] = []
