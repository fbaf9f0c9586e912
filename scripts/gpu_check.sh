#!/usr/bin/env bash
# GPU verification in one call: what the CUDA machine has, tests/gpu (vLLM CUDA rollout, colocated sleep,
# the training path, SGLang when it is installed) and the overhead benchmark on CUDA.  Logs go to $OUT (or /tmp/gpu_check).
#
#   bash scripts/gpu_check.sh            # after `make install EXTRA=gpu` (and EXTRA=sglang for SGLang)
#
# Each step has its own time limit and a failing step does not stop the next, so one call gives every
# result.  The last lines are a summary table.
set -u
cd "$(dirname "$0")/.."
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"
# The project's venv (`make install EXTRA=gpu`) when there is one, else python3 (packages on PYTHONPATH).
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary=()
# vLLM's sampler imports FlashInfer unless told not to; a slimmed install (scripts/gpu_stage_offline.py) has none.
"$PY" -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$LOGS/$name.log"
  summary+=("$(printf '%-16s rc=%-4s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/gpu.txt"
step versions 120 "$PY" -c "
import importlib, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
for m in ('vllm', 'sglang', 'ray', 'transformers'):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, 'missing:', type(e).__name__, e)
"
[ "${SKIP_TESTS:-0}" = 1 ] || step tests_gpu "${TESTS_LIMIT:-420}" "$PY" -m pytest tests/gpu -v -p no:cacheprovider -rs
# Routing replay (R3): vLLM returns routed experts only from its GPU model runner; this compares them with an HF
# forward's router top-k on a tiny Qwen3-MoE built on the spot (skipped on CPU, where the server refuses the key).
[ "${SKIP_TESTS:-0}" = 1 ] || step routing_replay 300 "$PY" -m pytest tests/integration/test_vllm_routing_replay.py \
  -v -p no:cacheprovider -rs
# BENCH_WORKERS="1 4 8": one benchmark per worker count (each ~2.5 min on an H100, engine start-up included);
# BENCH_N=8: GRPO-shaped batches (each prompt 8 times; the stack renders it once)
for w in ${BENCH_WORKERS:-1}; do
  step "bench_overhead_w$w" "${BENCH_LIMIT:-300}" "$PY" scripts/bench_overhead.py --device cuda \
    --repeats "${BENCH_REPEATS:-5}" --num-workers "$w" --n "${BENCH_N:-1}"
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
grep -E "passed|failed|skipped" "$LOGS/tests_gpu.log" 2>/dev/null | tail -n 1
grep -E "passed|failed|skipped" "$LOGS/routing_replay.log" 2>/dev/null | tail -n 1
for w in ${BENCH_WORKERS:-1}; do
  echo "workers=$w"; grep -E "^(raw AsyncLLM|AgentLoopManager|ratio|agentloop serial)" "$LOGS/bench_overhead_w$w.log"
done
