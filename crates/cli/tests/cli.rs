//! The `bucketfs` command line: bad input gets a clear one-line error and leaves no mount or
//! daemon behind; the local-directory source works.

mod common;

use common::*;
use std::ffi::OsString;
use std::fs;
use std::path::Path;
use std::time::Duration;

/// A fresh mount point (empty directory) inside a temp dir.
fn mountpoint() -> (tempfile::TempDir, std::path::PathBuf) {
    let d = tempfile::Builder::new()
        .prefix("bucketfs-cli-")
        .tempdir()
        .unwrap();
    let mp = d.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    (d, mp)
}

fn mount_args(source: &str, mp: &Path, extra: &[String]) -> Vec<OsString> {
    let mut a = os(&["mount", source]);
    a.push(mp.as_os_str().to_owned());
    a.extend(extra.iter().map(OsString::from));
    a
}

/// Connection flags for the test MinIO, plus a log file in the test's temp dir (a daemon
/// without a log file and without /dev/log would log to STATE_DIR/logs/bucketfs-PID.log).
fn daemon_args(dir: &tempfile::TempDir) -> Vec<String> {
    let mut a = s3_args();
    a.push("--log-file".into());
    a.push(dir.path().join("daemon.log").to_string_lossy().into_owned());
    a
}

/// The failed run left nothing behind: no mount, no process still naming the mount point.
fn assert_nothing_left(mp: &Path, run: &CliRun) {
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !is_mounted(mp),
        "{} is mounted after a failed mount: {run:?}",
        mp.display()
    );
    let pids = processes_mentioning(mp.to_str().unwrap());
    assert!(
        pids.is_empty(),
        "processes left running for {}: {pids:?}",
        mp.display()
    );
}

/// Non-zero exit, no timeout, and stderr is one non-empty line.
fn assert_one_line_failure(run: &CliRun, what: &str) -> String {
    assert!(
        !run.timed_out,
        "{what}: bucketfs did not exit within the limit: {run:?}"
    );
    let st = run.status.unwrap();
    assert!(
        !st.success(),
        "{what}: bucketfs exited successfully: {run:?}"
    );
    let err = run.stderr.trim();
    assert!(!err.is_empty(), "{what}: nothing on stderr: {run:?}");
    assert_eq!(
        err.lines().count(),
        1,
        "{what}: stderr is not one line:\n{err}"
    );
    err.to_string()
}

#[test]
fn wrong_credentials_fail_fast_with_a_clear_message() {
    let b = s3().new_bucket("badcreds");
    let (d, mp) = mountpoint();
    // Daemon mode (no -f): the parent must report the startup error and exit non-zero.
    let run = run_cli(
        &mount_args(&format!("s3://{b}"), &mp, &daemon_args(&d)),
        &[
            ("AWS_ACCESS_KEY_ID", "wrongkey"),
            ("AWS_SECRET_ACCESS_KEY", "wrongsecret123"),
        ],
        Some(&mp),
        Duration::from_secs(60),
    );
    let err = assert_one_line_failure(&run, "wrong credentials");
    assert!(
        run.elapsed < Duration::from_secs(20),
        "took {:?} to report wrong credentials",
        run.elapsed
    );
    let l = err.to_lowercase();
    assert!(
        l.contains("access") || l.contains("credential"),
        "message does not mention access or credentials: {err}"
    );
    assert_nothing_left(&mp, &run);
}

#[test]
fn missing_bucket_is_named() {
    let e = env();
    let b = unique_bucket_name("missing");
    let (d, mp) = mountpoint();
    let run = run_cli(
        &mount_args(&format!("s3://{b}"), &mp, &daemon_args(&d)),
        &[
            ("AWS_ACCESS_KEY_ID", &e.access_key),
            ("AWS_SECRET_ACCESS_KEY", &e.secret_key),
        ],
        Some(&mp),
        Duration::from_secs(60),
    );
    let err = assert_one_line_failure(&run, "missing bucket");
    let l = err.to_lowercase();
    assert!(
        l.contains(&b),
        "message does not name the bucket {b}: {err}"
    );
    assert!(
        l.contains("does not exist") || l.contains("no such bucket"),
        "message does not say the bucket does not exist: {err}"
    );
    assert!(
        run.elapsed < Duration::from_secs(20),
        "took {:?}",
        run.elapsed
    );
    assert_nothing_left(&mp, &run);
}

#[test]
fn config_file_with_unknown_key_is_rejected() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    fs::create_dir(&data).unwrap();
    let (_m, mp) = mountpoint();
    let cfg = d.path().join("bucketfs.toml");
    fs::write(&cfg, "stat_ttl_bogus_key = 5\n").unwrap();
    let mut args = mount_args(data.to_str().unwrap(), &mp, &[]);
    args.push("--config".into());
    args.push(cfg.clone().into_os_string());
    let run = run_cli(&args, &[], Some(&mp), Duration::from_secs(30));
    let err = assert_one_line_failure(&run, "unknown config key");
    assert!(
        err.contains("stat_ttl_bogus_key"),
        "message does not name the unknown key: {err}"
    );
    assert_nothing_left(&mp, &run);
}

/// `bucketfs mount -f DATA MP EXTRA...` of a local directory: refused in one line (described
/// as `what`) and leaving nothing behind; returns the message.
fn refused_local_mount(data: &Path, mp: &Path, extra: &[&str], what: &str) -> String {
    let mut args = vec!["-f".to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let run = run_cli(
        &mount_args(data.to_str().unwrap(), mp, &args),
        &[],
        Some(mp),
        Duration::from_secs(30),
    );
    let err = assert_one_line_failure(&run, what);
    assert_nothing_left(mp, &run);
    err
}

/// A part size whose upload buffers the memory budget cannot hold four of is refused at
/// mount: an earlier build mounted, and a background upload of one part waited for all of
/// the memory.
#[test]
fn a_part_size_too_big_for_the_memory_budget_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    fs::create_dir(&data).unwrap();
    let (_m, mp) = mountpoint();
    let extra = ["--max-memory", "32M", "--part-size", "16M"];
    let err = refused_local_mount(&data, &mp, &extra, "part size over a quarter of max memory");
    assert!(
        err.contains("part size 16 MiB") && err.contains("at least 64 MiB"),
        "message does not say what to change: {err}"
    );
}

/// The daemon's own directories inside the mount point (hidden once mounted, its own I/O
/// going through itself) or inside a local source directory (shown as the bucket's files)
/// are refused in one line, and nothing is made there.
#[test]
fn own_directories_inside_the_mount_point_or_the_source_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    fs::create_dir(&data).unwrap();
    let (_m, mp) = mountpoint();
    let cases = [
        ("--data-cache", mp.join("dc"), "data cache", "mount point"),
        ("--state-dir", mp.join("state"), "state dir", "mount point"),
        (
            "--cache-dir",
            data.join("cache"),
            "cache dir",
            "source directory",
        ),
    ];
    for (flag, dir, what, inside) in cases {
        let err = refused_local_mount(&data, &mp, &[flag, dir.to_str().unwrap()], flag);
        assert!(
            err.contains(what) && err.contains(inside),
            "{flag}: the message does not say what is wrong: {err}"
        );
        assert!(!dir.exists(), "{flag}: {} was made", dir.display());
    }
    assert_eq!(
        fs::read_dir(&mp).unwrap().count(),
        0,
        "the mount point is not empty"
    );
}

/// The daemon's own paths are checked where they lead: a link to the mount point (or a
/// dangling one into it) is inside it (before: accepted; the data cache was made in the
/// mount, through it, and uploaded as the bucket's files, and a cache dir there froze the
/// mount at the first write, the daemon's staging files going through itself); a link
/// another user owns on the way is refused (that user chose where the daemon, root, writes,
/// and can repoint it), and so is a directory of theirs (they could swap what is made in it
/// for such a link after the checks); nothing is made where any of them leads.
#[test]
fn own_paths_are_checked_where_their_links_lead() {
    use std::os::unix::fs::{lchown, symlink};
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    fs::create_dir(&data).unwrap();
    let (_m, mp) = mountpoint();
    let to_mp = d.path().join("to-mp");
    symlink(&mp, &to_mp).unwrap();
    let to_log = d.path().join("to-log");
    symlink(mp.join("log"), &to_log).unwrap();
    let to_data = d.path().join("to-data");
    symlink(data.join("dc"), &to_data).unwrap();
    let elsewhere = d.path().join("elsewhere");
    let theirs = d.path().join("theirs");
    symlink(&elsewhere, &theirs).unwrap();
    lchown(&theirs, Some(65534), Some(65534)).unwrap();
    // A directory of another user, who could swap what is made there for a link later.
    let their_dir = d.path().join("their-dir");
    fs::create_dir(&their_dir).unwrap();
    lchown(&their_dir, Some(65534), Some(65534)).unwrap();
    let cases = [
        ("--data-cache", &to_mp, "data cache", "mount point"),
        ("--cache-dir", &to_mp, "cache dir", "mount point"),
        ("--state-dir", &to_mp, "state dir", "mount point"),
        ("--log-file", &to_log, "log file", "mount point"),
        ("--data-cache", &to_data, "data cache", "source directory"),
        ("--data-cache", &theirs, "data cache", "link of user 65534"),
        ("--log-file", &theirs, "log file", "link of user 65534"),
        (
            "--cache-dir",
            &their_dir.join("cd"),
            "cache dir",
            "belongs to user 65534",
        ),
        (
            "--log-file",
            &their_dir.join("log"),
            "log file",
            "belongs to user 65534",
        ),
    ];
    for (flag, p, what, why) in cases {
        let err = refused_local_mount(&data, &mp, &[flag, p.to_str().unwrap()], flag);
        assert!(
            err.contains(what) && err.contains(why),
            "{flag} {}: the message does not say what is wrong: {err}",
            p.display()
        );
    }
    assert_eq!(
        fs::read_dir(&mp).unwrap().count(),
        0,
        "made in the mount point"
    );
    assert_eq!(
        fs::read_dir(&data).unwrap().count(),
        0,
        "made in the source"
    );
    assert!(!elsewhere.exists(), "made where another user's link leads");
    assert_eq!(
        fs::read_dir(&their_dir).unwrap().count(),
        0,
        "made in their directory"
    );
}

#[test]
fn non_empty_mount_point_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    fs::create_dir(&data).unwrap();
    let (_m, mp) = mountpoint();
    fs::write(mp.join("precious"), "do not hide me").unwrap();
    let run = run_cli(
        &mount_args(data.to_str().unwrap(), &mp, &["-f".into()]),
        &[],
        Some(&mp),
        Duration::from_secs(30),
    );
    let err = assert_one_line_failure(&run, "non-empty mount point");
    assert!(err.to_lowercase().contains("not empty"), "message: {err}");
    assert_nothing_left(&mp, &run);
    assert_eq!(
        fs::read_to_string(mp.join("precious")).unwrap(),
        "do not hide me"
    );
}

#[test]
fn missing_mount_point_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    fs::create_dir(&data).unwrap();
    let mp = d.path().join("no-such-dir");
    let run = run_cli(
        &mount_args(data.to_str().unwrap(), &mp, &["-f".into()]),
        &[],
        Some(&mp),
        Duration::from_secs(30),
    );
    let err = assert_one_line_failure(&run, "missing mount point");
    assert!(
        err.contains(mp.to_str().unwrap()),
        "message does not name the mount point: {err}"
    );
    assert!(!mp.exists(), "bucketfs created the missing mount point");
}

#[test]
fn local_directory_source_works() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    fs::create_dir(&data).unwrap();
    fs::write(data.join("existing.txt"), "was here before").unwrap();
    let m = MountSpec::local(&data).mount();
    assert_eq!(list_dir(m.path()), set(["existing.txt"]));
    assert_eq!(read_file(&m.join("existing.txt")), b"was here before");
    write_file(&m.join("hello.txt"), b"hello local");
    fs::create_dir(m.join("sub")).unwrap();
    write_file(&m.join("sub/inner.bin"), &pattern::bytes(1, 3 * MIB + 1));
    assert_eq!(fs::read(data.join("hello.txt")).unwrap(), b"hello local");
    pattern::check_slice(
        &fs::read(data.join("sub/inner.bin")).unwrap(),
        1,
        3 * MIB as u64 + 1,
    )
    .unwrap();
    let m = m.remount();
    assert_eq!(
        list_dir(m.path()),
        set(["existing.txt", "hello.txt", "sub"])
    );
    assert_eq!(read_file(&m.join("hello.txt")), b"hello local");
}

/// `-o noexec` makes a mount whose files the kernel will not execute (it was accepted and
/// ignored, so a no-execution policy for a volume silently had no effect).
#[test]
fn noexec_reaches_the_mount() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    fs::create_dir(&data).unwrap();
    fs::write(data.join("run.sh"), "#!/bin/sh\necho ran\n").unwrap();
    let m = MountSpec::local(&data).arg("-o").arg("noexec").mount();
    let script = m.join("run.sh");
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    let err = std::process::Command::new(&script).output().unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    assert!(fs::metadata(&script).unwrap().permissions().mode() & 0o111 != 0);
    drop(m);
    let m2 = MountSpec::local(&data).mount();
    let out = std::process::Command::new(m2.join("run.sh"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ran\n");
}

/// `bucketfs stats --once` reports what the mount sent to the store.
#[test]
fn stats_shows_the_requests_of_a_mount() {
    let b = s3().new_bucket("stats");
    let m = Mount::s3(&b);
    write_file(&m.join("one.bin"), &pattern::bytes(3, 3 * MIB));
    let mp = m.path().as_os_str().to_owned();
    let run = run_cli(
        &[
            OsString::from("stats"),
            mp.clone(),
            OsString::from("--once"),
        ],
        &[],
        None,
        Duration::from_secs(30),
    );
    assert_eq!(run.status.and_then(|s| s.code()), Some(0), "{run:?}");
    // One new file of 3 MiB: a single PUT, and it counts as published.
    assert!(run.stdout.contains("put 1"), "{}", run.stdout);
    assert!(run.stdout.contains("up        3.1 MB"), "{}", run.stdout);
    assert!(run.stdout.contains("1 published"), "{}", run.stdout);
    drop(m);
    // Unmounted: nobody answers, and stats says so.
    let gone = run_cli(
        &[OsString::from("stats"), mp, OsString::from("--once")],
        &[],
        None,
        Duration::from_secs(30),
    );
    assert_eq!(gone.status.and_then(|s| s.code()), Some(1), "{gone:?}");
}

/// `bucketfs bench` measures the store directly and cleans up after itself.
#[test]
fn bench_measures_the_store_and_leaves_nothing() {
    let b = s3().new_bucket("limit");
    let mut args = os(&[
        "bench",
        &format!("s3://{b}/limit"),
        "--size",
        "20M",
        "--json",
    ]);
    args.extend(s3_args().iter().map(OsString::from));
    let e = env();
    let run = run_cli(
        &args,
        &[
            ("AWS_ACCESS_KEY_ID", e.access_key.as_str()),
            ("AWS_SECRET_ACCESS_KEY", e.secret_key.as_str()),
        ],
        None,
        Duration::from_secs(120),
    );
    assert_eq!(run.status.and_then(|s| s.code()), Some(0), "{run:?}");
    // 20 MiB in 8 MiB parts: three part uploads and three ranged GETs.
    assert!(run.stdout.contains("\"put_requests\": 3"), "{}", run.stdout);
    assert!(run.stdout.contains("\"get_requests\": 3"), "{}", run.stdout);
    assert!(run.stdout.contains("\"get_mb_s\": "), "{}", run.stdout);
    assert!(s3().list_keys(&b, "").is_empty());
    assert!(s3().list_multipart_uploads(&b).is_empty());
}

/// `bucketfs bench --small-count` adds the small-object limit (N small PUTs, then N GETs) and
/// cleans those objects up too; `--size 0` skips the large object.
#[test]
fn bench_small_objects_measures_and_leaves_nothing() {
    let b = s3().new_bucket("limit-small");
    let mut args = os(&[
        "bench",
        &format!("s3://{b}/limit"),
        "--size",
        "0",
        "--small-count",
        "40",
        "--small-size",
        "8K",
        "--small-concurrency",
        "16",
        "--json",
    ]);
    args.extend(s3_args().iter().map(OsString::from));
    let e = env();
    let run = run_cli(
        &args,
        &[
            ("AWS_ACCESS_KEY_ID", e.access_key.as_str()),
            ("AWS_SECRET_ACCESS_KEY", e.secret_key.as_str()),
        ],
        None,
        Duration::from_secs(120),
    );
    assert_eq!(run.status.and_then(|s| s.code()), Some(0), "{run:?}");
    for want in [
        "\"small_count\": 40",
        "\"small_size\": 8192",
        "\"small_concurrency\": 16",
        "\"small_get_files_s\": ",
        "\"put_requests\": 0",
    ] {
        assert!(run.stdout.contains(want), "{want}: {}", run.stdout);
    }
    assert!(s3().list_keys(&b, "").is_empty());
}
