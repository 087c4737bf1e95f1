# Quick start on a fresh machine (Python 3.11 only):  make demo   |   make test
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch must be installed first: an unpinned resolve could pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.ucp-dcp-installed

.PHONY: demo test test-e2e test-quick test-gpu faults reconfig titan-demo plan-demo hf-demo foreign-demo bench bench-quick bench-trust setup clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,torchtitan,foreign]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python recipes/elastic_resume.py --save-topology dp=4 --load-topology dp=2

# everything on the CPU but the end-to-end runs (tests/gpu only with --gpu): the single-process tests and the
# multi-process cases, one per item, on the session's pool of gloo workers (tests/dist.py); the 20 slowest listed
test: $(STAMP)
	$(BIN)/python -m pytest -m "not e2e" --durations=20

# the end-to-end tier (marker e2e): real torchtitan Trainers under torchrun, DeepSpeed and Megatron-Core runs writing
# the foreign checkpoints, recipe scripts and fault injection in subprocesses. CI runs it after `make test`.
test-e2e: $(STAMP)
	$(BIN)/python -m pytest -m e2e --durations=10

# the inner loop: the single-process tests plus one small multi-process case (marker quick), about a minute
test-quick: $(STAMP)
	$(BIN)/python -m pytest -m "(not slow and not e2e) or quick"

# the GPU tier (tests/gpu, marker gpu): CUDA DTensors on one shared GPU (gloo) and one-rank NCCL jobs.
# Without CUDA it prints one line and succeeds; `make test` never collects it.
test-gpu: $(STAMP)
	@if $(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(BIN)/python -m pytest --gpu tests/gpu -p no:cacheprovider -ra; \
	else echo "test-gpu: SKIPPED, no CUDA GPU on this machine (torch.cuda.is_available() is False)"; fi

# fault injection: 100 bit flips, 20 truncations, 20 kills mid-save, crafted pickles; last line is the summary
faults: $(STAMP)
	$(BIN)/python recipes/faults.py

# a real torchtitan Trainer (CPU, torchrun) resumes at new layouts: dp4->dp2, pp2xdp2->dp2, tp2->dp2
titan-demo: $(STAMP)
	$(BIN)/python recipes/titan_resume.py

# will a checkpoint load at a layout? `ucp_dcp plan` on the recipe's checkpoint, up to 4096 ranks, one CPU process
# each, incl. a shape change it must name; last line PLAN OK / PLAN MISMATCH (docs/plan.md)
plan-demo: $(STAMP)
	$(BIN)/python recipes/plan_demo.py

# Hugging Face in and out: transformers' own tiny Llama/Mixtral load at dp2·tp2, pp2, ep2·tp2 with equal logits,
# a trained export loads back in transformers; last line HF OK / HF MISMATCH (docs/huggingface.md)
hf-demo: $(STAMP)
	$(BIN)/python recipes/hf_demo.py

# DeepSpeed ZeRO-1/3 (+universal) and Megatron-Core torch_dist checkpoints written by the real libraries on CPU load
# at dp2·tp2 inside dcp.load, bitwise equal to the libraries' own views; last line FOREIGN OK / MISMATCH (docs/migrating.md)
foreign-demo: $(STAMP)
	$(BIN)/python recipes/foreign_demo.py

# the whole reconfiguration set (15 save -> load transitions, up to 8 ranks), fresh processes per job
reconfig: $(STAMP)
	$(BIN)/python recipes/reconfig.py

# mistake injection: every rule/map dropped or altered at save/load/both, param groups reordered, a replica
# perturbed, the writer/reader swapped, on the whole reconfiguration set (tests/mistakes.py); one line per silent,
# crashed or unclear run, last line MISTAKES OK: N runs, 0 silent / MISTAKES FAILED: ...
.PHONY: mistakes
mistakes: $(STAMP)
	$(BIN)/python recipes/mistakes.py

# UCP against DCP's default planners and storage, one run: table + JSON (docs/performance.md)
bench: $(STAMP)
	$(BIN)/python recipes/benchmark.py --json runs/benchmark.json

# what atomic commit + checksums cost at save, and verify's rate vs a raw read (docs/reliability.md)
bench-trust: $(STAMP)
	$(BIN)/python recipes/bench_trust.py --json runs/bench_trust.json

bench-quick: $(STAMP)
	$(BIN)/python recipes/benchmark.py --quick --json runs/benchmark-quick.json

clean:
	rm -rf runs .pytest_cache .hypothesis
