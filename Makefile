# The README's two commands: `make demo` (set-up + the main job on the bundled example) and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
WARM    := $(VENV)/.kernels
WARM_MDP := $(VENV)/.kernels-mdp
WARM_FIT := $(VENV)/.kernels-fitting
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: demo test test-setup deb-for-tests lint typecheck venv deb clean

$(STAMP): setup.cfg pyproject.toml
	sh apache-conf/install-debian-packages.sh  # python3-venv first on a fresh Debian
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip uninstall -q -y overtake 2>/dev/null || true  # the pre-0.1 distribution name
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# numba compiles the solver kernels once into its on-disk cache and ahead of time (mdp/_kernels_aot, mdp/_sim_aot,
# fitting/_fitting_aot), so no solve or fit pays for compiling nor, with the extensions, for importing
# numba (re-run when a kernel's source changes: numba's cache is keyed by the source file).
# The two packages' kernels are independent: `make -j2` builds them side by side.
$(WARM_MDP): $(STAMP) mdp/_kernels.py mdp/_kernels_jit.py mdp/_observed_jit.py mdp/_simkernel.py mdp/_heurkernel.py mdp/_simcall.py mdp/model.py mdp/_warmup.py
	$(BIN)/python -m overtake.mdp._warmup
	touch $@

$(WARM_FIT): $(STAMP) fitting/_kernels.py fitting/_uniformization.py fitting/_hypererlang.py fitting/_poisson.py
	$(BIN)/python -m overtake.fitting._kernels
	touch $@

$(WARM): $(WARM_MDP) $(WARM_FIT)
	touch $(WARM)

venv: $(WARM)

demo: $(WARM)
	sh apache-conf/install-debian-packages.sh
	bash examples/demo/run.sh

# The set-up's jobs run two at a time (the Debian package and the kernels first, beside lint and the
# type check). The suite runs in two processes (pytest-xdist): the tests that start a real Apache or
# php-fpm and time it in one of them, one after another, while the other runs the rest (functional
# Apache tests too) off Apache's core and below them in CPU priority (tests/conftest.py), in about
# two thirds of the time of one process (`make test PYTEST_N=1`).
# The last line says how long the set-up and the suite took.
PYTEST_N    ?= 2
PYTEST_ARGS ?=
PYTEST_DIST := $(if $(filter 1,$(PYTEST_N)),,-n $(PYTEST_N) --dist loadgroup)
MAKE_T0 := $(shell date +%s)
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target test-setup
	sh apache-conf/install-debian-packages.sh
	@t0=$(MAKE_T0); t1=$$(date +%s); \
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_DIST) $(PYTEST_ARGS); rc=$$?; t2=$$(date +%s); \
	echo "make test: set-up $$((t1 - t0)) s, pytest $$((t2 - t1)) s (wall time)"; exit $$rc

test-setup: deb-for-tests $(WARM) lint typecheck

# tests/test_deb.py reads the package `make deb` builds: built here, beside the other set-up jobs,
# rather than inside the suite, where the build held one of its two processes. Only where that test
# would build it (dpkg-deb, and root or apxs); a failed build is left to the test, which runs
# `make deb` again and shows why.
deb-for-tests:
	@if command -v dpkg-deb >/dev/null 2>&1 && { [ "$$(id -u)" = 0 ] || command -v apxs >/dev/null 2>&1; }; then \
	    mkdir -p build; $(MAKE) --no-print-directory deb >build/make-deb.log 2>&1 \
	        || echo "make test: make deb failed in the set-up (build/make-deb.log); tests/test_deb.py runs it again"; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .

# mypy cannot follow setup.cfg's package_dir, so it reads a tree of links with the installed names.
TYPECHECK := build/typecheck
typecheck: $(STAMP)
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/overtake
	for f in overtake/*.py; do ln -s ../../../$$f $(TYPECHECK)/$$f; done
	for p in fitting mdp controller api; do ln -s ../../../$$p $(TYPECHECK)/overtake/$$p; done
	cd $(TYPECHECK) && $(abspath $(BIN))/mypy --config-file $(abspath setup.cfg) -p overtake

# The Debian package (packaging/deb/build.sh): the application in its own venv under /opt/overtake,
# mod_overtake_prio, the systemd unit and /etc/overtake/sidecar.yaml. Rebuilt when a shipped file changes.
VERSION    := $(shell sed -n 's/^version *= *//p' setup.cfg)
DEB_ARCH   := $(shell dpkg --print-architecture 2>/dev/null || echo amd64)
DEB        := dist/overtake-server_$(VERSION)_$(DEB_ARCH).deb
DEB_INPUTS := setup.cfg pyproject.toml README.md LICENSE $(shell find overtake fitting mdp controller api apache-conf \
	dashboards examples/sidecar docs/howto/install-debian.md packaging/deb -type f -not -path '*/__pycache__/*' \
	-not -name '_kernels_aot*' -not -name '_sim_aot*' -not -name '_fitting_aot*' 2>/dev/null)

deb: $(DEB)

$(DEB): $(DEB_INPUTS)
	bash packaging/deb/build.sh $@

clean:
	rm -rf $(VENV) demo-out build dist
