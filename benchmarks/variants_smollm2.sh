#!/usr/bin/env bash
# Issue 44: every variant on SmolLM2 at equal CPU time, from the committed drafter's backbone.
# Stages skip what is done, so a killed run continues: run it again.
#   bash benchmarks/variants_smollm2.sh data       # the prepared corpus and its hidden-state cache (~56 min, 1 thread)
#   bash benchmarks/variants_smollm2.sh calibrate  # 20 steps of each arm, side by side (one thread each): s/step
#   bash benchmarks/variants_smollm2.sh train      # each arm for CPU_MIN (60) CPU-minutes of steps, two at once
#   bash benchmarks/variants_smollm2.sh eval       # every trained arm: dflash-eval on MT-Bench, GSM8K, HumanEval
#                                                  # (8 prompts x 128 tokens, fp32, T=0; T=1 for the arms in T1),
#                                                  # two at once; then benchmarks/variants_table.py
# Arms: DFlash continued (the control, recipes/smollm2-135m-continue.yaml) and XPress, DSpark and DFlash2
# grown from the committed drafter (recipes/smollm2-135m-{xpress,dspark-grow,dflash2-grow}.yaml).
# ARMS picks them (default: the first two, calibrated side by side on an otherwise idle machine). Arms
# calibrated later, while other runs load the machine, calibrate beside a DFlash reference arm named
# dflashref (ARMS="dspark:... dflash2:... dflashref:recipes/smollm2-135m-continue.yaml"): their s/step is
# scaled by calib-dflash / calib-dflashref, i.e. measured against the control at the same load.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
R=data/real
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
stage=${1:-data}

if [ "$stage" = data ]; then
  [ -d $R/smollm2-135m-instruct ] || make real-target
  # rows 1,280-2,999 exactly: the corpus grows, and every arm must see the rows the recorded ones saw
  if [ ! -f $R/corpus-new.jsonl ]; then
    python3 -c "import gzip; r = gzip.open('data/smollm2-135m-corpus/conversations.jsonl.gz', 'rt').read().splitlines(); \
      open('$R/corpus-first1280.jsonl', 'w').write('\n'.join(r[:1280]) + '\n'); \
      open('$R/corpus-new.jsonl', 'w').write('\n'.join(r[1280:3000]) + '\n')"
  fi
  [ -f $R/corpus-prepared/prepare_info.json ] || $BIN/dflash-prepare --input $R/corpus-first1280.jsonl \
    --format messages --target $R/smollm2-135m-instruct --output $R/corpus-prepared --max-length 512 --val-size 32
  [ -f $R/corpus-new-prepared/prepare_info.json ] || $BIN/dflash-prepare --input $R/corpus-new.jsonl \
    --format messages --target $R/smollm2-135m-instruct --output $R/corpus-new-prepared --max-length 512 --val-size 1
  # dflash-cache resumes a cache it started
  $BIN/dflash-cache --data $R/corpus-new-prepared/train --target $R/smollm2-135m-instruct \
    --output $R/corpus-new-cache --num-draft-layers 2 --max-length 512 --target-dtype fp32
fi

ARMS=${ARMS:-"dflash:recipes/smollm2-135m-continue.yaml xpress:recipes/smollm2-135m-xpress.yaml"}
OUT=runs/variants
launch() {  # name recipe steps extra...
  local name=$1 recipe=$2 steps=$3; shift 3
  $BIN/accelerate launch -q --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
    --main_process_port 0 dflash_train/train.py --recipe "$recipe" output_dir=$OUT/$name max_steps=$steps "$@"
}

if [ "$stage" = calibrate ]; then
  mkdir -p $OUT
  for arm in $ARMS; do
    name=${arm%%:*}; recipe=${arm#*:}
    [ -f $OUT/calib-$name/summary.json ] || launch calib-$name "$recipe" 20 checkpoint_every=0 eval.every=0 \
      eval.max_samples=4 overwrite=true > $OUT/calib-$name.log 2>&1 &
  done
  wait
  for arm in $ARMS; do
    name=${arm%%:*}
    python3 -c "import json; s = json.load(open('$OUT/calib-$name/summary.json')); \
      print('$name', round(s['train_tokens'] / s['train_tokens_per_s'] / s['steps'], 3), 's/step')"
  done
fi

if [ "$stage" = train ]; then
  CPU_MIN=${CPU_MIN:-60}
  for arm in $ARMS; do
    name=${arm%%:*}; recipe=${arm#*:}
    # its calibration here (scaled to the first one's load), else the s/step recorded in the results
    sps=$($BIN/python benchmarks/variants_table.py --runs $OUT --s-per-step $name)
    steps=$(python3 -c "print(int($CPU_MIN * 60 / $sps))")
    echo "$name: $sps s/step -> $steps steps for $CPU_MIN CPU-min"
    # rerun to resume: the same command continues from the newest checkpoint
    [ -f $OUT/$name/summary.json ] || launch $name "$recipe" $steps checkpoint_every=100 >> $OUT/$name.log 2>&1 &
  done
  wait
fi

if [ "$stage" = eval ]; then
  # T=0: the chain and DDTree at T0_BUDGETS for every arm; T=1: the chain and T1_BUDGETS for the arms in T1
  # (the committed card's budgets are 3,4,8,16,64 and 3,4,8: fewer here, four arms share two cores)
  # SUITES: the prompt suites (fewer when CPU time is short); TAG: the other suites of an arm evaluated
  # before (eval-<arm>-t0-<TAG>, joined to its eval-<arm>-t0 by the table: SUITES="gsm8k humaneval" TAG=more);
  # an arm stopped early (no summary.json) is evaluated at DRAFTER_<name> (a training checkpoint, e.g.
  # runs/variants/dspark/checkpoints/step_001200)
  T0_BUDGETS=${T0_BUDGETS:-3,64}; T1_BUDGETS=${T1_BUDGETS:-3,8}; T1=${T1:-}
  SUITES=${SUITES:-"mtbench gsm8k humaneval"}
  evaluate() {  # name temperature budgets
    local out=$OUT/eval-$1-t$2${TAG:+-$TAG} drafter=DRAFTER_$1
    [ -f $out/report.json ] && return
    $BIN/dflash-eval --drafter ${!drafter:-$OUT/$1/final} $(printf -- "--suite %s " $SUITES) --limit 8 \
      --max-new-tokens 128 --budgets $3 --temperature $2 --target-dtype fp32 --output $out --overwrite \
      > $out.log 2>&1
  }
  for arm in $ARMS; do
    name=${arm%%:*}; drafter=DRAFTER_$name
    [ -f $OUT/$name/summary.json ] || [ -n "${!drafter:-}" ] || {
      echo "$name: not trained yet (no $OUT/$name/summary.json)"; continue; }
    evaluate $name 0 $T0_BUDGETS &
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n; done
    case " $T1 " in *" $name "*) evaluate $name 1 $T1_BUDGETS & ;; esac
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n; done
  done
  wait
  $BIN/python benchmarks/variants_table.py --runs $OUT
fi
