#!/usr/bin/env bash
# Mutation testing of tandem's pure core against its fast, process-free tests (not run by CI:
# minutes per module on two cores). Prints the score per module; see docs/testing.md.
#
#   bash scripts/mutation.sh                      # every module below, in this order
#   bash scripts/mutation.sh buckets schedules    # some of them
#   MUTATION_JOBS=1 bash scripts/mutation.sh data # one worker (default: all cores)
#
# mutmut rewrites source files, so it never runs in this checkout: each module gets a
# throw-away copy of src/ and tests/ under build/mutation/<module>/ (build/ is git-ignored),
# with a setup.cfg that names the one file to mutate and the tests allowed to kill it. The
# tests are process-free on purpose: a mutant must not reach a real process group.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
[ -x "$PY" ] || bash scripts/setup.sh
"$PY" -c "import mutmut" 2>/dev/null || "$ROOT/.venv/bin/pip" install --quiet "mutmut>=3.3,<4"

# module -> "file to mutate|pytest arguments that select its process-free tests (;-separated)"
declare -A TARGETS=(
  [buckets]="src/tandem/parallel/data_parallel/buckets.py|tests/test_buckets.py"
  [schedules]="src/tandem/parallel/pipeline/schedules.py|tests/test_schedules.py"
  [pipeline_balance]="src/tandem/parallel/pipeline/balance.py|tests/test_pipeline.py;-k;partition or costs or timing"
  [data]="src/tandem/data.py|tests/test_data.py;--deselect;tests/test_data.py::test_partition_dataset_on_real_ranks"
  [config]="src/tandem/launch/config.py|tests/test_launcher.py;-k;options_come_from_tandem_variables_unless_given or every_option_comes_from_its_flag_or_its_variable or addresses_are_parsed_at_the_last_colon_with_ports_1_to_65535 or unreadable_values_name_the_flag_or_variable or each_impossible_job_is_refused_with_the_fix or the_smallest_valid_values_are_accepted or run_help_names_each_variable_and_the_program or hosts_set_the_default_number_of_processes or default_backend_is_the_fastest_that_can_run_the_job or a_named_backend_wins_over_the_default or timeline_reaches_every_rank_as_an_absolute_path or missing_script_is_named_before_anything_starts or options_come_from_the_process_environment_by_default"
  [environments]="src/tandem/job/environments/*|tests/test_environments.py;tests/test_environments_mutation.py"
)
ORDER=(buckets schedules pipeline_balance data config environments)
[ $# -gt 0 ] && ORDER=("$@")

for module in "${ORDER[@]}"; do
  spec=${TARGETS[$module]:-}
  if [ -z "$spec" ]; then
    echo "unknown module '$module': choose from ${!TARGETS[*]}" >&2
    exit 2
  fi
  file=${spec%%|*}
  tests=${spec#*|}
  work=$ROOT/build/mutation/$module
  rm -rf "$work"
  mkdir -p "$work"
  cp -r src tests pyproject.toml "$work/"
  find "$work" -name __pycache__ -prune -exec rm -rf {} +
  {
    echo "[mutmut]"
    echo "source_paths = src"
    echo "only_mutate = $file"
    printf 'pytest_add_cli_args =\n    -p\n    no:cacheprovider\n'
    echo "pytest_add_cli_args_test_selection ="
    # one pytest argument per line; a test file that does not exist (yet) is left out
    IFS=';' read -ra words <<< "$tests"
    for word in "${words[@]}"; do
      case $word in tests/*.py) [ -e "$word" ] || continue ;; esac
      echo "    $word"
    done
  } > "$work/setup.cfg"
  echo "== $module: $file"
  (cd "$work" && nice -n 10 "$PY" -m mutmut run ${MUTATION_JOBS:+--max-children "$MUTATION_JOBS"} \
      > mutmut.log 2>&1) || { tail -30 "$work/mutmut.log"; exit 1; }
  (cd "$work" && "$PY" - "$module" <<'EOF'
import collections, subprocess, sys

out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                     capture_output=True, text=True, check=True).stdout
status = collections.Counter(line.rsplit(":", 1)[1].strip() for line in out.splitlines()
                             if "__mutmut_" in line and ":" in line)
total = sum(status.values())
caught = status["killed"] + status["timeout"]
print(f"{sys.argv[1]:<17} {caught:>4}/{total:<4} killed = {100 * caught / max(total, 1):5.1f}%  "
      + ", ".join(f"{k} {v}" for k, v in sorted(status.items())))
survivors = [line.split(":")[0].strip() for line in out.splitlines()
             if line.rstrip().endswith(("survived", "no tests"))]
with open("survivors.txt", "w") as f:
    f.write("\n".join(survivors) + "\n")
EOF
  )
done
echo "survivors: build/mutation/<module>/survivors.txt; show one with"
echo "  (cd build/mutation/<module> && ../../../.venv/bin/python -m mutmut show <name>)"
