# One device call: the segmented GEMM built twice, with the nvidia-cutlass wheel's headers and with the
# CUTLASS checkout at $CUTLASS_AB, each timed against torch._grouped_mm in its own run; then the GEMM op
# tests on the second build, and, while time is left, the GLM-4.5-Air layer at retention 1.0 on both.
# Usage (repo root; carry .whl and the checkout): CUTLASS_AB=.cutlass45 bash benchmarks/gpu_cutlass_ab.sh
source benchmarks/gpu_setup.sh || exit 1
NEW=$(cd "${CUTLASS_AB:?set CUTLASS_AB to a CUTLASS checkout}" && pwd) || exit 1
cp -r tests pytest.ini benchmarks /tmp/pkg/ && cd /tmp/pkg || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/env.log
use() {  # use wheel|new: the build directory and headers of one side
  export TORCH_EXTENSIONS_DIR=/root/ext_$1
  if [ "$1" = new ]; then export CUTLASS_PATH=$NEW; else unset CUTLASS_PATH; fi
}
for side in wheel new; do
  ( use $side; python3 -c "from lrmoe_ds.ops import cuda; print('$side: CUTLASS', cuda.load().cutlass_version())" ) \
    > /tmp/build_$side.log 2>&1 &
done
wait; tail -n 1 /tmp/build_*.log | tee -a $OUT/env.log
for side in wheel new; do
  ( use $side; timeout 170 python3 benchmarks/bench_grouped_gemm.py --variants coop-m1 \
      --out $OUT/gemm_$side.md > /tmp/gemm_$side.log 2>&1; echo "gemm $side rc=$?" )
  grep -E "^# |^Ratio:" $OUT/gemm_$side.md
done
( use new; for f in tests/ops/test_grouped_linear*.py; do
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short $f 2>&1 | tail -n 3
  done ) > $OUT/gpu_tests_gemm_new.log 2>&1
grep -E "passed|failed|error" $OUT/gpu_tests_gemm_new.log
for side in wheel new; do
  [ $SECONDS -lt ${LAYER_BEFORE_S:-420} ] || { echo "layer $side skipped at ${SECONDS}s"; continue; }
  ( use $side; timeout 80 python3 benchmarks/bench_layer.py --shapes glm-4.5-air --ratios 1.0 --policies stash \
      --back_to_back 4 --reps 8 --out $OUT/layer_$side.md > /tmp/layer_$side.log 2>&1; echo "layer $side rc=$?" )
done
echo "done at ${SECONDS}s"
