# One device call: this working tree's library against an earlier one, at the layer. Builds both (the old one in
# the background, into its own TORCH_EXTENSIONS_DIR), runs the op and layer GPU tests on this tree, then
# bench_layer.py per shape, this tree then the old one, in turns, AB_ROUNDS times (default 1), as long as AB_SECONDS (default 480) allow.
# AB_ORDER=alternate runs the old library first in even rounds (the first run of a pair can pay for a warmer or
# colder host); AB_PROFILE, when set, holds profile_layer.py's arguments, run once per library after the rounds.
# Usage (from the repo root, .whl carried; ab_old is an untracked folder, so it travels with the tree):
#   mkdir ab_old && git archive <old commit> lrmoe_ds ops | tar -x -C ab_old
#   bash benchmarks/gpu_layer_ab.sh ab_old      # AB_ARGS: bench_layer.py's arguments; AB_TESTS: pytest's files;
#                                               # AB_SHAPES: the shapes, one process each (default both)
# Logs and tables go to $OUT: build.log, gpu_tests.log and ab_round_<n>.md, one file per round holding every table
# of that round under a [new library] / [old library] heading, in the order they ran, and profile.txt (AB_PROFILE).
old=${1:?the folder of the old library (lrmoe_ds/ and ops/)}
source benchmarks/gpu_setup.sh || exit 1
rm -rf /tmp/pkgold && mkdir -p /tmp/pkgold && cp -r "$old/lrmoe_ds" /tmp/pkgold/ && cp -r "$old/ops" /tmp/pkgold/lrmoe_ds/ops
cp -r tests pytest.ini benchmarks train.py ds_configs /tmp/pkg/ && cd /tmp/pkg || exit 1
build='from lrmoe_ds import ops; print(ops.cuda_ops_status())'
( TORCH_EXTENSIONS_DIR=/tmp/ext_old PYTHONPATH=/tmp/pkgold:/tmp/site MAX_JOBS=8 python3 -c "$build" > /tmp/build_old.log 2>&1 ) &
old_build=$!
( time MAX_JOBS=8 python3 -c "$build" ) > $OUT/build.log 2>&1; tail -4 $OUT/build.log
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu -rs -p no:cacheprovider ${AB_TESTS:-tests/ops/test_unpermute_backward.py \
  tests/ops/test_swiglu.py tests/ops/test_unpermute.py tests/ops/test_unpermute_weight_grad.py tests/ops/test_permute.py \
  tests/test_layer_gpu.py tests/test_router_gpu.py} > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"
grep -E "passed|failed|error" $OUT/gpu_tests.log | tail -3; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -20
wait $old_build; tail -1 /tmp/build_old.log
args=${AB_ARGS:---ratios 1.0 0.5 --policies stash --back_to_back 4 --reps 8}
limit=${AB_SECONDS:-480}
for n in $(seq ${AB_ROUNDS:-1}); do
  for shape in ${AB_SHAPES:-glm-4.5-air qwen3-30b-a3b}; do
    order="new old"; [ "${AB_ORDER:-}" = alternate ] && [ $((n % 2)) = 0 ] && order="old new"
    for lib in $order; do
      left=$((limit - SECONDS)); [ $left -lt 40 ] && { echo "no time left for $shape $lib $n"; continue; }
      if [ $lib = old ]; then env="TORCH_EXTENSIONS_DIR=/tmp/ext_old PYTHONPATH=/tmp/pkgold:/tmp/site"; else env=""; fi
      table=/tmp/ab_${shape}_${lib}_$n.md
      env $env timeout $left python3 benchmarks/bench_layer.py $args --shapes $shape --out $table \
        > /tmp/ab_${shape}_${lib}_$n.log 2>&1; echo "$shape $lib $n rc=$? at ${SECONDS}s"
      grep -E "^\| (grouped|LRMoE)" $table 2>/dev/null | cut -d'|' -f1-4
      { echo "---"; echo; echo "# [$lib library]"; sed 's/^#/##/' $table 2>/dev/null; echo; } >> $OUT/ab_round_$n.md
    done
  done
done
if [ -n "${AB_PROFILE:-}" ]; then
  for lib in new old; do
    left=$((limit + 120 - SECONDS)); [ $left -lt 30 ] && { echo "no time left for the $lib profile"; continue; }
    if [ $lib = old ]; then env="TORCH_EXTENSIONS_DIR=/tmp/ext_old PYTHONPATH=/tmp/pkgold:/tmp/site"; else env=""; fi
    echo "# [$lib library] profile_layer.py $AB_PROFILE" >> $OUT/profile.txt
    env $env timeout $left python3 benchmarks/profile_layer.py $AB_PROFILE 2>&1 | grep -v Warn >> $OUT/profile.txt
    echo "$lib profile rc=$? at ${SECONDS}s"; grep -E "^(##|per step)" $OUT/profile.txt | tail -8
  done
fi
