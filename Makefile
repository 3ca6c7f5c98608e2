# The README's two commands: `make demo` (set-up + the main job on the bundled example) and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: demo test venv clean

$(STAMP): setup.cfg pyproject.toml
	sh apache-conf/install-debian-packages.sh  # python3-venv first on a fresh Debian
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip uninstall -q -y overtake 2>/dev/null || true  # the pre-0.1 distribution name
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	sh apache-conf/install-debian-packages.sh
	bash examples/demo/run.sh

test: $(STAMP)
	sh apache-conf/install-debian-packages.sh
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) demo-out
