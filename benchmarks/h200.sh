#!/usr/bin/env bash
# One H200 call: environment, the test suite (PYTEST_ARGS, default all of tests/), the benchmarks
# (SKIP_BENCH=1 leaves them out).
# Run through the device tool with carry [".devcarry/wheels"]:  bash benchmarks/h200.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source .devcarry/wheels/env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv
python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-tests/} 2>&1 | tee "$OUT/tests.log" | tail -25
rc=${PIPESTATUS[0]}
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 benchmarks/linear_bench.py --out "$OUT/linear_bench.md" 2>&1 | tee "$OUT/bench.log"
  python3 benchmarks/svdquant_bench.py --out "$OUT/svdquant_bench.md" 2>&1 | tail -20
fi
exit "$rc"  # the tests decide the call's exit status
