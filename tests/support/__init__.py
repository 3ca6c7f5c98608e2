"""Helpers shared by the tests of several folders: imported as ``support.X`` (pytest puts tests/ on
the path for tests/conftest.py). Fixtures live in the conftest.py files, not here.

api_helpers      tiny scenarios with known answers, job polling, the API as a live process
job_faults       misbehaving jobs for the API's job runner (pickled by name into its workers)
service_helpers  a stub upstream and the sidecar as a subprocess or in a thread
loop_turns       counting turns of the event loop
mdp_helpers      small tandem models for the solver tests
bench            the bench scripts, imported by file path
"""
