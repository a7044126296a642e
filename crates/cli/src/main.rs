//! `bucketfs`: the command-line front end (`bucketfs mount`, `bucketfs umount`, and the
//! `mount.bucketfs` helper form when the binary is invoked under that name).
//!
//! Modules: [`args`] (command-line syntax), [`options`] (the one list of settings), [`config`]
//! (settings from the config file, `-o` and flags), [`daemon`] (fork + readiness pipe),
//! [`logging`], [`run`] (checks, store, mount, run loop). `bucketfs csi` is the bucketfs-csi
//! crate. Every failure is one line `bucketfs: <message>` on stderr and exit code 1.

mod args;
mod config;
#[cfg(test)]
mod config_fuzz;
mod daemon;
mod dropin;
mod install;
mod limit;
mod logging;
mod metrics_http;
mod options;
mod run;
mod stats;
mod warmup;

use args::{Cli, Command, HelperCall, UmountArgs};
use clap::Parser;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command as Process;

/// Two malloc arenas instead of eight per core: part-sized write buffers freed by one tokio
/// worker are reused by the others instead of piling up in per-thread arenas (read buffers
/// come from the budget's own pool, see fs/pool.rs). A fixed mmap threshold would return them
/// to the kernel but doubled the write CPU (fresh pages for every part).
fn share_malloc_arenas() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes an allocator tunable; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

fn main() {
    share_malloc_arenas();
    let argv: Vec<OsString> = std::env::args_os().collect();
    let invoked_as = argv
        .first()
        .and_then(|a| Path::new(a).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let flavor = match invoked_as.as_str() {
        "s3fs" => Some(dropin::Flavor::S3fs),
        "ossfs" => Some(dropin::Flavor::Ossfs),
        _ => None,
    };
    if let Some(flavor) = flavor {
        std::process::exit(s3fs(&argv[1..], flavor));
    }
    if invoked_as == "ossfs2" {
        std::process::exit(mount_call(
            dropin::ossfs2_call(&argv[1..]),
            dropin::OSSFS2_USAGE,
        ));
    }
    let argv = if invoked_as.ends_with("mount.bucketfs") {
        match args::mount_helper_args(&argv) {
            Ok(HelperCall::Run(a)) => a,
            Ok(HelperCall::Fake) => std::process::exit(0),
            Err(msg) => {
                eprintln!("{msg}");
                std::process::exit(1);
            }
        }
    } else {
        argv
    };
    let cli = Cli::parse_from(argv);
    let code = match cli.command {
        Command::Mount(m) => run::run(&m),
        Command::Umount(u) => umount(&u),
        Command::Bench(b) => limit::run(&b),
        Command::Stats(a) => stats::run(&a),
        Command::Pending(a) => stats::pending(&a),
        Command::Refresh(r) => refresh(&r),
        Command::Warmup(a) => warmup::run(&a),
        Command::S3fs(a) => s3fs(&a.args, dropin::Flavor::S3fs),
        Command::Ossfs2(a) => mount_call(dropin::ossfs2_call(&a.args), dropin::OSSFS2_USAGE),
        Command::Install(a) => install::run(&a),
        Command::Csi(a) => csi(&a),
    };
    // A mount's last lines (why it stopped) are in the log's queue.
    logging::flush(std::time::Duration::from_secs(2));
    std::process::exit(code);
}

/// `bucketfs csi`: serves the CSI driver until SIGTERM; the mounts it made stay up.
fn csi(a: &args::CsiArgs) -> i32 {
    let level = match config::parse_log_level(&a.log_level) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("bucketfs: {e}");
            return 1;
        }
    };
    if let Err(e) = logging::init(level, &logging::LogTarget::Stderr) {
        eprintln!("bucketfs: {e}");
        return 1;
    }
    // Every connection of its socket and every volume it mounts is a descriptor.
    match run::raise_open_files_limit() {
        Ok(Some((old, new))) => tracing::info!("open files limit raised from {old} to {new}"),
        Ok(None) => {}
        Err(e) => tracing::warn!("cannot raise the open files limit: {e}"),
    }
    let bucketfs = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("bucketfs: cannot find the bucketfs binary: {e}");
            return 1;
        }
    };
    let cfg = bucketfs_csi::Config {
        endpoint: a.endpoint.clone(),
        node_id: a.node_id.clone(),
        state_dir: a.state_dir.clone(),
        bucketfs,
        unpublish_timeout: std::time::Duration::from_secs(a.unpublish_timeout),
        daemons: a.daemons,
        host_pid: a.host_pid,
    };
    match bucketfs_csi::run(cfg) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("bucketfs: csi: {e}");
            1
        }
    }
}

/// An s3fs-fuse/ossfs 1.x command line: mounts as `bucketfs mount` would.
fn s3fs(args: &[OsString], flavor: dropin::Flavor) -> i32 {
    let home = std::env::var_os("HOME").map(std::path::PathBuf::from);
    mount_call(
        dropin::s3fs_call(args, flavor, home.as_deref()),
        dropin::S3FS_USAGE,
    )
}

/// Runs a parsed s3fs/ossfs/ossfs2 command line.
fn mount_call(call: Result<dropin::S3fsCall, String>, usage: &str) -> i32 {
    match call {
        Ok(dropin::S3fsCall::Help) => {
            println!("{usage}");
            0
        }
        Ok(dropin::S3fsCall::Version) => {
            println!(
                "bucketfs {} (s3fs, ossfs and ossfs2 compatible)",
                env!("CARGO_PKG_VERSION")
            );
            0
        }
        Ok(dropin::S3fsCall::Mount {
            source,
            mountpoint,
            settings,
        }) => run::run(&args::MountArgs {
            source,
            mountpoint: Some(mountpoint),
            flags: Default::default(),
            options: Vec::new(),
            base: Some(settings),
        }),
        Err(msg) => {
            eprintln!("bucketfs: {msg}");
            1
        }
    }
}

/// `f_type` of FUSE file systems.
const FUSE_SUPER_MAGIC: libc::c_long = 0x6573_5546;

/// `bucketfs refresh`: asks the mount to refresh each path (an ioctl on the path opened for
/// reading). A path the mount does not know yet (added by another client) refreshes its
/// directory instead.
/// How long `bucketfs refresh` waits for a path's mount: a refresh may LIST or HEAD, each
/// bounded by the mount's `--retry-timeout` (30 s by default); a daemon that hangs (stopped,
/// deadlocked) would hold the command for good.
const REFRESH_ANSWER: std::time::Duration = std::time::Duration::from_secs(60);

fn refresh(args: &args::RefreshArgs) -> i32 {
    let mut code = 0;
    for p in &args.paths {
        let refresh_within = |p: PathBuf| {
            run::within(REFRESH_ANSWER, move || set_refresh(&p)).unwrap_or_else(|| {
                Err(std::io::Error::other(format!(
                    "no answer within {} s (is its mount hung?)",
                    REFRESH_ANSWER.as_secs()
                )))
            })
        };
        let mut r = refresh_within(p.clone());
        if matches!(&r, Err(e) if e.raw_os_error() == Some(libc::ENOENT)) {
            let parent = p.parent().filter(|d| !d.as_os_str().is_empty());
            r = refresh_within(parent.unwrap_or(Path::new(".")).to_path_buf());
        }
        if let Err(e) = r {
            let why = if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                "not on a bucketfs mount".to_string()
            } else {
                e.to_string()
            };
            eprintln!("bucketfs: refresh {}: {why}", p.display());
            code = 1;
        }
    }
    code
}

fn set_refresh(p: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(p.as_os_str().as_bytes())?;
    // Only FUSE mounts: on another file system the attribute would just be stored.
    // SAFETY: `path` is NUL-terminated and `st` is a valid out-parameter.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if st.f_type != FUSE_SUPER_MAGIC {
        return Err(std::io::Error::from_raw_os_error(libc::EOPNOTSUPP));
    }
    let older = |e: &std::io::Error| matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::ENOSYS));
    match refresh_by_ioctl(p, &path) {
        // A mount of an older version, or a FIFO or device node (the ioctl never reaches
        // the mount), or a path this user may not read: the extended attribute, which
        // needs a writable mount and file. Its error is said if the ioctl's is only that.
        Err(e)
            if older(&e)
                || matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::EACCES | libc::EPERM | libc::ENXIO)
                ) =>
        {
            set_refresh_xattr(&path).map_err(|x| if older(&e) { x } else { e })
        }
        r => r,
    }
}

/// Opens `p` for reading and sends it [`bucketfs_fuse::REFRESH_IOCTL`]: read access is all
/// it needs, on a read-only mount too. `O_DIRECT` for a file, so that a passthrough mount
/// makes no local copy for this open; `O_NONBLOCK`, so that a FIFO does not wait.
fn refresh_by_ioctl(p: &Path, path: &std::ffi::CStr) -> std::io::Result<()> {
    let kind = std::fs::metadata(p)?.file_type();
    let flags = libc::O_RDONLY
        | libc::O_NONBLOCK
        | libc::O_CLOEXEC
        | if kind.is_dir() {
            libc::O_DIRECTORY
        } else if kind.is_file() {
            libc::O_DIRECT
        } else {
            0
        };
    // SAFETY: `path` is NUL-terminated; the descriptor is closed below.
    let fd = unsafe { libc::open(path.as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened; the request carries no argument.
    let rc = unsafe { libc::ioctl(fd, bucketfs_fuse::REFRESH_IOCTL as _) };
    let r = match rc {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    };
    // SAFETY: `fd` is ours and closed once.
    unsafe { libc::close(fd) };
    r
}

fn set_refresh_xattr(path: &std::ffi::CStr) -> std::io::Result<()> {
    let name = std::ffi::CString::new(bucketfs_fuse::REFRESH_XATTR)?;
    // SAFETY: both strings are NUL-terminated and the value buffer is valid for 1 byte.
    let rc = unsafe { libc::setxattr(path.as_ptr(), name.as_ptr(), b"1".as_ptr().cast(), 1, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `bucketfs umount`: `fusermount3 -u` (then `umount`) on a FUSE mount point.
fn umount(args: &UmountArgs) -> i32 {
    let mp = match run::mountpoint_within(&args.mountpoint) {
        Ok(mp) => mp,
        Err(e) => {
            eprintln!("bucketfs: {e}");
            return 1;
        }
    };
    match bucketfs_fuse::mount_info(&mp) {
        None => {
            eprintln!("bucketfs: {} is not mounted", mp.display());
            return 1;
        }
        Some(m) if !m.is_fuse() => {
            eprintln!(
                "bucketfs: {} is not a bucketfs mount (it is {})",
                mp.display(),
                m.fstype
            );
            return 1;
        }
        Some(_) => {}
    }
    let lazy = args.lazy;
    let attempts: [(&str, Vec<&str>); 2] = [
        (
            "fusermount3",
            if lazy { vec!["-u", "-z"] } else { vec!["-u"] },
        ),
        ("umount", if lazy { vec!["-l"] } else { vec![] }),
    ];
    let mut last_err = String::new();
    for (bin, flags) in attempts {
        match Process::new(bin).args(&flags).arg(&mp).output() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => last_err = format!("{bin}: {e}"),
            Ok(out) if out.status.success() => return 0,
            Ok(out) => {
                let msg = String::from_utf8_lossy(&out.stderr);
                last_err = msg.split_whitespace().collect::<Vec<_>>().join(" ");
                if last_err.contains("busy") {
                    eprintln!(
                        "bucketfs: cannot unmount {}: it is busy (a process has a file or its \
                         working directory in it; see `fuser -vm {}`, or use --lazy)",
                        mp.display(),
                        mp.display()
                    );
                    return 1;
                }
            }
        }
    }
    if last_err.is_empty() {
        last_err = "neither fusermount3 nor umount found".into();
    }
    eprintln!("bucketfs: cannot unmount {}: {last_err}", mp.display());
    1
}
