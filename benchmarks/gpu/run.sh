#!/usr/bin/env bash
# On the GPU machine: install carried wheels, run GPU tests and benchmarks, keep results.
# Usage: bash benchmarks/gpu/run.sh STEP...
#   steps: tests (= tests_main tests_glue) tests_gpu tests_kernels (= tests_main) tests_spec tier forward profile components roofline roofline_glue sweep profile_prefill transfer cuda_ops transfer_native transfer_modes serving
#          speculative serving_spec train_draft speculative_oracle tp tp_allreduce tp_tests (two GPUs)
#          tier_only tier_repeats tier_saves_ab tier_gather tier_profile idle idle_paired profile_verify
#          train forward_v4 roofline_v4 serving_v4 speculative_v4 fp8_gemm roofline_fp8
#          invariant_cost invariant_sweep invariant_prefill invariant_tiles components_invariant gemm_calls serving_invariant determinism precision_agreement
#          fp4_sweep transfer_saves serving_saves fused_ab tests_opt_in
# cuda_ops builds lmcache.cuda_ops from lmcache's sources against this machine's torch
# (benchmarks/gpu/build_cuda_ops.py); once built (build/ stays while the machine is warm, or
# carried back), every later step's LMCache server uses it.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
[ -f build/lmcache_cuda_ops/cuda_ops.so ] && { python3 benchmarks/gpu/build_cuda_ops.py || exit 1; }
export PYTHONPATH=/tmp/site:$PWD LMCACHE_TRACK_USAGE=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the commit the results files name: the GPU machine's copy of the tree may carry a stale .git
# (at e17dae5 it reported f4910db), so the caller writes it to .whl/REV (git rev-parse --short
# HEAD, with -dirty where the tree is) or sets ATOM_GIT_REV
if [ -z "${ATOM_GIT_REV:-}" ] && [ -f .whl/REV ]; then ATOM_GIT_REV=$(cat .whl/REV); fi
export ATOM_GIT_REV=${ATOM_GIT_REV:-}
echo "=== results name commit ${ATOM_GIT_REV:-(unknown: git of this copy)}"
RESULTS=${OUT:-/tmp/out}  # where results are copied (the caller may set OUT)
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RESULTS/gpu.txt"
# the card in results names that carry one (h100, h200)
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE 'H[0-9]+' | tr H h)
CARD=${CARD:-gpu}
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@"; echo "=== rc=$? in $((SECONDS - t0)) s"; }
# a pytest step: every test's outcome in $RESULTS/NAME.log (it comes back as a file, and names
# what failed even when the limit cuts the run before pytest's summary); here its failures,
# its counts and its tail. Captured logs from WARNING up: torch's compile logs at DEBUG
# drowned the failures.
tests_step() { local name=$1 limit=$2; shift 2; echo "=== $name: pytest $* (limit ${limit}s)"
  local t0=$SECONDS rc log="$RESULTS/$name.log"
  timeout "$limit" python3 -m pytest -v -rfE --tb=short --durations=12 --log-level=WARNING \
    -p no:cacheprovider "$@" > "$log" 2>&1; rc=$?
  grep -E "^tests/.* (FAILED|ERROR) " "$log" | head -20
  echo "--- $(grep -cE "^tests/.* PASSED " "$log") passed, $(grep -cE "^tests/.* (FAILED|ERROR) " "$log") failed"
  tail -n 40 "$log"; echo "=== rc=$rc in $((SECONDS - t0)) s (log: $name.log)"; }
# one tier-arm serving run named serving_${CARD}_$1 (extra arguments passed on): its load,
# save and connector figures here; a run named warmup keeps no results
tier_run() { local tag=$1; shift; local log="/tmp/tier_$tag.log"
  step 120 python3 -m benchmarks.serving --preset gpu --arms tier "$@" \
    --name "serving_${CARD}_$tag" > "$log" 2>&1
  if [ "$tag" = warmup ]; then rm -f "$RESULTS"/serving_*_warmup_tier.* \
    benchmarks/results/serving_*_warmup_tier.*; echo "tier warm-up run done"; return; fi
  echo "tier run $tag: $(grep -oE "'(load_p50_ms|load_p99_ms|load_p50_over_copy|save_p50_ms|save_p99_ms|save_hold_p50_ms|save_hold_p50_over_copy|req_per_s|connector_ms_per_step|connector_exposed_ms_per_step|connector_cpu_ms_per_step|while_forward_hidden)': [0-9.]+" "$log" | tr '\n' ' ')"
  grep -oE "'connector_((cpu_)?ms_per_step|calls)_by_hook': \{[^}]*\}" "$log"; }
for s in "$@"; do
  case "$s" in
    # the gate's tests without the tier, in two parts that each finish within 600 s on the GPU
    # machine: tests_main (300 s on one H200 at b260e84, 381 s on an H100 at afe2d77) and
    # tests_glue (294 s on the H100; compiled glue: torch.compile in every test); "tests" runs
    # both (two calls' worth: run the parts in separate calls)
    tests) tests_step tests_main "${TESTS_LIMIT:-540}" tests/gpu tests/kernels \
        -k "not tier and not glue"
      tests_step tests_glue "${GLUE_LIMIT:-480}" tests/gpu/test_glue_compile_cuda.py ;;
    tests_main) tests_step tests_main "${TESTS_LIMIT:-540}" tests/gpu tests/kernels \
      -k "not tier and not glue" ;;
    # tests_main in two halves, for a machine that starts cold (Triton's cache empty): at
    # 8db1bdc on an H200 that way tests_main passed 218 of 247 in 470 s
    tests_gpu) tests_step tests_gpu "${TESTS_LIMIT:-540}" tests/gpu -k "not tier and not glue" ;;
    tests_kernels) tests_step tests_kernels "${TESTS_LIMIT:-540}" tests/kernels ;;
    tests_glue) tests_step tests_glue "${GLUE_LIMIT:-480}" tests/gpu/test_glue_compile_cuda.py ;;
    tests_spec)  # the speculative GPU tests alone (part of tests_main)
      tests_step tests_spec "${SPEC_TESTS_LIMIT:-300}" tests/gpu/test_greedy_walk_cuda.py \
        tests/gpu/test_speculative_cuda.py tests/gpu/test_v4_graphs_cuda.py \
        "tests/gpu/test_batch_invariant_cuda.py::test_drafts_replay_span_graphs_in_the_mode_bit_for_bit" ;;
    tier)  # with two GPUs this includes the tier across ranks (about 110 s); one GPU skips it
      tests_step tier "${TIER_LIMIT:-300}" tests/gpu -k tier ;;
    forward) step 200 python3 -m benchmarks.model_forward --model v41-bench --device cuda \
      --dtype bfloat16 --prompt-len 2048 --decode-steps 16 --batch 1 8 16 \
      --name model_forward_h200 ;;
    forward_v4) step "${FORWARD_V4_LIMIT:-240}" python3 -m benchmarks.model_forward \
      --model v4-bench --device cuda --dtype bfloat16 --prompt-len 2048 --decode-steps 16 \
      --batch 1 8 16 32 --graphs both --repeats 3 --name "${FORWARD_V4_NAME:-model_forward_v4_h200}" ;;
    roofline_v4) step "${ROOFLINE_V4_LIMIT:-300}" python3 -m benchmarks.roofline \
      --model v4-bench --device cuda --dtype bfloat16 --position 4096 --batch 1 8 16 32 \
      --decode-steps 16 --repeats 3 --prefill-repeats 2 --name "${ROOFLINE_V4_NAME:-roofline_v4_h200}" ;;
    serving_v4)  # the three arms on V4 (v4-bench), a smaller workload than v41-bench's gpu preset
      step "${SERVING_V4_LIMIT:-585}" python3 -m benchmarks.serving --preset gpu \
        --model v4-bench --requests 32 --prefix-len 2048 --tail-len 1536 --output-len 32 \
        --concurrency 8 --max-batched-tokens 4096 --pool-blocks 190 --name serving_v4_h200 ;;
    profile) step 200 python3 -m benchmarks.profile_forward --model v41-bench --device cuda \
      --dtype bfloat16 --position 4096 --batch 16 --prefill-tokens 2048 --top 25 \
      --name profile_forward_h200 ;;
    # decode against speculative decoding's verify forward (B sequences, 1 draft each: 2B
    # rows): op by op (eager) at batch 16 in both modes, then the wall times with graphs at
    # batch 1, 8 and 16 (VERIFY_BATCHES) in both modes (VERIFY_MODES; the speculative oracle
    # runs batch-invariant): what a k=1 step's rows cost, time beside weight bytes
    profile_verify)
      for mode in ${VERIFY_MODES:-default invariant}; do
        flag=""; [ "$mode" = invariant ] && flag=--batch-invariant
        step 200 python3 -m benchmarks.profile_forward --model v41-bench-draft --device cuda \
          --dtype bfloat16 --position 4096 --batch 16 --verify 1 --repeats 5 --top 25 \
          $flag --name "profile_verify_${mode}_${CARD}"
        for b in ${VERIFY_BATCHES:-1 8 16}; do
          step 150 python3 -m benchmarks.profile_forward --model v41-bench-draft --device cuda \
            --dtype bfloat16 --position 4096 --batch "$b" --verify 1 --repeats 20 --top 5 \
            --graphs $flag --name "profile_verify_graphs_b${b}_${mode}_${CARD}"
        done
      done ;;
    roofline) step "${ROOFLINE_LIMIT:-240}" python3 -m benchmarks.roofline --model v41-bench \
      --device cuda --dtype bfloat16 --position 4096 --batch ${ROOFLINE_BATCHES:-1 8 16 32} \
      --decode-steps 16 --repeats 3 --name "${ROOFLINE_NAME:-roofline_h200}" ;;
    # the same with compiled glue in the decode graphs (EngineConfig.compile_glue); both take
    # ROOFLINE_BATCHES (one batch keeps the glue's compile within a call)
    roofline_glue) step "${GLUE_ROOFLINE_LIMIT:-540}" python3 -m benchmarks.roofline --model v41-bench \
      --device cuda --dtype bfloat16 --position 4096 --batch ${ROOFLINE_BATCHES:-1 8 16 32} \
      --decode-steps 16 --repeats 3 --name "${GLUE_ROOFLINE_NAME:-roofline_h200_glue}" \
      --compile-glue ;;
    # the launch-cutting kernels (rope, hc_mix, route: default since bd8cbf3's gate; page_write,
    # swiglu: since 93bc75c's; V4's block_round, compressor_pool: since 352d6d6's) off (plain)
    # and on (fused), and with the opt-in ones
    # (atom.kernels.OPT_IN, named in OPT_IN_KERNELS; none at present) on too (opt_in): the decode
    # roofline in FUSED_ROUNDS alternating rounds of FUSED_ARMS (kernels per step and step time)
    fused_ab)
      for i in $(seq "${FUSED_ROUNDS:-2}"); do
        for arm in ${FUSED_ARMS:-plain fused}; do
          off=""; on=""
          [ "$arm" = plain ] && off=rope,hc_mix,route,page_write,swiglu,block_round,compressor_pool
          [ "$arm" = opt_in ] && on=${OPT_IN_KERNELS:?name the opt-in kernels}
          ATOM_TRITON_OFF=$off ATOM_TRITON_ON=$on step "${ROOFLINE_LIMIT:-240}" python3 -m benchmarks.roofline \
            --model v41-bench --device cuda --dtype bfloat16 --position 4096 \
            --batch ${ROOFLINE_BATCHES:-1 16} --decode-steps 16 --repeats 3 \
            --name "roofline_${CARD}_${arm}_r$i"
        done
      done ;;
    # the GPU tests with the opt-in kernels (OPT_IN_KERNELS, and their tests OPT_IN_TESTS) on:
    # the gate that makes them default
    tests_opt_in) ATOM_TRITON_ON=${OPT_IN_KERNELS:?name the opt-in kernels} tests_step tests_opt_in \
      "${TESTS_LIMIT:-540}" tests/gpu ${OPT_IN_TESTS:-} -k "not glue" ;;
    components) step "${COMPONENTS_LIMIT:-200}" python3 -m benchmarks.profile_components \
      --model v41-bench --device cuda --dtype bfloat16 --position 4096 --batch 16 \
      --prefill-tokens 4096 --late-prefill --name "profile_components_h200${COMPONENTS_TAG:-}" ;;
    gemm_calls)  # every weight GEMM of v41-bench's decode and prefill timed by shape, both modes
      for mode in default invariant; do
        flag=""; [ "$mode" = invariant ] && flag=--batch-invariant
        step "${GEMM_CALLS_LIMIT:-150}" python3 -m benchmarks.gemm_calls --model v41-bench \
          --device cuda --dtype bfloat16 --position 2048 --batch 16 --prefill-tokens 4096 \
          $flag --name "gemm_calls_${mode}_${CARD}"
      done ;;
    components_invariant)  # kernel device time per component, default mode then the mode
      for mode in ${COMPONENTS_MODES:-default invariant}; do
        flag=""; [ "$mode" = invariant ] && flag=--batch-invariant
        step "${COMPONENTS_LIMIT:-200}" python3 -m benchmarks.profile_components \
          --model v41-bench --device cuda --dtype bfloat16 --position 2048 --batch 16 \
          --prefill-tokens 4096 --repeats 2 --top 25 $flag \
          --name "profile_components_${mode}_${CARD}"
      done ;;
    sweep) step "${SWEEP_LIMIT:-300}" python3 -m benchmarks.kernel_sweep --tokens 4096 \
      --rows 4096 --name kernel_sweep_h200 ;;
    profile_prefill) step 200 python3 -m benchmarks.profile_forward --model v41-bench \
      --device cuda --dtype bfloat16 --position 4096 --batch 16 --prefill-tokens 4096 \
      --top 30 --graphs --name profile_forward_prefill_h200 ;;
    transfer) step 150 python3 -m benchmarks.transfer --device cuda --chunks 1 4 16 28 \
      --repeats 5 ;;
    cuda_ops) step 420 python3 benchmarks/gpu/build_cuda_ops.py \
      && cp build/lmcache_cuda_ops/cuda_ops.so "$RESULTS"/ ;;
    transfer_modes) step 200 python3 -m benchmarks.transfer --device cuda --chunks 1 4 16 28 \
      --repeats 5 --burst 16 --name transfer_h200_load_modes ;;
    transfer_saves)  # saves in both save modes (server's store vs the engine's copy into L1)
      step "${SAVES_LIMIT:-240}" python3 -m benchmarks.transfer_saves --device cuda \
        --chunks 1 4 16 28 --repeats 5 --burst 16 --name transfer_saves_h200 ;;
    serving_saves)  # the serving preset with engine-driven saves (compare: serving)
      step 585 python3 -m benchmarks.serving --preset gpu --save-mode engine_driven \
        --name serving_h200_engine_saves ;;
    transfer_native) step 150 python3 -m benchmarks.transfer --device cuda --chunks 1 4 16 28 \
      --repeats 5 --burst 16 --name transfer_h200_native ;;
    speculative) step "${SPEC_LIMIT:-300}" python3 -m benchmarks.speculative --device cuda \
      --ks 0 1 2 3 --eager-baseline --prompts 32 --output-len 128 --concurrency 16 \
      --repeats 3 ;;
    train_draft)  # v41-bench-draft's draft adapter (tools/train_draft_adapter.py), continuing
      # the committed one when there is one; the new adapter comes back as draft/ (give each run
      # its own TRAIN_DRAFT_RUN: it picks the run's prompts)
      prev=models/v41-bench-draft-adapter; resume=""
      [ -f $prev/adapter.safetensors ] && resume="--resume $prev"
      step "${TRAIN_DRAFT_LIMIT:-560}" python3 -m tools.train_draft_adapter --model v41-bench-draft \
        --device cuda --minutes "${TRAIN_DRAFT_MINUTES:-4}" --run "${TRAIN_DRAFT_RUN:-0}" \
        --prompts "${TRAIN_DRAFT_PROMPTS:-96}" $resume --out "$RESULTS/draft" \
        --name train_draft_adapter_h200 ;;
    speculative_oracle)  # v41-bench-draft, its draft layer run but its proposals replaced by
      # the true greedy token with probability ORACLE_ACCEPTANCE (benchmarks/oracle_drafts.py):
      # what drafts of that acceptance do on a weight-bound model, at each SPEC_BATCH, each k
      # also walking on the host ("kh"): what the device walk saves. Batch-invariant by default
      # (ORACLE_INVARIANT= turns it off): at 5fec4e7's run without it (H200, batch 16) the bf16
      # outputs with drafts parted from k=0's in 32 of 32 requests, which leaves the oracle's
      # truth behind (acceptance 0.053 instead of about 0.85). The arms share one copy of the
      # weights (benchmarks/shared_weights.py: at 8edc210 four arms did not fit an H100)
      for c in ${SPEC_BATCH:-1 16}; do
        step "${SPEC_ORACLE_LIMIT:-280}" python3 -m benchmarks.speculative --model v41-bench-draft \
          --oracle-acceptance "${ORACLE_ACCEPTANCE:-0.85}" --device cuda --ks ${SPEC_KS:-0 1 2 3} \
          --host-walk ${ORACLE_INVARIANT---batch-invariant} --prompts $((2 * c > 8 ? 2 * c : 8)) \
          --prompt-len 256 --output-len 96 \
          --concurrency $c --repeats 3 --name "speculative_oracle_${CARD}_b$c"
      done ;;
    speculative_v4)  # v4-bench's random MTP block (acceptance ~0): what a verify step costs
      step "${SPEC_V4_LIMIT:-300}" python3 -m benchmarks.speculative --model v4-bench \
        --device cuda --ks 0 1 2 --eager-baseline --prompts 16 --prompt-len 512 \
        --output-len 64 --concurrency 16 --repeats 2 --name speculative_v4_h200 ;;
    # tp: TP=1 against TP=2 summing through NCCL and through the one-shot kernel (TP_ALL_REDUCE:
    # both | group | one_shot), side by side
    tp) step "${TP_LIMIT:-400}" python3 -m benchmarks.tp --model v41-bench --device cuda --tp 2 \
      --prompts 16 --prompt-len 1024 --output-len 64 --concurrency 16 --repeats 3 \
      --graphs "${TP_GRAPHS:-on}" --all-reduce "${TP_ALL_REDUCE:-both}" \
      --name "tp2_${CARD}_graphs_${TP_GRAPHS:-on}" ;;
    tp_allreduce)  # the all-reduce alone at decode sizes, NCCL against one-shot (two GPUs)
      step "${ALLREDUCE_LIMIT:-200}" python3 -m benchmarks.allreduce --tp 2 \
        --name "allreduce_tp2_${CARD}" ;;
    tp_tests) step "${TP_TESTS_LIMIT:-500}" python3 -m pytest -x -q -s -p no:cacheprovider \
      tests/gpu/test_tp_cuda.py tests/gpu/test_one_shot_cuda.py tests/gpu/test_tp_tier_cuda.py \
      tests/distributed ;;
    serving_tp)  # the three arms at TP=2 (two GPUs, eager), the tier arm with rank collapse;
      # half the gpu preset (8 running need 8 x 28 blocks; 32 tails + prefixes do not fit 360).
      # SERVING_TP_ARGS="--save-mode engine_driven" SERVING_TP_TAG=_es: rank 0 copies the saves
      step "${SERVING_TP_LIMIT:-585}" python3 -m benchmarks.serving --preset gpu \
        --tensor-parallel-size 2 --rank-collapse true --requests 32 --concurrency 8 \
        --pool-blocks 360 ${SERVING_TP_ARGS:-} --name "serving_tp2_${CARD}${SERVING_TP_TAG:-}" ;;
    serving) step 585 python3 -m benchmarks.serving --preset gpu ;;
    fp8_gemm) step "${FP8_GEMM_LIMIT:-540}" python3 -m benchmarks.fp8_gemm \
      --models v4-bench-fp8 v41-bench-fp8 --m 1 16 32 64 256 4096 ${FP8_GEMM_SWEEP:+--sweep} \
      --name "${FP8_GEMM_NAME:-fp8_gemm_h200}" ;;
    precision_agreement)  # stored precision (FP8 linears, FP4 experts) against its dequantized twin
      for m in v41-bench-fp8 v4-bench-fp8; do
        step "${AGREEMENT_LIMIT:-240}" python3 -m benchmarks.precision_agreement --model $m \
          --device cuda --prompts 16 --prompt-len 256 --output-len 32 \
          --name "precision_agreement_${m//-/_}_h200"
      done ;;
    invariant_sweep)  # the mode's GEMM configurations on v41-bench's linears, decode and prefill M
      step "${INVARIANT_SWEEP_LIMIT:-420}" python3 -m benchmarks.invariant_gemm_sweep \
        --model v41-bench --m 16 4096 ;;
    invariant_prefill)  # the mode GEMM's prefill tiles on v41-bench's linears, bits checked
      step "${INVARIANT_PREFILL_LIMIT:-420}" python3 -m benchmarks.invariant_prefill_sweep \
        --model v41-bench --m 256 1024 4096 --name "invariant_prefill_sweep_${CARD}" ;;
    invariant_tiles)  # decode and prefill tiles of the mode's GEMM chosen together, per shape
      step "${INVARIANT_TILES_LIMIT:-480}" python3 -m benchmarks.invariant_prefill_sweep \
        --model v41-bench --m 16 256 1024 4096 --decode-tiles sweep \
        --name "invariant_tile_sweep_${CARD}" ;;
    fp4_sweep)  # the FP4 expert GEMM's launches on v41-bench-fp8's experts, decode and prefill
      step "${FP4_SWEEP_LIMIT:-300}" python3 -m benchmarks.fp4_gemm_sweep \
        --model v41-bench-fp8 --tokens 16 4096 ;;
    determinism)  # the default mode run to run (in-process and across processes)
      step "${DETERMINISM_LIMIT:-300}" python3 -m pytest -x -q -p no:cacheprovider \
        tests/gpu/test_default_determinism_cuda.py ;;
    invariant_cost)  # v41-bench decode and prefill, default mode (graphs) then batch-invariant mode
      for mode in "" "--batch-invariant"; do
        step "${INVARIANT_LIMIT:-240}" python3 -m benchmarks.roofline --model v41-bench \
          --device cuda --dtype bfloat16 --position 2048 --batch 1 16 32 --decode-steps 8 \
          --repeats 3 --prefill-repeats 2 $mode \
          --name "roofline_v41_bench_invariant${mode:+_on}_${CARD}"
      done ;;
    serving_invariant)  # the three arms in the batch-invariant mode, half the gpu preset's
      # requests; exits 1 unless every pass equals the no-reuse arm token for token
      step "${SERVING_INVARIANT_LIMIT:-585}" python3 -m benchmarks.serving --preset gpu \
        --batch-invariant --requests 32 --name serving_invariant_h200 ;;
    roofline_fp8)  # both bench models at stored precision (FP8 linears) and dequantized, side by side
      for m in v4-bench-fp8 v41-bench-fp8; do for w in fp8 bf16; do
        step "${ROOFLINE_FP8_LIMIT:-240}" python3 -m benchmarks.roofline --model $m \
          --weight-dtype $w --device cuda --dtype bfloat16 --position 4096 --batch 1 8 16 32 \
          --decode-steps 16 --repeats 3 --prefill-repeats 2 --name "roofline_${m//-/_}_$w"
      done; done ;;
    serving_spec)  # the three arms without / with drafts on v41-bench-draft, 32 requests
      step "${SERVING_SPEC_LIMIT:-585}" python3 -m benchmarks.serving --preset gpu \
        --arms speculative --speculative-tokens "${SERVING_SPEC_K:-1}" ;;
    tier_only) step 300 python3 -m benchmarks.serving --preset gpu --arms tier ;;
    # tier_repeats: the tier arm TIER_REPEATS times (the spread of load ratios, connector ms);
    # TIER_ARGS adds serving flags (e.g. "--load-streams 2"), TIER_TAG suffixes the names
    # the tier arm TIER_REPEATS times, after one unreported run (TIER_WARMUP=0 skips it): the
    # first run on a fresh machine was the slowest of its call every time at ade40a7 and
    # c9c63ff on H100s (req/s 16.6 against 17.8-18.0; 12.6 against 15.7-16.7): it compiles
    tier_repeats)
      [ "${TIER_WARMUP:-1}" = 1 ] && tier_run warmup ${TIER_ARGS:-}
      for i in $(seq "${TIER_REPEATS:-3}"); do
        tier_run "r$i${TIER_TAG:-}" ${TIER_ARGS:-}
      done ;;
    # the save modes side by side: after a warm-up, SAVES_ROUNDS rounds of one run each,
    # lmcache_driven first in odd rounds and engine_driven first in even ones
    tier_saves_ab)
      [ "${TIER_WARMUP:-1}" = 1 ] && tier_run warmup
      for i in $(seq "${SAVES_ROUNDS:-2}"); do
        modes="lmcache_driven engine_driven"; [ $((i % 2)) = 0 ] && modes="engine_driven lmcache_driven"
        for m in $modes; do tier_run "saves_${m%%_*}_r$i" --save-mode "$m"; done
      done ;;
    tier_gather)  # the tier arm with each engine-driven load one gather kernel (lmcache.load_copy)
      step 300 python3 -m benchmarks.serving --preset gpu --arms tier --load-copy kernel \
        --name "serving_${CARD}_gather" ;;
    # the tier arm alone with engine-driven saves, its connector hooks profiled by function
    # (the step thread's ms per hook are inflated by the profiler: compare tier_only)
    tier_profile) step 300 python3 -m benchmarks.serving --preset gpu --arms tier \
      --save-mode engine_driven --profile-hooks --name serving_h200_profile ;;
    idle) step "${IDLE_LIMIT:-560}" python3 -m benchmarks.serving --preset gpu --arms idle \
      --repeats "${IDLE_REPEATS:-2}" --passes "${IDLE_PASSES:-1}" ;;
    # both arms' engines alive, their passes alternating (IDLE_ROUNDS rounds of one pass each):
    # the overhead with a confidence interval, drift cancelled pass by pass
    idle_paired) step "${IDLE_LIMIT:-400}" python3 -m benchmarks.serving --preset gpu --arms idle \
      --interleave "${IDLE_ROUNDS:-60}" ;;
    train)  # a sweep of recipes in parallel (one GPU, launch-bound processes); keep every model
      m=${TRAIN_MINUTES:-6}; t=$(( ${TRAIN_MINUTES:-6} * 60 + 150 ))
      base="--minutes $m --batch 32 --far 80"
      for spec in "A --lr 1e-3 --lengths 256 768" \
                  "B --lr 1e-3 --lengths 256 768 --curriculum 0.3" \
                  "C --lr 3e-3 --lengths 256 768 --curriculum 0.3" \
                  "D --lr 2e-3 --lengths 192 448 --curriculum 0.3 --batch 64"; do
        set -- $spec; name=$1; shift
        (timeout "$t" python3 -m tools.train_recall $base "$@" --out "$RESULTS/recall-$name" 2>&1 \
          | sed -u "s/^/[$name] /") &
      done
      wait ;;
  esac
done
# this run's results, whatever card they name (benchmarks/common.py card_name: an H100's
# files say h100)
find benchmarks/results -type f -newer "$RESULTS/gpu.txt" -exec cp {} "$RESULTS"/ \;
# at most 8 files come back from the GPU machine: more than that go back as one tar
if [ "$(find "$RESULTS" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$RESULTS" && find . -maxdepth 1 -type f ! -name gpu.txt ! -name results.tar -printf '%P\n' \
    | tar -cf results.tar -T - --remove-files)
fi
ls "$RESULTS"
