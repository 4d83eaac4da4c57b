#!/usr/bin/env bash
# Build docker/Dockerfile (x86-64) with podman on a machine that cannot pull base images,
# then smoke-test the image: `edgetl --version` and one fine-tuning step on Fashion-MNIST.
#
# The base image is made locally: a Debian bookworm rootfs from debootstrap, plus this
# host's CPython (sys.base_prefix) at /usr/local and the packages of the repo's venv (torch
# etc.), committed with `buildah from scratch`. The Dockerfile then runs unchanged: pip
# finds torch already satisfied and installs edgetl. Needs root, podman, buildah, debootstrap,
# and about 12 GB of disk under $EDGETL_DOCKER_CACHE (default /var/tmp/edgetl-docker).
#
#   sudo bash docker/build_local.sh            # build base (cached) + image + smoke test
#   KEEP_BASE=0 sudo bash docker/build_local.sh  # rebuild the base image too
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${EDGETL_DOCKER_CACHE:-/var/tmp/edgetl-docker}
BASE_TAG=${BASE_TAG:-localhost/edgetl-base:py3.11-bookworm}
IMAGE_TAG=${IMAGE_TAG:-localhost/edgetl:dev}
VENV_PYTHON=${VENV_PYTHON:-$REPO/.venv/bin/python}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
FMNIST=${FMNIST:-/usr/share/datasets/fashion-mnist}
KEEP_BASE=${KEEP_BASE:-1}

die() { echo "build_local.sh: $*" >&2; exit 3; }
for tool in podman buildah debootstrap; do
  command -v "$tool" >/dev/null || die "$tool is missing (apt-get install podman buildah debootstrap)"
done
[ "$(id -u)" = 0 ] || die "run as root (debootstrap and chroot isolation need it)"
[ -x "$VENV_PYTHON" ] || die "no venv python at $VENV_PYTHON (make setup)"
mkdir -p "$CACHE"

step() { echo "== $* ($(date +%T))"; }

if [ "$KEEP_BASE" = 1 ] && podman image exists "$BASE_TAG"; then
  step "base image $BASE_TAG exists (KEEP_BASE=0 rebuilds it)"
else
  if [ ! -f "$CACHE/rootfs/etc/debian_version" ]; then
    step "debootstrap bookworm minbase"
    rm -rf "$CACHE/rootfs.tmp"
    debootstrap --variant=minbase --include=ca-certificates,libgomp1 bookworm "$CACHE/rootfs.tmp" "$MIRROR" >"$CACHE/debootstrap.log"
    mv "$CACHE/rootfs.tmp" "$CACHE/rootfs"
  fi
  prefix=$("$VENV_PYTHON" -c 'import sys; print(sys.base_prefix)')
  pyver=$("$VENV_PYTHON" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
  site=$("$VENV_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  step "base image from rootfs + $prefix + $site"
  ctr=$(buildah from scratch)
  mnt=$(buildah mount "$ctr")
  cp -a "$CACHE/rootfs/." "$mnt/"
  cp -a "$prefix/." "$mnt/usr/local/"
  # The repo's own editable install and dev tools stay out: the Dockerfile installs edgetl.
  tar -C "$site" --exclude='__editable__*' --exclude='edgetl*' --exclude='hadolint*' --exclude='__pycache__' -cf - . \
    | tar -C "$mnt/usr/local/lib/$pyver/site-packages" -xf -
  ln -sf python3 "$mnt/usr/local/bin/python"
  # The host's trust store: where HTTPS goes through a proxy with its own CA, pip inside the
  # build must trust what the host trusts.
  cp -L /etc/ssl/certs/ca-certificates.crt "$mnt/etc/ssl/certs/ca-certificates.crt"
  chroot "$mnt" /sbin/ldconfig
  chroot "$mnt" /usr/local/bin/python3 -c "import torch, sys; print('base:', sys.version.split()[0], 'torch', torch.__version__)"
  rm -rf "$mnt/var/cache/apt/archives/"*.deb "$mnt/var/lib/apt/lists/"*
  buildah unmount "$ctr" >/dev/null
  buildah config --env LANG=C.UTF-8 --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd python3 "$ctr"
  buildah commit --rm "$ctr" "$BASE_TAG" >/dev/null
fi

step "podman build $IMAGE_TAG"
context="$CACHE/context"
rm -rf "$context" && mkdir -p "$context"
git -C "$REPO" ls-files -co --exclude-standard -- pyproject.toml constraints.txt README.md edgetl deploy docker \
  | tar -C "$REPO" -cf - -T - | tar -C "$context" -xf -
# TORCH_INDEX_URL=PyPI: torch is already in the base; nothing comes from the CPU wheel index.
podman build --isolation chroot -f docker/Dockerfile \
  --build-arg BASE_IMAGE="$BASE_TAG" --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
  -t "$IMAGE_TAG" "$context"

step "smoke test"
runs=$(mktemp -d "$CACHE/runs.XXXXXX")
chmod 0777 "$runs"
ctr=$(buildah from "$IMAGE_TAG")
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah run --isolation chroot "$ctr" -- edgetl --version
if [ -f "$FMNIST/train-images-idx3-ubyte.gz" ]; then
  buildah run --isolation chroot -v "$FMNIST:/data/fashion-mnist:ro" -v "$runs:/runs" \
    -v "$REPO/docker/smoke_finetune.py:/opt/smoke_finetune.py:ro" "$ctr" -- \
    env OMP_NUM_THREADS=1 python3 /opt/smoke_finetune.py /data/fashion-mnist /runs/smoke
  test -s "$runs/smoke/last.pt"
else
  echo "no Fashion-MNIST at $FMNIST: fine-tuning step skipped (apt-get install dataset-fashion-mnist)"
fi
echo "image $IMAGE_TAG ok"
