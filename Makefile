# A thin layer over CMake. The real build is CMakeLists.txt; these targets
# only install dependencies, pick build directories and run things.
#
#   make            build (release with debug info) into build/release
#   make test       install test dependencies, build, run every test, then
#                   rebuild with ASan+UBSan and run the native tests again
#   make demo       install dependencies, build, train the example transformer
#                   language model (PyTorch) through a standalone daemon with 2
#                   ranks and 2 worker processes
#   make demo-mlp   the same with the C example (an MLP, workers in C)
#   make bench      run the benchmarks (JSON lines)
#   make bench-net  the example LM on two nodes in network namespaces at
#                   100 Mbit/s, 1 and 10 Gbit/s and unshaped, ZeRO++ off
#                   and on, and torch DDP (root; docs/benchmarks.md, "Emulated networks")
#   make bench-cpuadam  zerod's CPU AdamW (with its bf16 copy) against
#                   DeepSpeed's CPUAdam, 1 and 2 threads (from .venv-torch2)
#   make chaos      kill nodes and workers under two jobs for 5 minutes; each job
#                   must end bit-identical to a run without faults
#   make install    build, then install zerod, zerodctl, libzerod, zerod.h,
#                   zerod.pc and the CUDA module under PREFIX (default: the
#                   configured CMAKE_INSTALL_PREFIX, /usr/local); DESTDIR is
#                   honoured (docs/operations.md, "Install")
#   make test-gpu   run the GPU tests, failing (not skipping) without a GPU
#   make fuzz       build the libFuzzer targets with clang and run each briefly,
#                   from the kept corpora (tests/fuzz/corpus); make fuzz-merge
#                   folds what it found into them
#   make image      build, then make an OCI image of the installed tree on a
#                   minimal Debian bookworm root (mmdebstrap, buildah; no
#                   container daemon): build/image/zerod-VERSION.oci.tar and
#                   localhost/zerod:VERSION in buildah's storage under
#                   build/image/storage (docs/operations.md, "Image"); root
#   make test-image unpack that image (umoci) and run its programs in it as its
#                   user: versions, files, config, and the C example trained
#                   through the image's zerod; makes the image if it is missing
#   make format     clang-format every C/CUDA source
#   make abi-baseline  write libzerod's ABI, as this build has it, into
#                   client/abi/ as the baseline the test abi.check compares
#                   with: only in the commit that changes the ABI on purpose
#                   (docs/client.md, "ABI policy"); needs abigail-tools

BUILD      ?= build/release
ASAN_BUILD ?= build/asan
FUZZ_BUILD ?= build/fuzz
CMAKE_ARGS ?=
FUZZ_SECONDS ?= 60
PREFIX     ?=
IMAGE_DIR  ?= build/image
VERSION    := $(shell sed -n 's/^project(zerod VERSION \([0-9][0-9.]*\)[ )].*/\1/p' CMakeLists.txt)
GENERATOR  := $(if $(shell command -v ninja 2>/dev/null),-G Ninja,)
CTEST      := ctest --output-on-failure --timeout 900

.PHONY: all build deps test test-asan test-gpu demo demo-mlp bench bench-net bench-cpuadam chaos install wheel image image-torch test-image fuzz \
  fuzz-merge \
  format abi-baseline clean

all: build

# Configure once; later runs of cmake --build re-run CMake when needed.
$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) $(GENERATOR) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD)

deps:
	scripts/deps.sh test

# The Python package as a manylinux wheel carrying libzerod and the
# libraries it needs beyond glibc: build/wheel/zerod-*-manylinux_*.whl.
wheel: build
	scripts/deps.sh wheel
	scripts/wheel.sh $(BUILD)

test:
	scripts/deps.sh test
	$(MAKE) build
	cd $(BUILD) && $(CTEST)
	$(MAKE) test-asan

$(ASAN_BUILD)/CMakeCache.txt:
	cmake -S . -B $(ASAN_BUILD) $(GENERATOR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DZEROD_SANITIZE=ON \
	  -DZEROD_CUDA=OFF -DZEROD_BENCH=OFF $(CMAKE_ARGS)

# The sanitizer build runs every native test; of the Python tests, only
# python.asan_daemon (the sanitized daemon under an uninstrumented client
# library: the release build's, which an uninstrumented Python can load).
test-asan: $(ASAN_BUILD)/CMakeCache.txt
	cmake --build $(ASAN_BUILD)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  ZEROD_CLIENT_LIBRARY=$(if $(wildcard $(BUILD)/lib/libzerod.so),$(CURDIR)/$(BUILD)/lib/libzerod.so) \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 $(CTEST)

# The chaos run (docs/redundancy.md, "Chaos"): two jobs on four nodes, a
# node or a worker killed every ~20 s for 5 minutes (ZEROD_CHAOS_SECONDS,
# ZEROD_CHAOS_EVERY_S, ZEROD_CHAOS_SEED); bounded: it fails past 20 min.
chaos: build
	cd $(BUILD) && ZEROD_CHAOS_SECONDS=$${ZEROD_CHAOS_SECONDS:-300} \
	  ZEROD_CHAOS_EVERY_S=$${ZEROD_CHAOS_EVERY_S:-20} timeout 1200 ctest -R '^python.zerod_chaos$$' \
	  --output-on-failure --timeout 1200 -V

test-gpu: build
	cd $(BUILD) && ZEROD_REQUIRE_GPU=1 $(CTEST) -L gpu

demo:
	scripts/deps.sh demo
	$(MAKE) build
	scripts/demo.sh $(BUILD)

demo-mlp:
	scripts/deps.sh build
	$(MAKE) build
	scripts/demo_mlp.sh $(BUILD)

bench-net:
	scripts/deps.sh bench
	$(MAKE) build
	ZEROD_BIN_DIR=$(BUILD)/bin ZEROD_LIBRARY=$(CURDIR)/$(BUILD)/lib/libzerod.so /usr/bin/python3 bench/bench_net.py

# DeepSpeed's cpu_adam op is built (JIT, about a minute) on the first run.
bench-cpuadam:
	scripts/deps.sh deepspeed
	$(MAKE) build
	ZEROD_KERNELS_LIB=$(CURDIR)/$(BUILD)/lib/libzerod_kernels.so .venv-torch2/bin/python bench/bench_cpuadam.py

bench:
	scripts/deps.sh bench
	$(MAKE) build
	$(BUILD)/bench/bench_kernels
	$(BUILD)/bench/bench_comm
	$(BUILD)/bench/bench_ipc
	$(BUILD)/bench/bench_control
	ZEROD_BIN_DIR=$(BUILD)/bin /usr/bin/python3 bench/bench_cluster.py
	$(BUILD)/bench/bench_ckpt
	$(BUILD)/bench/bench_offload
	ZEROD_BIN_DIR=$(BUILD)/bin /usr/bin/python3 bench/bench_checkpoint.py
	scripts/bench_e2e.sh $(BUILD)
	ZEROD_BIN_DIR=$(BUILD)/bin ZEROD_LIBRARY=$(CURDIR)/$(BUILD)/lib/libzerod.so /usr/bin/python3 bench/bench_torch_lm.py
	ZEROD_BIN_DIR=$(BUILD)/bin ZEROD_LIBRARY=$(CURDIR)/$(BUILD)/lib/libzerod.so .venv-torch2/bin/python bench/bench_torch_lm.py
	ZEROD_BIN_DIR=$(BUILD)/bin ZEROD_LIBRARY=$(CURDIR)/$(BUILD)/lib/libzerod.so /usr/bin/python3 bench/bench_bases.py
	ZEROD_BIN_DIR=$(BUILD)/bin ZEROD_LIBRARY=$(CURDIR)/$(BUILD)/lib/libzerod.so .venv-torch2/bin/python bench/bench_bases.py
	ZEROD_BIN_DIR=$(BUILD)/bin ZEROD_LIBRARY=$(CURDIR)/$(BUILD)/lib/libzerod.so /usr/bin/python3 bench/bench_zeropp.py
	ZEROD_BIN_DIR=$(BUILD)/bin ZEROD_LIBRARY=$(CURDIR)/$(BUILD)/lib/libzerod.so /usr/bin/python3 bench/bench_redundancy.py
	ZEROD_BIN_DIR=$(BUILD)/bin ZEROD_LIBRARY=$(CURDIR)/$(BUILD)/lib/libzerod.so /usr/bin/python3 bench/bench_subscribe.py
	ZEROD_BIN_DIR=$(BUILD)/bin ZEROD_LIBRARY=$(CURDIR)/$(BUILD)/lib/libzerod.so /usr/bin/python3 bench/bench_follow.py
	@if [ -x $(BUILD)/bench/bench_cuda ]; then $(BUILD)/bench/bench_cuda; fi
	@if [ -x $(BUILD)/bench/bench_offload_gpu ]; then $(BUILD)/bench/bench_offload_gpu; fi

# cmake --install reads DESTDIR from the environment, where make puts a
# DESTDIR given on its command line.
install: build
	cmake --install $(BUILD) $(if $(PREFIX),--prefix $(PREFIX),)

image:
	scripts/deps.sh image
	$(MAKE) build
	ZEROD_IMAGE_DIR=$(IMAGE_DIR) scripts/image.sh $(BUILD)

# The PyTorch example job's image (deploy/examples/train-torch-job.yaml):
# Debian's torch and the manylinux wheel, checked by training a few steps
# in it before it is committed; root.
image-torch:
	scripts/deps.sh image
	scripts/deps.sh wheel
	$(MAKE) build
	ZEROD_IMAGE_DIR=$(IMAGE_DIR) scripts/image_torch.sh $(BUILD)

# Not part of `make test`: the image is made from Debian packages downloaded
# each time, and the test needs root.
test-image:
	scripts/deps.sh image
	$(MAKE) build
	@test -f $(IMAGE_DIR)/zerod-$(VERSION).oci.tar || $(MAKE) image
	tests/image/run_image_test.sh $(IMAGE_DIR)/zerod-$(VERSION).oci.tar $(BUILD)

$(FUZZ_BUILD)/CMakeCache.txt:
	CC=clang CXX=clang++ cmake -S . -B $(FUZZ_BUILD) $(GENERATOR) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DZEROD_FUZZ=ON -DZEROD_CUDA=OFF -DZEROD_BENCH=OFF $(CMAKE_ARGS)

fuzz:
	scripts/deps.sh fuzz
	$(MAKE) $(FUZZ_BUILD)/CMakeCache.txt
	cmake --build $(FUZZ_BUILD) --target fuzz_dequantize fuzz_onebit fuzz_frame fuzz_control fuzz_manifest \
	  fuzz_safetensors fuzz_promtext fuzz_replica fuzz_deepspeed
	@for f in $(FUZZ_BUILD)/tests/fuzz/fuzz_*; do \
	  name=$$(basename $$f); \
	  echo "== $$f ($(FUZZ_SECONDS) s)"; \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$name; \
	  ASAN_OPTIONS=malloc_context_size=0 $$f -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    $(FUZZ_BUILD)/corpus/$$name \
	    $$(test -d tests/fuzz/corpus/$$name && echo tests/fuzz/corpus/$$name) \
	    $$(test -d tests/fuzz/seeds/$$name && echo tests/fuzz/seeds/$$name) || exit 1; \
	done

# Folds what `make fuzz` (or a campaign) found into the kept corpora: each
# tests/fuzz/corpus/<target> becomes the smallest set of inputs that reaches
# every feature of it and of build/fuzz/corpus/<target> (libFuzzer -merge).
fuzz-merge:
	@for f in $(FUZZ_BUILD)/tests/fuzz/fuzz_*; do \
	  name=$$(basename $$f); \
	  test -d $(FUZZ_BUILD)/corpus/$$name || continue; \
	  rm -rf $(FUZZ_BUILD)/merged/$$name && mkdir -p $(FUZZ_BUILD)/merged/$$name; \
	  $$f -merge=1 $(FUZZ_BUILD)/merged/$$name \
	    $$(test -d tests/fuzz/corpus/$$name && echo tests/fuzz/corpus/$$name) \
	    $(FUZZ_BUILD)/corpus/$$name || exit 1; \
	  rm -rf tests/fuzz/corpus/$$name && mkdir -p tests/fuzz/corpus && \
	    mv $(FUZZ_BUILD)/merged/$$name tests/fuzz/corpus/$$name; \
	done

format:
	clang-format -i $$(git ls-files '*.c' '*.h' '*.cu' '*.cc')

abi-baseline:
	scripts/deps.sh test
	$(MAKE) build
	cmake --build $(BUILD) --target abi-baseline

clean:
	rm -rf build
