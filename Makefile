# `make setup` is idempotent: a virtual environment in .venv, torch's CPU build, the patched
# llama-cpp-python (cached by the hash of patches/), and this project in editable mode.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.river-edge-deps

.PHONY: setup runtime build-cuda build-vulkan test test-all test-vulkan test-rpc test-arm device-bundle device-check demo results results-report clean

setup: runtime $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.torch: | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	touch $@

runtime: $(VENV)/.torch
	$(PY) patches/build.py

# The patched tree with ggml's CUDA backend (a loadable module beside the CPU variants) for one GPU
# architecture (90: Hopper; 89 Ada, 86 Ampere): compiled and cached, not installed, so it can be built on a
# machine without a GPU. On a GPU host `make setup RIVER_CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90"`
# installs it.
CUDA_ARCH ?= 90
build-cuda: $(VENV)/.torch
	$(PY) patches/build.py --no-install --cmake-args="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCH)"

# ggml's Vulkan backend as a second runtime in its own environment (.venv-vulkan), the CPU one untouched.
# On a machine without a GPU, Mesa's lavapipe (a Vulkan driver running on the CPU) provides the device.
VK     := .venv-vulkan
VKPY   := $(VK)/bin/python
VULKAN_DEBS := libvulkan-dev glslc spirv-headers mesa-vulkan-drivers
build-vulkan:
	@command -v glslc >/dev/null && [ -e /usr/include/vulkan/vulkan.h ] && [ -d /usr/include/spirv ] || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq $(VULKAN_DEBS); } || \
	  { echo "install $(VULKAN_DEBS) (Debian/Ubuntu names) first"; exit 1; }
	[ -x $(VKPY) ] || $(PYTHON) -m venv $(VK)
	$(VKPY) -m pip install -q torch==2.13.0
	$(VKPY) patches/build.py --python $(VKPY) --cmake-args="-DGGML_VULKAN=ON"
	$(VKPY) -m pip install -q -e '.[test]'

# The runtime's invariants on the Vulkan device: all layers offloaded, and half (graph split with the CPU)
test-vulkan: build-vulkan
	# ggml-vulkan skips CPU-type devices unless named: lavapipe is one
	GGML_VK_VISIBLE_DEVICES=$${GGML_VK_VISIBLE_DEVICES:-0} RIVER_TEST_DEVICE=vulkan $(VKPY) -m pytest -q tests/test_device.py

# The same invariants over ggml's RPC backend: two `river rpc-server`s on 127.0.0.1, the model on them (all
# layers, and half of them with the rest on the local CPU)
test-rpc: setup
	RIVER_TEST_DEVICE=rpc $(PY) -m pytest -q tests/test_device.py

# ARM (aarch64) under emulation: the runtime cross-compiled with ggml's ARM CPU variants (patches/cross.py: clang-19
# over Debian's aarch64 cross toolchain; cached by the series' hash), then its self-comparing invariants and its
# logits against this host's, in Debian's arm64 Python 3.11 under qemu-user as four CPUs (armv8.0, dotprod,
# SVE+i8mm, everything), each CPU's record in a temporary folder it names (tests/arm/run.py; `make test-arm
# ARM_ARGS=--record` rewrites the committed ones in bench/results/arm). As root, the Debian side (packages, the arm64
# architecture, bookworm-backports for a qemu that knows neoverse-v1) sets itself up.
ARM_ARGS ?=
test-arm: setup
	$(PY) tests/arm/run.py $(ARM_ARGS)

# The one-call check on a GPU machine with many cores (bench/device_check.py; docs/backends.md): `make device-bundle`
# here writes .device/ (the runtime or its patched source, wheels the machine cannot download, the models' shapes),
# then, carrying .device, `make device-check` there (no setup: that machine's own python3 with torch) into $$OUT.
device-bundle: setup
	$(PY) bench/device_check.py bundle

device-check:
	python3 bench/device_check.py run

$(STAMP): pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: setup
	$(PY) -m pytest -q -m "not slow"

test-all: setup
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/river demo

# Every measurement behind the README's Results section (resumable; hours on 2 cores), then the section
# itself. `make results LIMIT=2` is a smoke run into /tmp/river-results (minutes); EVAL_LIMIT caps problems.
results: setup
	$(PY) -m bench.steps run $(if $(LIMIT),--limit $(LIMIT) --out /tmp/river-results) $(if $(EVAL_LIMIT),--eval-limit $(EVAL_LIMIT))

# Only the results pages (the README's headline block, docs/results.md's section, the plots) from bench/results/*.json,
# the new records' builds matched to their patch series first (bench/builds.py); no measurement runs.
results-report: setup
	$(PY) -m bench.builds
	$(PY) -m bench.steps report

clean:
	rm -rf $(VENV) build *.egg-info
