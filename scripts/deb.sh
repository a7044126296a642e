#!/usr/bin/env bash
# Builds bucketfs_VERSION_ARCH.deb from the repository: the release binary (or --binary FILE)
# laid out by `bucketfs install --prefix /usr --sbin /usr/sbin` in a staging directory, with
# the man page gzipped as Debian wants, and a control file that depends on fuse3.
#
#   scripts/deb.sh [--binary FILE] [--out DIR]      # default: build the release binary, out .
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=$PWD
binary=
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) binary=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: scripts/deb.sh [--binary FILE] [--out DIR]" >&2; exit 2 ;;
  esac
done
if [ -z "$binary" ]; then
  target=${CARGO_TARGET_DIR:-$HOME/.cache/bucketfs-target}
  (cd "$here" && CARGO_TARGET_DIR=$target cargo build --release --bin bucketfs)
  binary=$target/release/bucketfs
fi
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$here/Cargo.toml" | head -n 1)
arch=$(dpkg --print-architecture)
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
"$binary" install --root "$staging" --prefix /usr --sbin /usr/sbin --binary "$binary" >/dev/null
gzip -9n "$staging/usr/share/man/man1/bucketfs.1"
mkdir "$staging/DEBIAN"
cat >"$staging/DEBIAN/control" <<CONTROL
Package: bucketfs
Version: $version
Architecture: $arch
Maintainer: bucketfs developers <bucketfs@localhost>
Depends: fuse3
Section: utils
Priority: optional
Installed-Size: $(du -sk --exclude=DEBIAN "$staging" | cut -f1)
Description: mount an S3 bucket as a POSIX file system
 bucketfs mounts an Amazon S3, Alibaba OSS, MinIO or Ceph RGW bucket (or a local
 directory used as one) through FUSE, storing metadata as s3fs-fuse and ossfs do.
 It also runs ossfs 2.0 config files and s3fs/ossfs 1.x command lines.
CONTROL
mkdir -p "$out"
deb="$out/bucketfs_${version}_${arch}.deb"
dpkg-deb --root-owner-group --build "$staging" "$deb" >/dev/null
echo "$deb"
