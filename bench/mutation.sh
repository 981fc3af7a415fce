#!/usr/bin/env bash
# Mutation testing (mutmut, configured in pyproject.toml's [tool.mutmut]): each mutant is one
# small change to a module where a silent bug costs most; a mutant the tests do not fail is a
# behaviour no test checks. Prints mutmut's summary and writes the survivors to
# reports/mutation.txt.
#   bench/mutation.sh                      the engine and the schedules (about 15-25 minutes
#                                          on 2 cores)
#   bench/mutation.sh 'executor.batching.*'   batching and resume (about 10 minutes)
#   bench/mutation.sh 'planner.memory.*'   the memory model, 'planner.milp.*' the MILP,
#                                          'executor.quant.*' the int8/int4 codec (~15 minutes)
#                                          (reports/mutation.md says how each was run)
#                                          other modules: add them to only_mutate first
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
