"""The uplink benches' testbed, imported as ``uplink`` by the scripts in bench/ (their folder is on the path).

* :mod:`.testbed`: two network namespaces joined by a shaped veth pair;
* :mod:`.workload`: response-size models and seeded Poisson schedules;
* :mod:`.ideal`: the same schedule on a fluid link (PS, exact SRPT, SRPT bands);
* ``server.py``, ``client.py``, ``txclient.py``: programs run inside the namespaces
  (``python bench/uplink/server.py ...``), not imported.
"""
