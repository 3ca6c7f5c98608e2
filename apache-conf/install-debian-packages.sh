#!/bin/sh
# Install the Debian packages the private Apache needs (apache-conf/, controller/harness/apache/).
#
# Idempotent: does nothing when everything is installed; runs `apt-get update` once and only
# when something is missing. Needs root to install; without root it prints what is missing and
# exits 0, so `make test` still runs (the Apache tests then skip with the same reason).
#
#   apache2        /usr/sbin/apache2 + mod_mpm_event, mod_status, mod_lua (Lua 5.3)
#   liblua5.3-dev  lua.h/lauxlib.h for the thread-CPU clock module (apache-conf/lua/tcpu.c)
#   lua5.3         the interpreter, to syntax-check stage.lua (luac5.3 -p)
#   gcc libc6-dev  compile that module at start-up
#   apache2-dev    apxs + httpd/APR headers: builds mod_overtake_prio (per-request CPU priority
#                  of the worker threads) when the launcher is asked for cpu_priority=
#   util-linux     taskset (pinning Apache to one core)
#   libaprutil1-dbd-sqlite3  apr_dbd's SQLite driver: mod_lua's r:dbacquire("sqlite3", ...) in the
#                  priority-inversion test (tests/controller/harness/test_apache_prio_guard.py)
#   wrk haproxy    sidecar overhead benchmark (bench/sidecar_overhead.py): load generator, proxy peer
#   valgrind       the module's cost per request counted (bench/module_cost.py: callgrind)
#   iproute2 ethtool  uplink qdisc (controller/uplink/qdisc.py: tc, ip netns; TSO/GSO off for HTB)
#   chromium       headless check of the API's page (tests/api/test_api_page.py)
#   prometheus     private Prometheus scraping the sidecar and the API (controller/harness/prometheus.py)
#   python3-venv   the project's .venv (Makefile; not in a minimal Debian 12)
#   php8.2-fpm php8.2-dev php8.2-sqlite3  a private PHP-FPM pool, phpize for the overtake_prio
#                  extension and SQLite for its priority-inversion test
#                  (apache-conf/php_overtake_prio, controller/harness/php_fpm.py)
#
# With arguments, installs those packages instead (`make deb` and bench/deb_install.py name their
# own tools: packaging/deb/build.sh).
set -eu

PKGS="${*:-apache2 apache2-dev liblua5.3-dev lua5.3 gcc libc6-dev util-linux libaprutil1-dbd-sqlite3 wrk haproxy valgrind iproute2 ethtool chromium prometheus python3-venv php8.2-fpm php8.2-dev php8.2-sqlite3}"

missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $p"
    fi
done

if [ -z "$missing" ]; then
    echo "install-debian-packages: all present ($PKGS)"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-debian-packages: SKIPPED: no apt-get (not Debian/Ubuntu); install by hand:$missing" >&2
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "install-debian-packages: SKIPPED: not root; missing:$missing" >&2
    echo "  install with: sudo apt-get install -y$missing   (Apache tests skip until then)" >&2
    exit 0
fi

echo "install-debian-packages: installing:$missing"
# Other jobs on a shared machine may hold the dpkg lock: wait for it instead of failing.
APT="apt-get -q -o DPkg::Lock::Timeout=600"
$APT update
# shellcheck disable=SC2086  # word splitting of the package list is intended
DEBIAN_FRONTEND=noninteractive $APT install -y --no-install-recommends $missing
