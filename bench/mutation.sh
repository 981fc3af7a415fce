#!/usr/bin/env bash
# Mutation testing (mutmut, configured in pyproject.toml's [tool.mutmut]): each mutant is one
# small change to a module where a silent bug costs most; a mutant the tests do not fail is a
# behaviour no test checks. Prints mutmut's summary and writes the survivors to
# reports/mutation.txt.
#   bench/mutation.sh                      the engine and the schedules (about 15-25 minutes
#                                          on 2 cores)
#   bench/mutation.sh 'executor.batching.*'   batching and resume (about 10 minutes)
#   bench/mutation.sh 'planner.memory.*'   the memory model, 'planner.milp.*' the MILP,
#                                          'executor.quant.*' the int8/int4 codec (~15 minutes),
#                                          'executor.tasks.*', 'planner.search.*', and
#                                          'executor.checkpoint*' 'executor.stored_formats.*'
#                                          'executor.safetensors_mmap.*' the checkpoint reader
#                                          (each an hour or more on 2 cores: reports/mutation.md
#                                          says how each was run, some on a seeded sample)
#                                          other modules: add them to only_mutate first
# A timeout is a detection only if it is one again on a rerun of that mutant alone
# (`python -m mutmut run NAME`): see reports/mutation.md's correction.
# Needs `pip install mutmut` (not in the dev extra: CI does not run it).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" -m mutmut --help > /dev/null 2>&1 || { echo "mutation: pip install mutmut" >&2; exit 2; }
patterns=("$@")
[ ${#patterns[@]} -eq 0 ] && patterns=('executor.engine.*' 'executor.schedules.*')
"$python" -m mutmut run --max-children 2 "${patterns[@]}" > /dev/null 2>&1
"$python" -m mutmut results --all true > reports/mutation.txt 2>&1
awk '{print $NF}' reports/mutation.txt | sort | uniq -c
