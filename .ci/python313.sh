#!/usr/bin/env bash
# Build CPython 3.13 from Debian's own source package (trixie's python3.13) into a prefix, so the
# newer JAX releases (0.11+ need Python >= 3.12) can run on these Debian 12 machines, which ship
# Python 3.11 only. Nothing but Debian's package registry and PyPI is reached.
#
#   bash .ci/python313.sh [PREFIX]     # default PREFIX: /opt/py313; prints PREFIX/bin/python3.13
#
# A python3.13 already on PATH (Debian 13, a distribution's package) is used as it is. Else,
# as root (apt-get installs the build dependencies): about 5 minutes on 2 cores the first time;
# afterwards it only prints the path. The interpreter has pip bundled:
# "$PY" -m venv DIR && DIR/bin/pip install "jax==0.12.*" works.
set -euo pipefail
modules="import ssl, sqlite3, lzma, bz2, ctypes, zlib, venv"
if [ $# -eq 0 ] && command -v python3.13 >/dev/null && python3.13 -c "$modules" 2>/dev/null; then
  command -v python3.13; exit 0
fi
prefix=${1:-/opt/py313}
py=$prefix/bin/python3.13
if [ -x "$py" ] && "$py" -c "$modules" 2>/dev/null; then echo "$py"; exit 0; fi
src=/etc/apt/sources.list.d/trixie-src.sources
if [ ! -f $src ]; then
  printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' >$src
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
{
  apt-get update -q
  apt-get install -y -q build-essential libssl-dev zlib1g-dev libffi-dev libbz2-dev liblzma-dev \
    libsqlite3-dev libreadline-dev uuid-dev
  cd "$work" && apt-get source --download-only python3.13
  tar xf python3.13_*.orig.tar.xz && cd Python-3.13.*/
  ./configure --prefix="$prefix" --without-ensurepip
  make -j"$(nproc)"
  make install
} >"$work/build.log" 2>&1 || { tail -20 "$work/build.log" >&2; echo "python313.sh: build failed" >&2; exit 1; }
"$py" -c "$modules" || { echo "python313.sh: built without a needed module" >&2; exit 1; }
echo "$py"
