#!/usr/bin/env bash
# The CPU kernels' tests on ARM (aarch64) from an x86 Debian machine: Debian's qemu-user runs an
# aarch64 Python in a chroot, which installs this checkout (the aarch64 compiler builds the kernels, as
# on an ARM machine) and runs the tests on each ARM path: neon-dotprod (qemu's CPU has SDOT), neon,
# generic. Then it checks that a CPU without SDOT (QEMU_CPU=cortex-a72) is seen as one. Emulated, so
# correct but slow: the build ~4 minutes, the kernel tests ~5, on 2 cores; its timings mean nothing.
#
# Needs root (chroot, binfmt_misc) and Debian's package mirror.
#   sudo scripts/arm_under_qemu.sh                     # tests/test_packed.py tests/test_attention_kernel.py
#   sudo scripts/arm_under_qemu.sh tests/test_quant.py  # any pytest arguments
set -euo pipefail
root=${ARM_ROOT:-/var/tmp/jaxinfer-arm64}
repo=$(cd "$(dirname "$0")/.." && pwd)
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_packed.py tests/test_attention_kernel.py)

command -v qemu-aarch64-static >/dev/null && command -v debootstrap >/dev/null ||
  apt-get install -y -qq qemu-user-static debootstrap >/dev/null

# aarch64 ELF files run by the static qemu ('F': opened now, so it works inside the chroot too)
binfmt=/proc/sys/fs/binfmt_misc
[ -e $binfmt/register ] || mount -t binfmt_misc binfmt_misc $binfmt
if [ ! -e $binfmt/qemu-aarch64 ]; then
  magic='\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
  mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
  echo ":qemu-aarch64:M::$magic:$mask:$(command -v qemu-aarch64-static):OCF" >$binfmt/register
fi

# Debian's arm64 packages, unpacked (debootstrap's second stage is not needed to run Python)
if [ ! -x "$root/usr/bin/python3" ]; then
  debootstrap --foreign --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-dev,g++ \
    bookworm "$root" http://deb.debian.org/debian >/dev/null
  for deb in "$root"/var/cache/apt/archives/*.deb; do dpkg -x "$deb" "$root"; done
fi
mkdir -p "$root/proc" "$root/dev" "$root/src" "$root/etc/ssl/certs"
cp /etc/resolv.conf "$root/etc/"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
mountpoint -q "$root/dev" || mount --bind /dev "$root/dev"
mountpoint -q "$root/src" || mount --bind "$repo" "$root/src"
trap 'umount "$root/src" "$root/dev" "$root/proc"' EXIT

chroot "$root" /bin/bash -euc '
  cd /src
  export HOME=/root PIP_DISABLE_PIP_VERSION_CHECK=1
  [ -x /venv/bin/python ] || python3 -m venv /venv
  /venv/bin/pip install -q "setuptools>=77" "jax>=0.10.2" "jaxlib>=0.10.2" pytest pytest-xdist hypothesis pexpect
  /venv/bin/pip install -q --no-build-isolation -e .
  /venv/bin/python -m pytest -q -p no:cacheprovider "$@"
  QEMU_CPU=cortex-a72 /venv/bin/python -c "
from jaxinfer import kernel
assert kernel.isa() == \"neon\", kernel.isa()
print(\"a CPU without SDOT (cortex-a72) takes:\", kernel.isa())"
' arm "${tests[@]}"
