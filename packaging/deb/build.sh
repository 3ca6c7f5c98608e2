#!/bin/bash
# Build the Debian package: `make deb` -> dist/overtake-server_VERSION_ARCH.deb
#
#   /opt/overtake/venv          the wheel and its dependencies in their own Python (Debian's
#                               python3.11), compiled to bytecode, with the solver's kernels
#                               built ahead of time (no solve compiles at run time)
#   /usr/bin/overtake           -> /opt/overtake/venv/bin/overtake
#   /usr/lib/apache2/modules/mod_overtake_prio.so, /etc/apache2/mods-available/overtake_prio.{load,conf}
#                               built with Debian's apxs (apache2-dev): `a2enmod overtake_prio`
#   /lib/systemd/system/overtake-sidecar.service   (apache-conf/overtake-sidecar.service)
#   /etc/overtake/sidecar.yaml  the example configuration (a conffile, as is everything in /etc)
#   /usr/share/overtake/        the Grafana dashboard, its Prometheus scrape job, the examples
#   /var/log/overtake           the request log's folder; postinst creates the system user
#
# The tree is staged under a temporary folder and packed by `dpkg-deb --build`. The venv is made
# there and then moved in name only: its scripts' first lines and the bytecode's file names are
# rewritten to /opt/overtake (a venv cannot be copied as it is). Needs the network, or pip's cache,
# for the dependencies. Usage: packaging/deb/build.sh [OUTPUT.deb]
set -euo pipefail

cd "$(dirname "$0")/../.."
REPO=$PWD
HERE=$REPO/packaging/deb
PY=/usr/bin/python3.11
PREFIX=/opt/overtake
VERSION=$(sed -n 's/^version *= *//p' setup.cfg)
ARCH=$(dpkg --print-architecture)
OUT=${1:-dist/overtake-server_${VERSION}_${ARCH}.deb}
# The ahead-of-time kernels run on every machine of the architecture, not only on this one's CPU.
AOT_CPU=${OVERTAKE_AOT_CPU:-x86-64}

# python3.11-dev: Python.h for the ahead-of-time kernels; apache2-dev: apxs
sh apache-conf/install-debian-packages.sh python3.11 python3.11-venv python3.11-dev gcc libc6-dev apache2-dev
for tool in "$PY" apxs dpkg-deb; do
    command -v "$tool" >/dev/null || { echo "build.sh: $tool not found; run as root once to install it" >&2; exit 1; }
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/overtake-deb.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
STAGE=$WORK/root
VENV=$STAGE$PREFIX/venv
step() { echo "build.sh: [${SECONDS}s] $*" >&2; }

step "venv ($PY) and the wheel"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# a wheel as pip users get it: from a copy, so nothing the checkout has built (build/, .so) leaks in
mkdir "$WORK/src"
tar -C "$REPO" --exclude=.git --exclude=.venv --exclude=build --exclude=dist --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude='_kernels_aot*' --exclude='_sim_aot*' --exclude='_fitting_aot*' -cf - . | tar -C "$WORK/src" -xf -
"$VENV/bin/python" -m pip wheel -q --no-deps -w "$WORK/wheel" "$WORK/src"
"$VENV/bin/python" -m pip install -q --no-compile "$WORK"/wheel/overtake_server-*.whl

step "ahead-of-time kernels (cpu $AOT_CPU)"
cd "$WORK"  # not the checkout: its overtake/ folder would be imported instead of the installed package
"$VENV/bin/python" -m overtake.mdp._warmup --aot-only --cpu "$AOT_CPU"
"$VENV/bin/python" -c 'from overtake.mdp import _kernels, _simcall; assert _kernels.aot_active() and _simcall.aot_active(), "no ahead-of-time kernels"'
"$VENV/bin/python" -m pip uninstall -q -y pip  # a packaged tree is not changed in place
find "$VENV" \( -name '*.nbi' -o -name '*.nbc' -o -name direct_url.json \) -delete
# the dependencies' own test suites (a fifth of the tree), never imported by the program
find "$VENV/lib" -mindepth 4 -type d -name tests -prune -exec rm -rf {} +
"$VENV/bin/python" -c 'import overtake.api.app, overtake.controller.sidecar.service, overtake.fitting, overtake.mdp.solver, scipy.sparse.linalg, numba'

step "moving the venv to $PREFIX"
# text files naming the staging folder: console scripts' #! lines, activate scripts, pyvenv.cfg
grep -rlI --null -F "$STAGE" "$VENV" | xargs -0 -r sed -i "s|$STAGE$PREFIX|$PREFIX|g"
if grep -rlI -F "$STAGE" "$VENV"; then echo "build.sh: files above still name $STAGE" >&2; exit 1; fi
# bytecode with the installed file names; unchecked: the package replaces source and bytecode together
find "$VENV" -name __pycache__ -type d -prune -exec rm -rf {} +
"$VENV/bin/python" -m compileall -q -j 2 --invalidation-mode unchecked-hash -s "$STAGE" -p / "$VENV/lib" >/dev/null
mkdir -p "$STAGE/usr/bin"
ln -s "$PREFIX/venv/bin/overtake" "$STAGE/usr/bin/overtake"

step "mod_overtake_prio (apxs)"
cd "$REPO"
mkdir "$WORK/mod"
# every source and header the module's Makefile lists (one module, several files; -Werror)
cp apache-conf/mod_overtake_prio/Makefile apache-conf/mod_overtake_prio/*.c apache-conf/mod_overtake_prio/*.h "$WORK/mod/"
make -s -C "$WORK/mod" >/dev/null
install -D -m 0644 "$WORK/mod/.libs/mod_overtake_prio.so" "$STAGE/usr/lib/apache2/modules/mod_overtake_prio.so"
strip --strip-unneeded "$STAGE/usr/lib/apache2/modules/mod_overtake_prio.so"
install -D -m 0644 "$HERE/overtake_prio.load" "$STAGE/etc/apache2/mods-available/overtake_prio.load"
install -D -m 0644 "$HERE/overtake_prio.conf" "$STAGE/etc/apache2/mods-available/overtake_prio.conf"

step "unit, configuration, shared files"
install -D -m 0644 apache-conf/overtake-sidecar.service "$STAGE/lib/systemd/system/overtake-sidecar.service"
install -D -m 0644 apache-conf/examples/sidecar.yaml "$STAGE/etc/overtake/sidecar.yaml"
install -D -m 0644 "$HERE/logrotate" "$STAGE/etc/logrotate.d/overtake-server"
SHARE=$STAGE/usr/share/overtake
install -D -m 0644 -t "$SHARE/dashboards" dashboards/grafana-sidecar.json dashboards/prometheus-scrape.yml
install -D -m 0644 -t "$SHARE/examples" apache-conf/examples/sidecar.yaml apache-conf/examples/vhost-behind-sidecar.conf
install -D -m 0644 examples/sidecar/stages.yaml "$SHARE/examples/stages.yaml"
DOC=$STAGE/usr/share/doc/overtake-server
install -D -m 0644 LICENSE "$DOC/copyright"
install -D -m 0644 README.md "$DOC/README.md"
install -D -m 0644 docs/howto/install-debian.md "$DOC/install-debian.md"
install -D -m 0644 apache-conf/mod_overtake_prio/README.md "$DOC/mod_overtake_prio.md"
install -d -m 0750 "$STAGE/var/log/overtake"

step "control"
# Depends: Debian's python3.11, adduser, and the libraries the shared objects load from the system
# (the wheels bundle the rest): the packages owning them on this machine, as dpkg-shlibdeps would.
libs=$(find "$STAGE" -type f -name '*.so*' -print0 | xargs -0 -r ldd 2>/dev/null \
       | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | grep -v -F "$STAGE" | sort -u || true)
# Not found by ldd: a wheel's bundled library loaded by another one first (found in the tree), or
# libtbb, for numba's optional TBB threading layer (numba uses its own without it).
for lib in $(find "$STAGE" -type f -name '*.so*' -print0 | xargs -0 -r ldd 2>/dev/null \
             | awk '$3 == "not" {print $1}' | sort -u); do
    if [ "$lib" != libtbb.so.12 ] && [ -z "$(find "$STAGE" -name "$lib" -print -quit)" ]; then
        echo "build.sh: library $lib not found (needed by the tree)" >&2; exit 1
    fi
done
pkgs=$(for l in $libs; do dpkg -S "$l" 2>/dev/null || dpkg -S "$(readlink -f "$l")"; done | cut -d: -f1 | sort -u)
depends=$(printf '%s\n' python3.11 adduser $pkgs | sort -u | paste -sd, | sed 's/,/, /g')
mkdir -p "$STAGE/DEBIAN"
sed -e "s/@VERSION@/$VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@DEPENDS@/$depends/" \
    -e "s/@INSTALLED_SIZE@/$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)/" "$HERE/control.in" >"$STAGE/DEBIAN/control"
(cd "$STAGE" && find etc -type f | sed 's|^|/|' | sort) >"$STAGE/DEBIAN/conffiles"
install -m 0755 "$HERE/postinst" "$HERE/prerm" "$HERE/postrm" "$STAGE/DEBIAN/"

step "dpkg-deb"
chmod -R u+rwX,go+rX,go-w "$STAGE"
chmod 0750 "$STAGE/var/log/overtake"
mkdir -p "$(dirname "$OUT")"
dpkg-deb --root-owner-group -Zzstd --build "$STAGE" "$OUT.tmp" >/dev/null
mv "$OUT.tmp" "$OUT"
step "wrote $OUT ($(du -h "$OUT" | cut -f1))"
