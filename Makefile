# Waterwave: `make demo` runs the main job, `make test` the whole suite.
# Both create .venv on a fresh machine and install what they need.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CXX ?= g++
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
# Extras make installs (EXTRAS=test,planner,cupy12 for CuPy on CUDA 12).
EXTRAS ?= test,planner,cupy
RANDOM_RUN_OPS ?= 1000000

.PHONY: all build demo test test-python sanitize bench bench-gpu clean

all: build

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "setuptools>=77" wheel "pybind11>=2.12,<4"
	$(PY) -m pip install -q --no-build-isolation -e '.[$(EXTRAS)]'
	touch $@

$(EXT): $(VENV)/.installed $(ALL_SRC) $(HEADERS) setup.py waterwave/alloc/torch_bridge.cpp waterwave/alloc/torch_bridge.py
	$(PY) setup.py -q build_ext --inplace
	touch $@

build: $(EXT)

demo: build
	$(PY) -m waterwave demo --out out

$(BIN)/random_run: tests/cpp/random_run.cpp $(CORE_SRC) $(HEADERS)
	mkdir -p $(BIN)
	$(CXX) $(SAN_FLAGS) $(CORE_SRC) $< -o $@

$(BIN)/stress_threads: tests/cpp/stress_threads.cpp $(CORE_SRC) $(HEADERS)
	mkdir -p $(BIN)
	$(CXX) $(SAN_FLAGS) $(CORE_SRC) $< -o $@

$(BIN)/offset_search_run: tests/cpp/offset_search_run.cpp $(PLANNER_SRC) $(HEADERS)
	mkdir -p $(BIN)
	$(CXX) $(SAN_FLAGS) $(PLANNER_SRC) $< -o $@

# The fake CUDA driver (host memory behind the driver API) and the CUDA
# backend over it, through the entry points PyTorch calls.
$(BIN)/libfakecuda.so: tests/cpp/fake_cuda.c
	mkdir -p $(BIN)
	$(CC) -shared -fPIC -O1 -g -fsanitize=address,undefined -o $@ $< -lpthread

$(BIN)/cuda_backend_run: tests/cpp/cuda_backend_run.cpp $(CORE_SRC) $(CUDA_SRC) $(HEADERS)
	mkdir -p $(BIN)
	$(CXX) $(SAN_FLAGS) $(CORE_SRC) $(CUDA_SRC) $< -ldl -o $@

# The allocator under AddressSanitizer and UndefinedBehaviorSanitizer: a long
# random run of each policy (invariants after every step) and a thread stress;
# the CUDA backend over the fake driver; the planner's offset search on random
# instances.
sanitize: $(BIN)/random_run $(BIN)/stress_threads $(BIN)/offset_search_run $(BIN)/cuda_backend_run $(BIN)/libfakecuda.so
	$(BIN)/random_run waterwave $(RANDOM_RUN_OPS) 1
	$(BIN)/random_run pytorch $(RANDOM_RUN_OPS) 1
	$(BIN)/stress_threads waterwave 4 100000 1
	$(BIN)/stress_threads pytorch 4 100000 1
	$(BIN)/stress_threads waterwave 4 50000 2 expandable_segments:True
	$(BIN)/stress_threads pytorch 4 50000 2 expandable_segments:True
	$(BIN)/cuda_backend_run $(BIN)/libfakecuda.so waterwave 4 20000 1
	$(BIN)/cuda_backend_run $(BIN)/libfakecuda.so pytorch 4 20000 1
	$(BIN)/cuda_backend_run $(BIN)/libfakecuda.so waterwave 4 10000 2 expandable_segments:True
	$(BIN)/cuda_backend_run $(BIN)/libfakecuda.so pytorch 4 10000 2 expandable_segments:True
	$(BIN)/offset_search_run 400 1

test-python: build
	$(PY) -m pytest -q

test: build sanitize test-python

bench: build
	$(PY) -m waterwave bench alloc --json --out bench/results/alloc.json
	$(PY) bench/alloc_report.py bench/results/alloc.json bench/results/alloc.md
	$(PY) bench/concurrent/host.py --out bench/results

# On a GPU (docker/README.md): each allocator's cost inside PyTorch, training
# under each allocator and the planner, and the concurrent jobs under 12 GiB.
bench-gpu: build
	$(PY) -m waterwave bench alloc --gpu --out bench/results/alloc_gpu.json
	$(PY) bench/alloc_report.py bench/results/alloc_gpu.json bench/results/alloc_gpu.md
	$(PY) bench/gpu.py --out bench/results/gpu.json
	$(PY) bench/gpu.py --report bench/results/gpu.json
	$(PY) bench/concurrent/gpu.py --out bench/results
	$(PY) bench/concurrent/trainer_gpu.py --out bench/results

clean:
	rm -rf build $(BIN) waterwave/_C*.so waterwave/_torch_bridge.*.so out
