#!/bin/sh
# The kernels' ARM paths (NEON with SDOT, NEON alone, the portable C++) built and tested on an x86
# Linux machine: the kernels cross-compiled by Debian's aarch64 g++, the tests run by an aarch64
# Python with aarch64 wheels of jax and the project's dependencies in a Debian chroot, its programs
# run by qemu-user (whose default CPU has SDOT: `kernel.isa()` says neon-dotprod). What the x86
# suite checks of every path (`isa` fixture: each cap against XLA's own product), here for ARM's.
#
#   sudo scripts/arm64_kernels.sh [pytest arguments]     (as root: apt-get, debootstrap, chroot)
#
# Default arguments: the kernel tests that need no transformers (the matmuls, the routed experts'
# product, attention, quantized forms). The chroot (~1.2 GB, ARM64_ROOT, default /tmp/jaxinfer-arm64)
# is made once (~6 min) and reused; the working tree is copied in at each run. About 5× slower
# than the same tests here (test_packed.py: 90 s).
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CHROOT=${ARM64_ROOT:-/tmp/jaxinfer-arm64}
PYTHON=${PYTHON:-python3}  # the host's, with jax installed (its FFI headers)
[ $# -gt 0 ] || set -- -m "not slow" tests/test_packed.py tests/test_attention_kernel.py tests/test_forms.py \
  "tests/test_moe.py::test_the_routed_product_is_the_dense_mixture" tests/test_quant.py

command -v qemu-aarch64-static >/dev/null && command -v aarch64-linux-gnu-g++ >/dev/null && command -v debootstrap >/dev/null ||
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static binfmt-support debootstrap g++-aarch64-linux-gnu
[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64

if [ ! -x "$CHROOT/venv/bin/python" ]; then
  debootstrap --arch=arm64 --foreign --variant=minbase --include=python3,python3-venv bookworm "$CHROOT" http://deb.debian.org/debian
  cp /usr/bin/qemu-aarch64-static "$CHROOT/usr/bin/"
  chroot "$CHROOT" /debootstrap/debootstrap --second-stage
  # the project's dependencies as aarch64 wheels (Debian 12's Python 3.11, glibc 2.36), fetched here
  deps=$("$PYTHON" -c "import tomllib; print(' '.join(tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['dependencies']))" |
    sed 's/; sys_platform[^ ]*//g')
  platforms=""
  for glibc in 2_17 2_24 2_26 2_27 2_28 2_31 2_34 2_35 2_36; do platforms="$platforms --platform manylinux_${glibc}_aarch64"; done
  # shellcheck disable=SC2086 # the lists are words
  "$PYTHON" -m pip download -q $platforms --platform manylinux2014_aarch64 --platform linux_aarch64 --python-version 3.11 \
    --implementation cp --abi cp311 --abi abi3 --abi none --only-binary=:all: -d "$CHROOT/wheels" $deps pytest hypothesis
  chroot "$CHROOT" /bin/sh -c 'python3 -m venv /venv && /venv/bin/pip install -q --no-index /wheels/*.whl'
fi

# the working tree, and the package installed as pip lays it out (cli/ and models/ inside it)
rm -rf "$CHROOT/src" && mkdir -p "$CHROOT/src"
(cd "$ROOT" && git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$CHROOT/src")
objects=$(mktemp -d)
include=$("$PYTHON" -c "import jax.ffi; print(jax.ffi.include_dir())")
for name in matmul attention constrain paths generic x86_avx2 x86_avx512 arm_neon; do  # setup.py's flags
  aarch64-linux-gnu-g++ -O3 -std=c++17 -Wno-attributes -Wno-return-type -fPIC -I"$include" \
    -c "$ROOT/jaxinfer/kernels/$name.cc" -o "$objects/$name.o" &
done
wait
site=$(echo "$CHROOT"/venv/lib/python3*/site-packages)
rm -rf "$site/jaxinfer" && cp -r "$CHROOT/src/jaxinfer" "$site/jaxinfer"
cp -r "$CHROOT/src/cli" "$site/jaxinfer/cli" && cp -r "$CHROOT/src/models" "$site/jaxinfer/models"
aarch64-linux-gnu-g++ -shared -o "$site/jaxinfer/_kernels.cpython-311-aarch64-linux-gnu.so" "$objects"/*.o
rm -rf "$objects"

for mount in proc dev; do mountpoint -q "$CHROOT/$mount" || mount --bind "/$mount" "$CHROOT/$mount"; done
chroot "$CHROOT" /venv/bin/python -c "from jaxinfer import kernel; print('kernels:', kernel.isa())"
cd "$CHROOT/src" && exec chroot "$CHROOT" /bin/sh -c 'cd /src && exec /venv/bin/python -m pytest -o addopts="-ra" -p no:cacheprovider -q "$@"' sh "$@"
