#!/usr/bin/env bash
# Builds bucketfs (release) and mounts.
#
#   scripts/run.sh                 mounts the embedded local-directory store: ./data on ./mnt,
#                                  in the foreground (Ctrl-C or `fusermount3 -u ./mnt` to stop)
#   scripts/run.sh ARGS...         runs `bucketfs mount ARGS...`, e.g.
#                                  scripts/run.sh s3://my-bucket /mnt/b --region eu-west-1
#
# Installs fuse3 (apt) when fusermount3 is missing. The binary is left in
# $CARGO_TARGET_DIR/release/bucketfs (default target dir: ~/.cache/bucketfs-target).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bucketfs-target}"

need_pkgs=()
command -v fusermount3 >/dev/null 2>&1 || need_pkgs+=(fuse3)
for p in libfuse3-dev pkg-config; do
    dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if ((${#need_pkgs[@]})); then
    echo "==> installing ${need_pkgs[*]}"
    [[ $(id -u) -eq 0 ]] && SUDO="" || SUDO="sudo"
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y "${need_pkgs[@]}"
fi
if [[ ! -e /dev/fuse ]]; then
    modprobe fuse 2>/dev/null || true
    if [[ ! -e /dev/fuse ]]; then
        echo "scripts/run.sh: /dev/fuse is missing: load the fuse module (modprobe fuse) or run the container with --device /dev/fuse --cap-add SYS_ADMIN" >&2
        exit 1
    fi
fi

echo "==> building bucketfs (release, target dir $CARGO_TARGET_DIR)"
(cd "$REPO" && cargo build --release -p bucketfs)
BIN="$CARGO_TARGET_DIR/release/bucketfs"

if (($# == 0)); then
    mkdir -p ./data ./mnt
    MNT="$(cd ./mnt && pwd)"
    echo "==> mounting $(cd ./data && pwd) (local-directory store) on $MNT in the foreground"
    echo "    use it from another shell; stop with Ctrl-C here or: fusermount3 -u $MNT"
    exec "$BIN" mount -f ./data ./mnt
fi
exec "$BIN" mount "$@"
