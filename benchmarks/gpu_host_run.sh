# One device call after a change to the layer's host path: build, the GEMM and layer GPU tests, a
# profile with traces (one .tar, so it comes back as one file) and the layer benchmark. Logs go to $OUT.
# Usage (from the repo root, .whl carried):
#   bash benchmarks/gpu_host_run.sh      # BENCH_ARGS (default: the Qwen3 shape), BENCH_TIMEOUT, PROFILE_ARGS
source benchmarks/gpu_setup.sh || exit 1
cp -r tests pytest.ini benchmarks /tmp/pkg/ && cd /tmp/pkg || exit 1
( time python3 -c "from lrmoe_ds.ops import cuda; cuda.load(); print('built')" ) > $OUT/build.log 2>&1; tail -3 $OUT/build.log
timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/ops/test_grouped_linear.py \
  tests/ops/test_grouped_linear_dgrad.py tests/ops/test_grouped_linear_wgrad.py tests/test_layer_gpu.py 2>&1 \
  | tee $OUT/gpu_tests.log | tail -4
timeout ${PROFILE_TIMEOUT:-80} python3 benchmarks/profile_layer.py ${PROFILE_ARGS:---shape qwen3-30b-a3b --tokens 8192 --policies stash recompute} \
  --trace /tmp/traces > $OUT/profile_layer.txt 2>&1; echo "profile rc=$?"; grep "per step" $OUT/profile_layer.txt
tar -cf $OUT/traces.tar -C /tmp traces 2>/dev/null
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_layer.py ${BENCH_ARGS:---shapes qwen3-30b-a3b} \
  --out $OUT/layer_h200.md > $OUT/bench_layer.log 2>&1; echo "bench rc=$?"
grep -E "^\| (grouped|DeepSpeed|LRMoE)|^## " $OUT/layer_h200.md | cut -d'|' -f1-5,7,9
