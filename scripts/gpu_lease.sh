#!/bin/bash
# A lent GPU's checks (../shared/GPU.md), in parts of under 10 minutes each (a device call's limit),
# run back to back on the same warm machine, in the order they matter:
#   bash scripts/gpu_lease.sh sweep     # the kernels' tiles swept, then 1B decode with the best (~8 min)
#   bash scripts/gpu_lease.sh suite     # the whole suite, each result kept as it comes (SUITE_S seconds)
#   bash scripts/gpu_lease.sh kernels   # install; the GPU kernels compiled and checked; decode A/B (~5 min)
#   bash scripts/gpu_lease.sh peers     # compare_gpu.py (1B, 8B, int8, int4) and the parity tests (~8 min)
# Logs under $OUT when set, else /tmp; each part installs what it needs, so either may run first.
export PYTHONUNBUFFERED=1 JAXINFER_HOME=/tmp/jh XDG_CACHE_HOME=/tmp/xdg
OUT=${OUT:-/tmp}; T0=$(date +%s); t() { echo "== [$(( $(date +%s) - T0 ))s] $*"; }
quiet() { grep -v "^W0\|Warn\|^I0\|^E0000\|oneDNN\|Writing\|Loading" ; }
t install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1
# the test extras the lent machines lack (../shared/GPU.md), carried as wheels (and llguidance as installed)
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
[ -d .whl/site ] && cp -r .whl/site/* /tmp/site/
ONE_B=/tmp/jaxinfer-gpu/llama-3.2-1b
t "the 1B checkpoint"; python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path
from compare_peers import checkpoint; checkpoint('llama-3.2-1b', Path('/tmp/jaxinfer-gpu'), 'bfloat16')" 2>&1 | quiet | tail -2

case "$1" in
sweep)
  t "roofs, the int8/int4 products' and attention's tiles"; timeout 330 python3 scripts/sweep_gpu_kernels.py \
    --parts roof,gemv,attention --budget 150 --out $OUT 2>&1 | quiet
  BEST=$(python3 scripts/sweep_gpu_kernels.py --parts best --out $OUT); t "the best: $BEST"
  d() { t "1B decode $*"; timeout 70 python3 scripts/sweep_gpu_kernels.py --parts decode --model $ONE_B "$@" \
    --chunks 3 --top 12 2>&1 | quiet | tail -17; }
  d; d $BEST; d --quantize int8; d $BEST --quantize int8; d --quantize int4; d $BEST --quantize int4
  XLA_FLAGS=--xla_gpu_enable_dot_strength_reduction=false d $BEST
  XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,CONDITIONAL --legacy_command_buffer_custom_call_targets=__gpu\$xla.gpu.triton" d $BEST
  ;;
more)  # the second look: attention's rule at a longer context; int8's tiles end to end; int4 on the CUDA cores
  d() { t "1B decode $*"; timeout 40 python3 scripts/sweep_gpu_kernels.py --parts decode --model $ONE_B "$@" \
    --chunks 2 --steps 32 --top 6 2>&1 | quiet | tail -10; }
  d -p 3000; d -p 3000 --attention xla; d --quantize int8; d --quantize int8 --int8 kind=fma,step=2,bn=256,stages=1
  timeout 60 python3 scripts/sweep_gpu_kernels.py --parts gemv --bits 4 --only fma --budget 45 --out $OUT 2>&1 | quiet
  ;;
suite)
  t "the suite on the GPU, each result as it comes ($OUT/suite.log)"; timeout ${SUITE_S:-300} python3 -m pytest -v \
    -o addopts= -p no:cacheprovider -n 14 --dist loadfile tests/test_gpu.py tests/test_gpu_attention.py tests \
    > $OUT/suite.log 2>&1; grep -E " (FAILED|ERROR) " $OUT/suite.log | sed 's/^\[gw[0-9]*\] *//' | sort | head -80
  echo "$(grep -c " PASSED " $OUT/suite.log) passed, $(grep -c " FAILED " $OUT/suite.log) failed, $(grep -c " SKIPPED " $OUT/suite.log) skipped"
  ;;
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
