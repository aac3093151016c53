#!/usr/bin/env bash
# The GPU check for one lent GPU (H200: under 8 minutes), one command, a short table at the end:
#   1. the flex-attention training mask's forward AND gradients against SDPA (tests/test_model.py, CUDA only)
#   2. 20 bf16 steps of a Qwen3-8B-shaped drafter (5 layers, block 16, 512 anchors, 3072 tokens) on a
#      random Qwen3-8B-shaped target (6 layers) under single GPU, FSDP2 (1 process) and ZeRO-2 (1 process):
#      train tokens/s and peak GPU memory, from each run's summary.json
#   3. benchmarks/gpu_costs.py (verify/draft/tree/step costs at Qwen3-8B's shape; verify also after 2K-32K context
#      tokens, the context axis of dflash-eval's concurrency prediction; DSpark/DFlash2 scored trees) -> $OUT/gpu_costs.json
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine, from the repo root
#   TINY=1 bash benchmarks/gpu_check.sh          # the same script at tiny shapes on a CPU (smoke test)
# Writes into ${OUT:-/tmp/gpu_check}; needs the project installed (or PYTHONPATH=.).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
status=()

echo "== 1. flex attention vs SDPA (forward and gradients)"
if $PY -m pytest -q -p no:cacheprovider tests/test_model.py -k "flex" 2>&1 | tee "$OUT/flex.log" | tail -3; then
  status+=("flex-attention test|passed")
else
  status+=("flex-attention test|FAILED (see flex.log)")
fi

echo "== 2. a Qwen3-8B-shaped drafter on a random Qwen3-8B-shaped target"
if [ -n "${TINY:-}" ]; then
  $PY benchmarks/shape_target.py --out "$OUT/shape" --tiny --layers 6 --chats 8
  SHAPE="model.num_layers=2 model.block_size=8 model.target_layer_ids=[0,1] model.mask_token_id=1023 data.max_length=256 data.num_anchors=32 train.batch_size=2 max_steps=4"
else
  $PY benchmarks/shape_target.py --out "$OUT/shape" --layers 6 --chats 64
  SHAPE="model.target_layer_ids=[0,1,2,3,4] max_steps=20 train.batch_size=2"
fi
COMMON="--recipe recipes/qwen3-8b.yaml model.target=$OUT/shape/target data.train=$OUT/shape/train.jsonl data.val=$OUT/shape/val.jsonl checkpoint_every=0 eval.max_samples=2 eval.ddtree_budgets=[16] wandb.enabled=false overwrite=true $SHAPE"
for engine in single_gpu fsdp deepspeed_zero2; do
  echo "-- $engine"
  if $PY -m accelerate.commands.launch --config_file recipes/accelerate/$engine.yaml --num_processes 1 \
      dflash_train/train.py $COMMON output_dir="$OUT/run_$engine" > "$OUT/$engine.log" 2>&1; then
    status+=("$($PY - "$OUT/run_$engine/summary.json" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"training, {sys.argv[1].split('/')[-2][4:]}|engine {s['engine']}, {s['precision']}, "
      f"{s['train_tokens_per_s']:.0f} train tokens/s, peak {s['peak_gpu_memory_gib']} GiB, "
      f"{s['drafter_parameters'] / 1e6:.0f}M drafter params, val EAL {s['eval']['eal']:.2f}")
PYEOF
)")
  else
    status+=("$engine run|FAILED: $(grep -m1 '^error:\|Error' "$OUT/$engine.log" | cut -c1-150)")
  fi
done

echo "== 3. decoding costs at Qwen3-8B's shape"
if [ -n "${TINY:-}" ]; then GC="--tiny --device cpu --dtype float32 --repeats 1"; else GC="--repeats 3"; fi
if $PY benchmarks/gpu_costs.py $GC --out "$OUT/gpu_costs.json" > "$OUT/gpu_costs.log" 2>&1; then
  status+=("gpu_costs.py|$OUT/gpu_costs.json ($(tail -1 "$OUT/gpu_costs.log" | cut -c1-100))")
else
  status+=("gpu_costs.py|FAILED (see gpu_costs.log)")
fi

echo
echo "| check | result |"
echo "|---|---|"
for s in "${status[@]}"; do echo "| ${s%%|*} | ${s#*|} |"; done
