# contextd developer entry points. `make help` lists them.
# Every target bootstraps what it needs through its prerequisites, so `make run` and
# `make test` work on a fresh machine with Python 3.11, pip and cargo.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMPS := .stamps
PROTO_FILES := $(wildcard proto/contextd/v1/*.proto)
PROTO_OUT := service/contextd/v1
RUST_SOURCES := $(shell find rust_core/src -name '*.rs') rust_core/Cargo.toml $(wildcard rust_core/Cargo.lock) $(wildcard rust_core/data/*)

CONTEXTD_ADDR ?= 127.0.0.1:50051
CONTEXTD_DATA_DIR ?= ./data
export CONTEXTD_ADDR CONTEXTD_DATA_DIR

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMPS):
	@mkdir -p $(STAMPS)

$(STAMPS)/venv: pyproject.toml | $(STAMPS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "maturin>=1.7,<2"
	@touch $@

# Dependencies are installed from pyproject.toml without building the package, so that
# editing Rust code only rebuilds the extension (below), not the whole environment.
$(STAMPS)/deps: $(STAMPS)/venv pyproject.toml
	$(PY) -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	  print('\n'.join(d['dependencies'] + d['optional-dependencies']['dev']))" > $(STAMPS)/requirements.txt
	$(PIP) install --quiet -r $(STAMPS)/requirements.txt
	@touch $@

# maturin develop builds the extension directly (pip's route goes through build_backend/,
# which hands over to maturin: hence no warning about pyproject's build-backend).
$(STAMPS)/rust: $(STAMPS)/deps $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) MATURIN_NO_MISSING_BUILD_BACKEND_WARNING=1 \
	  $(VENV)/bin/maturin develop --release --quiet
	@touch $@

# The server's code (contextd.v1), and the client's development copy (contextd_client.v1,
# in client/src; client/codegen.py says why it is the same descriptors under another name).
$(STAMPS)/proto: $(STAMPS)/deps $(PROTO_FILES) client/codegen.py
	$(PY) -m grpc_tools.protoc -Iproto --python_out=service --grpc_python_out=service \
	  --pyi_out=service $(PROTO_FILES)
	$(PY) client/codegen.py client/src
	@touch $@

.PHONY: proto
proto: $(STAMPS)/proto ## Generate the gRPC code from proto/ into service/contextd/v1/ and client/src/

# The client package, installed editable (its stubs are the development copy `make proto`
# writes into client/src): the command line's client verbs and the tests import it.
$(STAMPS)/client-dev: $(STAMPS)/proto client/pyproject.toml client/setup.py
	$(PIP) install --quiet --no-deps --no-build-isolation -e ./client
	@touch $@

.PHONY: build
build: $(STAMPS)/rust $(STAMPS)/proto $(STAMPS)/client-dev ## Set up everything `run` needs (venv, deps, release Rust build, gRPC code)

.PHONY: run
run: build ## Start the server on $CONTEXTD_ADDR with its DuckDB file in $CONTEXTD_DATA_DIR
	$(VENV)/bin/contextd serve

.PHONY: test
test: build $(STAMPS)/bench-deps ## Run the whole suite: cargo test, pytest, then the quick benchmark once
	cd rust_core && cargo test --quiet
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory bench-quick

$(STAMPS)/bench-deps: $(STAMPS)/deps
	$(PY) -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	  print('\n'.join(d['optional-dependencies']['bench']))" > $(STAMPS)/bench-requirements.txt
	$(PIP) install --quiet -r $(STAMPS)/bench-requirements.txt
	@touch $@

.PHONY: bench
bench: build $(STAMPS)/bench-deps ## Run the full benchmark suite and write docs/benchmarks.md
	$(PY) -m bench --size full

.PHONY: bench-quick
bench-quick: build $(STAMPS)/bench-deps ## Run a small benchmark to keep the suite working (writes to bench/results/)
	$(PY) -m bench --size quick

# `buf breaking` compares proto/ with an earlier committed version of itself. When proto/
# has changes not yet committed (edited, staged or new files), the baseline is HEAD: what is
# checked is exactly those pending edits. Comparing them with HEAD~1 instead would mix them
# with the last commit's change, and after a commit that broke the contract on purpose (as a
# new major version may) every later edit would keep failing on that old break. With proto/
# clean, the baseline is HEAD~1: the check is on the change the last commit made. Set
# BUF_AGAINST to another ref to check more, e.g. `make lint BUF_AGAINST=main` for a branch.
BUF_AGAINST ?= $(shell if [ -n "$$(git status --porcelain -- proto)" ]; then echo HEAD; else echo HEAD~1; fi)
# Every change since the contract was decided (tag v1-contract) must be additive, too.
BUF_BASELINE ?= v1-contract

.PHONY: lint
lint: build $(STAMPS)/bench-deps ## ruff, mypy (+ stubtest of the Rust stub), buf lint and breaking, cargo fmt/clippy
	$(VENV)/bin/ruff check service tests bench build_backend client
	$(VENV)/bin/ruff format --check service tests bench build_backend client
	$(VENV)/bin/mypy
	cd client && $(abspath $(VENV))/bin/mypy
	$(VENV)/bin/mypy bench
	$(VENV)/bin/mypy build_backend
	$(VENV)/bin/mypy tests
	$(PY) -m mypy.stubtest contextd._core --mypy-config-file pyproject.toml
	$(VENV)/bin/buf lint
	$(VENV)/bin/buf breaking --against '.git#ref=$(BUF_AGAINST),subdir=proto'
	if git rev-parse -q --verify 'refs/tags/$(BUF_BASELINE)' >/dev/null; then \
	  $(VENV)/bin/buf breaking --against '.git#tag=$(BUF_BASELINE),subdir=proto'; fi
	cd rust_core && cargo fmt --check
	cd rust_core && cargo clippy --all-targets -- -D warnings
	cd rust_core && cargo clippy --all-targets --features python -- -D warnings

# What `pip install .` gives, checked end to end: an sdist (only what it declares), a wheel
# built from it by the build backend (which generates the gRPC code), installed into a fresh
# venv, whose `contextd` must serve on a free port and stop cleanly (`python -I` keeps this
# tree and PYTHONPATH off sys.path, so all of it comes from the installed wheel).
# It compiles the Rust core from scratch (a few minutes), so nothing else runs it; run it
# after changing pyproject.toml, build_backend/ or the package layout.
.PHONY: check-install
check-install: ## Build an sdist and a wheel, install in a fresh venv, start and stop `contextd serve`
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/pip" install --quiet build; \
	"$$tmp/venv/bin/python" -m build --outdir "$$tmp/dist" .; \
	"$$tmp/venv/bin/pip" install --quiet "$$tmp"/dist/*.whl; \
	"$$tmp/venv/bin/python" -I $(CURDIR)/build_backend/check_install.py

# contextd-client, the pure-Python client package (client/). Its setup.py generates the gRPC
# code from proto/ into the build directory while building (client/codegen.py), so nothing
# generated is committed or copied by hand. --no-build-isolation builds with this venv's
# setuptools and grpcio-tools (dev dependencies; codegen.py checks the generated code's
# version floors), so the build needs no network; `pip wheel ./client` without it works too.
.PHONY: client
client: $(STAMPS)/deps ## Build the Python client's wheel into dist/ (contextd_client-*.whl)
	rm -rf client/build
	$(PIP) wheel --quiet --no-deps --no-build-isolation --wheel-dir dist ./client
	rm -rf client/build client/src/*.egg-info
	@ls dist/contextd_client-*.whl

.PHONY: fmt
fmt: $(STAMPS)/deps ## Format Python and Rust code
	$(VENV)/bin/ruff format service tests bench build_backend client
	$(VENV)/bin/ruff check --fix service tests bench build_backend client
	cd rust_core && cargo fmt

.PHONY: clean
clean: ## Remove the venv, builds, generated code and stamps (keeps ./data)
	rm -rf $(VENV) $(STAMPS) rust_core/target target .pytest_cache .mypy_cache .ruff_cache
	rm -rf dist client/build client/src/*.egg-info
	find service client/src -name '*_pb2*.py*' -delete
	find service -name '_core*.so' -delete
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
