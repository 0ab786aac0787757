#!/bin/bash
# One lease's checks on a lent GPU (../shared/GPU.md), in the order they matter; about 8 minutes on an H100.
# Run from the checkout: bash scripts/gpu_lease.sh  (writes its logs under $OUT when set, else /tmp)
export PYTHONUNBUFFERED=1 JAXINFER_HOME=/tmp/jh XDG_CACHE_HOME=/tmp/xdg
OUT=${OUT:-/tmp}; T0=$(date +%s); t() { echo "== [$(( $(date +%s) - T0 ))s] $*"; }
quiet() { grep -v "^W0\|Warn\|^I0\|^E0000\|oneDNN\|Writing\|Loading" ; }
t install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
t "the kernels (int8/int4 matrices, decode attention), compiled"; timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/test_gpu.py tests/test_gpu_attention.py 2>&1 | tail -4
t "matrix forms"; timeout 90 python3 scripts/bench_int8_forms.py 2>&1 | quiet | grep "in  4096\|in  2048\|in  8192" | grep "B= 1"
t "jaxinfer against transformers"; timeout 420 python3 scripts/compare_gpu.py --shapes llama-3.2-1b,llama-3.1-8b \
  --quantize int8,int4 --tokens 64 --repeat 2 --out $OUT/BENCHMARKS.md 2>&1 | quiet | tail -12
t "decode profile, 1B"; timeout 60 python3 scripts/profile_decode.py /tmp/jaxinfer-gpu/llama-3.2-1b --top 15 2>&1 | quiet
for p in 520 7700; do for k in off ""; do  # decode attention: XLA's (off) against the kernel, short and long
  t "1B decode, prompt $p, JAXINFER_GPU_KERNELS=$k"; JAXINFER_GPU_KERNELS=$k timeout 60 python3 scripts/profile_decode.py \
    /tmp/jaxinfer-gpu/llama-3.2-1b -p $p --top 0 2>&1 | quiet | head -2
done; done
t "parity"; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_parity.py -x 2>&1 | tail -4
t done
