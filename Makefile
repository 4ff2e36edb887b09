# Waterwave: `make demo` runs the main job, `make test` the whole suite.
# Both create .venv on a fresh machine and install what they need, at the
# exact versions in constraints/dev.txt (pyproject.toml keeps ranges).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CXX ?= g++
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CONSTRAINTS := constraints/dev.txt
# SYSTEM_PYTHON=python3: use that interpreter and what it already holds, with
# no .venv and no pip (a machine that cannot reach a package index, such as
# the GPU machines the device tool lends; their python3 holds torch). The
# repository goes on PYTHONPATH, since nothing is installed.
ifdef SYSTEM_PYTHON
PYTHON := $(SYSTEM_PYTHON)
PY := $(SYSTEM_PYTHON)
INSTALLED :=
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
else
INSTALLED := $(VENV)/.installed
endif
# The allocator stack over the simulated device; the CUDA runtime over the
# driver backend; the planner's search. The bindings sit on top of them all.
CORE_SRC := $(wildcard csrc/core/*.cpp csrc/alloc/*.cpp csrc/device/sim/*.cpp)
HEADERS := $(wildcard csrc/*/*.h csrc/device/*/*.h)
PLANNER_SRC := $(wildcard csrc/planner/*.cpp)
CUDA_SRC := $(wildcard csrc/device/cuda/*.cpp csrc/runtime/*.cpp)
ALL_SRC := $(CORE_SRC) $(PLANNER_SRC) $(CUDA_SRC) $(wildcard csrc/bench/*.cpp csrc/bindings/*.cpp)
EXT := $(shell $(PYTHON) -c "import sysconfig; print('waterwave/_C' + sysconfig.get_config_var('EXT_SUFFIX'))" 2>/dev/null)
SAN_FLAGS := -std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined -pthread
BIN := tests/cpp/bin
OBJ := $(BIN)/obj
# Extras make installs (EXTRAS=test,planner,cupy12,optuna,demo for CuPy on CUDA 12).
EXTRAS ?= test,planner,cupy,optuna,demo
RANDOM_RUN_OPS ?= 1000000

.PHONY: all build demo test test-python sanitize sanitize-build bench bench-gpu gpu-check gpu-wheels clean

all: build

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) setuptools wheel pybind11
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-build-isolation -e '.[$(EXTRAS)]'
	touch $@

TORCH_LIBS := $(wildcard waterwave/alloc/torch_*.cpp waterwave/alloc/torch_*.py waterwave/alloc/native_abi.h)
$(EXT): $(INSTALLED) $(ALL_SRC) $(HEADERS) setup.py $(TORCH_LIBS)
	WATERWAVE_BUILD_JOBS=$(JOBS) $(PY) setup.py -q build_ext --inplace
	touch $@

build: $(EXT)

# Two jobs on a simulated GPU, then a real search: 16 Optuna trials, four at
# a time, on scikit-learn's digits (CPU), and what they would use on a
# simulated H100 with and without the pipeline.
demo: build
	$(PY) -m waterwave demo --out out
	$(PY) examples/optuna_search.py --simulate

# The sanitizer drivers. Every source is compiled once under ASan/UBSan into
# $(OBJ) and each driver links the objects it needs, so `make -j` builds them
# side by side and no source is compiled twice.
san_obj = $(patsubst %.cpp,$(OBJ)/%.o,$(1))
CORE_OBJ := $(call san_obj,$(CORE_SRC))
PLANNER_OBJ := $(call san_obj,$(PLANNER_SRC))
CUDA_OBJ := $(call san_obj,$(CUDA_SRC))

$(OBJ)/%.o: %.cpp $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(SAN_FLAGS) -c $< -o $@

$(BIN)/random_run: $(OBJ)/tests/cpp/random_run.o $(CORE_OBJ)
	$(CXX) $(SAN_FLAGS) $^ -o $@

$(BIN)/stress_threads: $(OBJ)/tests/cpp/stress_threads.o $(CORE_OBJ)
	$(CXX) $(SAN_FLAGS) $^ -o $@

$(BIN)/offset_search_run: $(OBJ)/tests/cpp/offset_search_run.o $(PLANNER_OBJ)
	$(CXX) $(SAN_FLAGS) $^ -o $@

# The fake CUDA driver (host memory behind the driver API) and the CUDA
# backend over it, through the entry points PyTorch calls.
$(BIN)/libfakecuda.so: tests/cpp/fake_cuda.c
	@mkdir -p $(BIN)
	$(CC) -shared -fPIC -O1 -g -fsanitize=address,undefined -o $@ $< -lpthread

$(BIN)/cuda_backend_run: $(OBJ)/tests/cpp/cuda_backend_run.o $(CORE_OBJ) $(CUDA_OBJ)
	$(CXX) $(SAN_FLAGS) $^ -ldl -o $@

# The threaded drivers again under ThreadSanitizer: the allocator's locks,
# the sharing members' ledger (waits, ties, a measured budget) and the
# runtime's pools, its objects in a folder of their own.
TSAN_FLAGS := -std=c++17 -O1 -g -fsanitize=thread -pthread
TOBJ := $(BIN)/tsan-obj
tsan_obj = $(patsubst %.cpp,$(TOBJ)/%.o,$(1))

$(TOBJ)/%.o: %.cpp $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(TSAN_FLAGS) -c $< -o $@

$(BIN)/stress_threads_tsan: $(TOBJ)/tests/cpp/stress_threads.o $(call tsan_obj,$(CORE_SRC))
	$(CXX) $(TSAN_FLAGS) $^ -o $@

$(BIN)/cuda_backend_run_tsan: $(TOBJ)/tests/cpp/cuda_backend_run.o $(call tsan_obj,$(CORE_SRC) $(CUDA_SRC))
	$(CXX) $(TSAN_FLAGS) $^ -ldl -o $@

$(BIN)/libfakecuda_tsan.so: tests/cpp/fake_cuda.c
	@mkdir -p $(BIN)
	$(CC) -shared -fPIC -O1 -g -fsanitize=thread -o $@ $< -lpthread

SAN_BINS := $(BIN)/random_run $(BIN)/stress_threads $(BIN)/offset_search_run $(BIN)/cuda_backend_run $(BIN)/libfakecuda.so \
	$(BIN)/stress_threads_tsan $(BIN)/cuda_backend_run_tsan $(BIN)/libfakecuda_tsan.so
sanitize-build: $(SAN_BINS)

# The allocator under AddressSanitizer and UndefinedBehaviorSanitizer: a long
# random run of each policy (invariants after every step) and a thread stress;
# the CUDA backend over the fake driver; the planner's offset search on random
# instances. The thread stress and the CUDA backend again under
# ThreadSanitizer. The runs are independent: tests/cpp/run_all.sh runs them side by
# side and fails if any fails, printing each one's output.
sanitize: sanitize-build
	RANDOM_RUN_OPS=$(RANDOM_RUN_OPS) JOBS=$(JOBS) tests/cpp/run_all.sh $(BIN)

# The Python suite on every core (pytest-xdist): a test file's tests run in
# one worker, in their order, as they would alone.
PYTEST := $(PY) -m pytest -q -n $(JOBS) --dist loadfile

test-python: build
	$(PYTEST)

# The sanitizer build, then its runs beside the Python suite: neither reads
# the other's files. A failure of either fails `make test`.
test:
	$(MAKE) -j$(JOBS) build sanitize-build
	$(MAKE) --no-print-directory test-side-by-side

.PHONY: test-side-by-side
test-side-by-side:
	@mkdir -p $(BIN); \
	( $(MAKE) --no-print-directory sanitize > $(BIN)/sanitize.log 2>&1; echo $$? > $(BIN)/sanitize.rc ) & \
	$(PYTEST) 2>&1 | tee $(BIN)/pytest.log; py=$${PIPESTATUS[0]}; wait; \
	echo "---- sanitizer runs (tests/cpp/run_all.sh) ----"; cat $(BIN)/sanitize.log; \
	san=$$(cat $(BIN)/sanitize.rc); \
	echo "make test: pytest exit $$py, sanitizer runs exit $$san; pytest's summary:"; \
	tail -n 1 $(BIN)/pytest.log; \
	[ $$py -eq 0 ] && [ $$san -eq 0 ]

bench: build
	$(PY) -m waterwave bench alloc --json --out bench/results/alloc.json
	$(PY) bench/alloc_report.py bench/results/alloc.json bench/results/alloc.md
	$(PY) bench/concurrent/host.py --out bench/results
	$(PY) bench/concurrent/train_host.py --out bench/results

# When a GPU is lent, the one command to run: the sharing tests and the
# measured Optuna searches first, then every other GPU test and GPU benchmark
# (bench/gpu_check.py lists them), their figures under $(RESULTS)
# with the device named, within $(GPU_BUDGET_MIN) minutes. It refuses to run
# without a GPU rather than skip everything. bench-gpu: the benchmarks alone.
# Through the device tool (10-minute calls; 8 files at most come back from
# $OUT, so GPU_PACK packs them all into one, rewritten after each part):
#   make gpu-check SYSTEM_PYTHON=python3 RESULTS=/tmp/gpu GPU_PACK=$OUT/gpu_check.tgz
# GPU_PARTS="concurrent trainer": only the parts whose names hold one of
# these words (what an earlier check's budget left out: GPU_PARTS="other
# recorded inside"); GPU_TESTS=resnet18: only the GPU tests pytest -k selects.
RESULTS ?= bench/results
GPU_BUDGET_MIN ?= 9
gpu-check: build
	$(PY) bench/gpu_check.py --out $(RESULTS) --budget-min $(GPU_BUDGET_MIN) \
		$(if $(GPU_PARTS),--only $(GPU_PARTS)) $(if $(GPU_TESTS),--tests '$(GPU_TESTS)') \
		$(if $(GPU_PACK),--pack $(GPU_PACK))

bench-gpu: build
	$(PY) bench/gpu_check.py --benchmarks-only --out $(RESULTS) --budget-min $(GPU_BUDGET_MIN)

# The GPU machines reach no package index and their Python lacks Optuna
# (and perhaps pynvml, through which torch.cuda.utilization reads the GPU's
# busy share): download them and their dependencies here, as wheels for
# their Python, into build/gpu-wheels; carried along (the device tool's
# carry: build/gpu-wheels), gpu-check installs those the machine lacks
# before the tests. Then:
#   make gpu-wheels, and run with carry ["build/gpu-wheels"]:
#   make gpu-check SYSTEM_PYTHON=python3 RESULTS=$OUT GPU_BUDGET_MIN=8
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS := optuna alembic sqlalchemy colorlog tqdm PyYAML Mako MarkupSafe greenlet \
	typing_extensions packaging nvidia-ml-py
gpu-wheels: $(INSTALLED)
	$(PY) -m pip download -q --no-deps --only-binary=:all: -c $(CONSTRAINTS) \
		--python-version $(GPU_PYTHON_VERSION) --implementation cp \
		--abi cp$(subst .,,$(GPU_PYTHON_VERSION)) \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d build/gpu-wheels $(GPU_WHEELS)

clean:
	rm -rf build $(BIN) waterwave/_C*.so waterwave/_torch_bridge.*.so waterwave/_torch_native.*.so out
