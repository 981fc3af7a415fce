#!/usr/bin/env bash
# The one prepared script for a session lent a GPU (under 8 minutes on the H200 machine: one
# H200, 16 cores, 128 GiB, no network). In order:
#   1. the GPU tests (pytest -m gpu: the CUDA paths against transformers and the resident run);
#   2. bench/gpu_check.py: `hrm profile --quick` of this machine, then every schedule planned
#      with that measured profile at one GPU budget (warm-up run, then timed run), cgopipe again
#      with int4 weights (streamed compact, dequantized on the GPU), cgopipe with half of its
#      streamed weights read from disk each pass (the disk tier, its file in $TMPDIR), static
#      against continuous
#      batching under the cgopipe plan (4 N requests of mixed max_tokens), the same job under
#      its continuous plan (hrm plan --batching continuous's limits, against its prediction), and
#      transformers with accelerate's offload at the same budget; one table, the JSON rewritten
#      after each row (a failing row costs only itself).
# Results go to $OUT (default reports/gpu-check): table.txt, gpu_check.json, the measured profile
# (h200-measured.yaml: copy it to hardware_profiles/ and commit it), log.txt, gpu_tests.txt,
# nvidia-smi.csv, and anything else packed into extra.tar.gz: at most 8 files.
#   bench/gpu_check.sh              on the GPU machine
#   bench/gpu_check.sh --dry-run    the same Python steps at tiny sizes, the CPU standing in (CI)
#   LAYERS=16 GPU_MEM=16GB bench/gpu_check.sh     (the defaults: 16 of Mixtral 8x7B's layers, 22.6 GB)
# The machine has no network, no pulp and no highspy (without it the MILP runs in CBC, slower).
# Carry their wheels (here, in the repository's root):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl pulp highspy
# then, with .whl carried, start the device command with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site && bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
dry=()
[ "${1:-}" = "--dry-run" ] && dry=(--dry-run)
out=${OUT:-reports/gpu-check}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$python" -c "import yaml, tqdm, pytest, transformers, safetensors, accelerate, pulp" || {
    echo "gpu_check: a requirement is missing (pulp travels as a wheel: see this script's head)" >&2
    exit 2
}
status=0
if [ ${#dry[@]} -eq 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,pcie.link.gen.max,pcie.link.width.max \
        --format=csv > "$out/nvidia-smi.csv" 2>&1 || true
    "$python" -m pytest -q -m gpu -p no:cacheprovider tests/test_profile_gpu.py \
        tests/executor/test_cuda.py tests/executor/test_offload_cuda.py \
        tests/executor/test_grouped_ffn_profile.py > "$out/gpu_tests.txt" 2>&1 || status=$?
    tail -n 3 "$out/gpu_tests.txt"
fi
"$python" bench/gpu_check.py --out "$out" --layers "${LAYERS:-16}" --gpu-mem "${GPU_MEM:-16GB}" \
    "${dry[@]}" 2>&1 | tee "$out/log.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# At most 8 files come back from the machine: pack whatever is beyond the named ones.
keep="table.txt gpu_check.json h200-measured.yaml log.txt gpu_tests.txt nvidia-smi.csv"
extra=()
for f in "$out"/*; do
    name=$(basename "$f")
    case " $keep extra.tar.gz " in *" $name "*) ;; *) extra+=("$name") ;; esac
done
if [ ${#extra[@]} -gt 0 ]; then
    tar -czf "$out/extra.tar.gz" -C "$out" "${extra[@]}" && (cd "$out" && rm -rf "${extra[@]}")
fi
exit "$status"
