"""Shared by the whole suite: whether the Debian packages a real Apache needs are here, the
``apache`` marker on every test that starts one, and mod_overtake_prio compiled once per run.

``make test PYTEST_N=2`` runs the suite in two processes (pytest-xdist, ``--dist loadgroup``). Every test
marked ``apache`` is also ``apache_timed`` unless it is marked ``apache_functional`` by hand (it
only checks what Apache or the sidecar answers, logs or refuses: no assertion on a duration, an
order under contention or a priority). The ``apache_timed`` tests are one xdist group, so they run
one after another in one process and never against each other: they pin their Apache to the last
core and time its requests. While they run, the other process keeps its tests (CPU work, loopback
traffic, the functional Apache tests and their Apache) off that core and below them in CPU
priority, so the timing tests see a machine as if that process were not there.

The packages are installed by ``apache-conf/install-debian-packages.sh`` (``make test`` runs it
first); a test never installs anything, it skips and names the installer. Helpers shared across
folders live in the ``support`` package next to this file (pytest puts this folder on the path
for its conftest).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overtake.controller.errors import ApacheNotInstalledError
from overtake.controller.harness import apache
from overtake.controller.harness.apache import cpu_priority, lifecycle


@pytest.fixture(scope="session")
def apache_available() -> None:
    """Apache, mod_lua and the C toolchain are installed; every test using this is marked ``apache``."""
    try:
        apache.check_installed()
    except ApacheNotInstalledError as e:  # its message names the package and the installer
        pytest.skip(str(e))


#: the xdist work unit of every test marked ``apache_timed`` (tests/conftest.py's scheduler)
APACHE_GROUP = "apache"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "apache_available" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.apache)
        if _is_apache(item) and item.get_closest_marker("apache_functional") is None:
            item.add_marker(pytest.mark.apache_timed)  # by default: a new Apache test times something
    worker = getattr(config, "workerinput", {}).get("workerid")
    listing = _run_file(f"apache-ids-{worker}")
    if listing is not None:  # an xdist worker: the controller's scheduler reads which tests are in the group
        listing.write_text("".join(f"{i.nodeid}\n" for i in items if _is_timed(i)))
        for name, keep in (("functional-ids", lambda i: _is_apache(i) and not _is_timed(i)),
                           ("slow-ids", lambda i: i.get_closest_marker("slow") is not None and not _is_timed(i))):
            out = _run_file(f"{name}-{worker}")
            assert out is not None
            out.write_text("".join(f"{i.nodeid}\n" for i in items if keep(i)))


def _is_apache(item: pytest.Item) -> bool:
    return item.get_closest_marker("apache") is not None


def _is_timed(item: pytest.Item) -> bool:
    return item.get_closest_marker("apache_timed") is not None


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, called in the controller
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (or ``load``, what ``-n`` alone means), with every test marked
    ``apache_timed`` in one work unit. (xdist's own ``xdist_group`` mark, added at collection, cannot be
    used: it renames the test, which pytest 9.2 no longer allows.) The workers list the
    ``apache_timed`` tests as they collect, before the controller schedules anything."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ApacheGroupScheduling(LoadGroupScheduling):  # type: ignore[misc]
        apache: frozenset[str] = frozenset()

        def schedule(self) -> None:
            first = self.collection is None  # the first call: every worker has collected
            if first:
                self.apache = _listed("apache-ids")
            super().schedule()
            if first:
                # the files of functional Apache tests next (a few long tests each, so the size
                # order put them last): they then run beside the group instead of after it; then
                # the files with a test marked ``slow`` (few tests, so also last by size: one of
                # them at the end would keep a process busy alone while the other had finished)
                for name in ("slow-ids", "functional-ids"):
                    listed = _listed(name)
                    for scope in [s for s, ids in self.workqueue.items() if listed.intersection(ids)][::-1]:
                        self.workqueue.move_to_end(scope, last=False)

        def _split_scope(self, nodeid: str) -> str:
            # the others by file, as ``--dist loadfile``: a module's fixtures (a built package, a
            # server shared by its tests) are set up once, never by two workers at the same time
            return APACHE_GROUP if nodeid in self.apache else nodeid.split("::", 1)[0]

    return ApacheGroupScheduling(config, log)


def _listed(name: str) -> frozenset[str]:
    """The test ids the workers listed in this run's ``name-*`` files."""
    return frozenset(line for f in Path(tempfile.gettempdir()).glob(f"{_RUN_PREFIX}{_run()}-{name}-*")
                     for line in f.read_text().splitlines())


@pytest.fixture(scope="session", autouse=True)
def mod_prio_built_once(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every private Apache with ``cpu_priority=`` compiles mod_overtake_prio into its own workdir
    (an apxs build of the whole module). The first build of a run is the harness's own, into a
    scratch workdir; later instances get a copy of that ``.so`` (its mtime kept, so newer than the
    sources) and the harness's up-to-date check then skips the compiler. A changed source, or
    another conf dir, builds again."""
    real = lifecycle.build_module
    built: dict[tuple[Path, float], Path] = {}

    def build_once(conf_dir: Path, workdir: Path) -> Path:
        sources = (Path(conf_dir) / cpu_priority.MODULE_DIR).rglob("*")
        key = (Path(conf_dir).resolve(), max(f.stat().st_mtime for f in sources))
        if key not in built:
            built[key] = real(conf_dir, tmp_path_factory.mktemp("mod-prio"))
        mod_dir = Path(workdir) / "modules"
        mod_dir.mkdir(parents=True, exist_ok=True)
        mod_dir.chmod(0o755)
        shutil.copy2(built[key], mod_dir / built[key].name)
        return real(conf_dir, workdir)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lifecycle, "build_module", build_once)
        yield


#: set in a worker once it has run an ``apache_timed`` test
_RAN_APACHE = pytest.StashKey[bool]()
#: names this run for its xdist workers (they inherit the environment)
_RUN_ENV = "OVERTAKE_TESTS_RUN"
_RUN_PREFIX = "overtake-tests-"


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        os.environ[_RUN_ENV] = uuid.uuid4().hex


def _run() -> str:
    return os.environ.get(_RUN_ENV, "")


def _run_file(name: str) -> Path | None:
    """A file of this run shared by its xdist workers and controller (None outside a worker)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return None
    return Path(tempfile.gettempdir()) / f"{_RUN_PREFIX}{_run()}-{name}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under xdist, while the ``apache_timed`` group may still run in the other worker, a test
    outside it runs (its fixtures, threads and child processes too) demoted: on the cores other than
    the last, where the timed tests pin their Apache, and at the lowest CPU priority
    (:func:`_demote`), so that the timed tests' clients and sidecars get a core whenever they want
    one. A functional ``apache`` test there runs on those cores too, its Apache with it (the tests'
    core choice reads the worker's affinity), at the machine's ordinary priority
    (:func:`_beside_the_group`).
    An ``apache_timed`` test has every core, raised above the machine's other work (:func:`_raise`)."""
    done, every = _run_file("apache-done"), _CORES
    if done is None or len(every) < 2:
        yield
        return
    demoted = raised = False
    with pytest.MonkeyPatch.context() as mp:
        if _is_timed(item):
            item.config.stash[_RAN_APACHE] = True
            raised = _raise()
        elif item.config.stash.get(_RAN_APACHE, False):
            done.touch()  # this worker ran the group and has moved past it
        elif not done.exists():
            os.sched_setaffinity(0, every - {max(every)})
            if _is_apache(item):
                _beside_the_group(mp)
            else:
                demoted = _demote()
        try:
            yield
        finally:
            os.sched_setaffinity(0, every)  # also whatever a test left narrowed
            if demoted or raised:
                _restore()


#: Linux autogroups: every session is one scheduling group, and groups share a core by their
#: autogroup nice, whatever the nice or policy of the threads inside (sched(7), "The autogroup
#: feature"). The ``apache`` worker's clients and sidecars are in the session pytest was started
#: from, so a low priority in the other worker only counts against them once that worker has a
#: session of its own.
_AUTOGROUP = Path("/proc/self/autogroup")
_CAP_SYS_NICE = 23


#: the cores this worker may use, read when it starts (a test that narrows its own affinity and
#: fails before it widens it again must not shrink every later test's)
_CORES = frozenset(os.sched_getaffinity(0))
#: the autogroup nice of an ``apache`` test's worker: above the machine's other work (a shared CI
#: runner's jobs, the other worker's children that raised themselves) so that its clients, sidecars
#: and the threads that watch Apache's priorities are not starved, and below the private Apache's
#: -20 so that on Apache's core the server still comes first
_RAISED_NICE = -10


def _own_session() -> None:
    if os.getpgrp() != os.getpid() and os.getsid(0) != os.getpid():
        os.setsid()  # once per worker; a group leader (not one under xdist) keeps its session


def _raise() -> bool:
    """This worker (the processes it starts too) above the machine's other work for an ``apache``
    test: its own session at autogroup nice :data:`_RAISED_NICE` (root only: lowering a nice
    value needs ``CAP_SYS_NICE``; without it the test runs as before)."""
    _own_session()
    if os.getsid(0) != os.getpid() or not _capable(_CAP_SYS_NICE):
        return False
    try:
        _AUTOGROUP.write_text(f"{_RAISED_NICE}\n")
    except OSError:  # a kernel without autogroups
        return False
    return True


def _demote() -> bool:
    """This worker (the calling thread, the threads and processes it starts) at the lowest
    priority: its own session, autogroup nice 19, ``SCHED_IDLE`` (a thread of another policy that
    wakes preempts it at once). ``SCHED_IDLE`` only where :func:`_restore` can undo it
    (``CAP_SYS_NICE``): the same worker may run the timed group next."""
    _own_session()
    if os.getsid(0) == os.getpid() and _AUTOGROUP.exists():
        _AUTOGROUP.write_text("19\n")
    if _capable(_CAP_SYS_NICE):
        # inherited by the processes a test starts (SCHED_RESET_ON_FORK resets only real-time
        # policies): a test that checks a server's priorities belongs in the timed group
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return True


def _beside_the_group(mp: pytest.MonkeyPatch) -> None:
    """A functional ``apache`` test while the timed group may still run: the worker as it is
    (autogroup nice 0, ``SCHED_OTHER``: its Apache, php-fpm and sidecars inherit the policy, and
    mod_overtake_prio demotes and restores threads of a normal one), and a private Apache it
    starts at its own session's nice 0 instead of the harness's -20. Both are then below the timed
    tests' clients and sidecars (:data:`_RAISED_NICE`) as any other work on the machine is, and
    not starved by them as a demoted test may be: their requests have deadlines."""
    real = lifecycle._raise_autogroup
    mp.setattr(lifecycle, "_raise_autogroup", lambda pids, nice: real(pids, 0))


def _restore() -> None:
    if os.getsid(0) == os.getpid() and _AUTOGROUP.exists():
        _AUTOGROUP.write_text("0\n")
    if os.sched_getscheduler(0) == os.SCHED_IDLE:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def _capable(cap: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and _run():
        for f in Path(tempfile.gettempdir()).glob(f"{_RUN_PREFIX}{_run()}-*"):
            f.unlink(missing_ok=True)
