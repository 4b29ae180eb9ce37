# One device call for both issues' recorded tables at this working tree's library: build the ops, every GPU test
# (one pytest), the segmented GEMM against torch._grouped_mm and the cuBLAS loop (default kernels only), the
# permutation kernels' bandwidth, and issue 4's layer table back to back. Logs and tables go to $OUT, named by the
# GPU (h100 / h200) so that a call that lands on the other card says so in its file names.
# Usage (from the repo root, .whl carried):
#   bash benchmarks/gpu_tables.sh    # GEMM_TIMEOUT, PERMUTE_TIMEOUT, LAYER_TIMEOUT, RETAINED_TIMEOUT (seconds; 0 skips
#                                    # that part; the last: the layer table again with router_grad "retained";
#                                    # GEMM_TIMEOUT defaults to 0 off the H200, whose targets issue 3 sets),
#                                    # LAYER_ARGS (more bench_layer.py arguments for issue 4's table),
#                                    # PROFILE_TIMEOUT (0, the default, skips it) with PROFILE_CASES ("shape:tokens ...")
#                                    # and PROFILE_ARGS: profile_layer.py per case, its kernel table printed
source benchmarks/gpu_setup.sh || exit 1
cp -r tests pytest.ini benchmarks train.py ds_configs /tmp/pkg/ && cd /tmp/pkg || exit 1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$gpu" in *H200*) card=h200;; *H100*) card=h100;; *) card=gpu;; esac
echo "$gpu" | tee $OUT/env_$card.log
( time python3 -c "from lrmoe_ds import ops; print(ops.cuda_ops_status())" ) > $OUT/build_$card.log 2>&1
tail -4 $OUT/build_$card.log
if [ "${TEST_TIMEOUT:-200}" -gt 0 ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/ops tests/test_layer_gpu.py \
    tests/test_router_gpu.py > $OUT/gpu_tests_$card.log 2>&1; echo "tests rc=$?"
  grep -E "passed|failed|error" $OUT/gpu_tests_$card.log | tail -2; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_$card.log | head
fi
[ "$card" = h200 ] && GEMM_TIMEOUT=${GEMM_TIMEOUT:-200} || GEMM_TIMEOUT=${GEMM_TIMEOUT:-0}
if [ "$GEMM_TIMEOUT" -gt 0 ]; then
  timeout $GEMM_TIMEOUT python3 benchmarks/bench_grouped_gemm.py --no_variants --out $OUT/grouped_gemm_$card.md \
    > /tmp/bench_gemm.log 2>&1; echo "gemm bench rc=$?"; tail -30 /tmp/bench_gemm.log
fi
if [ "${PERMUTE_TIMEOUT:-60}" -gt 0 ]; then
  timeout ${PERMUTE_TIMEOUT:-60} python3 benchmarks/bench_permute.py --out $OUT/permute_$card.md > /tmp/bench_permute.log 2>&1
  echo "permute bench rc=$?"; tail -12 /tmp/bench_permute.log
fi
if [ "${LAYER_TIMEOUT:-240}" -gt 0 ]; then
  timeout ${LAYER_TIMEOUT:-240} python3 benchmarks/bench_layer.py --back_to_back 4 --reps 8 ${LAYER_ARGS:-} \
    --out $OUT/layer_retention_${card}_back_to_back.md > /tmp/bench_layer.log 2>&1; echo "layer bench rc=$?"
  grep -E "^\| (grouped|DeepSpeed|LRMoE)|^## " $OUT/layer_retention_${card}_back_to_back.md | cut -d'|' -f1-5,7,9
fi
if [ "${RETAINED_TIMEOUT:-0}" -gt 0 ]; then
  timeout ${RETAINED_TIMEOUT} python3 benchmarks/bench_layer.py --back_to_back 4 --reps 8 --router_grad retained \
    --ratios 1.0 0.5 0.25 --policies stash recompute --out $OUT/layer_retained_router_${card}_back_to_back.md \
    > /tmp/bench_retained.log 2>&1; echo "retained-router layer bench rc=$?"
  grep -E "^\| (LRMoE)|^## " $OUT/layer_retained_router_${card}_back_to_back.md | cut -d'|' -f1-5,7,9
fi
if [ "${PROFILE_TIMEOUT:-0}" -gt 0 ]; then
  for case in ${PROFILE_CASES:-qwen3-30b-a3b:8192}; do
    f=$OUT/profile_layer_${case%%:*}_${case##*:}_$card.txt
    timeout $PROFILE_TIMEOUT python3 benchmarks/profile_layer.py --shape ${case%%:*} --tokens ${case##*:} ${PROFILE_ARGS:-} \
      > $f 2>&1; echo "profile $case rc=$?"; grep "per step" $f; sed -n '/^## kernels per step/,$p' $f | head -40
  done
fi
