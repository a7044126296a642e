#!/usr/bin/env bash
# Runs the whole bucketfs test suite on a fresh machine (Debian 12, root):
#   1. installs fuse3 (apt), MinIO and csi-sanity (pinned, `go install`) when missing,
#   2. cargo fmt --check and cargo clippy (cheap, first),
#   3. starts a private MinIO on 127.0.0.1 (free port, temp data dir, random credentials),
#   4. cargo test --workspace (unit + integration tests, real FUSE mounts against that MinIO),
#   5. the soak test (64 threads, integrity ledger, RSS budget) alone, so that the memory it
#      measures is its own; then the MinIO fault tests (they stop and restart the server).
# Exits non-zero on the first failure. Everything it starts is stopped and every temp dir removed
# on exit.
set -euo pipefail

MINIO_MODULE="github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"
# The CSI conformance tests the driver test (crates/cli/tests/csi.rs) runs.
CSI_SANITY_MODULE="github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity"
CSI_SANITY_VERSION="v5.4.0"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bucketfs-target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"
# Incremental artifacts only help edit-compile loops; in the suite they cost gigabytes of disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

log() { printf '\n==> %s (%s)\n' "$*" "$(date +%T)"; }
die() { printf 'scripts/test.sh: %s\n' "$*" >&2; exit 1; }
SECONDS=0

WORK="$(mktemp -d "${TMPDIR:-/tmp}/bucketfs-test.XXXXXX")"
# Traversable by other users: the permission tests switch to `nobody` to use test mounts below.
chmod 0755 "$WORK"
MINIO_PIDFILE="$WORK/minio.pid"
MINIO_INSTALL_PID=""

cleanup() {
    local rc=$?
    set +e
    if [[ -n "$MINIO_INSTALL_PID" ]] && kill -0 "$MINIO_INSTALL_PID" 2>/dev/null; then
        kill "$MINIO_INSTALL_PID" 2>/dev/null
        wait "$MINIO_INSTALL_PID" 2>/dev/null
    fi
    # The fault test may have restarted MinIO: the pid file always names the live server.
    if [[ -s "$MINIO_PIDFILE" ]]; then
        local pid
        pid="$(cat "$MINIO_PIDFILE")"
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
            kill -9 "$pid" 2>/dev/null
        fi
    fi
    # Safety net: a test that died hard may have left a mount under our temp dir.
    local mp
    while read -r mp; do
        fusermount3 -uz "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null
    done < <(awk -v w="$WORK" 'index($5, w) == 1 { print $5 }' /proc/self/mountinfo 2>/dev/null)
    rm -rf "$WORK"
    if [[ $rc -eq 0 ]]; then
        printf '\nscripts/test.sh: all tests passed in %dm%02ds\n' $((SECONDS / 60)) $((SECONDS % 60))
    else
        printf '\nscripts/test.sh: FAILED (exit %d) after %dm%02ds\n' "$rc" $((SECONDS / 60)) $((SECONDS % 60)) >&2
    fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------------------------
# 1. System packages: fuse3 (fusermount3, the kernel interface) and libfuse3-dev + pkg-config.
# ---------------------------------------------------------------------------------------------
need_pkgs=()
command -v fusermount3 >/dev/null 2>&1 || need_pkgs+=(fuse3)
command -v fio >/dev/null 2>&1 || need_pkgs+=(fio)
command -v sysbench >/dev/null 2>&1 || need_pkgs+=(sysbench)
command -v rsync >/dev/null 2>&1 || need_pkgs+=(rsync)
for p in libfuse3-dev pkg-config; do
    dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if ((${#need_pkgs[@]})); then
    log "installing ${need_pkgs[*]}"
    [[ $(id -u) -eq 0 ]] && SUDO="" || SUDO="sudo"
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y "${need_pkgs[@]}"
fi
if [[ ! -e /dev/fuse ]]; then
    modprobe fuse 2>/dev/null || true
    [[ -e /dev/fuse ]] || die "/dev/fuse is missing: load the fuse kernel module (modprobe fuse) or run the container with --device /dev/fuse --cap-add SYS_ADMIN"
fi

# ---------------------------------------------------------------------------------------------
# 2. MinIO, pinned. Reuse a binary on PATH or in GOPATH/bin; otherwise `go install` it in the
#    background while cargo works (both are CPU-bound, but the downloads overlap).
# ---------------------------------------------------------------------------------------------
command -v go >/dev/null 2>&1 || die "go is not installed (needed to install MinIO)"
GOBIN_DIR="$(go env GOBIN)"
[[ -n "$GOBIN_DIR" ]] || GOBIN_DIR="$(go env GOPATH | cut -d: -f1)/bin"
MINIO_INSTALL_LOG="$WORK/minio-install.log"

# Another `go install` of MinIO already running on this machine (e.g. a setup step): wait for it
# instead of building a second copy.
other_minio_install() {
    local f
    for f in /proc/[0-9]*/cmdline; do
        if tr '\0' ' ' <"$f" 2>/dev/null | grep -q "^go install github.com/minio/minio"; then
            echo "${f//[^0-9]/}"
            return 0
        fi
    done
    return 1
}

find_minio() {
    if command -v minio >/dev/null 2>&1; then command -v minio; return 0; fi
    if [[ -x "$GOBIN_DIR/minio" ]]; then echo "$GOBIN_DIR/minio"; return 0; fi
    return 1
}

MINIO_BIN=""
if ! other_minio_install >/dev/null && MINIO_BIN="$(find_minio)"; then
    log "using MinIO at $MINIO_BIN"
elif other_minio_install >/dev/null; then
    log "another 'go install' of MinIO is running; will wait for it"
else
    log "installing MinIO ($MINIO_MODULE) in the background, log: $MINIO_INSTALL_LOG"
    go install "$MINIO_MODULE" >"$MINIO_INSTALL_LOG" 2>&1 &
    MINIO_INSTALL_PID=$!
fi

wait_minio_install() {
    if [[ -n "$MINIO_BIN" ]]; then return 0; fi
    if [[ -n "$MINIO_INSTALL_PID" ]]; then
        log "waiting for the MinIO install"
        if ! wait "$MINIO_INSTALL_PID"; then
            MINIO_INSTALL_PID=""
            tail -n 30 "$MINIO_INSTALL_LOG" >&2
            die "go install $MINIO_MODULE failed"
        fi
        MINIO_INSTALL_PID=""
    else
        local pid
        while pid="$(other_minio_install)"; do
            log "waiting for the running 'go install' of MinIO (pid $pid)"
            while kill -0 "$pid" 2>/dev/null; do sleep 5; done
        done
    fi
    MINIO_BIN="$(find_minio)" || die "no minio binary after the install (looked on PATH and in $GOBIN_DIR)"
    log "MinIO installed at $MINIO_BIN"
}

# csi-sanity, pinned: reused when the binary in GOBIN was built from the pinned version (its
# build info names it), else installed now (a small Go build, well under a minute).
CSI_SANITY_BIN="$GOBIN_DIR/csi-sanity"
if [[ -x "$CSI_SANITY_BIN" ]] &&
    go version -m "$CSI_SANITY_BIN" 2>/dev/null | grep -q "csi-test/v5[[:space:]]*$CSI_SANITY_VERSION"; then
    log "using csi-sanity $CSI_SANITY_VERSION at $CSI_SANITY_BIN"
else
    log "installing csi-sanity ($CSI_SANITY_MODULE@$CSI_SANITY_VERSION)"
    go install "$CSI_SANITY_MODULE@$CSI_SANITY_VERSION" || die "go install $CSI_SANITY_MODULE@$CSI_SANITY_VERSION failed"
fi
export BUCKETFS_TEST_CSI_SANITY="$CSI_SANITY_BIN"

# ---------------------------------------------------------------------------------------------
# 3. Static checks first: they are cheap and catch most mistakes.
# ---------------------------------------------------------------------------------------------
cd "$REPO"
for c in rustfmt clippy; do
    command -v rustup >/dev/null 2>&1 || break
    if ! rustup component list --installed 2>/dev/null | grep -q "^$c"; then
        log "rustup component add $c"
        rustup component add "$c"
    fi
done

log "cargo fmt --check"
cargo fmt --all --check

log "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

log "cargo test --workspace --no-run (build)"
cargo test --workspace --no-run

# ---------------------------------------------------------------------------------------------
# 4. A private MinIO server.
# ---------------------------------------------------------------------------------------------
wait_minio_install

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
rand_hex() { od -An -N"$1" -tx1 /dev/urandom | tr -d ' \n'; }

# MinIO refuses writes (507 XMinioStorageFull) once a write would leave its drive more than 99 %
# full, and the suite stores up to ~6 GiB at once (a 2 GiB object, 1 GiB fio files, staging
# files). Say so up front instead of failing in whichever test hits the wall first.
read -r disk_total_kb disk_avail_kb < <(df -Pk "$WORK" | awk 'NR == 2 { print $2, $4 }')
disk_need_kb=$(( 7 * 1024 * 1024 + disk_total_kb / 100 ))
if (( disk_avail_kb < disk_need_kb )); then
    die "$WORK is on a drive with $((disk_avail_kb / 1024 / 1024)) GiB free; the tests need $((disk_need_kb / 1024 / 1024)) GiB (6 GiB of data plus MinIO's 1 % reserve): free some space or set TMPDIR to a roomier drive"
fi

MINIO_PORT="$(free_port)"
MINIO_DATA="$WORK/minio-data"
MINIO_LOG="$WORK/minio.log"
mkdir -p "$MINIO_DATA"
export BUCKETFS_TEST_ENDPOINT="http://127.0.0.1:$MINIO_PORT"
export BUCKETFS_TEST_ACCESS_KEY="bfs$(rand_hex 8)"
export BUCKETFS_TEST_SECRET_KEY="$(rand_hex 20)"
export BUCKETFS_TEST_MINIO_BIN="$MINIO_BIN"
export BUCKETFS_TEST_MINIO_DATA="$MINIO_DATA"
export BUCKETFS_TEST_MINIO_PIDFILE="$MINIO_PIDFILE"
export BUCKETFS_TEST_MINIO_LOG="$MINIO_LOG"

health() {
    if command -v curl >/dev/null 2>&1; then
        curl -sf -o /dev/null --max-time 2 "$BUCKETFS_TEST_ENDPOINT/minio/health/live"
    else
        python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
            "$BUCKETFS_TEST_ENDPOINT/minio/health/live" 2>/dev/null
    fi
}

log "starting MinIO on $BUCKETFS_TEST_ENDPOINT (data $MINIO_DATA)"
MINIO_ROOT_USER="$BUCKETFS_TEST_ACCESS_KEY" MINIO_ROOT_PASSWORD="$BUCKETFS_TEST_SECRET_KEY" \
    MINIO_BROWSER=off MINIO_UPDATE=off \
    "$MINIO_BIN" server --quiet --address "127.0.0.1:$MINIO_PORT" "$MINIO_DATA" \
    >>"$MINIO_LOG" 2>&1 &
echo $! >"$MINIO_PIDFILE"
# The fault test SIGKILLs and restarts the server: keep bash from reporting the killed job.
disown
export BUCKETFS_TEST_MINIO_PID="$(cat "$MINIO_PIDFILE")"
for i in $(seq 150); do
    health && break
    kill -0 "$BUCKETFS_TEST_MINIO_PID" 2>/dev/null || { cat "$MINIO_LOG" >&2; die "MinIO exited at startup"; }
    [[ $i -eq 150 ]] && { cat "$MINIO_LOG" >&2; die "MinIO did not become healthy in 30 s"; }
    sleep 0.2
done
log "MinIO is up (pid $BUCKETFS_TEST_MINIO_PID)"

# Mount points and staging files of the tests live under $WORK, so the trap can clean up after
# a test that died hard.
mkdir -p "$WORK/tmp"
export TMPDIR="$WORK/tmp"

# ---------------------------------------------------------------------------------------------
# 5. Tests: everything except the fault test in parallel, then the fault test alone (it stops
#    and restarts the shared MinIO, so nothing else may run at the same time).
# ---------------------------------------------------------------------------------------------
log "cargo test --workspace (unit and integration tests)"
if ! cargo test --workspace -- --skip minio_outage:: --skip soak_with_an_integrity_ledger; then
    echo "---- last lines of the MinIO log ----" >&2
    tail -n 20 "$MINIO_LOG" >&2 || true
    exit 1
fi

log "cargo test -p bucketfs --test soak (64 threads x ${BUCKETFS_SOAK_SECS:-20} s, integrity ledger)"
if ! cargo test -p bucketfs --test soak -- --nocapture; then
    echo "---- last lines of the MinIO log ----" >&2
    tail -n 20 "$MINIO_LOG" >&2 || true
    exit 1
fi

log "cargo test -p bucketfs --test fault (MinIO stopped and restarted during reads and writes)"
if ! cargo test -p bucketfs --test fault -- --test-threads=1; then
    echo "---- last lines of the MinIO log ----" >&2
    tail -n 20 "$MINIO_LOG" >&2 || true
    exit 1
fi

# ---------------------------------------------------------------------------------------------
# 6. Bench smoke: the benchmark suite at tiny sizes, bucketfs and the store limit only, so the
#    suite cannot rot. It starts its own MinIO and fails if any scenario errors or mis-verifies.
# ---------------------------------------------------------------------------------------------
log "bench smoke (python3 bench/run.py --size smoke --systems bucketfs)"
python3 bench/run.py --size smoke --systems bucketfs --bucketfs "$CARGO_TARGET_DIR/debug/bucketfs" \
    --out "$WORK/bench-smoke"
