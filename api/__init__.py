"""Overtake's product surface: the ``overtake`` command line, the REST app (:mod:`overtake.api.app`) with
its page and plots, and the private Prometheus launcher.

An application, not a library: nothing is re-exported here.
"""
