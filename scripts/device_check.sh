#!/usr/bin/env bash
# One call on a GPU machine: build, then the steps named on the command line
# (tests, cuda_tests, memcheck, sweep, bench, spmm, hetero, hetero_bench, e2e, nn_tests, minibatch, keep_so,
# det_tests, det_memcheck, det_bench, det_spmm, det_e2e, det_summary: deterministic mode), logs and CSVs packed into
# one file, $OUT/results.tgz (default OUT: /tmp/geot-out), for machines that return only a few files:
#   bash scripts/device_check.sh tests memcheck bench spmm
# A later call on the same warm machine can skip the build (KEEP_BUILD=1): the
# copied sources are newer than its objects, so setup.py would rebuild everything.
set -o pipefail
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD GEOT_DATA=${GEOT_DATA:-$PWD/.data}
FINAL_OUT=${OUT:-/tmp/geot-out}
export OUT=/tmp/geot-run  # the benchmarks write their CSVs here too
mkdir -p "$OUT" "$FINAL_OUT"
trap 'tar czf "$FINAL_OUT/results.tgz" -C "$OUT" . 2>/dev/null' EXIT
start=$(date +%s)
if [ -n "$KEEP_BUILD" ] && ls geot/_C.*.so >/dev/null 2>&1; then  # KEEP_BUILD=1: a warm machine's extension, as built
  echo "extension kept from an earlier call on this machine"
elif [ -n "$PREBUILT" ]; then  # PREBUILT=dir: the extension a previous call built (keep_so), carried back
  gunzip -c "$PREBUILT"/_C.*.so.gz > "geot/$(basename "$PREBUILT"/_C.*.so.gz .gz)" || exit 1
  echo "prebuilt extension from $PREBUILT"
else
  python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
fi
status=0
for step in "$@"; do
  case $step in
    tests)
      python3 -m pytest -q tests 2>&1 | tee "$OUT/tests.log" | tail -4 || status=1 ;;
    cuda_tests)  # the CUDA tests of the segment_reduce family only (a quick check before a sweep)
      python3 -m pytest -q -x tests/test_segment_reduce.py tests/test_index_segment_reduce.py -k cuda 2>&1 \
        | tee "$OUT/cuda_tests.log" | tail -4 || status=1 ;;
    memcheck)  # the CUDA tests of the segment_reduce family under compute-sanitizer
      compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 -m pytest -q -x tests/test_segment_reduce.py tests/test_index_segment_reduce.py \
          -k "cuda and not compile and not every_" -p no:cacheprovider \
        > "$OUT/memcheck.log" 2>&1
      rc=$?; echo "memcheck exit $rc (0 = clean)"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
      [ $rc -eq 0 ] || status=1 ;;
    sweep)  # the perf DB: resumes from perfdb/<gpu>/*.csv.gz, brings the grown DB back in $OUT
      db=perfdb/$(python3 -c "import sys; sys.path.insert(0, 'bench'); from common import device_slug; print(device_slug())")
      mkdir -p "$db"
      # SWEEP_FRESH=1: start over (the kernels changed), else resume the committed DB
      python3 perfdb/sweep.py --budget-s "${SWEEP_BUDGET_S:-360}" ${SWEEP_FRESH:+--fresh} $SWEEP_ARGS \
        > "$OUT/sweep.log" 2>&1 || status=1
      tail -2 "$OUT/sweep.log"
      python3 scripts/analyze_sweep.py "$db" | tee "$OUT/sweep_summary.txt"
      for f in "$db"/*.csv; do gzip -c "$f" > "$FINAL_OUT/$(basename "$f").gz"; done
      cp "$db/device.json" "$FINAL_OUT/" ;;
    bench)
      python3 bench/segment_reduce.py 2>&1 | tee "$OUT/bench.log" | tail -45 || status=1 ;;
    hetero)  # segment_matmul / edge_softmax: their tests (CUDA included), then a memcheck of the CUDA ones
      python3 -m pytest -q tests/test_segment_matmul.py tests/test_edge_softmax.py tests/test_examples.py 2>&1 \
        | tee "$OUT/hetero_tests.log" | tail -4 || status=1
      compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 -m pytest -q -x tests/test_segment_matmul.py tests/test_edge_softmax.py \
          -k "cuda and not compile and not opcheck" -p no:cacheprovider > "$OUT/hetero_memcheck.log" 2>&1
      rc=$?; echo "hetero memcheck exit $rc (0 = clean)"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/hetero_memcheck.log" | tail -3
      [ $rc -eq 0 ] || status=1 ;;
    hetero_bench)
      python3 bench/hetero.py 2>&1 | grep -v Warning | tee "$OUT/hetero_bench.log" | grep -E "geomean|^segment_matmul|^edge_softmax" || status=1 ;;
    e2e)  # every model and path eagerly in fp32, then the torch.compile paths where they matter most
          # (E2E_COMPILE_MODELS, E2E_COMPILE_GRAPHS, E2E_COMPILE_MODE=reduce-overhead);
          # logs straight to the real $OUT, so a run cut off by the time limit still brings them back
      python3 bench/e2e.py --dtypes fp32 --no-compile 2>&1 | grep -v Warning | tee "$FINAL_OUT/e2e_eager.log" \
        | sed -n '/^ms per step/,$p' || status=1
      mv bench/out/e2e_*.csv "$OUT/e2e_eager.csv"; mv bench/out/e2e_*.png "$OUT/e2e_eager.png"
      rm -f "$OUT"/e2e_nvidia*
      python3 bench/e2e.py --models "${E2E_COMPILE_MODELS:-gcn,sage}" --hidden 64 --dtypes fp32 \
        --graphs "${E2E_COMPILE_GRAPHS:-pubmed,powerlaw:n=200000,deg=10}" \
        ${E2E_COMPILE_MODE:+--compile-mode $E2E_COMPILE_MODE} 2>&1 | grep -v Warning \
        | tee "$FINAL_OUT/e2e_compile.log" | sed -n '/^ms per step/,$p' || status=1 ;;
    nn_tests)  # geot.nn against PyG (every option, CUDA), under compute-sanitizer's memcheck when NN_MEMCHECK=1
      ${NN_MEMCHECK:+compute-sanitizer --tool memcheck --error-exitcode 9} \
        python3 -m pytest -q tests/test_nn_conformance.py tests/test_nn.py -k cuda -p no:cacheprovider 2>&1 \
        | grep -v Warning | tee "$OUT/nn_tests.log" | tail -4 || status=1 ;;
    minibatch)  # sampled GraphSAGE training, a new graph every step (MINIBATCH_ARGS: bench/minibatch.py's options)
      python3 bench/minibatch.py $MINIBATCH_ARGS 2>&1 | grep -v -i warn | tee "$FINAL_OUT/minibatch.log" | tail -12 \
        || status=1 ;;
    keep_so)  # bring the built extension back (gzipped), for a later call's PREBUILT
      for f in geot/_C.*.so; do gzip -c "$f" > "$FINAL_OUT/$(basename "$f").gz"; done ;;
    det_tests)  # deterministic mode: tests/test_determinism.py (CUDA tests included)
      timeout "${DET_TESTS_S:-240}" python3 -m pytest -q tests/test_determinism.py -p no:cacheprovider 2>&1 \
        | tee "$OUT/det_tests.log" | tail -6 || status=1 ;;
    det_memcheck)  # a cut of them under compute-sanitizer: one config per schedule, fp32 and bf16
      timeout "${DET_MEMCHECK_S:-150}" compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 -m pytest -q -x tests/test_determinism.py -p no:cacheprovider \
          -k "${DET_MEMCHECK_K:-(test_segment_reduce and sum) or (test_weighted_reduce and mean) or index_scatter or segment_matmul or gin}" \
        > "$OUT/det_memcheck.log" 2>&1
      rc=$?; echo "det memcheck exit $rc (0 = clean, 124 = time limit)"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/det_memcheck.log" | tail -3
      [ $rc -eq 0 ] || status=1 ;;
    det_bench)  # segment_reduce in both modes (DET_BENCH_ARGS: e.g. --F 1 8 64)
      timeout "${DET_BENCH_S:-200}" python3 bench/segment_reduce.py --deterministic --reps 20 $DET_BENCH_ARGS 2>&1 \
        | tee "$OUT/det_bench.log" | sed -n '/^Deterministic mode/,+2p' || status=1 ;;
    det_spmm)  # SpMM forward in both modes
      timeout "${DET_SPMM_S:-150}" python3 bench/spmm.py --sections fwd --deterministic --reps 15 $DET_SPMM_ARGS 2>&1 \
        | grep -v Warning | tee "$OUT/det_spmm.log" | grep -E "geomean|deterministic mode" || status=1 ;;
    det_e2e)  # GCN and GAT, 50 training steps twice in deterministic mode: losses bitwise equal
      timeout "${DET_E2E_S:-150}" python3 bench/e2e.py --deterministic --models gcn,gat --steps 50 \
        --graphs "${DET_E2E_GRAPHS:-cora,pubmed,powerlaw:n=200000,deg=10}" 2>&1 | grep -v Warning \
        | tee "$OUT/det_e2e.log" | grep -E "bitwise-identical" || status=1 ;;
    det_summary)  # the deterministic steps' results, one line each (last in the output)
      echo "=== deterministic mode ==="
      grep -hE "passed|failed" "$OUT/det_tests.log" 2>/dev/null | tail -1 | sed 's/^/tests:          /'
      grep -h "ERROR SUMMARY" "$OUT/det_memcheck.log" 2>/dev/null | tail -1 | sed 's/^/memcheck:       /'
      grep -h -A2 "^Deterministic mode" "$OUT/det_bench.log" 2>/dev/null | sed 's/^/segment_reduce: /'
      grep -h "deterministic mode:" "$OUT/det_spmm.log" 2>/dev/null | sed 's/^/spmm:           /'
      grep -h "bitwise-identical" "$OUT/det_e2e.log" 2>/dev/null | sed 's/^/e2e:            /' ;;
    spmm)
      python3 bench/spmm.py 2>&1 | grep -v Warning | tee "$OUT/spmm.log" | grep -E "geomean|speedup|^ *cora +16 |^ *graph +F +op" || status=1 ;;
  esac
done
echo "total: $(( $(date +%s) - start )) s"
exit $status
