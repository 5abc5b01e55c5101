#!/usr/bin/env bash
# Build the kvsvc images (kvsvc:server, kvsvc:worker) with podman, also on a machine that
# reaches PyPI and a Debian archive but no container registry.
#
#   deploy/images/build.sh                  # both targets, base chosen as below
#   deploy/images/build.sh --base local     # always the local Debian base (bootstrapped once)
#   deploy/images/build.sh --base public    # python:3.11-slim from the registry, as docker does
#   deploy/images/build.sh server           # one target
#   deploy/images/build.sh prometheus       # localhost/prometheus:bookworm for compose
#
# The base (--base auto, the default): python:3.11-slim when podman has it or can pull it
# (within KVSVC_PULL_TIMEOUT seconds, default 60), else the local base: a
# `debootstrap --variant=minbase bookworm` of the Debian archive apt already uses (or
# DEBIAN_MIRROR), imported as localhost/debian:bookworm, plus Debian's Python 3.11 and this
# host's extra CA certificates (/usr/local/share/ca-certificates/*.crt) in
# localhost/kvsvc-python:3.11-bookworm (deploy/images/python-base.Containerfile). Both stay in
# podman's store: later builds reuse them (--rebuild-base makes them again).
#
# The worker's torch: from a local wheel directory when one is given (--torch-wheels DIR,
# else PIP_FIND_LINKS when it names a directory holding a torch wheel), mounted read-only
# into the build; without one the Dockerfile's TORCH_INDEX_URL (download.pytorch.org).
#
# prometheus: Debian's prometheus on the local Debian base (deploy/images/prometheus.Containerfile),
# a stand-in for compose's prom/prometheus image where no registry answers.
#
# Builds run with --format docker (the OCI format drops HEALTHCHECK) and --network host.
# CONTAINERS_CONF defaults to deploy/images/containers.conf (fixed ulimits, runc). Needs
# root or a working rootless podman, and podman, buildah, debootstrap (for the local base):
# apt-get install podman buildah fuse-overlayfs slirp4netns uidmap runc debootstrap
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$HERE/containers.conf}"

PUBLIC_BASE="${KVSVC_PUBLIC_BASE:-docker.io/library/python:3.11-slim}"
DEBIAN_IMAGE="localhost/debian:bookworm"
LOCAL_BASE="localhost/kvsvc-python:3.11-bookworm"
PROMETHEUS_IMAGE="localhost/prometheus:bookworm"
PULL_TIMEOUT="${KVSVC_PULL_TIMEOUT:-60}"
TAG_PREFIX="${KVSVC_IMAGE:-kvsvc}"

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  echo "options: --base auto|public|local  --rebuild-base  --torch-wheels DIR  [server] [worker] [prometheus]"
}

base_mode=auto
rebuild_base=no
torch_wheels=""
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base_mode="${2:?--base needs auto, public or local}"; shift 2 ;;
    --rebuild-base) rebuild_base=yes; shift ;;
    --torch-wheels) torch_wheels="${2:?--torch-wheels needs a directory}"; shift 2 ;;
    server|worker|prometheus) targets+=("$1"); shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (--help)" >&2; exit 2 ;;
  esac
done
[ "${#targets[@]}" -gt 0 ] || targets=(server worker)
case "$base_mode" in auto|public|local) ;; *)
  echo "build.sh: --base must be auto, public or local, not '$base_mode'" >&2; exit 2 ;;
esac

say() { echo "== $*"; }

cleanup=()
trap 'rm -rf "${cleanup[@]}"' EXIT

# The Debian archive this host's apt uses (its first .../debian URI), else deb.debian.org.
debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
  local uri
  uri="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
           2>/dev/null | grep -oE '(https?|file)://[^ ]+/debian/?( |$)' | head -n 1 | tr -d ' ' || true)"
  echo "${uri:-http://deb.debian.org/debian}"
}

bootstrapped=no
bootstrap_local_base() {
  [ "$bootstrapped" = no ] || return 0
  bootstrapped=yes
  local start=$SECONDS work
  work="$(mktemp -d)"
  cleanup+=("$work")
  if [ "$rebuild_base" = yes ] || ! podman image exists "$DEBIAN_IMAGE"; then
    command -v debootstrap >/dev/null || {
      echo "build.sh: the local base needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
    local mirror
    mirror="$(debian_mirror)"
    say "debootstrap bookworm from $mirror (about a minute)"
    debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
      tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
    tar -C "$work/rootfs" -c . | podman import - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$work/rootfs"
  fi
  mkdir -p "$work/context/extra-ca"
  # The host's extra CA certificates, when it has any (a proxy that re-signs TLS).
  for crt in /usr/local/share/ca-certificates/*.crt; do
    [ -e "$crt" ] && cp "$crt" "$work/context/extra-ca/"
  done
  say "building $LOCAL_BASE (Debian's python3, venv, pip; $(ls "$work/context/extra-ca" | wc -l) extra CA certificate(s))"
  podman build --format docker --network host --pull=never \
    --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
    -f "$HERE/python-base.Containerfile" -t "$LOCAL_BASE" "$work/context" >"$work/base.log" 2>&1 || {
      tail -n 30 "$work/base.log" >&2; exit 1; }
  say "local base ready in $((SECONDS - start)) s"
}

# Sets base: the image the Dockerfile's BASE_IMAGE gets.
choose_base() {
  case "$base_mode" in
    public)
      podman image exists "$PUBLIC_BASE" || podman pull "$PUBLIC_BASE" >/dev/null
      base="$PUBLIC_BASE" ;;
    local)
      if [ "$rebuild_base" = yes ] || ! podman image exists "$LOCAL_BASE"; then
        bootstrap_local_base
      fi
      base="$LOCAL_BASE" ;;
    auto)
      if [ "$rebuild_base" = no ] && podman image exists "$PUBLIC_BASE"; then
        base="$PUBLIC_BASE"
      elif [ "$rebuild_base" = no ] && podman image exists "$LOCAL_BASE"; then
        base="$LOCAL_BASE"
      elif [ "$rebuild_base" = no ] \
           && timeout "$PULL_TIMEOUT" podman pull -q "$PUBLIC_BASE" >/dev/null 2>&1; then
        base="$PUBLIC_BASE"
      else
        [ "$rebuild_base" = yes ] || say "$PUBLIC_BASE cannot be pulled here: bootstrapping the local base"
        bootstrap_local_base
        base="$LOCAL_BASE"
      fi ;;
  esac
}

# A directory holding a torch wheel: --torch-wheels, else PIP_FIND_LINKS when it is one.
find_torch_wheels() {
  if [ -n "$torch_wheels" ]; then
    compgen -G "$torch_wheels/torch-*.whl" >/dev/null || {
      echo "build.sh: --torch-wheels $torch_wheels holds no torch-*.whl" >&2; exit 2; }
    (cd "$torch_wheels" && pwd)
  elif [ -n "${PIP_FIND_LINKS:-}" ] && [ -d "$PIP_FIND_LINKS" ] \
       && compgen -G "$PIP_FIND_LINKS/torch-*.whl" >/dev/null; then
    (cd "$PIP_FIND_LINKS" && pwd)
  fi
}

command -v podman >/dev/null || {
  echo "build.sh: podman is not installed (apt-get install podman buildah fuse-overlayfs slirp4netns uidmap runc debootstrap)" >&2
  exit 1
}
build_prometheus() {
  local start=$SECONDS
  if [ "$rebuild_base" = yes ] || ! podman image exists "$DEBIAN_IMAGE"; then
    bootstrap_local_base
  fi
  say "building $PROMETHEUS_IMAGE (Debian's prometheus)"
  podman build --format docker --network host --pull=never \
    --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
    -f "$HERE/prometheus.Containerfile" -t "$PROMETHEUS_IMAGE" "$HERE"
  say "$PROMETHEUS_IMAGE built in $((SECONDS - start)) s"
}

kvsvc_targets=()
for target in "${targets[@]}"; do
  if [ "$target" = prometheus ]; then build_prometheus; else kvsvc_targets+=("$target"); fi
done
[ "${#kvsvc_targets[@]}" -gt 0 ] || exit 0
base=""
choose_base
say "base image: $base"
for target in "${kvsvc_targets[@]}"; do
  start=$SECONDS
  extra=()
  if [ "$target" = worker ]; then
    wheels="$(find_torch_wheels)"
    if [ -n "$wheels" ]; then
      say "worker: torch from the local wheels in $wheels (mounted read-only)"
      extra+=(--volume "$wheels:/tmp/torch-wheels:ro" --build-arg TORCH_WHEELS=/tmp/torch-wheels)
    fi
  fi
  previous="$(podman image inspect --format '{{.Id}}' "$TAG_PREFIX:$target" 2>/dev/null || true)"
  say "building $TAG_PREFIX:$target"
  podman build --format docker --network host --pull=never \
    --build-arg "BASE_IMAGE=$base" "${extra[@]}" \
    --target "$target" -t "$TAG_PREFIX:$target" -f "$REPO/Dockerfile" "$REPO"
  # The image this tag named before (and its layers no other image uses) would stay as
  # a dangling GB per rebuild; a container still running it keeps it.
  current="$(podman image inspect --format '{{.Id}}' "$TAG_PREFIX:$target")"
  if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
    podman rmi "$previous" >/dev/null 2>&1 || true
  fi
  size="$(podman image inspect --format '{{.Size}}' "$TAG_PREFIX:$target")"
  say "$TAG_PREFIX:$target built in $((SECONDS - start)) s ($((size / 1000000)) MB)"
done
