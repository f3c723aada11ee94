# dynprobe: `make demo` sets up and runs the demonstration, `make test` sets up and runs the tests,
# `make bench` runs the benchmark harness. Each creates .venv and installs what it needs.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
CC     ?= gcc

EXAMPLES := examples/bin/wordcount examples/bin/app

.PHONY: all venv demo test lint typecheck unit bench tracefs toolchains stress-test stress-kill mutate lossless coverage clean

all: test

# gcc and Python's headers: pip builds output/callwalk.c and core/upcalls.c (setup.py) with the package.
$(STAMP): pyproject.toml setup.py src/dynprobe/output/callwalk.c src/dynprobe/core/upcalls.c
	@command -v $(CC) >/dev/null && command -v g++ >/dev/null || (apt-get update -qq && apt-get install -y -qq gcc g++)
	@$(PYTHON) -c "import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" || \
	  (apt-get update -qq && apt-get install -y -qq python3-dev)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

# Byte-compiled once here: an environment with PYTHONDONTWRITEBYTECODE (CI images often set it)
# would otherwise compile dynprobe again at every start (~0.15 s per command).
venv: $(STAMP)
	@$(PY) -m compileall -q src

examples/bin/%: examples/%.c
	@mkdir -p examples/bin
	$(CC) -O1 -g -fno-omit-frame-pointer -o $@ $<

demo: venv $(EXAMPLES)
	@bash examples/demo.sh

# Kernel uprobes (tracefs) are used by comparison tests and the benchmark; mount it if we may.
tracefs:
	@[ -e /sys/kernel/tracing/uprobe_events ] || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || \
	  echo "note: tracefs not available; kernel-uprobe comparisons will be skipped"

lint: venv
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

typecheck: venv
	$(VENV)/bin/mypy src

# A Go toolchain lets the return-probe tests check that Go programs are refused (hazard 1);
# uftrace is the function tracer's reference (same call graphs, and the benchmark's comparison);
# gdb is the stack walk's (the same frames as its backtraces); bpftrace is the language's (the
# same errors, and the benchmark's peer for stacks); ltrace counts library calls (memcpy's and
# mempcpy's, whose branch between them a probe takes along).
toolchains:
	@command -v go >/dev/null || (apt-get install -y -qq golang-go >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq golang-go >/dev/null 2>&1)) || \
	  echo "note: no Go toolchain; the Go refusal test will be skipped"
	@command -v uftrace >/dev/null || (apt-get install -y -qq uftrace >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq uftrace >/dev/null 2>&1)) || \
	  echo "note: no uftrace; the comparison with it will be skipped"
	@command -v gdb >/dev/null || (apt-get install -y -qq gdb >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq gdb >/dev/null 2>&1)) || \
	  echo "note: no gdb; the comparison of stacks with its backtraces will be skipped"
	@command -v bpftrace >/dev/null || (apt-get install -y -qq bpftrace >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq bpftrace >/dev/null 2>&1)) || \
	  echo "note: no bpftrace; the comparisons with it will be skipped"
	@command -v ltrace >/dev/null || (apt-get install -y -qq ltrace >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq ltrace >/dev/null 2>&1)) || \
	  echo "note: no ltrace; the comparison of library call counts with it will be skipped"
	@command -v sqlite3 >/dev/null && [ -e /usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0 ] || \
	  (apt-get install -y -qq sqlite3 libpython3.11 liblzma5 >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq sqlite3 libpython3.11 liblzma5 >/dev/null 2>&1)) || \
	  echo "note: no sqlite3 or libpython3.11; the real programs' tests and make bench's rows of them will be skipped"

test: venv tracefs toolchains lint typecheck
	$(VENV)/bin/pytest -q -p no:cacheprovider

bench: venv tracefs toolchains
	$(PY) bench/run.py

# The suite 20 times in a row, every other run on a loaded machine (tests/stress.sh RUNS).
stress-test: venv tracefs toolchains
	bash tests/stress.sh 20

# dynprobe SIGKILLed at random moments in every mode, 100 runs each, then again on a loaded
# machine (tests/killing.py).
stress-kill: venv
	$(PY) -m tests.killing --runs 100
	$(PY) -m tests.killing --runs 100 --loaded

# Mutation testing of the pure core: each module's mutants against its unit tests (tests/mutation.py).
mutate: venv
	$(PY) -m tests.mutation

# The bursts that once lost records at the defaults, 20 runs each beside a CPU hog per CPU.
lossless: venv
	$(PY) -m tests.lossless

# The suite under coverage.py, every Python process it starts measured (pyproject.toml's
# [tool.coverage]), then lines and branches per module; fails below 92% of branches.
coverage: venv tracefs toolchains
	rm -rf build/coverage && mkdir -p build/coverage
	$(VENV)/bin/coverage run -m pytest -q -p no:cacheprovider -n 2
	$(VENV)/bin/coverage combine -q
	$(PY) -m tests.coverage_check

clean:
	rm -rf $(VENV) examples/bin bench/build tests/.build
