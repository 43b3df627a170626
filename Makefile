# The two README commands: `make demo` and `make test`. Everything else is CMake.
BUILD     ?= build
JOBS      ?= $(shell nproc)
CMAKE_ARGS ?=
MAKEFLAGS += --no-print-directory

.PHONY: all deps build demo test test-asan test-tsan test-long clean

all: build

deps:
	@./scripts/install-deps.sh

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

clean:
	rm -rf build build-asan build-tsan
