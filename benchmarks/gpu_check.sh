#!/usr/bin/env bash
# The one prepared GPU check (issues 8 and 26): installs the GPU bundle offline, then runs benchmarks/gpu_bench.py,
# whose sections (probe, quantizers, gemm, train_step, rl, the GPU-marked tests, and the TE / vLLM sections where
# those stacks exist) each run in their own process under their own timeout. Writes gpu_check.md / .json with
# provenance into results/gpu/ (or $OUT_DIR). Budget: 9 minutes on one H200 ($GPU_CHECK_BUDGET_S, default 540 s,
# for everything including the install).
#
#   make gpu-bundle                                   # here, with a package index: .gpu-bundle/ (about 6 MB)
#   bash benchmarks/gpu_check.sh                      # there, carrying .gpu-bundle (no network needed)
#   OUT_DIR=$OUT PYTHON=python3 bash benchmarks/gpu_check.sh
#
# Exit status: 0 passed, 1 failed, 3 measured nothing on a GPU (a CPU rehearsal, or every GPU section skipped),
# 4 partial (no failure, but a required section did not pass on the GPU); 124/137 the whole check timed out.
# Without a bundle (or where it cannot install) the sections that need megatron-core, torchao or math-verify
# report themselves skipped with the reason; nothing missing is fatal.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-results/gpu}
BUNDLE=${GPU_BUNDLE:-.gpu-bundle}
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
start=$(date +%s)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PIP_NO_INDEX=1

deps=""
if [ -f "$BUNDLE/manifest.json" ]; then
  if deps=$("$PY" benchmarks/gpu_bundle.py install --bundle "$BUNDLE" 2>"$OUT/bundle_install.log"); then
    bundle_state="installed offline: $("$PY" benchmarks/gpu_bundle.py summary --bundle "$BUNDLE")"
  else
    bundle_state="install failed: $(tail -n 3 "$OUT/bundle_install.log" | tr '\n' ' ')"
    deps=""
  fi
else
  bundle_state="missing ($BUNDLE/manifest.json not found: run make gpu-bundle on a machine with a package index)"
fi
echo "GPU bundle: $bundle_state"
export FP8RL_GPU_BUNDLE="$bundle_state"
export PYTHONPATH="$PWD${deps:+:$deps}${PYTHONPATH:+:$PYTHONPATH}"

left=$(( BUDGET_S - ($(date +%s) - start) ))
# The driver stops starting sections once its budget is spent; the outer timeout is the backstop.
timeout -k 10 "$left" "$PY" benchmarks/gpu_bench.py --out "$OUT" --budget-s $(( left - 20 )) 2>&1 | tee "$OUT/gpu_bench.log"
rc=${PIPESTATUS[0]}
echo "gpu_check: exit ${rc}, $(( $(date +%s) - start )) s in all; report $OUT/gpu_check.md" | tee -a "$OUT/gpu_bench.log"
# The logs as committed carry no local paths (the report is scrubbed as it is written).
"$PY" benchmarks/gpu_bench.py --out "$OUT" --scrub-logs >/dev/null 2>&1 || echo "gpu_check: could not scrub the logs"
exit "$rc"
