#!/usr/bin/env bash
# GPU checks for a session lent a CUDA machine: the GPU tests (profiling clocks, the executor and
# the offloading runtime on CUDA against transformers and the resident run, hrm run --device
# cuda), every schedule at the planner's policy for 16 and 24 GB of GPU memory
# (bench/bench_schedules.py, Mixtral 8x7B geometry with random weights), the CPU attention
# kernels, then a profile of the machine compared with its datasheet profile. Installs nothing (the machine has no network): torch with CUDA and the
# project's requirements must already be there, and the script stops at once when one is missing.
# Results go under $OUT (default reports/gpu_check).
#   bench/gpu_check.sh [PROFILE_NAME [DATASHEET]]     e.g. bench/gpu_check.sh h200-measured h200-sxm
#   FULL=1 bench/gpu_check.sh                         the full profile (adds about 4 minutes)
#   LAYERS=12 bench/gpu_check.sh                      layers of the schedule runs (default 12)
# Without FULL the whole script is meant to finish in about 6 minutes. The full profile is
# bounded by its CPU matmul budget (110 s per dtype) plus about a minute of GPU and link work;
# then copy $OUT/PROFILE_NAME.yaml to hardware_profiles/ and commit it.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-h200-measured}
datasheet=${2:-h200-sxm}
out=${OUT:-reports/gpu_check}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$python" -c "import yaml, tqdm, pytest, transformers, safetensors, pulp" || {
    echo "gpu_check: a requirement is missing; install the project first (no network here)" >&2
    exit 2
}
"$python" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.get_device_name())
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,pcie.link.gen.max,pcie.link.width.max \
    --format=csv > "$out/nvidia-smi.csv" 2>&1 || true
status=0
"$python" -m pytest -q -m gpu tests/test_profile_gpu.py tests/executor/test_cuda.py \
    tests/executor/test_offload_cuda.py tests/executor/test_grouped_ffn_profile.py 2>&1 | tee "$out/gpu_tests.txt" || status=$?
"$python" bench/bench_schedules.py --device cuda --gpu-mem 16GB,24GB --layers "${LAYERS:-12}" \
    --max-batch 256 --gen-len 16 -o "$out/bench_schedules.json" 2>&1 | tee "$out/bench_schedules.txt" || status=$?
"$python" bench/bench_cpu_attention.py --quick -o "$out/bench_cpu_attention.json" 2>&1 \
    | tee "$out/bench_cpu_attention.txt" || status=$?
quick=(--quick)
[ -n "${FULL:-}" ] && quick=()
uptime > "$out/load.txt"
start=$SECONDS
"$python" -m hrm profile "${quick[@]}" --device cuda --quiet -o "$out/$name.yaml" \
    --compare "$datasheet" 2>&1 | tee "$out/profile.txt" || status=$?
echo "hrm profile wall time: $((SECONDS - start)) s" | tee -a "$out/profile.txt"
uptime >> "$out/load.txt"
exit "$status"
