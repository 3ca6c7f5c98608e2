"""The job store (api/db.py) and the ``overtake api`` options."""

from __future__ import annotations

from pathlib import Path

import pytest

from overtake.api.cli import main
from overtake.api.commands.api import parse_listen
from overtake.api.db import INTERRUPTED, Store, sqlite_path
from overtake.api.errors import ApiUsageError, DatabaseURLError


@pytest.mark.parametrize(("url", "path"), [
    ("jobs.db", Path("jobs.db")),
    ("sqlite:///rel/jobs.db", Path("rel/jobs.db")),
    ("sqlite:////abs/jobs.db", Path("/abs/jobs.db")),
])
def test_sqlite_urls(url: str, path: Path) -> None:
    assert sqlite_path(url) == path


@pytest.mark.parametrize(("url", "msg"), [
    ("postgresql://h/db", "only SQLite"),
    ("sqlite://", "sqlite:///PATH"),
    ("sqlite:///:memory:", "in-memory"),
])
def test_other_urls_are_refused(url: str, msg: str) -> None:
    with pytest.raises(DatabaseURLError, match=msg):
        sqlite_path(url)


def test_lifecycle_and_recovery(tmp_path: Path) -> None:
    s = Store(str(tmp_path / "j.db"))
    a = s.create("model", "a", {"x": 1})
    b = s.create("fit", "b", {"y": 2})
    c = s.create("model", "c", {"z": 3})
    assert s.start(a) and not s.start(a)  # a job starts once
    s.progress(a, 0.5, "half")
    assert (s.get(a).progress, s.get(a).message) == (0.5, "half")  # type: ignore[union-attr]
    assert s.start(c)
    s.finish(c, {"ok": True}, b"blob")
    assert s.get(c).result == {"ok": True} and s.artifact(c) == b"blob"  # type: ignore[union-attr]
    assert s.get(b, "model") is None and s.get(b, "fit") is not None
    assert s.counts() == {("model", "running"): 1, ("fit", "queued"): 1, ("model", "done"): 1}
    # a restart: the running job failed with the documented reason, the queued one is handed back
    failed, queued = Store(str(tmp_path / "j.db")).recover()
    assert failed == [a] and queued == [b]
    assert s.get(a).status == "failed" and s.get(a).reason == INTERRUPTED  # type: ignore[union-attr]
    s.fail(c, "late")  # a finished job keeps its result
    assert s.get(c).status == "done"  # type: ignore[union-attr]


@pytest.mark.parametrize(("value", "expected"), [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9", ("::1", 9)),
                                                 ("localhost:8080", ("localhost", 8080))])
def test_listen(value: str, expected: tuple[str, int]) -> None:
    assert parse_listen(value) == expected


@pytest.mark.parametrize("value", ["8080", "example.com:80", "127.0.0.1:0", "127.0.0.1:x",
                                   "127.0.0.1:\u00b2", "127.0.0.1:\u0663"])
def test_bad_listen(value: str) -> None:
    with pytest.raises(ApiUsageError, match="--listen"):
        parse_listen(value)


def test_cli_reports_bad_options_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["api", "--listen", "0.0.0.0", "--db", str(tmp_path / "x.db")]) == 2
    assert capsys.readouterr().err.strip() == "overtake api: error: --listen must be HOST:PORT, got '0.0.0.0'"
    assert main(["api", "--db", "mysql://x/y"]) == 2
    assert "only SQLite" in capsys.readouterr().err
    for bad in ("0", "-1", "nan", "inf"):
        assert main(["api", "--db", str(tmp_path / "x.db"), "--job-deadline", bad]) == 2
        assert f"--job-deadline must be > 0 seconds, got {float(bad)}" in capsys.readouterr().err


def test_a_table_of_the_previous_version_is_migrated(tmp_path: Path) -> None:
    """A database written before jobs could be cancelled (its status check lacks 'cancelled')
    keeps its jobs and takes the new status."""
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as c:
        c.executescript("""
            CREATE TABLE jobs (id TEXT PRIMARY KEY, kind TEXT NOT NULL CHECK (kind IN ('model', 'fit')),
                name TEXT NOT NULL, status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'done', 'failed')),
                progress REAL NOT NULL DEFAULT 0, message TEXT NOT NULL DEFAULT '', reason TEXT, created REAL NOT NULL,
                started REAL, finished REAL, request TEXT NOT NULL, result TEXT, artifact BLOB);
            CREATE INDEX jobs_kind_created ON jobs (kind, created);
            INSERT INTO jobs (id, kind, name, status, created, request, result, artifact)
                VALUES ('done1', 'model', 'm', 'done', 1.0, '{"digest": "d"}', '{"x": 1}', x'0102'),
                       ('queued1', 'fit', 'f', 'queued', 2.0, '{}', NULL, NULL);
        """)
    s = Store(str(path))
    done = s.get("done1")
    assert done is not None and (done.status, done.result, s.artifact("done1")) == ("done", {"x": 1}, b"\x01\x02")
    assert s.cancel("queued1", "cancelled: test") and s.get("queued1").status == "cancelled"  # type: ignore[union-attr]
    assert Store(str(path)).counts() == {("model", "done"): 1, ("fit", "cancelled"): 1}  # opened again: as is
    with sqlite3.connect(path) as c:
        indexes = c.execute("SELECT name FROM sqlite_master WHERE type='index' AND sql IS NOT NULL").fetchall()
    assert indexes == [("jobs_kind_created",)]
