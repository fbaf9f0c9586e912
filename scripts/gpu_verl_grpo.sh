#!/usr/bin/env bash
# verl 0.9.1's GSM8K GRPO quickstart on one GPU, offline, twice on the same machine: with agentloop's
# AgentLoopManager (python -m agentloop.compat.verl_main) and with verl's own agent loop
# (python -m verl.trainer.main_ppo), same trainer (trainer.use_v1=false), same overrides; prints
# step / rollout (gen) / weight-sync (update_weights) seconds side by side.
#
#   scripts/gpu_verl_grpo.sh                      # defaults below
#   STEPS=8 MODEL_PATH=/models/Qwen2.5-0.5B-Instruct scripts/gpu_verl_grpo.sh
#
# Needs: a Python (PY, default .venv/bin/python, else python3) with agentloop and verl==0.9.1 installed with its
# GPU dependencies (torch CUDA, vLLM); nothing is downloaded.  The model is agentloop's tiny model,
# built locally (agentloop.testing.tiny_model), unless MODEL_PATH names a local HF directory.  The
# data is a GSM8K-shaped parquet made here (verl's examples/data_preprocess/gsm8k.py columns,
# data_source openai/gsm8k so verl's own gsm8k score applies).  Logs: $OUT/{agentloop,verl}.log.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/gpu_verl_grpo}
STEPS=${STEPS:-5}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

"$PY" -c "import verl, vllm, torch; assert torch.cuda.is_available(), 'no GPU'; \
print('verl', verl.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name(0))"
MODEL_PATH=${MODEL_PATH:-$("$PY" -c \
  "from agentloop.testing.tiny_model import ensure_tiny_model; print(ensure_tiny_model())")}

"$PY" - "$OUT" <<'EOF'
import random, sys
import pandas as pd
out = sys.argv[1]
def rows(n, split, seed):
    rng = random.Random(seed)
    for i in range(n):
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
        q = f"Tom has {a} apples and buys {c} bags of {b} apples. How many apples does he have?"
        yield {"data_source": "openai/gsm8k", "ability": "math",
               "prompt": [{"role": "user", "content": q + ' Let\'s think step by step and output '
                           'the final answer after "####".'}],
               "reward_model": {"style": "rule", "ground_truth": str(a + b * c)},
               "extra_info": {"split": split, "index": i}}
pd.DataFrame(list(rows(512, "train", 0))).to_parquet(f"{out}/train.parquet")
pd.DataFrame(list(rows(64, "test", 1))).to_parquet(f"{out}/test.parquet")
EOF

ARGS=(
  algorithm.adv_estimator=grpo trainer.use_v1=false
  data.train_files="$OUT/train.parquet" data.val_files="$OUT/test.parquet"
  data.train_batch_size=32 data.max_prompt_length=256 data.max_response_length=256
  actor_rollout_ref.model.path="$MODEL_PATH" actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
  trainer.logger=console trainer.n_gpus_per_node=1 trainer.nnodes=1
  trainer.total_training_steps="$STEPS" trainer.val_before_train=false trainer.test_freq=-1
  trainer.save_freq=-1 trainer.project_name=gpu_verl_grpo
)
run() {  # run NAME MODULE: one training run, its wall time on the log's last line
  local start=$SECONDS
  "$PY" -m "$2" "${ARGS[@]}" trainer.experiment_name="$1" \
    trainer.default_local_dir="$OUT/ckpt_$1" > "$OUT/$1.log" 2>&1 \
    || { echo "$1 run failed; tail of $OUT/$1.log:"; tail -40 "$OUT/$1.log"; return 1; }
  echo "wall_s:$((SECONDS - start))" >> "$OUT/$1.log"
}
status=0
run agentloop agentloop.compat.verl_main || status=1
run verl verl.trainer.main_ppo || status=1

"$PY" - "$OUT" <<'EOF'
import re, statistics, sys
out = sys.argv[1]
keys = ("timing_s/step", "timing_s/gen", "timing_s/update_weights", "critic/score/mean")
def read(name):
    vals = {k: [] for k in keys}
    try:
        text = open(f"{out}/{name}.log").read()
    except OSError:
        return vals, "?"
    for line in text.splitlines():
        if "step:" not in line:
            continue
        for k in keys:
            m = re.search(re.escape(k) + r":([-0-9.eE+]+)", line)
            if m:
                vals[k].append(float(m.group(1)))
    wall = re.findall(r"wall_s:(\d+)", text)
    return vals, wall[-1] if wall else "?"
def show(v):  # mean over steps after the first (compile / warm-up), else the only one
    v = v[1:] or v
    return f"{statistics.mean(v):9.2f}" if v else "        -"
runs = {n: read(n) for n in ("agentloop", "verl")}
print(f"{'per step (mean, steps 2..N)':32s}{'agentloop':>10s}{'verl':>10s}")
for k in keys:
    print(f"{k:32s}{show(runs['agentloop'][0][k]):>10s}{show(runs['verl'][0][k]):>10s}")
print(f"{'steps logged':32s}{len(runs['agentloop'][0][keys[0]]):>10d}"
      f"{len(runs['verl'][0][keys[0]]):>10d}")
print(f"{'wall seconds (whole run)':32s}{runs['agentloop'][1]:>10s}{runs['verl'][1]:>10s}")
EOF
exit $status
