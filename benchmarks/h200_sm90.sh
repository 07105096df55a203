#!/usr/bin/env bash
# One H200 call for the sm90 backend: GPU conformance + seam tests, the config sweep, the benchmark.
# Through the device tool with carry [".devcarry/wheels"]:  bash benchmarks/h200_sm90.sh [--sweep]
# STEPS (default "tests bench"; also epipf (bench_epi_prefetch.py: the quack GEMMs' work-tile edges, old against new; EPIPF_ARGS), lora, lorarank (bench_lora_rank.py: a LoRA's cost on a W4A4 layer; LORARANK_ARGS), lowrank (LOWRANK_ARGS=--pdl: the PDL pair, both modes), pdl (bench_pdl.py: the pair alone), parts (bench_exact_parts.py: an exact linear's parts, two launches against the one read), stages (bench_lowrank_stages.py, the library's against a tighter low-rank shared-memory count, STAGES_ALT alternations, STAGES_ARGS), timeline (timeline_exact.py: each kernel of the exact forward, two launches against the one read; TIMELINE_ARGS), normin (bench_norm_in.py: the pass fused into the adaLN norm; NORMIN_ARGS), forms (bench_norm_forms.py: the norm pass's forms alone, Triton only; FORMS_ARGS), fast, flux, small (SMALL_ARGS=--fast-one / --exact-one: a mode's one launch; --exact-kernel: the exact one alone, no quack; SMALL_TAG suffixes its files), decode (bench_decode_dense.py: decode-once + dense GEMM against quack's W4, measured and rejected; DECODE_ARGS=--quick), trace (where the one-launch kernel's time goes; TRACE_ARGS=--exact or --tokens ...), diag, act, gelu, cachehit, pctriton, fallback, host, ncu, suite) picks what runs; each step has its own time limit. PYTEST_ARGS is split on
# spaces: select tests by node id (file::test), not with a quoted -k expression.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
# The CuTe DSL (61 MiB) and the wheels (quack, diffusers) do not fit one call: a call that carries
# .devcarry/cutedsl stages it under /tmp; the next call (machine still warm) carries the wheels.
if [ -d .devcarry/cutedsl ]; then source .devcarry/cutedsl/env.sh
elif [ -f /tmp/cutedsl-site/.ok ]; then
  export PYTHONPATH=/tmp/cutedsl-site:/tmp/cutedsl-site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  export CUTE_DSL_CACHE_DIR=/tmp/cutedsl-cache
else echo "CuTe DSL not staged: quack paths fall back to Triton"; fi
[ -d .devcarry/wheels ] && source .devcarry/wheels/env.sh
export QUACK_CACHE_DIR="${QUACK_CACHE_DIR:-/tmp/quack-cache}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, torch.cuda.get_device_name(), 'triton', triton.__version__)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader
rc=0
for step in ${STEPS:-tests bench}; do
  case "$step" in
    tests) timeout "${TEST_LIMIT:-240}" python3 -m pytest -q -x -p no:cacheprovider -W ignore ${PYTEST_ARGS:-tests/test_conformance.py tests/test_backends.py} \
             > "$OUT/tests.log" 2>&1; rc=$?; tail -15 "$OUT/tests.log" ;;
    bench) timeout "${BENCH_LIMIT:-420}" python3 benchmarks/bench_sm90.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1; tail -70 "$OUT/bench.log" ;;
    pdl) timeout "${PDL_LIMIT:-200}" python3 benchmarks/bench_pdl.py --out "$OUT/bench_pdl.md" > "$OUT/pdl.log" 2>&1; tail -12 "$OUT/pdl.log" ;;
    parts) timeout "${PARTS_LIMIT:-200}" python3 benchmarks/bench_exact_parts.py --out "$OUT/bench_exact_parts.md" ${PARTS_ARGS:-} \
             > "$OUT/parts.log" 2>&1; tail -12 "$OUT/parts.log" ;;
    timeline) timeout "${TIMELINE_LIMIT:-300}" python3 benchmarks/timeline_exact.py --out "$OUT/timeline_exact.md" ${TIMELINE_ARGS:-} \
             > "$OUT/timeline.log" 2>&1; tail -40 "$OUT/timeline.log" ;;
    forms) timeout "${FORMS_LIMIT:-240}" python3 benchmarks/bench_norm_forms.py --out "$OUT/bench_norm_forms.md" ${FORMS_ARGS:-} \
             > "$OUT/forms.log" 2>&1; tail -20 "$OUT/forms.log" ;;
    normin) timeout "${NORMIN_LIMIT:-300}" python3 benchmarks/bench_norm_in.py --out "$OUT/bench_norm_in.md" ${NORMIN_ARGS:-} \
             > "$OUT/normin.log" 2>&1; tail -20 "$OUT/normin.log" ;;
    stages) # the low-rank GEMMs' K-stages under the library's and a tighter shared-memory count, alternating processes,
            # each accounting with its own quack cache (the switch does not change the kernels' cache key)
            for i in $(seq "${STAGES_ALT:-1}"); do for acc in library tight; do
              QUACK_CACHE_DIR="/tmp/quack-cache-$acc" timeout "${STAGES_LIMIT:-280}" python3 benchmarks/bench_lowrank_stages.py \
                --accounting "$acc" --out "$OUT/bench_lowrank_stages_${acc}_$i.md" ${STAGES_ARGS:-} > "$OUT/stages_${acc}_$i.log" 2>&1
              echo "== $acc $i rc=$?"; grep "^| [lt]" "$OUT/stages_${acc}_$i.log" | cut -c1-200
            done; done ;;
    epipf) timeout "${EPIPF_LIMIT:-420}" python3 benchmarks/bench_epi_prefetch.py --out "$OUT/bench_epi_prefetch.md" ${EPIPF_ARGS:-} > "$OUT/epipf.log" 2>&1; tail -30 "$OUT/epipf.log" ;;
    lowrank) timeout "${LOWRANK_LIMIT:-300}" python3 benchmarks/bench_lowrank.py --out "$OUT" ${LOWRANK_ARGS:-} > "$OUT/lowrank.log" 2>&1; tail -40 "$OUT/lowrank.log" ;;
    fast) timeout "${FAST_LIMIT:-400}" python3 benchmarks/bench_fast.py --out "$OUT" ${FAST_ARGS:-} > "$OUT/fast.log" 2>&1; tail -45 "$OUT/fast.log" ;;
    flux) timeout "${FLUX_LIMIT:-500}" python3 benchmarks/flux_forward.py --out "$OUT" ${FLUX_ARGS:-} > "$OUT/flux.log" 2>&1; tail -12 "$OUT/flux.log" ;;
    lora) timeout "${LORA_LIMIT:-200}" python3 benchmarks/bench_lora_split.py --triton --best-env "$OUT/lora_env" \
            --out "$OUT/bench_lora_split.md" > "$OUT/lora.log" 2>&1; tail -6 "$OUT/lora.log"
          # the later steps run with the config that measured best (or cuBLAS)
          if [ -s "$OUT/lora_env" ]; then export SVDQ_SM90_LORA_ACT="$(cat "$OUT/lora_env")"; echo "SVDQ_SM90_LORA_ACT=$SVDQ_SM90_LORA_ACT"; fi ;;
    lorarank) timeout "${LORARANK_LIMIT:-240}" python3 benchmarks/bench_lora_rank.py --out "$OUT/bench_lora_rank.md" ${LORARANK_ARGS:-} \
                > "$OUT/lorarank.log" 2>&1; tail -20 "$OUT/lorarank.log" ;;
    small) timeout "${SMALL_LIMIT:-120}" python3 benchmarks/bench_small_m.py --out "$OUT/bench_small_m${SMALL_TAG:-}.md" ${SMALL_ARGS:-} \
             > "$OUT/small${SMALL_TAG:-}.log" 2>&1; tail -30 "$OUT/small${SMALL_TAG:-}.log" ;;
    decode) timeout "${DECODE_LIMIT:-300}" python3 benchmarks/bench_decode_dense.py --out "$OUT/bench_decode_dense.md" ${DECODE_ARGS:-} \
              > "$OUT/decode.log" 2>&1; tail -14 "$OUT/decode.log" ;;
    act) timeout "${ACT_LIMIT:-200}" python3 benchmarks/bench_act.py --out "$OUT/bench_act.md" ${ACT_ARGS:-} > "$OUT/act.log" 2>&1; tail -60 "$OUT/act.log" ;;
    cachehit) timeout "${CACHE_LIMIT:-200}" python3 benchmarks/check_precompiled.py --cache .devcarry/precompiled/quack-cache \
                > "$OUT/cachehit.log" 2>&1; tail -6 "$OUT/cachehit.log" ;;
    host) timeout "${HOST_LIMIT:-200}" python3 benchmarks/host_overhead.py --out "$OUT/host_overhead.md" ${HOST_ARGS:-} \
            > "$OUT/host.log" 2>&1; tail -40 "$OUT/host.log" ;;
    ncu) NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)"
         timeout "${NCU_LIMIT:-240}" "$NCU" --profile-from-start off --nvtx --clock-control none --target-processes all \
           --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy \
           --section LaunchStats --section WarpStateStats --section SchedulerStats \
           python3 benchmarks/ncu_cases.py ${NCU_ARGS:-} > "$OUT/ncu.log" 2>&1
         echo "ncu rc=$?"; grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Compute \(SM\)|^case" "$OUT/ncu.log" | head -60 ;;
    pctriton) # precompile with this machine's Triton (its cache is version-specific), then a fresh process
              # runs the layers --quick covers and reports Triton cache hits and misses
              timeout "${PC_LIMIT:-300}" python3 -m svdq_linear.precompile --arch sm_90a --quick --out /tmp/pc > "$OUT/pctriton.log" 2>&1
              tail -3 "$OUT/pctriton.log"; cp /tmp/pc/report-sm_90a.json "$OUT/" 2>/dev/null
              timeout 200 python3 benchmarks/check_precompiled.py --triton-cache /tmp/pc/triton-cache >> "$OUT/pctriton.log" 2>&1
              tail -8 "$OUT/pctriton.log" ;;
    gelu) timeout "${GELU_LIMIT:-200}" python3 benchmarks/bench_gelu_in.py --out "$OUT/bench_gelu_in.md" > "$OUT/gelu.log" 2>&1; tail -12 "$OUT/gelu.log" ;;
    fallback) timeout "${FALLBACK_LIMIT:-150}" python3 benchmarks/bench_fallback.py --out "$OUT/bench_fallback.md" > "$OUT/fallback.log" 2>&1; tail -12 "$OUT/fallback.log" ;;
    diag) # graphs of the one-launch fast kernel replayed several ways, each in its own process; then the
          # faulting way under compute-sanitizer when present (DIAG_SAN="mode layers")
          for c in ${DIAG_CASES:-"serial 0,1,2" "concurrent 0,1,2" "drop 0,1,2"}; do
            echo "== $c"; timeout 120 python3 benchmarks/diag_graph_streams.py $c 2>&1 | tail -3
          done > "$OUT/diag.log"
          SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
          if [ -n "$SAN" ] && [ -n "${DIAG_SAN:-}" ]; then
            echo "== compute-sanitizer $DIAG_SAN" >> "$OUT/diag.log"
            timeout "${SAN_LIMIT:-200}" "$SAN" --tool memcheck --print-limit 8 python3 benchmarks/diag_graph_streams.py $DIAG_SAN \
              >> "$OUT/diag.log" 2>&1
          fi
          cat "$OUT/diag.log" | cut -c1-300 | tail -60 ;;
    trace) timeout "${TRACE_LIMIT:-200}" python3 benchmarks/trace_small_m_fast.py --out "$OUT/trace_small_m_fast.md" ${TRACE_ARGS:-} > "$OUT/trace.log" 2>&1; tail -22 "$OUT/trace.log" ;;
    suite) timeout "${TEST_LIMIT:-400}" python3 -m pytest -q -p no:cacheprovider -W ignore tests/ > "$OUT/suite.log" 2>&1; rc=$?; tail -15 "$OUT/suite.log" ;;
  esac
done
exit "$rc"
