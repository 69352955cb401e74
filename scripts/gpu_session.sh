#!/usr/bin/env bash
# All GPU work of one device lease in one command (see DESIGN.md §9): install without fetching,
# the CUDA tests, then the GPU A/B benchmarks, each under its own time limit so a slow or broken
# step cannot eat the others' time. Writes logs and JSON into $WORK, packed into
# $OUT/gpu_session.tgz (default ./out).
#
#   bash scripts/gpu_session.sh                 # tests, per-op profile, memory, fidelity, A/B: ~13 min
#   STEPS="env install tests ops memory fidelity" bash scripts/gpu_session.sh   # ~8 min
#   STEPS="ab" AB_ARGS="--batches 8,32" bash scripts/gpu_session.sh
#
# On an H200: env+install take ~25 s, the CUDA tests ~30 s, gpu_ab ~20 s a case (DenseNet-121's
# ~35 s), the per-op profile ~4 s a case (DenseNet-121's training ~30 s), the memory check ~80 s
# for 7 rows. A lease has 15 minutes in all, its start included: run this with a timeout that
# leaves room to rerun a step.
# A lease returns at most 8 files from $OUT: the steps write into $WORK, which is packed into
# $OUT/gpu_session.tgz after every step (a step cut by its limit still leaves the earlier ones);
# $WORK lies outside $OUT, so its files do not count against that limit.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
WORK=${WORK:-${TMPDIR:-/tmp}/fxdream_gpu_session}
mkdir -p "$OUT" "$WORK"
pack() { tar czf "$OUT/gpu_session.tgz.part" -C "$WORK" . && mv "$OUT/gpu_session.tgz.part" "$OUT/gpu_session.tgz"; }
# what the last lease left unverified first: the build report's replays (the event gap) and GNMT's LSTMs
STEPS=${STEPS:-"env install tests fidelity ab memory ops aux"}
TESTS_S=${TESTS_S:-90}
AB_S=${AB_S:-260}
AUX_S=${AUX_S:-90}
OPS_S=${OPS_S:-150}
MEMORY_S=${MEMORY_S:-110}
FIDELITY_S=${FIDELITY_S:-150}
# each case in its own process (a CUDA error costs one case); the peer for ResNet-50 at bs1, 128
AB_ARGS=${AB_ARGS:-"--models gnmt,resnet50,tv_resnet50,bert_base,hf_bert --batches 1,128,8 --dtypes fp16,fp32 --budget-s 200"}
AUX_ARGS=${AUX_ARGS:-"--batches 32,128 --dtypes fp16 --rounds 3 --cost auto"}
# per-op measurements for benchmarks/fit_gpu_model.py (stops timing new ops at its budget)
# (the committed file holds ResNet-50 and BERT at every batch and dtype, the others at fp16 bs1/8)
OPS_ARGS=${OPS_ARGS:-"--models resnet18,vgg19,densenet121,gnmt --batches 32,128 --dtypes fp16,fp32 --budget-s 130"}
# the simulator's peak against torch.cuda.max_memory_allocated (each row written as it comes)
MEMORY_ARGS=${MEMORY_ARGS:-"--batches 8 --modes infer,train --dtype fp16"}
# the build report's predictions against the built modules timed side by side (zoo x bs1,8 fp16, inference:
# a training build takes 25-40 s on the GPU)
FIDELITY_ARGS=${FIDELITY_ARGS:-"--models resnet50,bert_base,resnet18,vgg19,gnmt,mnist_convnet --batches 1,8 --modes infer --dtype fp16 --rounds 6"}
PY=${PY:-python3}
started=$(date +%s)
step() { echo "=== [$(( $(date +%s) - started )) s] $*"; }

for s in $STEPS; do
  case $s in
    env)
      step env
      { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
        $PY -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
                'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
      } 2>&1 | tee "$WORK/env.txt" ;;
    install)
      step install
      # Editable, so fxdream.passes / fxdream.models map onto passes/ and models/ as in setup.cfg.
      $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -5
      $PY -c "import fxdream, fxdream.passes, fxdream.models; print('fxdream passes:', ', '.join(fxdream.available_passes()))" ;;
    tests)
      step "pytest -m cuda (limit ${TESTS_S} s)"
      per_test=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60")
      # shellcheck disable=SC2086
      timeout "$TESTS_S" $PY -m pytest -v -p no:cacheprovider -m cuda -rfEs --durations=8 $per_test \
        --junitxml="$WORK/cuda_tests.xml" 2>&1 | tee "$WORK/cuda_tests.log" | tail -60 ;;
    alltests)
      step "pytest, the whole default suite on this machine's torch (limit ${ALL_S:-150} s)"
      # -v: each result is a line as it comes, so a run cut by the limit still names its failures
      # (the first lease's -q run was cut at 67 % with 12 F's and no names)
      timeout "${ALL_S:-150}" $PY -m pytest -v --tb=line -p no:cacheprovider -n 8 -m "not slow" -rfE 2>&1 \
        | tee "$WORK/all_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40 ;;
    ab)
      step "benchmarks/gpu_ab.py $AB_ARGS (limit ${AB_S} s)"
      # shellcheck disable=SC2086
      timeout "$AB_S" $PY benchmarks/gpu_ab.py $AB_ARGS --out "$WORK/gpu_ab.json" 2>&1 | tee "$WORK/gpu_ab.log" | tail -40 ;;
    aux)
      step "benchmarks/gpu_aux_stream.py $AUX_ARGS (limit ${AUX_S} s)"
      # shellcheck disable=SC2086
      timeout "$AUX_S" $PY benchmarks/gpu_aux_stream.py $AUX_ARGS --out "$WORK/gpu_aux_stream.json" 2>&1 \
        | tee "$WORK/gpu_aux_stream.log" | tail -30 ;;
    ops)
      step "benchmarks/gpu_op_profile.py $OPS_ARGS (limit ${OPS_S} s)"
      # shellcheck disable=SC2086
      timeout "$OPS_S" $PY benchmarks/gpu_op_profile.py $OPS_ARGS --out "$WORK/gpu_op_profile.json" 2>&1 \
        | tee "$WORK/gpu_op_profile.log" | tail -20 ;;
    memory)
      step "benchmarks/memory_check.py --device cuda $MEMORY_ARGS (limit ${MEMORY_S} s)"
      # shellcheck disable=SC2086
      timeout "$MEMORY_S" $PY benchmarks/memory_check.py --device cuda $MEMORY_ARGS --out "$WORK/memory_check_gpu" 2>&1 \
        | tee "$WORK/memory_check.log" | tail -30 ;;
    fidelity)
      step "benchmarks/build_fidelity.py --device cuda $FIDELITY_ARGS (limit ${FIDELITY_S} s)"
      # shellcheck disable=SC2086
      timeout "$FIDELITY_S" $PY benchmarks/build_fidelity.py --device cuda $FIDELITY_ARGS \
        --out "$WORK/build_fidelity_gpu" 2>&1 | tee "$WORK/build_fidelity.log" | tail -30 ;;
    *) echo "unknown step $s (env install tests alltests ab aux ops memory fidelity)"; exit 2 ;;
  esac
  pack
done
step done
