//! Data integrity under real I/O patterns: fio writes files with crc32c block checksums
//! through the mount, then reads them back sequentially and randomly (after a remount, so the
//! bytes come from the bucket) and verifies every block; sysbench fileio validates its write
//! modes the same way.

mod common;

use common::*;
use std::process::Command;

/// Runs `tool` with `args` in `dir`; panics with its output if it fails or its output holds
/// one of `failures`. Returns the output.
fn run_tool(tool: &str, dir: &std::path::Path, args: &[&str], failures: &[&str]) -> String {
    let out = Command::new(tool)
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{tool} is installed by scripts/test.sh: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{tool} {args:?} failed:\n{text}");
    for f in failures {
        assert!(!text.contains(f), "{tool} {args:?}: {f}\n{text}");
    }
    text
}

/// Runs fio with `args` in `dir`; panics with its output if it fails or reports a verify error.
fn fio(dir: &std::path::Path, args: &[&str]) -> String {
    let args = [&["--output-format=terse", "--terse-version=3"], args].concat();
    run_tool("fio", dir, &args, &["verify:"])
}

const COMMON: &[&str] = &[
    "--ioengine=psync",
    "--verify=crc32c",
    "--verify_fatal=1",
    "--size=48M",
    "--filename=data.bin",
    "--name=v",
];

#[test]
fn fio_sequential_write_then_sequential_and_random_verified_reads() {
    let b = s3().new_bucket("fio");
    let m = Mount::s3(&b);
    // Written sequentially in 1 MiB blocks with a checksum header in each block.
    fio(
        m.path(),
        &[COMMON, &["--rw=write", "--bs=1M", "--do_verify=0"]].concat(),
    );
    let m = m.remount();
    fio(
        m.path(),
        &[COMMON, &["--rw=read", "--bs=1M", "--verify_only"]].concat(),
    );
    // Random 4 KiB reads over a file written with 4 KiB verified blocks.
    fio(
        m.path(),
        &[
            COMMON,
            &[
                "--rw=randwrite",
                "--bs=4k",
                "--filename=rnd.bin",
                "--size=8M",
                "--do_verify=0",
            ],
        ]
        .concat(),
    );
    let m = m.remount();
    fio(
        m.path(),
        &[
            COMMON,
            &[
                "--rw=randread",
                "--bs=4k",
                "--filename=rnd.bin",
                "--size=8M",
                "--verify_only",
            ],
        ]
        .concat(),
    );
    assert_eq!(s3().head(&b, "data.bin").map(|h| h.size), Some(48 << 20));
}

#[test]
fn fio_random_writes_verify_in_place() {
    let b = s3().new_bucket("fiorw");
    let m = Mount::s3(&b);
    // Random 16 KiB writes over a 32 MiB file, verified by reading back through the same mount
    // (staged bytes) and again after a remount (the uploaded object).
    fio(
        m.path(),
        &[
            "--ioengine=psync",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--size=32M",
            "--filename=rw.bin",
            "--name=rw",
            "--rw=randwrite",
            "--bs=16k",
        ],
    );
    let m = m.remount();
    fio(
        m.path(),
        &[
            "--ioengine=psync",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--size=32M",
            "--filename=rw.bin",
            "--name=rw",
            "--rw=randread",
            "--bs=16k",
            "--verify_only",
        ],
    );
}

/// fio random writes over a whole 1 GiB file (every block once, in random order, crc32c in
/// each), verified through the mount while it is open and again from the bucket after a remount.
#[test]
fn fio_random_writes_over_1gib_verify() {
    let b = s3().new_bucket("fio1g");
    let m = Mount::s3(&b);
    let job = [
        "--ioengine=psync",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--size=1G",
        "--filename=big.bin",
        "--name=big",
        "--bs=64k",
    ];
    fio(m.path(), &[&job[..], &["--rw=randwrite"]].concat());
    assert_eq!(s3().head(&b, "big.bin").map(|h| h.size), Some(1 << 30));
    let m = m.remount();
    fio(
        m.path(),
        &[&job[..], &["--rw=randread", "--verify_only"]].concat(),
    );
    drop(m);
    s3().remove_bucket(&b);
}

/// sysbench fileio (the bench suite's tool) in its write modes, with `--validate`: every block
/// it reads back carries a checksum of what it wrote.
#[test]
fn sysbench_write_modes_validate() {
    let b = s3().new_bucket("sysbench");
    let m = Mount::s3(&b);
    let common = [
        "fileio",
        "--file-num=4",
        "--file-total-size=32M",
        "--file-block-size=16384",
        "--validate=on",
    ];
    // Sequential modes make exactly one pass (2,048 blocks of 16 KiB; fsyncs would count as
    // events too, so only the end-of-test one), with no time limit: seqwr opens the files with
    // O_TRUNC, so a pass cut short by the clock on a slow machine would leave files the next
    // mode finds too short. Random modes run 4 s with an fsync every 50 requests.
    let limits = |mode: &str| -> [&'static str; 3] {
        if mode.starts_with("seq") {
            ["--time=0", "--events=2048", "--file-fsync-freq=0"]
        } else {
            ["--time=4", "--events=0", "--file-fsync-freq=50"]
        }
    };
    let sysbench = |dir: &std::path::Path, args: &[&str]| {
        run_tool("sysbench", dir, args, &["FATAL", "alidation failed"])
    };
    sysbench(m.path(), &[&common[..], &["prepare"]].concat());
    for mode in ["seqwr", "rndwr", "rndrw", "seqrewr"] {
        let text = sysbench(
            m.path(),
            &[
                &common[..],
                &[format!("--file-test-mode={mode}").as_str()],
                &limits(mode)[..],
                &["run"],
            ]
            .concat(),
        );
        assert!(
            text.contains("written, MiB/s:"),
            "sysbench {mode} reported no writes:\n{text}"
        );
    }
    // Read everything back, validated, from the bucket.
    let m = m.remount();
    sysbench(
        m.path(),
        &[
            &common[..],
            &["--file-test-mode=seqrd"],
            &limits("seqrd")[..],
            &["run"],
        ]
        .concat(),
    );
}
