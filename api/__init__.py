"""Overtake's product surface: the ``overtake`` command line (and, later, the REST app).

An application, not a library: nothing is re-exported here.
"""
