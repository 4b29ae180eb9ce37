# One device call: build the ops, run the GPU op tests file by file (a crash in one does not hide the
# others), then both benchmarks. Logs go to $OUT. Usage (from the repo root, .whl carried):
#   bash benchmarks/gpu_run.sh
source benchmarks/gpu_setup.sh || exit 1
R=$PWD
cp -r tests pytest.ini benchmarks /tmp/pkg/ && cd /tmp/pkg || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/env.log
( time python3 -c "from lrmoe_ds.ops import cuda; cuda.load(); print('built')" ) > $OUT/build.log 2>&1
tail -5 $OUT/build.log
for f in tests/ops/test_*.py; do
  case $f in *builder*|*compile_gate*) continue;; esac
  echo "== $f" >> $OUT/gpu_tests.log
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short $f >> $OUT/gpu_tests.log 2>&1
  echo "rc=$? $f" | tee -a $OUT/gpu_tests.log
done
grep -E "passed|failed|error" $OUT/gpu_tests.log | tail -20
[ -n "$SKIP_BENCH" ] && exit 0
timeout 240 python3 benchmarks/bench_grouped_gemm.py --out $OUT/grouped_gemm_h200.md > $OUT/bench_gemm.log 2>&1; echo "gemm bench rc=$?"
tail -60 $OUT/bench_gemm.log
# wgrad alone under more tile orders (the skewed wgrad cells are the ones still below torch._grouped_mm)
timeout 150 python3 benchmarks/bench_grouped_gemm.py --passes wgrad --out $OUT/grouped_gemm_wgrad_h200.md \
  --variants pingpong-m1,pingpong-n2,pingpong-n4,pingpong-m2,coop-m1,coop-n2 > $OUT/bench_wgrad.log 2>&1
echo "wgrad variants rc=$?"; grep -A20 "every variant" $OUT/grouped_gemm_wgrad_h200.md
timeout 60 python3 benchmarks/bench_permute.py --out $OUT/permute_h200.md > $OUT/bench_permute.log 2>&1; echo "permute bench rc=$?"
tail -16 $OUT/bench_permute.log
