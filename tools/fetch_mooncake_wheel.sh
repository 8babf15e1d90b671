#!/usr/bin/env bash
# Downloads into ./.whl-mc what tools/bench_mooncake.py needs on the GPU machine, and keeps .whl-mc out
# of git. Run from the project's root, on a machine that reaches PyPI and Debian's packages.
#
#   .whl-mc/mooncake_transfer_engine_cuda13-0.3.14-cp312-...whl   Mooncake's transfer engine, for the
#       GPU machine's Python 3.12 (its import needs no other Python package).
#   .whl-mc/lib/*.so*   system libraries that mooncake/engine.so links and a bare image may lack:
#       libibverbs.so.1 and libmlx5.so.1 (rdma-core; engine.so links them even when no RDMA NIC is
#       used), their libnl-3 libraries, libnuma.so.1, and libcurl.so.4 with its own libraries.
#       They come from Debian 12 packages (glibc 2.36: they load on any newer glibc). The bench loads
#       one of them only where the system cannot (see load_mooncake() in tools/bench_mooncake.py).
#
# Not fetched: libcuda.so.1 (the NVIDIA driver's own) and libcudart.so.13 (PyTorch's CUDA 13 build
# brings it; the bench also looks in the nvidia-* wheels and /usr/local/cuda*).
#
# Send .whl-mc along with the tree (the run tool's carry list) and start each command there with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-mc/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail

MOONCAKE="mooncake-transfer-engine-cuda13==0.3.14"
# Debian packages whose libraries go to .whl-mc/lib (glibc, OpenSSL, zlib and zstd are left out: every
# image that runs Python has them).
PACKAGES=(
  libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1
  libcurl4 libnghttp2-14 libidn2-0 librtmp1 libssh2-1 libpsl5 libgssapi-krb5-2 libkrb5-3
  libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libldap-2.5-0 libsasl2-2 libbrotli1
  libgnutls30 libhogweed6 libnettle8 libgmp10 libp11-kit0 libtasn1-6 libunistring2 libffi8
)
# The files copied, by the names the dynamic linker looks for.
SONAMES=(
  libibverbs.so.1 libmlx5.so.1 libnl-3.so.200 libnl-route-3.so.200 libnuma.so.1
  libcurl.so.4 libnghttp2.so.14 libidn2.so.0 librtmp.so.1 libssh2.so.1 libpsl.so.5
  libgssapi_krb5.so.2 libkrb5.so.3 libk5crypto.so.3 libkrb5support.so.0 libkeyutils.so.1
  libcom_err.so.2 libldap-2.5.so.0 liblber-2.5.so.0 libsasl2.so.2 libbrotlidec.so.1
  libbrotlicommon.so.1 libgnutls.so.30 libhogweed.so.6 libnettle.so.8 libgmp.so.10
  libp11-kit.so.0 libtasn1.so.6 libunistring.so.2 libffi.so.8
)

exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl-mc/' "$exclude" 2>/dev/null || echo '/.whl-mc/' >> "$exclude"
mkdir -p .whl-mc/lib

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl-mc "$MOONCAKE"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
apt-cache show libibverbs1 >/dev/null 2>&1 || apt-get update -qq
(cd "$scratch" && apt-get download -qq "${PACKAGES[@]}")
for deb in "$scratch"/*.deb; do dpkg-deb -x "$deb" "$scratch/root"; done
for soname in "${SONAMES[@]}"; do
  found="$(find "$scratch/root" -name "$soname" | head -n 1)"
  [ -n "$found" ] || { echo "fetch_mooncake_wheel: $soname is in none of the packages" >&2; exit 1; }
  cp -L "$found" ".whl-mc/lib/$soname"
done

ls -la .whl-mc .whl-mc/lib
du -sh .whl-mc
echo "tree (tracked files) + .whl-mc, which must stay under 64 MiB:"
{ git ls-files -z | du -cb --files0-from=- | tail -n 1 | cut -f1; du -sb .whl-mc | cut -f1; } |
  awk '{s += $1} END {printf "%.1f MiB\n", s / 1048576}'
