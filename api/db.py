"""Job persistence: one SQLite table of model and fit jobs, shared by the API and its workers.

SQLite (stdlib ``sqlite3``) in WAL mode, so the solver worker processes write progress and
results while the API reads. The location is a path or a ``sqlite:///PATH`` URL (``sqlite:////abs``
for an absolute path); other database URLs are refused with a message.

A row holds the request as posted (JSON), the status (``queued`` → ``running`` → ``done`` |
``failed``; ``cancelled`` from either of the first two), progress, the result document (JSON)
and, for models, the policy artifact (the ``.npz`` bytes of :meth:`overtake.mdp.Policy.save`).
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DatabaseURLError, QueueFullError

STATUSES = ("queued", "running", "done", "failed", "cancelled")

_TABLE = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('model', 'fit')),
    name TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'done', 'failed', 'cancelled')),
    progress REAL NOT NULL DEFAULT 0,
    message TEXT NOT NULL DEFAULT '',
    reason TEXT,
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    request TEXT NOT NULL,
    result TEXT,
    artifact BLOB
)"""
_INDEX = "CREATE INDEX IF NOT EXISTS jobs_kind_created ON jobs (kind, created)"

INTERRUPTED = "interrupted: the API stopped while this job was running; post it again"


def sqlite_path(url: str) -> Path:
    """The file behind ``PATH``, ``sqlite:///relative`` or ``sqlite:////absolute``."""
    if "://" not in url:
        return Path(url)
    scheme, _, rest = url.partition("://")
    if scheme != "sqlite":
        raise DatabaseURLError(f"--db: only SQLite is supported (a path or sqlite:///PATH), got scheme {scheme!r}")
    if not rest.startswith("/") or rest == "/":
        raise DatabaseURLError(f"--db: a SQLite URL is sqlite:///PATH, got {url!r}")
    path = rest[1:]
    if path in ("", ":memory:"):
        raise DatabaseURLError("--db: an in-memory database cannot be shared with worker processes; give a file")
    return Path(path)


def _migrate(c: sqlite3.Connection) -> None:
    """A table of an earlier version, whose status check lacks 'cancelled', is copied into the
    current one (SQLite cannot change a CHECK in place)."""
    row = c.execute("SELECT sql FROM sqlite_master WHERE type='table' AND name='jobs'").fetchone()
    if row is None or "'cancelled'" in row[0]:
        return
    c.execute("ALTER TABLE jobs RENAME TO jobs_before_cancel")
    c.execute("DROP INDEX IF EXISTS jobs_kind_created")
    c.execute(_TABLE)
    c.execute("INSERT INTO jobs SELECT * FROM jobs_before_cancel")
    c.execute("DROP TABLE jobs_before_cancel")


@dataclass(frozen=True)
class Admission:
    """:meth:`Store.admit`'s answer: the job's id and status, and whether it existed already."""

    id: str
    status: str
    existing: bool


@dataclass(frozen=True)
class Job:
    """One row of ``jobs``; ``request`` and ``result`` decoded."""

    id: str
    kind: str
    name: str
    status: str
    progress: float
    message: str
    reason: str | None
    created: float
    started: float | None
    finished: float | None
    request: dict[str, Any]
    result: dict[str, Any] | None
    has_artifact: bool


_COLUMNS = "id, kind, name, status, progress, message, reason, created, started, finished, request, result, artifact IS NOT NULL"


def _job(row: tuple[Any, ...]) -> Job:
    return Job(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8], row[9],
               json.loads(row[10]), None if row[11] is None else json.loads(row[11]), bool(row[12]))


class Store:
    """The jobs table; every method opens its own short connection (safe across processes)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.path = sqlite_path(url)
        if self.path.parent and not self.path.parent.exists():
            raise DatabaseURLError(f"--db: directory {self.path.parent} does not exist")
        with self._conn() as c:
            c.execute("PRAGMA journal_mode=WAL")
        with self._conn() as c:
            c.execute("BEGIN IMMEDIATE")  # one process creates or migrates the table, the others then see it
            _migrate(c)
            c.execute(_TABLE)
            c.execute(_INDEX)

    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        c = sqlite3.connect(self.path, timeout=30.0)
        try:
            with c:  # one transaction, committed on success
                yield c
        finally:
            c.close()

    # ---- writes ----------------------------------------------------------------------------
    def create(self, kind: str, name: str, request: dict[str, Any]) -> str:
        with self._conn() as c:
            return _insert(c, kind, name, request)

    def admit(self, kind: str, label: str, request: dict[str, Any], digest: str, *, max_queued: int) -> Admission:
        """Queue a job, unless the same one already lives: one transaction, so concurrent posts
        never admit more than ``max_queued`` waiting jobs between them.

        The job is named :meth:`unique_name`; ``digest`` (what the job computes) is stored in
        the request. When a job of this kind, name and digest is queued, running or done, that
        job is the answer (``existing``) and nothing is queued; a failed or cancelled one is run
        again as a new job. Raises :class:`~overtake.api.errors.QueueFullError` when ``max_queued`` jobs wait.
        """
        with self._conn() as c:
            c.execute("BEGIN IMMEDIATE")  # the count, the look-up and the insert see no other writer
            name = _unique_name(c, kind, label, digest)
            row = c.execute("SELECT id, status FROM jobs WHERE kind=? AND name=? AND status IN ('queued', 'running', "
                            "'done') AND json_extract(request, '$.digest')=? ORDER BY created DESC LIMIT 1",
                            (kind, name, digest)).fetchone()
            if row is not None:
                return Admission(row[0], row[1], existing=True)
            queued = c.execute("SELECT COUNT(*) FROM jobs WHERE status='queued'").fetchone()[0]
            if queued >= max_queued:
                raise QueueFullError(queued)
            return Admission(_insert(c, kind, name, {**request, "digest": digest}), "queued", existing=False)

    def unique_name(self, kind: str, label: str, digest: str) -> str:
        """``label · <digest prefix>``: two different jobs (digests) never share a name.

        Eight hex digits, more only if a job of another digest already holds that name (a
        collision, found or made on purpose); the same job posted twice keeps one name.
        """
        with self._conn() as c:
            return _unique_name(c, kind, label, digest)

    def start(self, job_id: str) -> bool:
        """queued → running; False when the job is no longer queued (then the worker skips it)."""
        with self._conn() as c:
            cur = c.execute("UPDATE jobs SET status='running', started=?, progress=0 WHERE id=? AND status='queued'",
                            (time.time(), job_id))
            return cur.rowcount == 1

    def progress(self, job_id: str, fraction: float, message: str) -> None:
        with self._conn() as c:
            c.execute("UPDATE jobs SET progress=?, message=? WHERE id=? AND status='running'",
                      (min(max(fraction, 0.0), 1.0), message[:500], job_id))

    def finish(self, job_id: str, result: dict[str, Any], artifact: bytes | None = None) -> None:
        """running → done (a job cancelled or failed meanwhile stays so)."""
        with self._conn() as c:
            c.execute("UPDATE jobs SET status='done', progress=1, finished=?, result=?, artifact=?, message='done' "
                      "WHERE id=? AND status='running'",
                      (time.time(), json.dumps(result, allow_nan=False), artifact, job_id))

    def fail(self, job_id: str, reason: str, *, only_running: bool = False) -> None:
        states = "('running')" if only_running else "('queued', 'running')"
        with self._conn() as c:
            c.execute(f"UPDATE jobs SET status='failed', finished=?, reason=? WHERE id=? AND status IN {states}",
                      (time.time(), reason[:2000], job_id))

    def cancel(self, job_id: str, reason: str) -> bool:
        """queued or running → cancelled; False when the job had already ended (or is unknown)."""
        with self._conn() as c:
            cur = c.execute("UPDATE jobs SET status='cancelled', finished=?, reason=? WHERE id=? "
                            "AND status IN ('queued', 'running')", (time.time(), reason[:2000], job_id))
            return cur.rowcount == 1

    def fail_running(self, reason: str) -> list[str]:
        """Mark every running job failed (their worker processes are gone); returns their ids."""
        with self._conn() as c:
            ids = [r[0] for r in c.execute("SELECT id FROM jobs WHERE status='running'")]
            c.execute("UPDATE jobs SET status='failed', finished=?, reason=? WHERE status='running'",
                      (time.time(), reason))
        return ids

    def recover(self) -> tuple[list[str], list[str]]:
        """At start-up: running jobs of a previous process → failed; queued jobs are returned to re-queue.

        A solve interrupted mid-way is not resumed (its worker is gone and a re-run could loop on a
        job that crashed the server); the reason says to post it again. Queued jobs never started, so
        they are simply queued again.
        """
        running = self.fail_running(INTERRUPTED)
        with self._conn() as c:
            queued = [r[0] for r in c.execute("SELECT id FROM jobs WHERE status='queued' ORDER BY created")]
        return running, queued

    # ---- reads -----------------------------------------------------------------------------
    def get(self, job_id: str, kind: str | None = None) -> Job | None:
        with self._conn() as c:
            row = c.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is None:
            return None
        job = _job(row)
        return job if kind is None or job.kind == kind else None

    def artifact(self, job_id: str) -> bytes | None:
        with self._conn() as c:
            row = c.execute("SELECT artifact FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None else row[0]

    def list(self, kind: str, limit: int = 200) -> list[Job]:
        with self._conn() as c:
            rows = c.execute(f"SELECT {_COLUMNS} FROM jobs WHERE kind=? ORDER BY created DESC LIMIT ?",
                             (kind, limit)).fetchall()
        return [_job(r) for r in rows]

    def counts(self) -> dict[tuple[str, str], int]:
        with self._conn() as c:
            rows = c.execute("SELECT kind, status, COUNT(*) FROM jobs GROUP BY kind, status").fetchall()
        return {(k, s): n for k, s, n in rows}


def _insert(c: sqlite3.Connection, kind: str, name: str, request: dict[str, Any]) -> str:
    job_id = uuid.uuid4().hex[:12]
    c.execute("INSERT INTO jobs (id, kind, name, status, created, request) VALUES (?, ?, ?, 'queued', ?, ?)",
              (job_id, kind, name, time.time(), json.dumps(request)))
    return job_id


def _unique_name(c: sqlite3.Connection, kind: str, label: str, digest: str) -> str:
    """See :meth:`Store.unique_name`. The digests are read from the request in SQL: a fit's
    request holds its samples, not decoded here."""
    for width in (8, 16, len(digest)):
        name = f"{label} · {digest[:width]}"
        rows = c.execute("SELECT json_extract(request, '$.digest') FROM jobs WHERE kind=? AND name=?",
                         (kind, name)).fetchall()
        if {r[0] for r in rows} <= {digest}:
            return name
    return name  # the whole digest: equal names mean equal jobs
