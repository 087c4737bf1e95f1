# Quick start on a fresh machine (Python 3.11: the Makefile reads pyproject.toml with tomllib; the library itself
# runs on 3.10+):  make demo   |   make test
PYTHON ?= $(shell command -v python3.11 || command -v python3)
# The default venv gets the CPU build of torch 2.13.0 from this machine's disk, installed first: an unpinned
# resolve could pull a multi-GB CUDA build. Any torch 2.11-2.15 works (docs/compatibility.md).
DEFAULT_TORCH := 2.13.0
TORCH  ?= $(DEFAULT_TORCH)
VENV   ?= .venv
# the extras the test tiers, lint and the e2e recipes need (pyproject.toml); `make demo` installs DEMO_EXTRAS only
EXTRAS ?= dev,torchtitan,foreign,hf
DEMO_EXTRAS ?=
comma := ,
# one stamp per set of extras: `make demo` then `make test` installs the test extras into the same venv
EXTRAS_TAG = $(if $(EXTRAS),$(subst $(comma),-,$(EXTRAS)),base)
# SEED=N: the shuffled order of the test tiers (pytest-randomly); unset, a fresh seed each run, printed in the
# header. CI passes the commit's depth, so its order reproduces.
SEED   ?=
# Bytecode caches are written (into git-ignored __pycache__ folders) even where the environment turns them off
# (PYTHONDONTWRITEBYTECODE=1 on these VMs): otherwise every process a test tier starts -- pool workers, torchrun
# ranks, recipe subprocesses -- compiles ucp_dcp again and pytest rewrites every test module's asserts again.
export PYTHONDONTWRITEBYTECODE :=
RANDOM_ORDER = $(if $(SEED),--randomly-seed=$(SEED))
# `make test-torch TORCH=2.15 [TIER=test-quick]`: one venv per release outside the checkout, reused
TORCH_VENVS ?= $(HOME)/.cache/ucp-dcp/venvs
TIER   ?= test
# NOVENV=1: run on $(PYTHON) as it is (a machine whose Python already has a CUDA torch), missing pure-Python
# dependencies installed from the wheels `make wheels` put in $(WHEELS) into .novenv/site (both git-ignored)
NOVENV ?=
WHEELS ?= wheels
# torch==2.15 -> torch==2.15.* (the newest patch release); torch==2.14.1 as given
TORCH_REQ = torch==$(TORCH)$(if $(word 3,$(subst ., ,$(TORCH))),,.*)
REQS = $(PIP) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	print('\n'.join(p['dependencies'] + [r for e in '$(EXTRAS)'.split(',') if e for r in p['optional-dependencies'][e]]))"

# PY runs the code (tests, recipes); PIP installs (never with PYTHONPATH: a checkout's egg-info would look installed).
# The checkout's development package (dev/: ucp_dev, the tests' and recipes' fixtures and toy model, not in the
# wheel) is installed in editable mode in .venv; every other venv, and NOVENV, finds it on PYTHONPATH.
DEV_PATH := $(CURDIR)/dev
ifneq ($(NOVENV),)
PIP    := $(PYTHON)
STAMP  := .novenv/.ready-$(EXTRAS_TAG)
PY     := PYTHONPATH=$(CURDIR):$(DEV_PATH):$(CURDIR)/.novenv/site $(PYTHON)
else
PIP    := $(VENV)/bin/python
STAMP  := $(VENV)/.ucp-dcp-installed-$(EXTRAS_TAG)
ifeq ($(VENV),.venv)
PY     := $(PIP)
else
# a venv outside the checkout holds the dependencies only; the code under test is this checkout's
PY     := PYTHONPATH=$(CURDIR):$(DEV_PATH) $(PIP)
endif
endif

.PHONY: demo demo-run lint test test-e2e test-e2e-ci plan-scale test-full test-quick test-gpu test-torch torch-venvs wheels faults chaos soak reconfig titan-demo moe-demo memory-demo plan-demo hf-demo foreign-demo s3-demo bench-s3 bench-s3-s3rver bench bench-quick bench-gpu bench-trust scale gpu-check setup clean

# A release above this machine's pip cap (/etc/xdg/pip: torch<=2.14.1, the builds on its disk) is fetched from
# PyPI with the cap lifted; every later pip call is held to the installed torch (PIP_CONSTRAINT replaces the cap).
$(VENV)/.ucp-dcp-installed-$(EXTRAS_TAG): pyproject.toml dev/pyproject.toml Makefile constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -m pip install -q --upgrade pip
	$(PIP) -c "import torch, sys; sys.exit(not torch.__version__.startswith('$(TORCH)'))" 2>/dev/null || \
		$(PIP) -m pip install -q '$(TORCH_REQ)' || PIP_CONSTRAINT=/dev/null $(PIP) -m pip install -q '$(TORCH_REQ)'
	$(PIP) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/constraints.txt
	$(if $(filter $(DEFAULT_TORCH),$(TORCH)),grep -v '^torch==' constraints.txt >> $(VENV)/constraints.txt,true)
ifeq ($(VENV),.venv)
	PIP_CONSTRAINT=$(VENV)/constraints.txt DS_BUILD_OPS=0 $(PIP) -m pip install -q -e '.$(if $(EXTRAS),[$(EXTRAS)])' -e ./dev
else
	$(REQS) > $(VENV)/requirements.txt
	PIP_CONSTRAINT=$(VENV)/constraints.txt DS_BUILD_OPS=0 $(PIP) -m pip install -q -r $(VENV)/requirements.txt
endif
	touch $@

# no venv: what $(PYTHON) lacks of the requirements is resolved against what it has (a dry run, no index, only
# $(WHEELS)) and installed without dependencies into .novenv/site, which PYTHONPATH puts after the checkout
.novenv/.ready-$(EXTRAS_TAG): pyproject.toml dev/pyproject.toml Makefile
	mkdir -p .novenv/site
	$(REQS) > .novenv/requirements.txt
	PIP_BREAK_SYSTEM_PACKAGES=1 $(PIP) -m pip install -q --dry-run --report .novenv/report.json --no-index \
		--find-links $(WHEELS) -r .novenv/requirements.txt || { echo "NOVENV: a dependency is missing from $(WHEELS)/ \
		(run \`make wheels\` on a machine with network, for this Python: PY_VERSION=3.12)"; exit 1; }
	$(PIP) -c "import json; r = json.load(open('.novenv/report.json')); \
		print('\n'.join(f\"{i['metadata']['name']}=={i['metadata']['version']}\" for i in r['install']))" > .novenv/missing.txt
	@echo "NOVENV: $(PIP) ($$($(PIP) -c 'import torch; print("torch", torch.__version__)')); installing from $(WHEELS)/: $$(tr '\n' ' ' < .novenv/missing.txt)"
	test ! -s .novenv/missing.txt || DS_BUILD_OPS=0 $(PIP) -m pip install -q --no-deps --no-index --find-links $(WHEELS) \
		--target .novenv/site --upgrade -r .novenv/missing.txt
	touch $@

setup: $(STAMP)

# the demo needs the library alone (torch, numpy, xxhash): its venv gets no extras; a later `make test` adds them
demo:
	$(MAKE) demo-run EXTRAS=$(DEMO_EXTRAS)

demo-run: $(STAMP)
	$(PY) recipes/elastic_resume.py --save-topology dp=4 --load-topology dp=2

# style and types, before any test (CI runs it first): ruff's rules and formatting over the code, the development
# package, tests, recipes and tools; mypy over ucp_dcp (pyproject.toml [tool.ruff], [tool.mypy]; both come with the
# dev extra)
lint: $(STAMP)
	$(PY) -m ruff check ucp_dcp dev tests recipes tools
	$(PY) -m ruff format --check ucp_dcp dev tests recipes tools
	$(PY) -m mypy

# everything on the CPU but the end-to-end runs (tests/gpu only with --gpu): the single-process tests and the
# multi-process cases, one per item, on the session's pool of gloo workers (tests/support/dist.py); the 20 slowest listed.
# Two pytest-xdist workers: the multi-process items stay together on one (one set of pools), the single-process
# tests run on the other beside them (tests/conftest.py; 344 s -> 315 s on the 2-core VM, 2026-11-27)
test: $(STAMP)
	$(PY) -m pytest -m "not e2e and not full" -n 2 --dist loadgroup --durations=20 $(RANDOM_ORDER)

# the end-to-end tier (marker e2e): real torchtitan Trainers under torchrun, DeepSpeed and Megatron-Core runs writing
# the foreign checkpoints, recipe scripts and fault injection in subprocesses. CI runs it after `make test`.
test-e2e: $(STAMP)
	$(PY) -m pytest -m e2e --durations=10 $(RANDOM_ORDER)

# CI's share of it (docs/testing.md, "Testing"): the core items (marker e2e_core: one per capability) and the commit's
# rotating shard of the rest (tests/support/e2e_shard.py; E2E_SHARD=K picks shard K). Each item's time goes to
# runs/e2e.xml: `python tools/e2e_durations.py runs/e2e.xml` records it for the shard balance.
E2E_SHARD ?= auto
test-e2e-ci: $(STAMP)
	$(PY) -m pytest -m e2e --e2e-shard $(E2E_SHARD) --durations=10 --junitxml=runs/e2e.xml $(RANDOM_ORDER)

# planning at scale (CI's plan tier): `ucp_dcp plan` of the recipe's checkpoint at 1,024 ranks in one process,
# its time printed against its budget (docs/performance.md, "Planning"); last line PLAN SCALE ok / OVER BUDGET
# and the checkpoint protocol's exact store counts per call at 2 and 4 gloo ranks (`recipes/scale.py --check-counts`:
# the same gates at every N, O(1) requests per rank per gate, nothing between calls, no key left); last line
# SCALE COUNTS OK / FAILED
plan-scale: $(STAMP)
	$(PY) recipes/plan_demo.py --scale --out runs/plan_scale
	$(PY) recipes/scale.py --check-counts --json runs/scale_counts.json

# the rest of the large matrices make test samples (marker full): 42 more (dp,tp) pairs, 13 more reconfiguration
# transitions and their plan checks (~10 min); not in CI, whose e2e tier loads every transition in the mistake set
test-full: $(STAMP)
	$(PY) -m pytest -m full --durations=10

# the inner loop: the single-process tests plus one small multi-process case (marker quick), about a minute
test-quick: $(STAMP)
	$(PY) -m pytest -m "(not slow and not e2e and not full) or quick" $(RANDOM_ORDER)

# the GPU tier (tests/gpu, marker gpu): CUDA DTensors on one shared GPU (gloo) and one-rank NCCL jobs.
# Without CUDA it prints one line and succeeds; `make test` never collects it.
test-gpu: $(STAMP)
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PY) -m pytest --gpu tests/gpu -p no:cacheprovider -ra; \
	else echo "test-gpu: SKIPPED, no CUDA GPU on this machine (torch.cuda.is_available() is False)"; fi

# fault injection: 100 bit flips, 20 truncations, 20 kills mid-save, crafted pickles; last line is the summary
faults: $(STAMP)
	$(PY) recipes/faults.py
	$(PY) recipes/faults.py --store s3

# one rank fails at each step of a load (read_once on/off, 2 and 4 ranks): every rank ends, with the cause
chaos: $(STAMP)
	$(PY) recipes/chaos.py

# the 3 -> 2 FSDP load, 50 fresh torchrun jobs in a row with a normal teardown: no run may end by a signal
# (issue 32's intermittent SIGABRT); last line SOAK OK / SOAK FAILED (~10 min)
soak: $(STAMP)
	$(PY) recipes/soak.py --runs $(or $(RUNS),50)

# a real torchtitan Trainer (CPU, torchrun) resumes at new layouts: dp4->dp2, pp2xdp2->dp2, tp2->dp2
titan-demo: $(STAMP)
	$(PY) recipes/titan_resume.py

# torchtitan's qwen3 MoE (CPU size) saved at dp4 x ep2 resumes at ep4, dp2 (no EP) and pp2 x dp2 x ep2 bitwise,
# a swapped expert caught; last line MOE OK / MOE MISMATCH (docs/torchtitan.md)
moe-demo: $(STAMP)
	$(PY) recipes/moe_demo.py

# will a checkpoint load at a layout? `ucp_dcp plan` on the recipe's checkpoint, up to 4096 ranks, one CPU process
# each, incl. a shape change it must name; last line PLAN OK / PLAN MISMATCH (docs/plan.md)
memory-demo: $(STAMP)
	$(PY) recipes/memory_demo.py

plan-demo: $(STAMP)
	$(PY) recipes/plan_demo.py

# Hugging Face in and out: transformers' own tiny Llama/Mixtral load at dp2·tp2, pp2, ep2·tp2 with equal logits,
# a trained export loads back in transformers; last line HF OK / HF MISMATCH (docs/huggingface.md)
hf-demo: $(STAMP)
	$(PY) recipes/hf_demo.py

# DeepSpeed ZeRO-1/3 (+universal) and Megatron-Core torch_dist checkpoints written by the real libraries on CPU load
# at dp2·tp2 inside dcp.load, bitwise equal to the libraries' own views; last line FOREIGN OK / MISMATCH (docs/migrating.md)
foreign-demo: $(STAMP)
	$(PY) recipes/foreign_demo.py

# a job saved at dp4 to s3:// on a local S3 server (moto, 127.0.0.1) resumes at dp2 x tp2 bitwise, every object
# re-hashed by verify; last line S3 OK / S3 FAILED (docs/storage.md)
s3-demo: $(STAMP)
	$(PY) recipes/s3_demo.py

# ucp_dcp's object-store writer/reader against DCP's FsspecWriter/Reader on the same local S3 server, one run:
# ratios of a save and of a resharding load (docs/performance.md)
bench-s3: $(STAMP)
	$(PY) recipes/bench_s3.py --mib 64 --repeats 3

# the same against npm's file-backed s3rver (installed under runs/ from npm; its ranged GETs cost their bytes, as on
# S3, where moto's cost the whole object): a resharding load by rows and by columns, 128 MiB
S3RVER := runs/s3rver/node_modules/.bin/s3rver
$(S3RVER):
	mkdir -p runs/s3rver && npm install --prefix runs/s3rver --no-audit --no-fund s3rver@3.7.1
bench-s3-s3rver: $(STAMP) $(S3RVER)
	$(PY) recipes/bench_s3.py --mib 128 --repeats 3 --load-dim 0 --server s3rver
	$(PY) recipes/bench_s3.py --mib 128 --repeats 3 --load-dim 1 --server s3rver

# the whole reconfiguration set (15 save -> load transitions, up to 8 ranks), fresh processes per job
reconfig: $(STAMP)
	$(PY) recipes/reconfig.py

# mistake injection: every rule/map dropped or altered at save/load/both, param groups reordered, a replica
# perturbed, the writer/reader swapped (also a stock save over ours), maps forgotten on plain tensors, on the whole
# reconfiguration set (dev/ucp_dev/testing/mistakes.py); one line per silent,
# crashed or unclear run, last line MISTAKES OK: N runs, 0 silent / MISTAKES FAILED: ...
.PHONY: mistakes
mistakes: $(STAMP)
	$(PY) recipes/mistakes.py

# UCP against DCP's default planners and storage, one run: table + JSON (docs/performance.md)
bench: $(STAMP)
	$(PY) recipes/benchmark.py --json runs/benchmark.json

# what atomic commit + checksums cost at save, and verify's rate vs a raw read (docs/reliability.md)
bench-trust: $(STAMP)
	$(PY) recipes/bench_trust.py --json runs/bench_trust.json

# where the checkpoint protocol's cost grows with the rank count: ucp_dcp.save/load against stock DCP at 2, 4, 8, 16
# gloo ranks, the job's TCPStore behind a counting proxy (recipes/store_meter.py): store requests, bytes and
# connections per call (total, busiest rank), rank 0's gathered bytes, time; their growth exponents, the idle traffic,
# the keys left, the goals met / not met; table + runs/scale.json, last line SCALE: ... (~2 min)
scale: $(STAMP)
	$(PY) recipes/scale.py

# the GPU figures (docs/performance.md, GPU): one process on one GPU, then 4 ranks sharing it; JSON + plot in runs/bench_gpu
bench-gpu: $(STAMP)
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PY) recipes/bench_single.py --device cuda --mib 4096 --json runs/bench_gpu/single.json --plot runs/bench_gpu/single.png && \
		$(PY) recipes/bench_device.py --device cuda --json runs/bench_gpu/device.json; \
	else echo "bench-gpu: SKIPPED, no CUDA GPU on this machine (torch.cuda.is_available() is False)"; fi

# the whole GPU proof in one command (issue 33): the GPU tier, bench-gpu's one-GPU and shared-GPU cases, the async
# save of 2 GiB, the CPU quick tier on the machine's torch; one JSON, one SVG plot and a summary line of the goals
# met in $(GPU_CHECK_OUT) within GPU_CHECK_BUDGET seconds. Needs no venv and no wheels: the interpreter's torch, numpy,
# xxhash, pytest and hypothesis (the GPU machine's image has them; .novenv/site is used when there). Without CUDA:
# one SKIPPED line. GPU_CHECK_ARGS=--rehearse runs it on the CPU at tiny sizes (CPU stand-in figures)
GPU_CHECK_OUT ?= runs/gpu_check
GPU_CHECK_BUDGET ?= 480
GPU_CHECK_ARGS ?=
GPU_PY = $(if $(NOVENV),$(PYTHON),$(if $(wildcard $(VENV)/bin/python),$(PIP),$(PYTHON)))
gpu-check:
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR):$(DEV_PATH)$(if $(wildcard .novenv/site),:$(CURDIR)/.novenv/site) $(GPU_PY) \
		recipes/gpu_check.py --out $(GPU_CHECK_OUT) --budget $(GPU_CHECK_BUDGET) $(GPU_CHECK_ARGS)

bench-quick: $(STAMP)
	$(PY) recipes/benchmark.py --quick --json runs/benchmark-quick.json

# the whole suite (TIER=test, or test-quick / test-e2e) on another torch release: `make test-torch TORCH=2.15`
# builds $(TORCH_VENVS)/torch-2.15 once (torch from PyPI, the rest as for .venv) and runs this checkout on it
test-torch:
	$(MAKE) $(TIER) VENV=$(TORCH_VENVS)/torch-$(TORCH) TORCH=$(TORCH) SEED=$(SEED)

# the wheels NOVENV=1 needs on a machine without network (the GPU machine: Python 3.12, torch 2.11+cu130):
# every requirement of ucp-dcp[$(EXTRAS)] this venv resolved, but the torch/CUDA/triton stack and what
# WHEELS_HAVE names (torch's own requirements and numpy: on any machine with torch), for PY_VERSION, as binary wheels (sdists built here)
PY_VERSION ?= 3.12
WHEELS_HAVE ?= numpy jinja2 markupsafe sympy mpmath networkx typing-extensions setuptools filelock
wheels: $(STAMP)
	$(REQS) > .wheels-requirements.txt
	$(PIP) tools/wheels.py --requirements .wheels-requirements.txt --have "$(WHEELS_HAVE)" --python-version $(PY_VERSION) \
		--dest $(WHEELS)
	rm -f .wheels-requirements.txt

clean:
	rm -rf runs .pytest_cache .hypothesis .novenv
