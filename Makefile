# The two README commands: `make demo` and `make test`. Everything else is CMake.
BUILD     ?= build
JOBS      ?= $(shell nproc)
CMAKE_ARGS ?=
MAKEFLAGS += --no-print-directory

.PHONY: all deps bench-deps build demo test test-asan test-tsan test-long fuzz fuzz-run mutate clean

all: build

deps:
	@./scripts/install-deps.sh

# the llama.cpp baseline of `bench engine --context-only` (npm ci in bench/llamacpp)
bench-deps:
	@./scripts/install-bench-deps.sh

build: deps
	cmake -S . -B $(BUILD) $(CMAKE_ARGS) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	./scripts/demo.sh $(BUILD)/kvtier

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) -LE long

test-long: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) -L long

test-asan: deps
	cmake -S . -B build-asan -DKVT_SANITIZE=address -DCMAKE_BUILD_TYPE=Debug $(CMAKE_ARGS) >/dev/null
	cmake --build build-asan -j $(JOBS)
	ctest --test-dir build-asan --output-on-failure -j $(JOBS) -LE long

test-tsan: deps
	cmake -S . -B build-tsan -DKVT_SANITIZE=thread -DCMAKE_BUILD_TYPE=Debug $(CMAKE_ARGS) >/dev/null
	cmake --build build-tsan -j $(JOBS)
	ctest --test-dir build-tsan --output-on-failure -j $(JOBS) -LE long

# libFuzzer targets of fuzz/ (clang, ASan+UBSan) in build-fuzz; fuzz-run runs
# each (or only TARGETS="fuzz_a fuzz_b") for SECONDS seconds on its corpus,
# new inputs and crashes under build-fuzz/fuzz-run (fuzz/README.md)
SECONDS ?= 30
TARGETS ?=
fuzz: deps
	cmake -S . -B build-fuzz -DKVT_FUZZ=ON -DCMAKE_C_COMPILER=clang -DBUILD_TESTING=OFF $(CMAKE_ARGS) >/dev/null
	cmake --build build-fuzz -j $(JOBS) --target fuzz

fuzz-run: fuzz
	./fuzz/run.sh build-fuzz/fuzz $(SECONDS) build-fuzz/fuzz-run $(TARGETS)

# mutation testing: every mutation of tools/mutate/mutations.txt, one at a
# time in a scratch copy under /tmp (never this tree), built and tested;
# prints killed/survived and the kill rate. MUTATE_ARGS="--only R01,S07"
MUTATE_ARGS ?=
mutate: deps
	python3 tools/mutate/mutate.py --jobs $(JOBS) $(MUTATE_ARGS)

clean:
	rm -rf build build-asan build-tsan build-fuzz
