#!/usr/bin/env bash
# An aarch64 Python environment mirroring the Jetson image's Python stack, built on an x86-64
# Debian host and run under qemu user-mode emulation (issue #28): Debian bookworm's arm64
# python3.11 unpacked into .jetson/sysroot, the pinned aarch64 wheels of
# docker/requirements-jetson.txt (its "#check: " lines too: torch, torchvision, pytest)
# installed into .jetson/site. Run it with .jetson/python (a wrapper around
# qemu-aarch64-static -L .jetson/sysroot). The Jetson image has Python 3.10 on Ubuntu 22.04;
# Ubuntu's ports mirror is not reachable from here, so this tests Python 3.11.
#
# Idempotent: downloads are cached in .jetson/debs and .jetson/wheels; the sysroot and the
# site are rebuilt only when the package list or the pins change. Registers no binfmt
# handler and leaves the host's dpkg architectures alone (apt reads arm64 lists from a
# private state folder). Needs root only to install qemu-user-static if it is missing (and
# g++-aarch64-linux-gnu, for the fused kernels' check, which skips without it).
# Usage: scripts/jetson_env.sh [--offline]   (--offline: use the caches, fetch nothing)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ROOT=$REPO/.jetson
REQS=$REPO/docker/requirements-jetson.txt
PYVER=3.11
HOSTPY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
OFFLINE=0
[ "${1:-}" = "--offline" ] && OFFLINE=1

die() { echo "jetson_env: error: $*" >&2; exit 1; }
say() { echo "jetson_env: $*"; }

# Debian bookworm arm64 packages: python3.11 and the libraries it and the wheels load
# (apt-cache depends --recurse of python3.11, libstdc++6, libgomp1, less perl/dpkg/tar), and
# distutils, which the Jetson image's setuptools uses (torch 2.5 builds extensions with them).
DEBS=(
  python3.11 python3.11-minimal libpython3.11-minimal libpython3.11-stdlib media-types
  libc6 libgcc-s1 gcc-12-base libstdc++6 libgomp1 zlib1g libffi8 libssl3 libexpat1
  libbz2-1.0 liblzma5 libzstd1 libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8
  readline-common libdb5.3 libgdbm6 libgdbm-compat4 libcrypt1 libnsl2 libtirpc3
  libtirpc-common libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1
  libcom-err2 libselinux1 libpcre2-8-0 libacl1 libmd0
  python3-distutils python3-lib2to3
)

# --- host tools --------------------------------------------------------------------------
if ! command -v qemu-aarch64-static >/dev/null; then
  if [ "$OFFLINE" = 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing qemu-user-static (host package; no binfmt handler is registered)"
    (apt-get install -y -q qemu-user-static || (apt-get update -q && apt-get install -y -q qemu-user-static)) >/dev/null
  fi
  command -v qemu-aarch64-static >/dev/null ||
    die "qemu-aarch64-static not found: as root run apt-get install qemu-user-static"
fi
# the aarch64 cross compiler the check builds edgetl's fused mask kernels with (a host package,
# amd64: the emulated interpreter starts it as a host program); without it that check skips
if ! command -v aarch64-linux-gnu-g++ >/dev/null && [ "$OFFLINE" = 0 ] && [ "$(id -u)" = 0 ] &&
   command -v apt-get >/dev/null; then
  say "installing g++-aarch64-linux-gnu (host package: the fused kernels' cross compiler)"
  (apt-get install -y -q g++-aarch64-linux-gnu || (apt-get update -q && apt-get install -y -q g++-aarch64-linux-gnu)) \
    >/dev/null || say "g++-aarch64-linux-gnu could not be installed: the fused-kernels check will skip"
fi
for tool in apt-get dpkg sha256sum; do
  command -v "$tool" >/dev/null || die "$tool not found (this script needs a Debian host)"
done
"$HOSTPY" -m pip --version >/dev/null 2>&1 || die "$HOSTPY has no pip (set PYTHON=... to a python with pip)"
[ -f "$REQS" ] || die "$REQS is missing"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[ -f "$KEYRING" ] || die "$KEYRING is missing (apt-get install debian-archive-keyring)"

mkdir -p "$ROOT"/{apt/lists/partial,apt/cache/archives/partial,debs,wheels}

# --- arm64 .deb files, through a private apt state (the host's architectures stay as they are)
APTCONF=$ROOT/apt/apt.conf
cat >"$ROOT/apt/sources.list" <<EOF
deb [arch=arm64 signed-by=$KEYRING] http://deb.debian.org/debian bookworm main
deb [arch=arm64 signed-by=$KEYRING] http://deb.debian.org/debian bookworm-updates main
deb [arch=arm64 signed-by=$KEYRING] http://deb.debian.org/debian-security bookworm-security main
EOF
: >"$ROOT/apt/status.empty"
cat >"$APTCONF" <<EOF
APT::Architecture "arm64";
APT::Architectures { "arm64"; };
Dir::State::Lists "$ROOT/apt/lists";
Dir::State::Status "$ROOT/apt/status.empty";
Dir::Cache "$ROOT/apt/cache";
Dir::Etc::SourceList "$ROOT/apt/sources.list";
Dir::Etc::SourceParts "$ROOT/apt/none";
Dir::Etc::Preferences "$ROOT/apt/none";
Dir::Etc::PreferencesParts "$ROOT/apt/none";
APT::Install-Recommends "false";
APT::Sandbox::User "root";
EOF
mkdir -p "$ROOT/apt/none"
missing=()
for pkg in "${DEBS[@]}"; do
  compgen -G "$ROOT/debs/${pkg}_*_arm64.deb" >/dev/null || compgen -G "$ROOT/debs/${pkg}_*_all.deb" >/dev/null ||
    missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$OFFLINE" = 0 ] || die "--offline but ${#missing[@]} .deb files are not cached: ${missing[*]}"
  if ! compgen -G "$ROOT/apt/lists/*_binary-arm64_Packages*" >/dev/null; then
    say "apt-get update (arm64 lists, private state in .jetson/apt)"
    APT_CONFIG=$APTCONF apt-get -q update >/dev/null || die "apt-get update of the arm64 lists failed"
  fi
  say "downloading ${#missing[@]} arm64 .deb files"
  (cd "$ROOT/debs" && APT_CONFIG=$APTCONF apt-get -q download "${missing[@]}" >/dev/null) ||
    die "apt-get download failed for: ${missing[*]}"
fi

# --- sysroot: the .deb files unpacked (dpkg -x, no maintainer scripts) -------------------
SYSROOT=$ROOT/sysroot
debs_now=$(cd "$ROOT/debs" && for pkg in "${DEBS[@]}"; do ls "${pkg}"_*.deb | sort | tail -n 1; done)
stamp=$(printf '%s\n' "$debs_now" | sha256sum | cut -c1-16)
if [ "$(cat "$SYSROOT/.stamp" 2>/dev/null)" != "$stamp" ]; then
  say "unpacking ${#DEBS[@]} packages into .jetson/sysroot"
  rm -rf "$SYSROOT" "$SYSROOT.tmp"
  mkdir -p "$SYSROOT.tmp"
  while read -r deb; do dpkg -x "$ROOT/debs/$deb" "$SYSROOT.tmp"; done <<<"$debs_now"
  # qemu -L looks a path up in the sysroot first and falls back to the host's: empty
  # folders here keep the host's x86-64 site packages off the emulated sys.path.
  mkdir -p "$SYSROOT.tmp/usr/lib/python3/dist-packages" "$SYSROOT.tmp/usr/local/lib/python$PYVER/dist-packages"
  # oneDNN reads the CPU id from sysfs (a warning on every torch import where it cannot):
  # the id of the Cortex-A76 that QEMU_CPU emulates, below
  midr=$SYSROOT.tmp/sys/devices/system/cpu/cpu0/regs/identification
  mkdir -p "$midr" && echo 0x00000000414fd0b1 >"$midr/midr_el1"
  echo "$stamp" >"$SYSROOT.tmp/.stamp"
  mv "$SYSROOT.tmp" "$SYSROOT"
fi
[ -x "$SYSROOT/usr/bin/python$PYVER" ] || die "$SYSROOT/usr/bin/python$PYVER missing after unpacking"

# --- wheels: every pin of requirements-jetson.txt, plus its "#check: " lines --------------
mapfile -t PINS < <(sed -n -e 's/[[:space:]]*#.*//' -e '/==/p' "$REQS"; sed -n 's/^#check: *\([^ ]*==[^ ]*\).*/\1/p' "$REQS")
[ "${#PINS[@]}" -gt 0 ] || die "no pins found in $REQS"
norm() { echo "$1" | tr 'A-Z' 'a-z' | sed 's/[-_.]\{1,\}/_/g'; }
wheel_of() {  # the cached wheel file of NAME==VERSION, if any
  local name ver w
  name=$(norm "${1%%==*}"); ver=${1#*==}
  for w in "$ROOT"/wheels/*.whl; do
    [ -e "$w" ] || continue
    w=$(basename "$w")
    [ "$(norm "${w%%-*}")" = "$name" ] && [ "$(echo "$w" | cut -d- -f2)" = "$ver" ] && { echo "$w"; return 0; }
  done
  return 1
}
PLATFORMS=(manylinux2014_aarch64 manylinux_2_17_aarch64 manylinux_2_24_aarch64 manylinux_2_26_aarch64
           manylinux_2_27_aarch64 manylinux_2_28_aarch64 manylinux_2_31_aarch64 manylinux_2_34_aarch64)
PIPTARGET=(--only-binary=:all: --python-version "$PYVER" --implementation cp)
for p in "${PLATFORMS[@]}"; do PIPTARGET+=(--platform "$p"); done
want=()
for pin in "${PINS[@]}"; do wheel_of "$pin" >/dev/null || want+=("$pin"); done
if [ "${#want[@]}" -gt 0 ]; then
  [ "$OFFLINE" = 0 ] || die "--offline but ${#want[@]} wheels are not cached: ${want[*]}"
  say "downloading ${#want[@]} aarch64 wheels: ${want[*]}"
  "$HOSTPY" -m pip download -q --disable-pip-version-check --no-deps "${PIPTARGET[@]}" -d "$ROOT/wheels" "${want[@]}" ||
    die "pip download failed (is PyPI reachable? do the pins have aarch64 cp${PYVER/./} wheels?)"
fi
files=()
for pin in "${PINS[@]}"; do
  w=$(wheel_of "$pin") || die "no wheel for $pin in .jetson/wheels after downloading"
  files+=("$ROOT/wheels/$w")
done

# --- site: the wheels installed for the emulated python ----------------------------------
SITE=$ROOT/site
stamp=$(printf '%s\n' "${files[@]##*/}" | sort | sha256sum | cut -c1-16)
if [ "$(cat "$SITE/.stamp" 2>/dev/null)" != "$stamp" ]; then
  say "installing ${#files[@]} wheels into .jetson/site"
  rm -rf "$SITE" "$SITE.tmp"
  # byte-compiled here by the host's CPython $PYVER (same bytecode), which spares the
  # emulated interpreter minutes of compiling at first import
  "$HOSTPY" -m pip install -q --disable-pip-version-check --no-deps --no-index "${PIPTARGET[@]}" \
    --target "$SITE.tmp" "${files[@]}" || die "pip install --target failed"
  echo "$stamp" >"$SITE.tmp/.stamp"
  mv "$SITE.tmp" "$SITE"
fi

# --- the launcher: `.jetson/python ARGS` runs the emulated interpreter -------------------
# qemu's -0 sets argv[0], so sys.executable is this wrapper and a child python (pytest's
# subprocesses, edgetl's) is emulated too; no binfmt handler is needed. The Orin's CPU is a
# Cortex-A78AE (ARMv8.2, no SVE); qemu 7.2's nearest model is the Cortex-A76, whereas its
# default "max" CPU offers SVE and later extensions that the Jetson lacks.
cat >"$ROOT/python.tmp" <<EOF
#!/usr/bin/env bash
# generated by scripts/jetson_env.sh: aarch64 CPython $PYVER under qemu user-mode emulation
# a PYTHONPATH given (another checkout of edgetl) comes before this repository
export PYTHONPATH="$SITE:\${PYTHONPATH:+\$PYTHONPATH:}$REPO"
export PYTHONNOUSERSITE=1 MPLBACKEND=Agg MPLCONFIGDIR="\${MPLCONFIGDIR:-$ROOT/mplconfig}"
export QEMU_CPU="\${QEMU_CPU:-cortex-a76}"
unset PYTHONHOME
exec qemu-aarch64-static -L "$SYSROOT" -0 "$ROOT/python" "$SYSROOT/usr/bin/python$PYVER" "\$@"
EOF
chmod +x "$ROOT/python.tmp"
mv "$ROOT/python.tmp" "$ROOT/python"

# --- check: aarch64, and every installed distribution's requirements met (as pip check) ---
"$ROOT/python" - "$SITE" <<'EOF' || die "the emulated environment is inconsistent (see above)"
import importlib.metadata as md
import platform
import sys


try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    sys.exit("jetson_env: packaging is not installed: requirements-jetson.txt must pin it (a dependency "
             "of onnxruntime, onnxscript and matplotlib)")

assert platform.machine() == "aarch64", platform.machine()
dists = list(md.distributions(path=[sys.argv[1]]))
have = {canonicalize_name(d.metadata["Name"]): d.version for d in dists}
bad = []
for dist in dists:
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        version = have.get(canonicalize_name(req.name))
        if version is None or not req.specifier.contains(version, prereleases=True):
            bad.append(f"{dist.metadata['Name']} {dist.version} needs {req}, has {version or 'nothing'}")
if bad:
    print("\n".join(bad), file=sys.stderr)
print(f"jetson_env: {platform.machine()} Python {platform.python_version()}, "
      f"{len(have)} distributions, requirements {'NOT met' if bad else 'met'}")
sys.exit(1 if bad else 0)
EOF
say "ready: .jetson/python -m edgetl --help"
