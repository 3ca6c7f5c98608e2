"""A handler with a real lock for tests: ``/locked?work=S`` takes SQLite's write lock.

``BEGIN IMMEDIATE`` through apr_dbd's sqlite3 driver (Debian's libaprutil1-dbd-sqlite3; its busy
handler sleeps between tries), then S s of thread CPU inside the transaction, UPDATE, COMMIT.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from overtake.controller.harness import apache

__all__ = ["SQLITE_DRIVER", "conf_with_lock"]

SQLITE_DRIVER = Path("/usr/lib/x86_64-linux-gnu/apr-util-1/apr_dbd_sqlite3-1.so")

LOCKED_LUA = """local tcpu = require "tcpu"
local DB = "@DB@"
local WAIT_S = 60

local function fail(r, msg)
    r.status = 500
    r.content_type = "text/plain"
    r:puts(msg, "\\n")
    return apache2.OK
end

function handle(r)
    local work = tonumber(r:parseargs().work or "0") or 0
    local db, err = r:dbacquire("sqlite3", DB)
    if not db then
        return fail(r, "locked: cannot open " .. DB .. ": " .. tostring(err))
    end
    local deadline = os.time() + WAIT_S
    local ok, qerr = db:query(r, "BEGIN IMMEDIATE")
    while not ok do
        if os.time() > deadline then
            db:close()
            return fail(r, "locked: no write lock within " .. WAIT_S .. " s: " .. tostring(qerr))
        end
        ok, qerr = db:query(r, "BEGIN IMMEDIATE")
    end
    local target = tcpu.now_ns() + math.floor(work * 1e9)
    local x = 0
    while tcpu.now_ns() < target do for i = 1, 500 do x = x + (i % 7) end end
    ok, qerr = db:query(r, "UPDATE tx SET n = n + 1")
    db:query(r, ok and "COMMIT" or "ROLLBACK")
    db:close()
    if not ok then
        return fail(r, "locked: update failed: " .. tostring(qerr))
    end
    r.content_type = "text/plain"
    r:puts("ok\\n")
    return apache2.OK
end
"""


def conf_with_lock(parent: Path) -> Path:
    """apache-conf/ in ``parent``/conf plus ``/locked``, on a SQLite database the worker user may write."""
    conf = parent / "conf"
    shutil.copytree(apache.DEFAULT_CONF_DIR, conf, ignore=shutil.ignore_patterns("__pycache__"))
    dbdir = parent / "db"
    dbdir.mkdir()
    db = dbdir / "lock.sqlite"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE tx (n INTEGER)")
        c.execute("INSERT INTO tx VALUES (0)")
    c.close()
    for p in (dbdir, db):  # SQLite writes its journal next to the database
        shutil.chown(p, "www-data", "www-data")
    (conf / "lua" / "locked.lua").write_text(LOCKED_LUA.replace("@DB@", str(db)))
    with (conf / "httpd.conf.in").open("a") as f:
        f.write('\nLuaMapHandler "^/locked$" "@APACHE_DIR@/lua/locked.lua" handle\n')
    return conf
