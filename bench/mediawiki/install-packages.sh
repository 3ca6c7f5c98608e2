#!/bin/sh
# Debian packages of the real-application bench (bench/realapp.py): MediaWiki on SQLite served by
# mod_php under mpm_prefork or by PHP-FPM behind mpm_event, and mod_qos as the peer.
#
# Idempotent: does nothing when everything is installed; runs `apt-get update` only when
# something is missing. Needs root. Not part of `make test` (the bench's own set-up).
#
#   mediawiki php-sqlite3    MediaWiki 1.39 and its SQLite driver (no database server)
#   php-apcu                 the object cache in shared memory (mediawiki recommends it; without it
#                            every request rewrites the message cache into SQLite)
#   php-mbstring php-intl php-xml   extensions MediaWiki needs or warns without
#   libapache2-mod-php       mod_php for the prefork stack
#   php-fpm                  PHP-FPM for the event stack (Apache's mod_proxy_fcgi is in apache2)
#   libapache2-mod-qos       mod_qos, the per-location request caps of the peer arm
#
# Installing libapache2-mod-php switches the *system* Apache to mpm_prefork and the packages'
# scripts may try to start the system Apache and php-fpm: the bench's instances are private
# (their own configs, ports and processes), so any system service left running afterwards that
# was not running before is stopped here.
set -eu

PKGS="mediawiki php-sqlite3 php-apcu libapache2-mod-php php-mbstring php-intl php-xml php-fpm libapache2-mod-qos"

missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $p"
    fi
done
if [ -z "$missing" ]; then
    echo "mediawiki/install-packages: all present ($PKGS)"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "mediawiki/install-packages: not root; missing:$missing" >&2
    echo "  install with: sudo apt-get install -y --no-install-recommends$missing" >&2
    exit 1
fi

running() {  # the system service's pid file names a live process
    [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}
APACHE_PID=/var/run/apache2/apache2.pid
FPM_PID=/run/php/php8.2-fpm.pid
apache_before=0; fpm_before=0
running "$APACHE_PID" && apache_before=1
running "$FPM_PID" && fpm_before=1

echo "mediawiki/install-packages: installing:$missing"
# Other jobs on a shared machine may hold the dpkg lock: wait for it instead of failing.
APT="apt-get -q -o DPkg::Lock::Timeout=600"
$APT update
# shellcheck disable=SC2086  # word splitting of the package list is intended
DEBIAN_FRONTEND=noninteractive $APT install -y --no-install-recommends $missing

# the bench runs private instances only: stop system services the install started
if [ "$apache_before" = 0 ] && running "$APACHE_PID"; then
    echo "mediawiki/install-packages: stopping the system Apache the install started" >&2
    apache2ctl stop || kill "$(cat "$APACHE_PID")"
fi
if [ "$fpm_before" = 0 ] && running "$FPM_PID"; then
    echo "mediawiki/install-packages: stopping the system php-fpm the install started" >&2
    kill "$(cat "$FPM_PID")"
fi
