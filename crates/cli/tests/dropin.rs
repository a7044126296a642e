//! bucketfs as a drop-in for the tools users come from (issue 23): the ossfs 2.0 guide's config
//! file and `mount DIR -c FILE` shape, the ossfs 1.91 guide's and the usual s3fs command lines
//! (also through links named `ossfs` and `s3fs`), `passwd_file` and its permission check, the
//! notices for options without a meaning here, errors for unknown ones, and logs without
//! terminal colour codes. Real mounts against the test MinIO, endpoint pointed at it.

mod common;

use common::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The bucket the Alibaba Cloud guides name, shared by the tests that use their exact text.
const GUIDE_BUCKET: &str = "bucket-test";

fn guide_bucket() -> &'static str {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if s3()
            .block_on(s3().client.head_bucket().bucket(GUIDE_BUCKET).send())
            .is_err()
        {
            // Another test binary may create it at the same time: that is fine too.
            let _ = s3().block_on(s3().client.create_bucket().bucket(GUIDE_BUCKET).send());
        }
    });
    GUIDE_BUCKET
}

fn private_file(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, text).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
    p
}

/// A link to the built binary named `name` (as `ln -s $(which bucketfs) /usr/bin/s3fs`).
fn link_named(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::os::unix::fs::symlink(bin(), &p).unwrap();
    p
}

/// A spec that runs `program command... [SOURCE] MOUNTPOINT args...` with no credentials in
/// the environment unless the test adds them.
fn spec(program: Option<PathBuf>, command: &[&str], source: &str, args: &[String]) -> MountSpec {
    let mut s = MountSpec::s3("unused", "");
    s.program = program;
    s.command = command.iter().map(|c| c.to_string()).collect();
    s.source = source.into();
    s.args = args.to_vec();
    s.envs.clear();
    s
}

fn etag(bucket: &str, key: &str) -> String {
    let h = s3()
        .block_on(s3().client.head_object().bucket(bucket).key(key).send())
        .unwrap();
    h.e_tag().unwrap_or_default().trim_matches('"').to_string()
}

/// The ossfs 2.0 performance guide's `ossfs2.conf`, verbatim but for the endpoint, mounted the
/// guide's way (`mount DIR -c ossfs2.conf`: the bucket comes from the file). Its
/// `upload_buffer_size` becomes the part size: a 33 MiB file is uploaded in 2 parts of 32 MiB
/// and 1 MiB (8 MiB parts would make 5). Before: `unknown key "upload_buffer_size"`, and
/// SOURCE was required.
#[test]
fn ossfs2_guide_config_mounts_the_bucket_it_names() {
    let bucket = guide_bucket();
    let dir = tempfile::tempdir().unwrap();
    let e = env();
    let conf = private_file(
        dir.path(),
        "ossfs2.conf",
        &format!(
            "--oss_endpoint={}\n--oss_bucket={bucket}\n--oss_access_key_id={}\n\
             --oss_access_key_secret={}\n--upload_buffer_size=33554432\n",
            e.endpoint, e.access_key, e.secret_key
        ),
        0o600,
    );
    let m = spec(
        None,
        &["mount", "-f"],
        "",
        &["-c".into(), conf.display().to_string()],
    )
    .mount();
    let data = pattern::bytes(23, 33 * MIB);
    write_file(&m.join("ossfs2-guide.bin"), &data);
    assert_eq!(s3().get(bucket, "ossfs2-guide.bin").unwrap(), data);
    assert!(etag(bucket, "ossfs2-guide.bin").ends_with("-2"));
    fs::remove_file(m.join("ossfs2-guide.bin")).unwrap();
    assert!(!m.log().contains("notice"), "{}", m.log());
}

/// The ossfs 2.0 command line, `ossfs2 mount DIR -c ossfs2.conf --KEY=VALUE...`, through a
/// link named `ossfs2`: keys on the command line are read as the file's (here the bucket and
/// the prefix), notices included.
#[test]
fn ossfs2_command_line_mounts_through_a_link_named_ossfs2() {
    let bucket = s3().new_bucket("dropin-ossfs2");
    let dir = tempfile::tempdir().unwrap();
    let e = env();
    let conf = private_file(
        dir.path(),
        "ossfs2.conf",
        &format!(
            "--oss_endpoint={}\n--oss_access_key_id={}\n--oss_access_key_secret={}\n",
            e.endpoint, e.access_key, e.secret_key
        ),
        0o600,
    );
    let m = spec(
        Some(link_named(dir.path(), "ossfs2")),
        &["mount"],
        "",
        &[
            "-c".into(),
            conf.display().to_string(),
            format!("--oss_bucket={bucket}"),
            "--oss_bucket_prefix=team/".into(),
            "--close_to_open=true".into(),
            "-f".into(),
        ],
    )
    .mount();
    write_file(&m.join("o2.txt"), b"ossfs2");
    assert_eq!(s3().get(&bucket, "team/o2.txt").unwrap(), b"ossfs2");
    assert!(
        m.log().contains("bucketfs: notice: --close_to_open: "),
        "{}",
        m.log()
    );
}

/// The ossfs 1.91 guide's command line, `ossfs bucket-test /mnt/ossfs -ourl=... -odirect_read
/// -oreaddir_optimize`, through a link named `ossfs` (credentials from the environment, which
/// ossfs reads too): it mounts, and each option without a meaning here gets one notice line.
#[test]
fn ossfs1_guide_command_line_mounts_through_a_link_named_ossfs() {
    let bucket = guide_bucket();
    let dir = tempfile::tempdir().unwrap();
    let ossfs = link_named(dir.path(), "ossfs");
    let e = env();
    let mut s = spec(
        Some(ossfs),
        &[],
        bucket,
        &[
            format!("-ourl={}", e.endpoint),
            "-odirect_read".into(),
            "-oreaddir_optimize".into(),
            "-f".into(),
        ],
    );
    s.envs = vec![
        ("AWS_ACCESS_KEY_ID".into(), e.access_key.clone()),
        ("AWS_SECRET_ACCESS_KEY".into(), e.secret_key.clone()),
    ];
    let m = s.mount();
    write_file(&m.join("ossfs1-guide.txt"), b"ossfs 1.91");
    assert_eq!(s3().get(bucket, "ossfs1-guide.txt").unwrap(), b"ossfs 1.91");
    fs::remove_file(m.join("ossfs1-guide.txt")).unwrap();
    let log = m.log();
    for opt in ["direct_read", "readdir_optimize"] {
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.starts_with(&format!("bucketfs: notice: -o {opt}: ")))
            .collect();
        assert_eq!(lines.len(), 1, "{opt}: {log}");
    }
}

/// The usual s3fs line as `bucketfs s3fs BUCKET:/PREFIX MNT -o url=...,use_path_request_style,
/// passwd_file=...,allow_other,uid=,gid=,umask=,mp_umask=`: the BUCKET:ACCESS:SECRET line for
/// this bucket is used (not the other bucket's wrong one), files land under PREFIX, and
/// uid/gid/umask show on an object another client wrote without metadata and on one made
/// through the mount; mp_umask closes the mount point itself (before: a notice, and the
/// mount point stayed 0750, open to the group).
#[test]
fn s3fs_command_line_with_passwd_file_mounts_a_prefix() {
    let bucket = s3().new_bucket("dropin-s3fs");
    s3().put(&bucket, "team/a/plain.txt", b"no metadata".to_vec());
    let dir = tempfile::tempdir().unwrap();
    let e = env();
    let passwd = private_file(
        dir.path(),
        "passwd-s3fs",
        &format!(
            "other-bucket:WRONG:WRONG\n{bucket}:{}:{}\n",
            e.access_key, e.secret_key
        ),
        0o600,
    );
    let opts = format!(
        "url={},use_path_request_style,passwd_file={},allow_other,uid=4321,gid=4322,\
         umask=0027,mp_umask=0077,_netdev",
        e.endpoint,
        passwd.display()
    );
    let m = spec(
        None,
        &["s3fs"],
        &format!("{bucket}:/team/a"),
        &["-o".into(), opts, "-f".into()],
    )
    .mount();
    use std::os::unix::fs::MetadataExt;
    let md = fs::metadata(m.join("plain.txt")).unwrap();
    assert_eq!((md.uid(), md.gid()), (4321, 4322));
    assert_eq!(md.mode() & 0o777, 0o640);
    write_file(&m.join("new.txt"), b"via s3fs line");
    assert_eq!(
        s3().get(&bucket, "team/a/new.txt").unwrap(),
        b"via s3fs line"
    );
    // As s3fs, the umask applies to every object, also one that stores its mode (this file,
    // made 0644 through the mount): before, only to those without one, so a mount shared
    // with allow_other showed new files to every local user.
    let md = fs::metadata(m.join("new.txt")).unwrap();
    assert_eq!(md.mode() & 0o777, 0o640);
    assert_eq!(fs::metadata(m.path()).unwrap().mode() & 0o777, 0o700);
    assert!(!m.log().contains("notice: -o mp_umask"), "{}", m.log());
}

/// Through a link named `s3fs`, with a plain ACCESS:SECRET passwd file.
#[test]
fn s3fs_link_with_a_plain_passwd_file() {
    let bucket = s3().new_bucket("dropin-s3fs-link");
    let dir = tempfile::tempdir().unwrap();
    let e = env();
    let passwd = private_file(
        dir.path(),
        "pw",
        &format!("{}:{}\n", e.access_key, e.secret_key),
        0o400,
    );
    let s3fs = link_named(dir.path(), "s3fs");
    let m = spec(
        Some(s3fs),
        &[],
        &bucket,
        &[
            "-o".into(),
            format!(
                "url={},use_path_request_style,passwd_file={}",
                e.endpoint,
                passwd.display()
            ),
            "-f".into(),
        ],
    )
    .mount();
    write_file(&m.join("x"), b"x");
    assert_eq!(s3().get(&bucket, "x").unwrap(), b"x");
}

/// s3fs's own credential variables, `AWSACCESSKEYID` and `AWSSECRETACCESSKEY`, are used
/// when no passwd file is given (before: they only kept the default passwd file from being
/// read, and the mount went to the SDK chain with neither).
#[test]
fn s3fs_credential_variables_are_used() {
    let bucket = s3().new_bucket("dropin-s3fs-vars");
    let e = env();
    let mut m = spec(
        None,
        &["s3fs"],
        &bucket,
        &[
            "-o".into(),
            format!("url={},use_path_request_style", e.endpoint),
            "-f".into(),
        ],
    );
    m.envs.push(("AWSACCESSKEYID".into(), e.access_key.clone()));
    m.envs
        .push(("AWSSECRETACCESSKEY".into(), e.secret_key.clone()));
    let m = m.mount();
    write_file(&m.join("x"), b"via s3fs variables");
    assert_eq!(s3().get(&bucket, "x").unwrap(), b"via s3fs variables");
}

/// As s3fs does, a passwd file others (or its group) may read is refused with one line that
/// says how to fix it and shows no secret; nothing is mounted.
#[test]
fn passwd_file_readable_by_others_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mp = dir.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    for mode in [0o644, 0o640] {
        let passwd = private_file(dir.path(), "pw", "AKID:TOPSECRETVALUE\n", mode);
        let run = run_cli(
            &os(&[
                "s3fs",
                "b",
                mp.to_str().unwrap(),
                "-o",
                &format!("url={},passwd_file={}", env().endpoint, passwd.display()),
            ]),
            &[],
            Some(&mp),
            Duration::from_secs(20),
        );
        assert_eq!(run.status.and_then(|s| s.code()), Some(1), "{run:?}");
        let err = run.stderr.trim_end();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("bucketfs: passwd_file ")
                && err.contains(&format!("(mode {mode:04o})"))
                && err.contains("chmod 600"),
            "{err}"
        );
        assert!(!err.contains("TOPSECRETVALUE"));
        assert!(!is_mounted(&mp));
        fs::remove_file(&passwd).unwrap();
    }
}

/// ossfs 2.0 keys with no meaning here are accepted with one notice line each; a key that is
/// neither ossfs's nor bucketfs's stays an error naming it; so does an unknown s3fs option,
/// and an s3fs option whose effect bucketfs cannot give (encryption) is refused.
#[test]
fn notices_for_foreign_options_and_errors_for_unknown_ones() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir");
    let conf = private_file(
        dir.path(),
        "ossfs2.conf",
        "--oss_endpoint=http://127.0.0.1:1\n--oss_bucket=b\n--readdirplus=true\n\
         --log_file_max_size=1024\n--prefetch_concurrency=64\n",
        0o600,
    );
    let run = run_cli(
        &os(&[
            "mount",
            missing.to_str().unwrap(),
            "-c",
            conf.to_str().unwrap(),
        ]),
        &[],
        None,
        Duration::from_secs(20),
    );
    assert_eq!(run.status.and_then(|s| s.code()), Some(1), "{run:?}");
    let lines: Vec<&str> = run.stderr.lines().collect();
    assert_eq!(lines.len(), 4, "{}", run.stderr);
    for (line, key) in
        lines
            .iter()
            .zip(["readdirplus", "log_file_max_size", "prefetch_concurrency"])
    {
        assert!(
            line.starts_with(&format!("bucketfs: notice: --{key}: bucketfs ")),
            "{line}"
        );
    }
    assert!(lines[3].contains("does not exist"), "{}", lines[3]);

    let bad = private_file(
        dir.path(),
        "bad.conf",
        "--oss_bucket=b\n--oss_bogus=1\n",
        0o600,
    );
    let run = run_cli(
        &os(&[
            "mount",
            missing.to_str().unwrap(),
            "-c",
            bad.to_str().unwrap(),
        ]),
        &[],
        None,
        Duration::from_secs(20),
    );
    assert_eq!(
        run.stderr.trim_end(),
        format!(
            "bucketfs: config {}: unknown key \"oss_bogus\"",
            bad.display()
        )
    );

    for (opt, want) in [
        (
            "bogus_option",
            "bucketfs: -o: unknown option \"bogus_option\"",
        ),
        (
            "use_sse",
            "bucketfs: -o use_sse: not supported by bucketfs: ",
        ),
    ] {
        let run = run_cli(
            &os(&["s3fs", "b", missing.to_str().unwrap(), "-o", opt]),
            &[],
            None,
            Duration::from_secs(20),
        );
        assert_eq!(run.status.and_then(|s| s.code()), Some(1), "{run:?}");
        assert!(run.stderr.starts_with(want), "{}", run.stderr);
    }
}

/// A foreground daemon whose stderr is a file (`-f 2>>log`, systemd's journal) and a
/// `--log-file` get plain text: no ESC byte of a terminal colour code. Before, stderr was
/// coloured whatever it was.
#[test]
fn logs_written_to_files_carry_no_colour_codes() {
    let bucket = s3().new_bucket("dropin-colour");
    let m = Mount::s3(&bucket);
    write_file(&m.join("f"), b"1");
    let log = m.log();
    assert!(log.contains("ready"), "{log}");
    assert!(!log.contains('\u{1b}'), "{log:?}");
    drop(m);

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bucketfs.log");
    let m = MountSpec::s3(&bucket, "")
        .arg("--log-file")
        .arg(file.to_str().unwrap())
        .mount();
    write_file(&m.join("g"), b"2");
    drop(m);
    let text = fs::read_to_string(&file).unwrap();
    assert!(text.contains("ready"), "{text}");
    assert!(!text.contains('\u{1b}'), "{text:?}");
}

/// `bucketfs install --root DIR --s3fs-links` lays out what a package would: the binary (it
/// runs), the mount.bucketfs helper link for fstab, the man page as roff that groff formats
/// without a warning, bash/zsh/fish completions that know the flags, the systemd unit
/// template and the s3fs/ossfs links (the installed `s3fs` runs as bucketfs's s3fs front end).
#[test]
fn install_lays_out_the_system_files_in_a_temp_root() {
    let dir = tempfile::tempdir().unwrap();
    let root = &dir.path().join("root");
    // The test binary has hundreds of MB of debug info: install a stand-in that runs it under
    // the name it was called by.
    let stand_in = private_file(
        dir.path(),
        "bucketfs",
        &format!("#!/bin/bash\nexec -a \"$0\" {} \"$@\"\n", bin()),
        0o755,
    );
    let run = run_cli(
        &os(&[
            "install",
            "--root",
            root.to_str().unwrap(),
            "--s3fs-links",
            "--binary",
            stand_in.to_str().unwrap(),
        ]),
        &[],
        None,
        Duration::from_secs(60),
    );
    assert_eq!(run.status.and_then(|s| s.code()), Some(0), "{run:?}");
    let usr = root.join("usr/local");
    let bin = usr.join("bin/bucketfs");
    assert_eq!(
        fs::metadata(&bin).unwrap().permissions().mode() & 0o777,
        0o755
    );
    let out = std::process::Command::new(&bin)
        .arg("--version")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("bucketfs "));
    assert_eq!(
        fs::read_link(root.join("sbin/mount.bucketfs")).unwrap(),
        Path::new("/usr/local/bin/bucketfs")
    );
    for name in ["s3fs", "ossfs", "ossfs2"] {
        assert_eq!(
            fs::read_link(usr.join("bin").join(name)).unwrap(),
            Path::new("bucketfs")
        );
    }
    let out = std::process::Command::new(usr.join("bin/s3fs"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("s3fs, ossfs and ossfs2 compatible"));

    let man = usr.join("share/man/man1/bucketfs.1");
    let roff = fs::read_to_string(&man).unwrap();
    assert!(roff.starts_with(".TH BUCKETFS 1 "));
    assert!(roff.contains("\n.SH OPTIONS\n") && !roff.contains("```"));
    if Path::new("/usr/bin/groff").exists() {
        let out = std::process::Command::new("groff")
            .args(["-man", "-Tascii", "-ww", "-P-cbou"])
            .arg(&man)
            .output()
            .unwrap();
        assert!(out.status.success());
        assert_eq!(String::from_utf8_lossy(&out.stderr), "");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("--part-size"), "{text}");
    }
    for path in [
        "share/bash-completion/completions/bucketfs",
        "share/zsh/site-functions/_bucketfs",
        "share/fish/vendor_completions.d/bucketfs.fish",
    ] {
        let text = fs::read_to_string(usr.join(path)).unwrap();
        assert!(
            text.contains("part-size") && text.contains("s3fs"),
            "{path}"
        );
    }
    let unit = fs::read_to_string(usr.join("lib/systemd/system/bucketfs@.service")).unwrap();
    assert!(
        unit.contains("\nExecStart=/usr/local/bin/bucketfs mount -f %f -c /etc/bucketfs/%i.conf\n"),
        "{unit}"
    );
    // systemd learns when the mount is ready (see the next test): before, `Type=simple`
    // reported the unit started before the mount was there, and failed or not.
    assert!(unit.contains("\nType=notify\n"), "{unit}");
}

/// A mount started by systemd as a `Type=notify` service says `READY=1` on `$NOTIFY_SOCKET`
/// once the mount is there, and only then.
#[test]
fn a_foreground_mount_tells_systemd_when_it_is_ready() {
    use std::os::unix::net::UnixDatagram;
    let bucket = s3().new_bucket("notify");
    s3().put(&bucket, "f", b"here".to_vec());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify");
    let server = UnixDatagram::bind(&path).unwrap();
    server
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut spec = MountSpec::s3(&bucket, "");
    spec.envs
        .push(("NOTIFY_SOCKET".into(), path.display().to_string()));
    let m = spec.mount();
    let mut buf = [0u8; 64];
    let n = server.recv(&mut buf).expect("READY=1 within 60 s");
    assert_eq!(&buf[..n], b"READY=1");
    assert_eq!(fs::read(m.join("f")).unwrap(), b"here");
}

/// Runs `cmd` as mount(8) runs a helper for an fstab line: `path_dir` first on PATH, the test
/// credentials in the environment, HOME a new `home` below `dir`, no stdin.
fn output_as_mount8_runs_it(
    mut cmd: std::process::Command,
    path_dir: &Path,
    dir: &Path,
) -> std::process::Output {
    let home = dir.join("home");
    fs::create_dir_all(&home).unwrap();
    isolate_env(&mut cmd, &home);
    let path = format!(
        "{}:{}",
        path_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let e = env();
    cmd.env("PATH", path)
        .env("AWS_ACCESS_KEY_ID", &e.access_key)
        .env("AWS_SECRET_ACCESS_KEY", &e.secret_key)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

/// Runs `program args...` with `dir` first on PATH and the test credentials in the
/// environment, as mount(8) runs a helper for an fstab line; the mount it makes is checked
/// with a file written through it, then unmounted (the daemon then exits).
fn mount_like_mount8(program: &Path, args: &[String], dir: &Path, mp: &Path, bucket: &str) {
    let mut cmd = std::process::Command::new(program);
    cmd.args(args);
    let out = output_as_mount8_runs_it(cmd, dir, dir);
    let mounted = is_mounted(mp);
    if mounted {
        write_file(&mp.join("fstab.txt"), args.join(" ").as_bytes());
        assert!(force_unmount(mp));
    }
    assert!(
        out.status.success() && mounted,
        "{program:?} {args:?}: {out:?}"
    );
    assert_eq!(
        s3().get(bucket, "fstab.txt").unwrap(),
        args.join(" ").as_bytes()
    );
}

/// The two s3fs fstab forms, `s3fs#BUCKET MNT fuse OPTS` and `BUCKET MNT fuse.s3fs OPTS`, as
/// mount(8) runs them: mount.fuse3 starts `s3fs` from PATH, here the link to bucketfs. The
/// options are an s3fs fstab line's (`_netdev`, `allow_other`, `url=`, `passwd_file=`,
/// `logfile=`).
#[test]
fn s3fs_fstab_lines_mount_through_mount_fuse() {
    let helper = [
        "/sbin/mount.fuse3",
        "/usr/sbin/mount.fuse3",
        "/sbin/mount.fuse",
    ]
    .into_iter()
    .map(Path::new)
    .find(|p| p.exists())
    .expect("mount.fuse3 (package fuse3, which scripts/test.sh installs)");
    let bucket = s3().new_bucket("dropin-fstab");
    let dir = tempfile::tempdir().unwrap();
    link_named(dir.path(), "s3fs");
    let e = env();
    let passwd = private_file(
        dir.path(),
        "pw",
        &format!("{bucket}:{}:{}\n", e.access_key, e.secret_key),
        0o600,
    );
    let mp = dir.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let opts = format!(
        "_netdev,allow_other,url={},use_path_request_style,passwd_file={},logfile={}",
        e.endpoint,
        passwd.display(),
        dir.path().join("log").display()
    );
    let mpath = mp.display().to_string();
    mount_like_mount8(
        helper,
        &[
            format!("s3fs#{bucket}"),
            mpath.clone(),
            "-o".into(),
            opts.clone(),
        ],
        dir.path(),
        &mp,
        &bucket,
    );
    mount_like_mount8(
        helper,
        &[
            bucket.clone(),
            mpath,
            "-t".into(),
            "fuse.s3fs".into(),
            "-o".into(),
            opts,
        ],
        dir.path(),
        &mp,
        &bucket,
    );
    let log = fs::read_to_string(dir.path().join("log")).unwrap();
    assert!(log.contains("ready") && !log.contains('\u{1b}'), "{log}");
}

/// An fstab line of type `bucketfs`, as mount(8) runs its helper: `mount.bucketfs SOURCE MNT
/// -o OPTS` through a link of that name.
#[test]
fn bucketfs_fstab_line_mounts_through_the_mount_helper() {
    let bucket = s3().new_bucket("dropin-helper");
    let dir = tempfile::tempdir().unwrap();
    let helper = link_named(dir.path(), "mount.bucketfs");
    let mp = dir.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let opts = format!(
        "rw,_netdev,nofail,url={},use_path_request_style,log_file={}",
        env().endpoint,
        dir.path().join("log").display()
    );
    mount_like_mount8(
        &helper,
        &[
            format!("s3://{bucket}"),
            mp.display().to_string(),
            "-o".into(),
            opts,
        ],
        dir.path(),
        &mp,
        &bucket,
    );
}

/// `scripts/deb.sh` builds a Debian package from the repository: the install layout under
/// /usr (helper in /usr/sbin, man page gzipped), depending on fuse3. A stand-in binary keeps
/// the test from building a release binary.
#[test]
fn deb_package_builds_from_the_repository() {
    let dir = tempfile::tempdir().unwrap();
    let stand_in = private_file(
        dir.path(),
        "bucketfs",
        &format!("#!/bin/bash\nexec -a \"$0\" {} \"$@\"\n", bin()),
        0o755,
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/deb.sh");
    let out = std::process::Command::new(&script)
        .args(["--binary", stand_in.to_str().unwrap(), "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let deb = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(deb.ends_with(".deb") && Path::new(&deb).exists(), "{deb}");
    let info = run("dpkg-deb", &["-f", &deb, "Package", "Depends"]);
    assert_eq!(info, "Package: bucketfs\nDepends: fuse3\n");
    let contents = run("dpkg-deb", &["-c", &deb]);
    for path in [
        "./usr/bin/bucketfs",
        "./usr/sbin/mount.bucketfs -> /usr/bin/bucketfs",
        "./usr/share/man/man1/bucketfs.1.gz",
        "./usr/share/bash-completion/completions/bucketfs",
        "./usr/share/zsh/site-functions/_bucketfs",
        "./usr/share/fish/vendor_completions.d/bucketfs.fish",
        "./usr/lib/systemd/system/bucketfs@.service",
    ] {
        assert!(contents.contains(path), "{path} not in\n{contents}");
    }
    assert!(contents.contains(" root/root "), "{contents}");
}

/// mount(8) and df show the file system as `fuse.bucketfs` with the bucket as its source, as
/// s3fs shows `fuse.s3fs`: scripts that find their mounts by type keep working.
#[test]
fn mount_and_df_show_the_bucketfs_type_and_the_bucket() {
    let b = s3().new_bucket("fstype");
    let m = Mount::s3(&b);
    let out = run(
        "df",
        &["--output=fstype,source", &m.path().display().to_string()],
    );
    let line = out.lines().last().unwrap_or_default();
    assert!(line.starts_with("fuse.bucketfs "), "df: {out}");
    assert!(line.contains(&b), "df: {out}");
}

/// A test fstab mounted by mount(8) itself: `mount -a -T FSTAB` with a `bucketfs` line (run
/// through `/sbin/mount.bucketfs`, as `bucketfs install` lays it out) and an s3fs-style
/// `fuse.s3fs` line (mount.fuse runs `s3fs`, the link to bucketfs, from its shell's default path). mount(8) looks
/// for helpers in /sbin only, so the run happens in a private mount namespace where a copy of
/// /usr/sbin with the helper link is bound over it: the system's /sbin is never touched. Inside
/// it a file is written through each mount, read back, and both are unmounted.
#[test]
fn mount_a_with_a_test_fstab_mounts_both_lines() {
    let b1 = s3().new_bucket("fstab-a");
    let b2 = s3().new_bucket("fstab-b");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // /usr/sbin (where /sbin points on merged-usr systems) as links into the original, bound
    // at `orig` first since it is shadowed then, plus the helper.
    let (sbin, orig) = (d.join("sbin"), d.join("orig-sbin"));
    fs::create_dir(&sbin).unwrap();
    fs::create_dir(&orig).unwrap();
    for e in fs::read_dir("/usr/sbin").unwrap() {
        let e = e.unwrap();
        std::os::unix::fs::symlink(orig.join(e.file_name()), sbin.join(e.file_name())).unwrap();
    }
    link_named(&sbin, "mount.bucketfs");
    // mount(8) of util-linux 2.38.1-5+deb12u3 passes its helpers no PATH, so mount.fuse's
    // shell finds `s3fs` only on its default path, of which /usr/sbin is part.
    link_named(&sbin, "s3fs");
    let bin_dir = d.join("bin");
    fs::create_dir(&bin_dir).unwrap();
    link_named(&bin_dir, "s3fs");
    let e = env();
    let passwd = private_file(
        d,
        "pw",
        &format!("{b2}:{}:{}\n", e.access_key, e.secret_key),
        0o600,
    );
    let (m1, m2) = (d.join("m1"), d.join("m2"));
    fs::create_dir(&m1).unwrap();
    fs::create_dir(&m2).unwrap();
    let fstab = d.join("fstab");
    fs::write(
        &fstab,
        format!(
            "# a test fstab\n\
             s3://{b1}/data {m1} bucketfs _netdev,nofail,url={ep},use_path_request_style,log_file={d}/log1 0 0\n\
             {b2} {m2} fuse.s3fs _netdev,allow_other,url={ep},use_path_request_style,passwd_file={pw},logfile={d}/log2 0 0\n",
            m1 = m1.display(),
            m2 = m2.display(),
            ep = e.endpoint,
            d = d.display(),
            pw = passwd.display(),
        ),
    )
    .unwrap();
    let script = format!(
        r#"set -e
mount --make-rprivate /
mount --bind /usr/sbin {orig}
mount --bind {sbin} /usr/sbin
mount -a -T {fstab}
echo one > {m1}/one.txt
echo two > {m2}/two.txt
test "$(cat {m1}/one.txt)" = one
test "$(cat {m2}/two.txt)" = two
findmnt -n -o FSTYPE,SOURCE {m1}
findmnt -n -o FSTYPE,SOURCE {m2}
umount {m1}
umount {m2}
"#,
        sbin = sbin.display(),
        orig = orig.display(),
        fstab = fstab.display(),
        m1 = m1.display(),
        m2 = m2.display(),
    );
    let mut cmd = std::process::Command::new("unshare");
    cmd.args(["--mount", "--", "sh", "-c", &script]);
    let out = output_as_mount8_runs_it(cmd, &bin_dir, d);
    let logs = ["log1", "log2"]
        .map(|l| fs::read_to_string(d.join(l)).unwrap_or_default())
        .join("\n");
    assert!(out.status.success(), "{out:?}\n{logs}");
    let types = String::from_utf8_lossy(&out.stdout);
    assert!(
        types.contains(&format!("fuse.bucketfs s3://{b1}/data")),
        "mount(8) shows: {types}"
    );
    assert_eq!(s3().get(&b1, "data/one.txt").unwrap(), b"one\n");
    assert_eq!(s3().get(&b2, "two.txt").unwrap(), b"two\n");
}

/// s3fs's `allow_root`: the user who mounts and root may use the mount, no other user (FUSE
/// `allow_root`; before: mapped to `allow_other`, so every local user could, here reading a
/// file whose mode lets everyone).
#[test]
fn s3fs_allow_root_admits_root_and_the_owner_only() {
    let bucket = s3().new_bucket("dropin-allow-root");
    s3().put(&bucket, "f", b"not for everyone".to_vec());
    let dir = tempfile::tempdir().unwrap();
    let e = env();
    let passwd = private_file(
        dir.path(),
        "pw",
        &format!("{}:{}\n", e.access_key, e.secret_key),
        0o600,
    );
    let opts = format!(
        "url={},use_path_request_style,passwd_file={},allow_root,umask=0000",
        e.endpoint,
        passwd.display()
    );
    let m = spec(None, &["s3fs"], &bucket, &["-o".into(), opts, "-f".into()]).mount();
    // Other users may reach the mount point.
    let parent = m.path().parent().unwrap();
    fs::set_permissions(parent, fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(fs::read(m.join("f")).unwrap(), b"not for everyone");
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "cat"])
        .arg(m.join("f"))
        .output()
        .expect("setpriv");
    assert!(!out.status.success(), "another user read the file");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Permission denied"), "{err}");
}
