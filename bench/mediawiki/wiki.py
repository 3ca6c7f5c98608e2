"""The bench's MediaWiki: Debian's package, installed on SQLite into a data directory of its own.

:func:`ensure_wiki` does the set-up once and again only when the recipe changes::

    DATA/LocalSettings.php   maintenance/install.php's file plus the bench's settings (below)
    DATA/db/                 the SQLite databases (owned by www-data: PHP writes them)
    DATA/pages/              the generated wikitext that was imported (templates/, articles/)
    DATA/wiki.json           the recipe, its fingerprint and MediaWiki's version: the stamp

The code stays in ``/usr/share/mediawiki``; the private Apache and php-fpm point MediaWiki at the
data directory with the ``MW_CONFIG_FILE`` environment variable. The bench's settings
(:data:`SETTINGS`, each with its reason) are an operator's for a one-server wiki: object caches in
APCu, so that no request writes to SQLite but a preview's transaction; no jobs run at the end of
requests; and, the bench's own choice, no parser cache, so every request renders; short URLs (``/wiki/Title``) let a path matcher tell a view from a preview (``/api.php``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .pages import Recipe, fingerprint, templates, wiki_pages

__all__ = ["DEFAULT_DATA_DIR", "MEDIAWIKI", "PACKAGES_SCRIPT", "SETTINGS", "WikiNotInstalled", "ensure_wiki",
           "db_state", "mediawiki_installed", "missing_packages", "read_stamp", "settings_digest", "wanted_stamp",
           "written_since"]

MEDIAWIKI = Path("/usr/share/mediawiki")
DEFAULT_DATA_DIR = Path("/var/tmp/overtake-realapp")
PACKAGES_SCRIPT = Path(__file__).with_name("install-packages.sh")
#: what the bench needs on disk, by Debian package
REQUIRED = {
    "mediawiki": MEDIAWIKI / "index.php",
    "php-sqlite3": Path("/usr/lib/php/20220829/pdo_sqlite.so"),
    "php-apcu": Path("/usr/lib/php/20220829/apcu.so"),
    "libapache2-mod-php": Path("/usr/lib/apache2/modules/libphp8.2.so"),
    "php-fpm": Path("/usr/sbin/php-fpm8.2"),
    "libapache2-mod-qos": Path("/usr/lib/apache2/modules/mod_qos.so"),
    "php-mbstring": Path("/usr/lib/php/20220829/mbstring.so"),
    "php-intl": Path("/usr/lib/php/20220829/intl.so"),
    "php-xml": Path("/usr/lib/php/20220829/xml.so"),
}
ADMIN_PASSWORD = "overtake-bench-admin"  # a throw-away account on a loopback-only wiki

#: appended to install.php's LocalSettings.php: how an operator tunes a one-server wiki on SQLite,
#: except the parser cache, off so that every request renders (the bench measures rendering)
SETTINGS = """
# --- overtake bench (bench/mediawiki/wiki.py)
# Object caches in APCu (php-apcu, which Debian's mediawiki package recommends; install.php picks
# it when present): the message cache, sessions and the WAN cache live in the server's shared
# memory. Without an object cache MediaWiki cannot validate its message cache, rebuilds it on
# every request and writes it back to the SQLite object cache (wikicache.sqlite, WAL mode) under
# a named lock, with four fdatasyncs: a second lock every preview and view waited on.
$wgMainCacheType = CACHE_ACCEL;
$wgSessionCacheType = CACHE_ACCEL;
$wgMessageCacheType = CACHE_ACCEL;
# no parser cache: every preview and view renders the article (the bench's point)
$wgParserCacheType = CACHE_NONE;
# jobs are not run at the end of web requests (they would write to the database after a view);
# the set-up runs the import's jobs with maintenance/runJobs.php, as a cron job would
$wgJobRunRate = 0;
# short URLs: /wiki/Title, through `Alias /wiki .../index.php` in the private Apache
$wgArticlePath = "/wiki/$1";
$wgUsePathInfo = true;
# the private instances listen on ports chosen at start
$wgServer = WebRequest::detectServer();
$wgShowExceptionDetails = true;
"""


def settings_digest() -> str:
    """A short hash of :data:`SETTINGS`: part of the stamp, so a changed setting rebuilds the wiki."""
    return hashlib.sha256(SETTINGS.encode()).hexdigest()[:16]


def wanted_stamp(recipe: Recipe) -> dict[str, Any]:
    """The stamp a wiki of ``recipe`` set up by this code carries (recipe, pages, settings, version)."""
    return {"recipe": asdict(recipe), "fingerprint": fingerprint(recipe), "settings": settings_digest(),
            "mediawiki": _mediawiki_version()}


def db_state(data_dir: Path) -> dict[str, int]:
    """Modification time (ns) of each SQLite database in ``data_dir/db``, by file name."""
    return {f.name: f.stat().st_mtime_ns for f in sorted((data_dir / "db").glob("*.sqlite"))}


def written_since(data_dir: Path, before: dict[str, int]) -> list[str]:
    """The databases written since :func:`db_state` gave ``before`` (a WAL database's file changes
    when its last connection checkpoints), and any that appeared."""
    return [name for name, t in db_state(data_dir).items() if before.get(name) != t]


#: the main database's journal modes the bench sets (``--journal``): SQLite's default rollback
#: journal, where a commit waits for every reader, and the write-ahead log, where it waits for none
JOURNALS = ("delete", "wal")


def _journal(db: Path, mode: str) -> str:
    """Set ``db``'s journal mode; return the one it had."""
    con = sqlite3.connect(db)
    try:
        before = str(con.execute("PRAGMA journal_mode").fetchone()[0]).lower()
        got = str(con.execute(f"PRAGMA journal_mode={mode}").fetchone()[0]).lower()
    finally:
        con.close()
    if got != mode:
        raise RuntimeError(f"journal: SQLite kept {got!r} for {db} (is it in use?)")
    return before


@contextlib.contextmanager
def journal_mode(data_dir: Path, mode: str) -> Iterator[str]:
    """The wiki's main database (``db/wiki.sqlite``) in journal ``mode`` for the block, then back
    in the mode it had (which the block gets). The mode is kept in the file, so MediaWiki's own
    connections use it; a write-ahead log's files (``wiki.sqlite-wal``, ``-shm``) are PHP's, in its
    www-data directory."""
    if mode not in JOURNALS:
        raise ValueError(f"journal: one of {', '.join(JOURNALS)}, got {mode!r}")
    db = data_dir / "db" / "wiki.sqlite"
    before = _journal(db, mode)
    try:
        yield before
    finally:
        if before != mode:
            _journal(db, before)


class WikiNotInstalled(RuntimeError):
    """A package or the wiki's set-up is missing; the message says how to get it."""


def missing_packages() -> list[str]:
    """The Debian packages of :data:`REQUIRED` whose files are absent."""
    return [pkg for pkg, path in REQUIRED.items() if not path.exists()]


def mediawiki_installed() -> bool:
    return not missing_packages()


def read_stamp(data_dir: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((data_dir / "wiki.json").read_text()))
    except (OSError, ValueError):
        return None


def _mediawiki_version() -> str:
    text = (MEDIAWIKI / "includes" / "Defines.php").read_text()
    for line in text.splitlines():
        if "MW_VERSION" in line and "define" in line:
            return line.split(",", 1)[1].strip(" );'\"")
    return "unknown"


def _php(script: str, *args: str, conf: Path, log: Path) -> None:
    """Run a maintenance script with our LocalSettings.php; its output goes to ``log``."""
    env = {**os.environ, "MW_CONFIG_FILE": str(conf)}
    with log.open("a") as out:
        out.write(f"$ php maintenance/{script} {' '.join(args)}\n")
        out.flush()
        proc = subprocess.run(["php", f"maintenance/{script}", *args], cwd=MEDIAWIKI, env=env, stdout=out,
                              stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-12:]
        raise WikiNotInstalled(f"mediawiki set-up: maintenance/{script} failed (rc {proc.returncode}); "
                               f"log {log}:\n" + "\n".join(tail))


def _chown_www(path: Path) -> None:
    pw = pwd.getpwnam("www-data")
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.chown(os.path.join(root, name), pw.pw_uid, pw.pw_gid)
    os.chown(path, pw.pw_uid, pw.pw_gid)


def ensure_wiki(data_dir: Path, recipe: Recipe, *, rebuild: bool = False,
                say: Any = lambda msg: print(msg, file=sys.stderr)) -> dict[str, Any]:
    """The wiki of ``recipe`` in ``data_dir``, set up unless its stamp matches; returns the stamp.

    Raises
    ------
    WikiNotInstalled
        Packages are missing (run :data:`PACKAGES_SCRIPT` as root), or we are not root, or a
        maintenance script failed.
    """
    miss = missing_packages()
    if miss:
        raise WikiNotInstalled(f"mediawiki: packages missing: {' '.join(miss)}; install them with "
                               f"`sh {PACKAGES_SCRIPT}` (root)")
    want = wanted_stamp(recipe)
    have = read_stamp(data_dir)
    if not rebuild and have is not None and all(have.get(k) == v for k, v in want.items()):
        return have
    if os.geteuid() != 0:
        raise WikiNotInstalled(f"mediawiki: the wiki in {data_dir} needs (re)building for this recipe; run as root")
    say(f"mediawiki: setting up the wiki in {data_dir} ({recipe.articles} articles, seed {recipe.seed}); "
        "this takes a minute or two")
    for sub in ("db", "pages", "wiki.json", "LocalSettings.php", "setup.log"):
        p = data_dir / sub
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o755)
    (data_dir / "db").mkdir()
    log, conf = data_dir / "setup.log", data_dir / "LocalSettings.php"
    _php("install.php", "--dbtype", "sqlite", "--dbpath", str(data_dir / "db"), "--dbname", "wiki",
         "--confpath", str(data_dir), "--server", "http://127.0.0.1", "--scriptpath", "",
         "--extensions", "ParserFunctions,Cite", "--skins", "Vector", "--pass", ADMIN_PASSWORD,
         "Benchwiki", "Admin", conf=conf, log=log)
    conf.write_text(conf.read_text() + SETTINGS)
    conf.chmod(0o644)
    tdir, adir = data_dir / "pages" / "templates", data_dir / "pages" / "articles"
    for d, pages in ((tdir, templates()), (adir, wiki_pages(recipe))):
        d.mkdir(parents=True)
        for title, text in pages.items():
            (d / title).write_text(text)
    _php("importTextFiles.php", "--bot", "--prefix", "Template:", *sorted(map(str, tdir.iterdir())), conf=conf, log=log)
    _php("importTextFiles.php", "--bot", *sorted(map(str, adir.iterdir())), conf=conf, log=log)
    _php("runJobs.php", conf=conf, log=log)  # the import's link updates, not left for page views
    _php("rebuildLocalisationCache.php", "--lang", "en", conf=conf, log=log)
    _chown_www(data_dir / "db")  # PHP (www-data) writes the databases and their journals
    (data_dir / "wiki.json").write_text(json.dumps(want, indent=1) + "\n")
    return want
