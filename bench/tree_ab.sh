#!/usr/bin/env bash
# An A/B of two Python trees on the GPU machine, alternating: the working tree against an older
# commit's dflash_trt/ and bench/ (same plugins: the library is built once for both when their
# plugins/ match). For changes outside the kernels, which no switch can turn off at run time.
#
#   bash bench/tree_ab.sh prepare REV [DIR]  # here: REV's tree into DIR (default .gpu/old, ignored;
#                                            # carry it)
#   bash bench/tree_ab.sh run ROUNDS ARGS... # there: profile_step.py ARGS with each tree, ROUNDS
#                                            # times; $OUT/tree_{old,new}_ROUND.json, logs beside;
#                                            # OLD=DIR for another prepared tree than .gpu/old
set -u
case ${1:-} in
prepare)
  rev=${2:?usage: tree_ab.sh prepare REV [DIR]}
  dir=${3:-.gpu/old}
  rm -rf "$dir" && mkdir -p "$dir"
  git archive "$rev" dflash_trt plugins build_configs bench | tar -x -C "$dir"
  cp -r "$dir/build_configs" "$dir/dflash_trt/build_configs"  # the installed package's layout
  rm -rf "$dir/dflash_trt/fixtures/demo"  # the demo pair's weights: random-weight runs need none, a call's carry is small
  echo "$(git rev-parse --short "$rev")" > "$dir/REV"  # a name (HEAD, a branch) would not say which commit
  ;;
run)
  rounds=${2:?usage: tree_ab.sh run ROUNDS ARGS...}
  shift 2
  OUT=${OUT:-/tmp/tree_ab}
  old=${OLD:-.gpu/old}
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1
  if [ ! -f /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . && touch /tmp/site/.done
  fi
  # the old tree first on the path: its dflash_trt, its plugins/ (plugins.plugin_dir)
  for r in $(seq "$rounds"); do
    for arm in old new; do
      if [ $arm = old ]; then path=$old:/tmp/site script=$old/bench/profile_step.py tree=$(cat "$old/REV")
      else path=/tmp/site script=bench/profile_step.py tree="working tree"; fi
      PYTHONPATH=$path python3 "$script" "$@" --json "$OUT/tree_${arm}_$r.json" > "$OUT/tree_${arm}_$r.log" 2>&1
      echo "tree_ab $arm ($tree) $r rc=$?"
    done
  done
  ;;
*)
  echo "usage: tree_ab.sh prepare REV [DIR] | [OLD=DIR] tree_ab.sh run ROUNDS PROFILE_STEP_ARGS..." >&2
  exit 2
  ;;
esac
