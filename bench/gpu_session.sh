#!/usr/bin/env bash
# A lent GPU's 15 minutes for the GPU issues (serving: 34, training: 31), as two commands that each end
# inside one 10-minute call, the must-show numbers first; every phase writes its JSON under OUT as it ends.
#
#   bash bench/gpu_session.sh serve OUT   # env + GEMM rate, the cuda-marked tests, decode steps of 1 and
#                                         # 64 sequences @ 512 (eager / compiled / flex / transformers
#                                         # compiled), the offline batch against generate_batch (~9 min)
#   bash bench/gpu_session.sh train OUT   # calibrate + simulate train --gpu this, gpu_train.py (compiled /
#                                         # eager against transformers compiled / eager), torchrun train at
#                                         # 4 x 2048 (~9 min)
#   bash bench/gpu_session.sh smoke OUT   # both on the CPU with tiny shapes: checks this script here
#
# The GPU image has torch 2.11, transformers and the test tools but not the serving stack: the wheels of
# bench/gpu_wheels.txt (its header says how to fetch them into ./.whl, which git ignores) are installed
# first where present, and carried with the checkout. shiftlm runs from this checkout, not installed.
set -uo pipefail
part=${1:?usage: gpu_session.sh serve|train|smoke OUT}
out=${2:?usage: gpu_session.sh serve|train|smoke OUT}
case $part in
    serve | train | smoke) ;;
    *) echo "gpu_session.sh: the part is serve, train or smoke, not $part" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null && [ "$part" != smoke ]; then
    $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
status=0
serve() {
    SHIFTLM_GPU_LIMITS=env=45,cuda_tests=170 $python bench/gpu.py --phase env --phase cuda_tests --out "$out" "$@" || status=1
    SHIFTLM_GPU_LIMITS=decode=200,offline=150 $python bench/gpu_serve.py --quick --phase decode --phase offline \
        --out "$out" "$@" || status=1
}
train() {
    # Limits: 20 s of wheels + 140 + 270 + 120 = 550 s of the 600 s call (each phase ends sooner if it can).
    # calibrate first: it needs no checkpoint; its own split is 100 s calibrate (~50 s expected on a GPU
    # host, 60-90 s on a busy 2-core CPU, the smoke) + 30 s simulate. train_compile writes the 1.1B
    # checkpoint once for both training phases (~15 s) and starts no variant past its deadline (eager
    # ones last); its compiled shiftlm layers leave inductor's cache warm for train's same layers:
    # 15 steps (~0.2 s each), metrics written per step, no checkpoint (the last step's would be ~13 GB).
    SHIFTLM_GPU_LIMITS=calibrate=140,train_compile=270,train=120 $python bench/gpu.py --phase calibrate \
        --phase train_compile --phase train --out "$out" "$@" || status=1
}
case $part in
    serve) serve ;;
    train) train ;;
    smoke) serve --smoke && train --smoke ;;
esac
ls -l "$out"
exit $status
