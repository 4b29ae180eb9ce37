# One device call for the layer: build the ops, the layer's op tests (GEMM, permute, unpermute, gate gradient, the
# fused combine backward, swiglu), the router's GPU tests and the bf16 layer tests, the layer benchmark (exact and
# retention rows under stash and recompute: layer_retention_h200.md), the layer's host time at 256 tokens
# (host_time_h200.md), a profile of one shape with its Chrome traces (one .tar, so it comes back as one file), and
# (TRAIN_STEPS > 0) a short train.py run on one GPU. Logs go to $OUT.
# Usage (from the repo root, .whl carried):
#   bash benchmarks/gpu_layer_run.sh  # BENCH_ARGS (e.g. "--shapes glm-4.5-air"), BENCH_TIMEOUT, BENCH2_ARGS, PROFILE_ARGS, PROFILE_TIMEOUT (0: none), TRAIN_STEPS, RUN_TESTS (0: no tests), HOST_TIMEOUT (0: no host_time.py)
source benchmarks/gpu_setup.sh || exit 1
cp -r tests pytest.ini benchmarks train.py ds_configs /tmp/pkg/ && cd /tmp/pkg || exit 1
( time python3 -c "from lrmoe_ds import ops; print(ops.cuda_ops_status())" ) > $OUT/build.log 2>&1; tail -4 $OUT/build.log
[ "${RUN_TESTS:-1}" = 1 ] && timeout 200 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/ops/test_grouped_linear.py \
  tests/ops/test_grouped_linear_dgrad.py tests/ops/test_grouped_linear_wgrad.py tests/ops/test_unpermute.py \
  tests/ops/test_unpermute_weight_grad.py tests/ops/test_unpermute_backward.py tests/ops/test_swiglu.py \
  tests/ops/test_permute.py tests/test_layer_gpu.py tests/test_router_gpu.py \
  2>&1 | tee $OUT/layer_gpu_tests.log | tail -5
# both shapes x 8k/16k tokens, 11 rows each; the .md is rewritten after every row, so a timeout keeps what ran
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_layer.py ${BENCH_ARGS:-} --out $OUT/layer_retention_h200.md \
  > $OUT/bench_layer.log 2>&1; echo "bench rc=$?"
grep -E "^\| (grouped|DeepSpeed|LRMoE)|^## " $OUT/layer_retention_h200.md | cut -d'|' -f1-5,7,9
# BENCH2_ARGS: a second table (e.g. "--ratios 0.5 --allocations waterfill threshold"), layer_bench2_h200.md
if [ -n "${BENCH2_ARGS:-}" ]; then
  timeout ${BENCH2_TIMEOUT:-150} python3 benchmarks/bench_layer.py $BENCH2_ARGS --out $OUT/layer_bench2_h200.md \
    > $OUT/bench_layer2.log 2>&1; echo "bench2 rc=$?"
  grep -E "^\| (grouped|DeepSpeed|LRMoE)|^## " $OUT/layer_bench2_h200.md | cut -d'|' -f1-5,7,9
fi
# the host's share at 256 tokens, where the GPU idles (the stacked expert weights' effect shows here)
[ "${HOST_TIMEOUT:-120}" -gt 0 ] && timeout ${HOST_TIMEOUT:-120} python3 benchmarks/host_time.py --shape qwen3-30b-a3b --tokens 256 --ratio 0.5 --out $OUT/host_time_h200.md \
  > $OUT/host_time.log 2>&1; echo "host_time rc=$?"; grep -A5 "^| layer" $OUT/host_time_h200.md
[ "${PROFILE_TIMEOUT:-80}" -gt 0 ] && timeout ${PROFILE_TIMEOUT:-80} python3 benchmarks/profile_layer.py \
  ${PROFILE_ARGS:---shape qwen3-30b-a3b --tokens 8192 --policies stash recompute} --trace /tmp/traces \
  > $OUT/profile_layer.txt 2>&1; echo "profile rc=$?"; grep "per step" $OUT/profile_layer.txt
[ -d /tmp/traces ] && tar -cf $OUT/traces.tar -C /tmp traces 2>/dev/null
if [ "${TRAIN_STEPS:-0}" -gt 0 ]; then
  timeout 150 python3 -m deepspeed.launcher.runner --num_gpus 1 train.py --deepspeed_config ds_configs/h200.json \
    --steps $TRAIN_STEPS --eval_every 30 --save_dir /tmp/ckpt --summary_json $OUT/train_summary.json > $OUT/train.log 2>&1
  echo "train rc=$?"; grep -v WARNING $OUT/train.log | tail -6
fi
