"""Overtake's product surface: the ``overtake`` command line, the REST app (:mod:`overtake.api.app`) with
its routers, page and plots, and the one scenario loader (:mod:`overtake.api.scenario`).

An application, not a library: nothing is re-exported here.
"""
