#!/bin/bash
# A lent GPU's checks (../shared/GPU.md), in two parts of under 10 minutes each (a device call's limit),
# run back to back on the same warm machine, in the order they matter:
#   bash scripts/gpu_lease.sh kernels   # install; the GPU kernels compiled and checked; decode A/B (~5 min)
#   bash scripts/gpu_lease.sh peers     # compare_gpu.py (1B, 8B, int8, int4) and the parity tests (~8 min)
# Logs under $OUT when set, else /tmp; each part installs what it needs, so either may run first.
export PYTHONUNBUFFERED=1 JAXINFER_HOME=/tmp/jh XDG_CACHE_HOME=/tmp/xdg
OUT=${OUT:-/tmp}; T0=$(date +%s); t() { echo "== [$(( $(date +%s) - T0 ))s] $*"; }
quiet() { grep -v "^W0\|Warn\|^I0\|^E0000\|oneDNN\|Writing\|Loading" ; }
t install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
ONE_B=/tmp/jaxinfer-gpu/llama-3.2-1b
t "the 1B checkpoint"; python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path
from compare_peers import checkpoint; checkpoint('llama-3.2-1b', Path('/tmp/jaxinfer-gpu'), 'bfloat16')" 2>&1 | quiet | tail -2

case "$1" in
kernels)
  t "the kernels (int8/int4 matrices, decode attention), compiled and checked"; timeout 150 python3 -m pytest -q -o addopts= \
    -p no:cacheprovider tests/test_gpu.py tests/test_gpu_attention.py 2>&1 | tail -4
  one() { t "1B decode, prompt $1, $2 $3"; env $2 timeout 60 python3 scripts/profile_decode.py $ONE_B -p $1 --top $4 $3 \
    2>&1 | quiet | head -$(( $4 + 3 )); }
  # the defaults (attention kernel, fused layout) against XLA's attention, and q/k/v apart; short and long
  one 520 "" "" 15; one 520 JAXINFER_GPU_KERNELS=off "" 0; one 520 "" "--layout out_in" 0
  one 7700 "" "" 0; one 7700 JAXINFER_GPU_KERNELS=off "" 0
  one 520 "" "--quantize int8" 8; one 520 "" "--quantize int4" 0
  t "matrix forms"; timeout 90 python3 scripts/bench_int8_forms.py 2>&1 | quiet | grep "in  4096\|in  2048\|in  8192" | grep "B= 1"
  ;;
peers)
  t "jaxinfer against transformers"; timeout 420 python3 scripts/compare_gpu.py --shapes llama-3.2-1b,llama-3.1-8b \
    --quantize int8,int4 --tokens 64 --repeat 2 --out $OUT/BENCHMARKS.md 2>&1 | quiet | tail -12
  t "parity"; timeout 120 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/test_parity.py -x 2>&1 | tail -4
  ;;
*) echo "usage: bash scripts/gpu_lease.sh kernels|peers" >&2; exit 2 ;;
esac
t done
