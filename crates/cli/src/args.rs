//! Command-line syntax: `bucketfs mount|umount` (clap derive) and the `mount.bucketfs` helper
//! form that mount(8) and /etc/fstab use.
//!
//! Flags are kept as strings here and parsed by [`crate::config::Settings::apply`], so a flag,
//! its `-o` spelling and its config-file key accept exactly the same values.

use crate::config::{Origin, Settings};
use crate::options::SettingArgs;
use clap::{Args, Parser, Subcommand};
use std::ffi::OsString;
use std::path::PathBuf;

const ABOUT: &str = "Mount an S3 bucket (or a local directory used as a bucket) as a POSIX \
                     directory";

pub(crate) const MOUNT_AFTER_HELP: &str = "\
SOURCE:
  s3://BUCKET[/PREFIX]   a bucket on Amazon S3 or any S3-compatible service (MinIO, Alibaba OSS,
                         Ceph RGW, ...); with PREFIX the mount shows only keys under PREFIX/.
                         s3:// without a bucket takes `bucket` (and `prefix`) from the config file.
  /path/to/dir           a local directory used as the bucket (it must exist)

SETTINGS come from, lowest precedence first: defaults, the config file (-c), -o options, flags
and their BUCKETFS_* environment variables. Every flag --some-flag has the config key some_flag
(some-flag also works) and the -o option some_flag=VALUE (booleans: -o some_flag).

CONFIG FILE (-c FILE or -o config=FILE), either format:
  TOML:        endpoint_url = \"http://127.0.0.1:9000\"
               force_path_style = true
               part_size = \"16M\"
               access_key_id = \"...\"          # credentials: file must be chmod 600
               secret_access_key = \"...\"
  ossfs 2.0:   --oss_endpoint=oss-cn-hangzhou.aliyuncs.com
               --oss_bucket=BUCKET   --oss_bucket_prefix=PREFIX
               --oss_access_key_id=...   --oss_access_key_secret=...
               --ro   --allow_other   --log_dir=DIR   --log_level=info
               --upload_buffer_size=BYTES ... (every ossfs 2.0 option: docs/migration.md);
               bucketfs's own keys also work as --key=value (e.g. --force_path_style)
  With a file that names the bucket, MOUNTPOINT alone is enough: mount /mnt/oss -c ossfs2.conf
  Keys only the file may hold: bucket, prefix, access_key_id, secret_access_key, session_token.
  Unknown keys are errors. A file holding credentials must not be readable or writable by group or others.

CREDENTIALS (S3): the config file keys above, else the AWS SDK chain: AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, --profile or AWS_PROFILE in ~/.aws/config and
~/.aws/credentials, SSO, web identity, ECS and EC2 instance roles. There are deliberately no
credential flags: command lines are visible to every user through ps.

-o OPTIONS: comma-separated, as in /etc/fstab. Besides the keys above: ro, config=FILE,
url=URL (= endpoint_url), use_path_request_style (= force_path_style). Generic mount options
(rw, defaults, auto, noauto, user, users, _netdev, nofail, nosuid, nodev, noatime, x-systemd.*,
...) are accepted and ignored.

LOGGING: to --log-file if given; else to syslog with --syslog; else to stderr with
--foreground; else (in the background) to syslog through /dev/log, or to
STATE_DIR/logs/bucketfs-<PID>.log (mode 0600, directory 0700) when there is no /dev/log.
RUST_LOG overrides --log-level with a tracing filter. Credentials are never logged.

STARTUP: without -f, bucketfs returns only once the mount is ready (exit 0) or has failed
(a one-line message on stderr, exit 1). It checks the mount point (exists, is a directory, is
empty, is not already a mount point unless --allow-stacking; a dead FUSE mount left by a
crash is unmounted) and, for S3, that the bucket exists and the credentials can list it. On
SIGTERM/SIGINT/SIGHUP it publishes files still being written, unmounts and exits (a busy
mount point is detached lazily and served until its last user leaves); it also exits when
the mount point is unmounted externally (bucketfs umount, umount).

FSTAB:
  s3://bucket/prefix  /mnt/data  bucketfs  _netdev,allow_other,config=/etc/bucketfs.toml  0 0
  (needs the helper link /sbin/mount.bucketfs: bucketfs install makes it)

EXAMPLES:
  bucketfs mount --endpoint-url http://127.0.0.1:9000 --force-path-style s3://data /mnt/data
  bucketfs mount -c /etc/bucketfs.toml -o allow_other,ro s3://logs/2024 /mnt/logs
  bucketfs mount /srv/bucket-dir /mnt/local
  bucketfs umount /mnt/data";

#[derive(Debug, Parser)]
#[command(name = "bucketfs", version, about = ABOUT, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Mount SOURCE (s3://BUCKET[/PREFIX] or a local directory) at MOUNTPOINT.
    #[command(after_long_help = MOUNT_AFTER_HELP)]
    Mount(Box<MountArgs>),
    /// Unmount a bucketfs mount (the daemon then exits).
    Umount(UmountArgs),
    /// Measure the store with no file system in between (the limit for benchmarks): one
    /// parallel multipart PUT, then parallel ranged GETs of it; the object is deleted after.
    Bench(Box<BenchArgs>),
    /// Live view of a mount: throughput, requests/s by type, cache hit rates, memory in use.
    Stats(StatsArgs),
    /// Files of a mount with --upload background that are not in the bucket yet: each with
    /// its state (queued; parked: fsync'd while still open, goes up at its close or 5 s
    /// after; uploading; failed; conflict), size, key and last error.
    Pending(PendingArgs),
    /// Make the mount forget what it cached about PATHs (attributes, directory listings), so
    /// changes made by other clients show now instead of after --stat-ttl.
    Refresh(RefreshArgs),
    /// Read files and trees through their mount, several at once, so a mount with
    /// --data-cache holds them before a job reads them; prints files, bytes, time and how
    /// much was cached already.
    Warmup(WarmupArgs),
    /// Mount with an s3fs-fuse or ossfs 1.x command line: BUCKET[:/PREFIX] MOUNTPOINT
    /// [-f] [-o OPT,...] (also when the binary is invoked as `s3fs` or `ossfs`).
    #[command(disable_help_flag = true)]
    S3fs(S3fsArgs),
    /// Mount with an ossfs 2.0 command line: mount MOUNTPOINT [-c CONFIG] [--KEY=VALUE ...]
    /// (also when the binary is invoked as `ossfs2`).
    #[command(disable_help_flag = true)]
    Ossfs2(S3fsArgs),
    /// Install the binary, the mount.bucketfs helper, the man page, shell completions and a
    /// systemd unit template (bucketfs@.service) under ROOT, as a package would.
    Install(InstallArgs),
    /// Serve the Kubernetes CSI driver on a Unix socket (docs/kubernetes.md).
    ///
    /// Identity, controller and node services. NodePublishVolume mounts s3://BUCKET/PREFIX
    /// with one bucketfs daemon per pod volume, which outlives a restart of the driver.
    #[command(after_long_help = CSI_AFTER_HELP)]
    Csi(CsiArgs),
}

const CSI_AFTER_HELP: &str = "\
VOLUME ATTRIBUTES (PV volumeAttributes, StorageClass parameters): bucket (required), prefix,
endpoint, region, forcePathStyle, readOnly, uid, gid, fileMode, dirMode, maxMemory, statTTL,
partSize, dataCacheSize (a data cache under STATE_DIR/cache), options (-o options, as the PV's
mountOptions). SECRET keys: accessKeyID, secretAccessKey, sessionToken, and optionally
endpoint, region, forcePathStyle. Credentials reach each mount daemon in a 0600 file under
STATE_DIR, never on a command line or in a log.

EXAMPLE:
  bucketfs csi --endpoint unix:///csi/csi.sock --node-id \"$NODE_NAME\"";

#[derive(Debug, Args)]
pub struct CsiArgs {
    /// The gRPC socket: unix:///PATH/csi.sock.
    #[arg(long, value_name = "unix:///PATH", env = "CSI_ENDPOINT")]
    pub endpoint: String,
    /// This node's name, as NodeGetInfo reports it (the Kubernetes node name).
    #[arg(long, value_name = "ID", env = "NODE_ID")]
    pub node_id: String,
    /// Records of the mounts (so a restarted driver finds them), credentials files, daemon
    /// logs and data caches. Keep it on the node's disk (a hostPath), not in the container.
    #[arg(
        long,
        value_name = "DIR",
        env = "BUCKETFS_CSI_STATE_DIR",
        default_value = "/var/lib/bucketfs/csi"
    )]
    pub state_dir: PathBuf,
    /// How long NodeUnpublishVolume waits, from its first call for a target, for the mount
    /// to be free and its daemon to store files still being written and exit; until then it
    /// answers UNAVAILABLE (the kubelet retries), after it detaches the mount and kills the
    /// daemon.
    #[arg(long, value_name = "SECONDS", default_value_t = 120)]
    pub unpublish_timeout: u64,
    /// Where the mount daemons run: systemd (transient services of the host's systemd), host
    /// (in PID 1's cgroups and mount namespace), child (children of the driver: they die with
    /// its container), auto (systemd or host when the driver has hostPID and privileges,
    /// else child).
    #[arg(long, value_name = "MODE", default_value = "auto")]
    pub daemons: bucketfs_csi::DaemonMode,
    /// The process whose mount and cgroup namespaces and cgroups are the host's, for
    /// `--daemons host`/`systemd`: the host's init (with hostPID, 1). Tests name another.
    #[arg(long, value_name = "PID", default_value_t = 1, hide = true)]
    pub host_pid: u32,
    /// error, warn, info, debug or trace.
    #[arg(long, value_name = "LEVEL", default_value = "info")]
    pub log_level: String,
}

#[derive(Debug, Args)]
pub struct InstallArgs {
    /// Install into this directory as if it were / (a package's staging directory).
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub root: PathBuf,
    /// Where the files go on the installed system: PREFIX/bin, PREFIX/share/man, ...
    #[arg(long, value_name = "DIR", default_value = "/usr/local")]
    pub prefix: PathBuf,
    /// Also install links named s3fs, ossfs and ossfs2 in PREFIX/bin, so their command lines
    /// and s3fs fstab lines (fuse.s3fs, s3fs#BUCKET) run bucketfs.
    #[arg(long)]
    pub s3fs_links: bool,
    /// Where the mount.bucketfs helper link goes (mount(8) looks in /sbin; /usr/sbin is the
    /// same directory on merged-/usr systems, and where a package puts it).
    #[arg(long, value_name = "DIR", default_value = "/sbin")]
    pub sbin: PathBuf,
    /// The binary to install. Default: this one.
    #[arg(long, value_name = "FILE")]
    pub binary: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct S3fsArgs {
    /// The s3fs arguments, as s3fs takes them (see docs/migration.md).
    #[arg(allow_hyphen_values = true, trailing_var_arg = true, num_args = 0..)]
    pub args: Vec<OsString>,
}

#[derive(Debug, Args)]
pub struct RefreshArgs {
    /// Files or directories inside a bucketfs mount.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
}

#[derive(Debug, Args)]
pub struct WarmupArgs {
    /// Files or directories inside bucketfs mounts.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// Files read at the same time.
    #[arg(long, short = 'j', value_name = "N", default_value_t = 8)]
    pub jobs: usize,
}

#[derive(Debug, Args)]
pub struct PendingArgs {
    /// The mount point of a running bucketfs.
    pub mountpoint: PathBuf,
}

#[derive(Debug, Args)]
pub struct StatsArgs {
    /// The mount point of a running bucketfs.
    pub mountpoint: PathBuf,
    /// Print the totals since mounting once and exit, instead of refreshing every second.
    #[arg(long)]
    pub once: bool,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// s3://BUCKET[/PREFIX] or a local directory; the test object goes under PREFIX.
    pub source: String,
    /// Bytes to write and read back (K/M/G suffixes).
    #[arg(long, value_name = "SIZE", default_value = "1G")]
    pub size: String,
    /// Requests in flight at once.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub concurrency: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Between the PUT and the GETs, flush and drop the kernel's page cache (needs root), so
    /// a store on this machine serves the GETs from disk, as it does a mount's cold reads.
    #[arg(long)]
    pub cold: bool,
    /// Config file, as for mount (connection and credential keys are used).
    #[arg(short, long, value_name = "FILE", env = "BUCKETFS_CONFIG")]
    pub config: Option<PathBuf>,
    /// S3 endpoint, as for mount.
    #[arg(long, value_name = "URL", env = "BUCKETFS_ENDPOINT_URL")]
    pub endpoint_url: Option<String>,
    /// S3 region, as for mount.
    #[arg(long, value_name = "REGION", env = "BUCKETFS_REGION")]
    pub region: Option<String>,
    /// Path-style addressing, as for mount.
    #[arg(long)]
    pub force_path_style: bool,
    /// Named AWS profile, as for mount.
    #[arg(long, value_name = "NAME", env = "BUCKETFS_PROFILE")]
    pub profile: Option<String>,
    /// Part size of the upload and of each GET. [default: 8M]
    #[arg(long, value_name = "SIZE")]
    pub part_size: Option<String>,
    /// Unsigned upload bodies, as for mount.
    #[arg(long)]
    pub unsigned_payload: bool,
    /// Also PUT then GET this many small objects (the limit of a small-file workload, whose
    /// cost is per request). 0: skip. `--size 0` skips the large object.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub small_count: usize,
    /// Bytes of each small object (K/M/G suffixes).
    #[arg(long, value_name = "SIZE", default_value = "128K")]
    pub small_size: String,
    /// Small-object requests in flight at once.
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub small_concurrency: usize,
}

impl BenchArgs {
    pub fn settings(&self) -> Result<Settings, String> {
        let mut s = Settings::default();
        if let Some(path) = &self.config {
            s.apply_file(path)?;
        }
        let values = [
            ("endpoint_url", &self.endpoint_url),
            ("region", &self.region),
            ("profile", &self.profile),
            ("part_size", &self.part_size),
        ];
        for (key, v) in values {
            if let Some(v) = v {
                s.apply(key, Some(v), Origin::Flag)?;
            }
        }
        if self.force_path_style {
            s.apply("force_path_style", None, Origin::Flag)?;
        }
        if self.unsigned_payload {
            s.apply("unsigned_payload", None, Origin::Flag)?;
        }
        Ok(s)
    }
}

#[derive(Debug, Args)]
pub struct UmountArgs {
    /// The mount point to unmount.
    pub mountpoint: PathBuf,
    /// Detach now even if the mount is busy; it goes away when its last user does.
    #[arg(short = 'z', long)]
    pub lazy: bool,
}

#[derive(Debug, Args)]
pub struct MountArgs {
    /// What to mount: s3://BUCKET[/PREFIX] or a local directory. Given alone, it is the mount
    /// point, and the bucket comes from the config file (as `ossfs2 mount DIR -c FILE`).
    pub source: String,

    /// Where to mount it: an existing, empty directory.
    pub mountpoint: Option<PathBuf>,

    /// The settings' flags, made from [`crate::options::OPTIONS`].
    #[command(flatten)]
    pub flags: SettingArgs,

    /// Mount options, comma-separated, as in /etc/fstab: any config key as key=value or a bare
    /// boolean key, plus ro and config=FILE (e.g. -o allow_other,ro,part_size=16M). Repeatable.
    #[arg(short = 'o', value_name = "OPT[=VAL],...")]
    pub options: Vec<String>,

    /// Settings to start from instead of the defaults (an s3fs command line's).
    #[arg(skip)]
    pub base: Option<Box<Settings>>,
}

impl MountArgs {
    /// SOURCE and the mount point: a lone positional is the mount point of the config file's
    /// bucket (`s3://`).
    pub fn source_and_mountpoint(&self) -> (String, PathBuf) {
        match &self.mountpoint {
            Some(m) => (self.source.clone(), m.clone()),
            None => ("s3://".into(), PathBuf::from(&self.source)),
        }
    }

    /// Merges the config file, `-o` options and flags into one set of settings.
    pub fn settings(&self) -> Result<Settings, String> {
        let mut s = self.base.as_deref().cloned().unwrap_or_default();
        let config = self
            .flags
            .config
            .clone()
            .or_else(|| crate::config::config_from_mount_options(&self.options));
        if let Some(path) = &config {
            s.apply_file(path)?;
        }
        s.apply_mount_options(&self.options)?;
        for (key, v) in &self.flags.given {
            s.apply(key, v.as_deref(), Origin::Flag)?;
        }
        Ok(s)
    }
}

/// What a `mount.bucketfs` invocation asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum HelperCall {
    /// Run `bucketfs` with these arguments.
    Run(Vec<OsString>),
    /// `-f` (fake): do everything but mount, i.e. nothing.
    Fake,
}

/// Turns `mount.bucketfs SOURCE MOUNTPOINT [-sfnv] [-o OPTS] [-t TYPE] [-N NS]` (the mount(8)
/// helper calling convention) into `bucketfs mount SOURCE MOUNTPOINT -o OPTS`.
pub fn mount_helper_args(args: &[OsString]) -> Result<HelperCall, String> {
    let mut out: Vec<OsString> = vec!["bucketfs".into(), "mount".into()];
    let mut positional = Vec::new();
    let mut fake = false;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        match s.as_ref() {
            "-o" => {
                let v = it.next().ok_or("-o needs a value")?;
                out.push("-o".into());
                out.push(v.clone());
            }
            "-t" => {
                it.next();
            }
            // util-linux passes the namespace to enter (`mount -N`); mounting in the
            // caller's instead would put the mount where nobody asked for it.
            "-N" => {
                return Err("-N (mount in another namespace) is not supported: run \
                            `nsenter --mount=NAMESPACE mount ...` instead"
                    .into())
            }
            "-h" | "--help" => {
                return Ok(HelperCall::Run(vec![
                    "bucketfs".into(),
                    "mount".into(),
                    "--help".into(),
                ]))
            }
            _ if s.starts_with("-o") && s.len() > 2 => {
                out.push("-o".into());
                out.push(s[2..].to_string().into());
            }
            _ if s.starts_with('-')
                && s.len() > 1
                && s[1..].chars().all(|c| "sfnvw".contains(c)) =>
            {
                // -s sloppy, -n no mtab, -v verbose, -w read-write: nothing to do; -f fake.
                fake |= s.contains('f');
            }
            _ if s.starts_with('-') && s.len() > 1 => {
                return Err(format!("mount.bucketfs: unknown option {s}"));
            }
            _ => positional.push(a.clone()),
        }
    }
    if positional.len() != 2 {
        return Err("usage: mount.bucketfs SOURCE MOUNTPOINT [-o OPTION[,OPTION...]]".into());
    }
    if fake {
        return Ok(HelperCall::Fake);
    }
    out.splice(2..2, positional);
    Ok(HelperCall::Run(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn clap_definition_is_valid() {
        Cli::command().debug_assert();
    }

    #[test]
    fn helper_translation() {
        let r = mount_helper_args(&os(&[
            "/sbin/mount.bucketfs",
            "s3://b/p",
            "/mnt/x",
            "-n",
            "-o",
            "rw,_netdev,allow_other",
            "-t",
            "bucketfs",
        ]))
        .unwrap();
        assert_eq!(
            r,
            HelperCall::Run(os(&[
                "bucketfs",
                "mount",
                "s3://b/p",
                "/mnt/x",
                "-o",
                "rw,_netdev,allow_other"
            ]))
        );
        assert_eq!(
            mount_helper_args(&os(&["mount.bucketfs", "a", "b", "-fv"])).unwrap(),
            HelperCall::Fake
        );
        assert!(mount_helper_args(&os(&["mount.bucketfs", "a"])).is_err());
        let e = mount_helper_args(&os(&["mount.bucketfs", "a", "b", "-N", "/proc/1/fd/3"]));
        assert!(e
            .unwrap_err()
            .contains("-N (mount in another namespace) is not supported"));
        assert!(mount_helper_args(&os(&["mount.bucketfs", "a", "b", "--bogus"])).is_err());
    }

    #[test]
    fn flags_override_options_and_file() {
        let cli = Cli::try_parse_from([
            "bucketfs",
            "mount",
            "s3://b",
            "/mnt",
            "-o",
            "part_size=16M,ro",
            "--part-size",
            "32M",
            "--allow-other",
        ])
        .unwrap();
        let Command::Mount(m) = cli.command else {
            panic!()
        };
        let s = m.settings().unwrap();
        assert_eq!(s.part_size, 32 << 20);
        assert!(s.read_only && s.allow_other);
    }

    /// `bench` takes some of mount's settings by key: each is a setting of the table.
    #[test]
    fn bench_flags_are_settings() {
        let cli = Cli::try_parse_from([
            "bucketfs",
            "bench",
            "s3://b",
            "--endpoint-url",
            "http://h:9000",
            "--region",
            "r",
            "--force-path-style",
            "--profile",
            "p",
            "--part-size",
            "16M",
            "--unsigned-payload",
        ])
        .unwrap();
        let Command::Bench(b) = cli.command else {
            panic!()
        };
        let s = b.settings().unwrap();
        assert_eq!(s.part_size, 16 << 20);
        assert!(s.force_path_style && s.unsigned_payload == Some(true));
    }

    #[test]
    fn no_credential_flags() {
        let r = Cli::try_parse_from([
            "bucketfs",
            "mount",
            "s3://b",
            "/mnt",
            "--secret-access-key",
            "x",
        ]);
        assert!(r.is_err());
    }
}
