//! Mount settings: one set of keys fed from the config file, `-o` options and flags.
//!
//! Every source goes through [`Settings::apply`] with a key and a string value, so a value is
//! parsed and validated the same way wherever it comes from, and an error names its origin
//! (`config /etc/bucketfs.toml: part_size: ...`, `--part-size: ...`, `-o part_size: ...`).
//! Precedence, lowest first: built-in defaults, the config file, `-o` options, flags and their
//! `BUCKETFS_*` environment variables.
//!
//! Config files are TOML (`key = value`, keys as the long flags with `-` or `_`) or the ossfs 2.0
//! format (`--key=value` lines, detected by the first non-comment line starting with `--`).
//! Unknown keys are errors. A file that holds credentials must not be readable by group or
//! others. Credentials are accepted only from the config file (and the AWS SDK's own chain),
//! never from flags or `-o`, which show up in `ps` and `/etc/fstab`.

use crate::options::{setting, Kind, OptionSpec, Scope, IGNORED_MOUNT_OPTIONS};
use bucketfs_fs::{DataCacheConfig, FsConfig, MinFree, WriteBackConfig};

/// Background uploads at once (`--upload background`): small files are latency-bound, so
/// many go up together.
pub(crate) const BACKGROUND_UPLOADS: usize = 32;
use bucketfs_store::list_meta::ListMetadata;
use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

/// Everything `bucketfs mount` can be told, merged from all sources.
#[derive(Clone)]
pub struct Settings {
    pub foreground: bool,
    pub endpoint_url: Option<String>,
    pub region: Option<String>,
    pub force_path_style: bool,
    pub profile: Option<String>,
    pub read_only: bool,
    /// `-o noexec`: the kernel refuses to execute files of the mount.
    pub no_exec: bool,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub file_mode: u16,
    pub dir_mode: u16,
    pub umask: u16,
    pub mp_umask: u16,
    pub allow_other: bool,
    pub allow_root: bool,
    pub nonempty: bool,
    /// Mount even where a file system is already mounted (stacking over it).
    pub allow_stacking: bool,
    pub part_size: u64,
    pub stat_ttl: Duration,
    pub negative_ttl: Duration,
    pub stat_cache_size: usize,
    pub cache_dir: PathBuf,
    pub cache_min_free: MinFree,
    /// Upload journals and the background log; `None`: the default (see `run::state_dir`).
    pub state_dir: Option<PathBuf>,
    pub max_dir_rename: usize,
    pub upload_concurrency: usize,
    /// `--upload background`: close returns once the file is in the write-back directory.
    pub background_upload: bool,
    /// With background upload, fsync waits for the upload.
    pub fsync_waits_upload: bool,
    pub writeback_size: u64,
    pub upload_delay: Duration,
    pub max_memory: u64,
    pub max_prefetch: u64,
    /// The data cache's directory, if any (off by default).
    pub data_cache: Option<PathBuf>,
    pub data_cache_size: u64,
    /// Hand the kernel the data cache's whole files (FUSE passthrough; opt-in: not POSIX).
    pub passthrough: bool,
    /// Forces `passthrough` off (the old opt-out, still accepted).
    pub no_passthrough: bool,
    pub fuse_threads: usize,
    /// Where to serve Prometheus metrics (`/metrics`), if anywhere.
    pub metrics_addr: Option<std::net::SocketAddr>,
    pub log_file: Option<PathBuf>,
    pub log_level: LogLevel,
    pub syslog: bool,
    /// PEM bundle of the CAs trusted for HTTPS (instead of the system's).
    pub ca_bundle: Option<PathBuf>,
    /// Accept any HTTPS certificate (explicit flag only; warned about).
    pub no_verify_ssl: bool,
    /// Upload bodies unsigned (`UNSIGNED-PAYLOAD`); `None`: only over HTTPS.
    pub unsigned_payload: Option<bool>,
    /// How long a failing store request is retried.
    pub retry_timeout: Duration,
    /// Whether LISTs ask for user metadata (MinIO's `metadata=true`).
    pub list_metadata: ListMetadata,
    /// Most S3 requests (and connections) at once.
    pub max_connections: usize,
    /// Objects written get a Content-Type guessed from their name (`--content-type guess`).
    pub guess_content_type: bool,
    /// From the config file only: used when SOURCE is `s3://` without a bucket.
    pub bucket: Option<String>,
    /// From the config file only: used when SOURCE has no prefix.
    pub prefix: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    /// Options of another tool accepted without effect: one line each, shown at startup.
    pub notices: Vec<String>,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hidden = |o: &Option<String>| o.as_ref().map(|_| "<hidden>");
        f.debug_struct("Settings")
            .field("foreground", &self.foreground)
            .field("endpoint_url", &self.endpoint_url)
            .field("region", &self.region)
            .field("force_path_style", &self.force_path_style)
            .field("profile", &self.profile)
            .field("read_only", &self.read_only)
            .field("no_exec", &self.no_exec)
            .field("uid", &self.uid)
            .field("gid", &self.gid)
            .field("file_mode", &format_args!("{:o}", self.file_mode))
            .field("dir_mode", &format_args!("{:o}", self.dir_mode))
            .field("umask", &format_args!("{:o}", self.umask))
            .field("mp_umask", &format_args!("{:o}", self.mp_umask))
            .field("allow_other", &self.allow_other)
            .field("allow_root", &self.allow_root)
            .field("nonempty", &self.nonempty)
            .field("allow_stacking", &self.allow_stacking)
            .field("part_size", &self.part_size)
            .field("stat_ttl", &self.stat_ttl)
            .field("negative_ttl", &self.negative_ttl)
            .field("stat_cache_size", &self.stat_cache_size)
            .field("cache_dir", &self.cache_dir)
            .field("cache_min_free", &self.cache_min_free)
            .field("state_dir", &self.state_dir)
            .field("max_dir_rename", &self.max_dir_rename)
            .field("upload_concurrency", &self.upload_concurrency)
            .field("upload", &self.background_upload)
            .field("upload_fsync", &self.fsync_waits_upload)
            .field("writeback_size", &self.writeback_size)
            .field("upload_delay", &self.upload_delay)
            .field("max_memory", &self.max_memory)
            .field("max_prefetch", &self.max_prefetch)
            .field("data_cache", &self.data_cache)
            .field("data_cache_size", &self.data_cache_size)
            .field("passthrough", &self.passthrough)
            .field("no_passthrough", &self.no_passthrough)
            .field("fuse_threads", &self.fuse_threads)
            .field("metrics_addr", &self.metrics_addr)
            .field("log_file", &self.log_file)
            .field("log_level", &self.log_level)
            .field("syslog", &self.syslog)
            .field("ca_bundle", &self.ca_bundle)
            .field("no_verify_ssl", &self.no_verify_ssl)
            .field("unsigned_payload", &self.unsigned_payload)
            .field("retry_timeout", &self.retry_timeout)
            .field("list_metadata", &self.list_metadata)
            .field("max_connections", &self.max_connections)
            .field(
                "content_type",
                &if self.guess_content_type {
                    "guess"
                } else {
                    "none"
                },
            )
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("access_key_id", &hidden(&self.access_key_id))
            .field("secret_access_key", &hidden(&self.secret_access_key))
            .field("session_token", &hidden(&self.session_token))
            .finish()
    }
}

impl Default for Settings {
    fn default() -> Self {
        let fs = FsConfig::default();
        Self {
            foreground: false,
            endpoint_url: None,
            region: None,
            force_path_style: false,
            profile: None,
            read_only: false,
            no_exec: false,
            uid: None,
            gid: None,
            file_mode: fs.file_mode,
            dir_mode: fs.dir_mode,
            umask: fs.umask,
            mp_umask: fs.mp_umask,
            allow_other: false,
            allow_root: false,
            nonempty: false,
            allow_stacking: false,
            part_size: fs.part_size,
            stat_ttl: fs.stat_ttl,
            negative_ttl: fs.negative_ttl,
            stat_cache_size: fs.stat_cache_size,
            cache_dir: fs.cache_dir,
            cache_min_free: fs.cache_min_free,
            state_dir: None,
            max_dir_rename: fs.max_dir_rename_objects,
            upload_concurrency: fs.upload_concurrency,
            background_upload: false,
            fsync_waits_upload: false,
            writeback_size: 4 << 30,
            upload_delay: Duration::ZERO,
            max_memory: fs.max_memory,
            max_prefetch: fs.max_prefetch,
            data_cache: None,
            data_cache_size: 10 << 30,
            passthrough: false,
            no_passthrough: false,
            fuse_threads: 4,
            metrics_addr: None,
            log_file: None,
            log_level: LogLevel::Info,
            syslog: false,
            ca_bundle: None,
            no_verify_ssl: false,
            unsigned_payload: None,
            retry_timeout: Duration::from_secs(30),
            list_metadata: ListMetadata::Auto,
            max_connections: bucketfs_store::s3::DEFAULT_MAX_CONNECTIONS,
            guess_content_type: true,
            bucket: None,
            prefix: None,
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            notices: Vec::new(),
        }
    }
}

/// Where a setting came from, for error messages.
#[derive(Debug, Clone, Copy)]
pub enum Origin<'a> {
    File(&'a Path),
    /// A command-line flag (or its environment variable).
    Flag,
    /// A `-o` option.
    Opt,
}

const CREDENTIAL_KEYS: &[&str] = &["access_key_id", "secret_access_key", "session_token"];

/// Generic mount(8)/fstab options that mean nothing to bucketfs and are accepted silently.
fn ignored_mount_option(key: &str) -> bool {
    IGNORED_MOUNT_OPTIONS.contains(&key) || key.starts_with("x-")
}

pub(crate) fn canonical(key: &str) -> String {
    key.trim().replace('-', "_").to_ascii_lowercase()
}

pub fn parse_bool(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "" | "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("invalid boolean \"{s}\" (use true or false)")),
    }
}

/// Parses `8388608`, `8M`, `8MB`, `16MiB`, `1.5G`, `512k`: suffixes are powers of 1024.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let err = || format!("invalid size \"{s}\" (use bytes or a K/M/G/T suffix, e.g. 16M)");
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(err());
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(err()),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(err);
    }
    let f: f64 = num.parse().map_err(|_| err())?;
    let v = f * mult as f64;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 || v.fract() != 0.0 {
        return Err(err());
    }
    Ok(v as u64)
}

/// Parses an octal permission string: `0644`, `644`, `0o644`.
pub fn parse_mode(s: &str) -> Result<u16, String> {
    let t = s.trim();
    let digits = t.strip_prefix("0o").unwrap_or(t);
    match u16::from_str_radix(digits, 8) {
        Ok(m) if m <= 0o7777 && !digits.is_empty() => Ok(m),
        _ => Err(format!("invalid mode \"{s}\" (use octal, e.g. 0644)")),
    }
}

/// Parses seconds (`5`, `0.5`) or a number with `ms`, `s`, `m` or `h`.
/// A size (K/M/G/T) or a percentage of the disk (`10%`).
pub fn parse_min_free(s: &str) -> Result<MinFree, String> {
    match s.trim().strip_suffix('%') {
        Some(p) => match p.trim().parse::<u8>() {
            Ok(n) if n <= 100 => Ok(MinFree::Percent(n)),
            _ => Err(format!("invalid percentage \"{s}\" (0% to 100%)")),
        },
        None => parse_size(s).map(MinFree::Bytes),
    }
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let err = || format!("invalid duration \"{s}\" (use seconds, e.g. 5 or 0.5, or 500ms, 2m)");
    let t = s.trim().to_ascii_lowercase();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (t.as_str(), 1.0)
    };
    let f: f64 = num.trim().parse().map_err(|_| err())?;
    let secs = f * scale;
    if !secs.is_finite() || !(0.0..=86_400.0 * 365.0).contains(&secs) {
        return Err(err());
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_count(s: &str, min: usize, max: usize) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!("invalid number \"{s}\" (expected {min} to {max})")),
    }
}

fn parse_id(s: &str) -> Result<u32, String> {
    s.trim()
        .parse::<u32>()
        .map_err(|_| format!("invalid id \"{s}\" (expected a number)"))
}

pub fn parse_log_level(s: &str) -> Result<LogLevel, String> {
    Ok(match s.trim().to_ascii_lowercase().as_str() {
        "error" | "err" | "fatal" | "critical" => LogLevel::Error,
        "warn" | "warning" => LogLevel::Warn,
        "info" => LogLevel::Info,
        "debug" => LogLevel::Debug,
        "trace" => LogLevel::Trace,
        _ => {
            return Err(format!(
                "invalid log level \"{s}\" (use error, warn, info, debug or trace)"
            ))
        }
    })
}

/// `host[:port]` gets `https://`; URLs with a scheme are kept.
fn normalize_endpoint(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("empty endpoint URL".into());
    }
    if t.contains(char::is_whitespace) {
        return Err(format!("invalid endpoint URL \"{t}\""));
    }
    if t.contains("://") {
        if !(t.starts_with("http://") || t.starts_with("https://")) {
            return Err(format!(
                "invalid endpoint URL \"{t}\" (use http:// or https://)"
            ));
        }
        Ok(t.trim_end_matches('/').to_string())
    } else {
        Ok(format!("https://{}", t.trim_end_matches('/')))
    }
}

fn non_empty(s: &str, what: &str) -> Result<String, String> {
    let t = s.trim();
    if t.is_empty() {
        Err(format!("empty {what}"))
    } else {
        Ok(t.to_string())
    }
}

impl Settings {
    /// Sets `key` (any spelling: `part-size`, `part_size`) to `value` (`None`: a bare boolean
    /// key such as `-o allow_other`).
    pub fn apply(&mut self, key: &str, value: Option<&str>, origin: Origin) -> Result<(), String> {
        let ckey = canonical(key);
        let unknown = || match origin {
            Origin::File(p) => format!("config {}: unknown key \"{key}\"", p.display()),
            Origin::Flag => format!("unknown option \"{key}\""),
            Origin::Opt => format!("-o: unknown option \"{key}\""),
        };
        let ctx = |msg: String| match origin {
            Origin::File(p) => format!("config {}: {ckey}: {msg}", p.display()),
            Origin::Flag => format!("--{}: {msg}", ckey.replace('_', "-")),
            Origin::Opt => format!("-o {ckey}: {msg}"),
        };
        let Some(&OptionSpec {
            key: name,
            kind,
            scope,
            ..
        }) = setting(&ckey)
        else {
            return Err(unknown());
        };
        if scope == Scope::FileOnly && !matches!(origin, Origin::File(_)) {
            return Err(if CREDENTIAL_KEYS.contains(&name) {
                ctx(
                    "credentials are not accepted on the command line or in mount options \
                     (they show in ps and /etc/fstab): put them in a config file (chmod 600) \
                     or use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or --profile"
                        .into(),
                )
            } else {
                ctx("give the bucket and prefix in SOURCE (s3://BUCKET/PREFIX)".into())
            });
        }
        let v = match (kind, value) {
            (Kind::Bool, None) => "true",
            (Kind::Value, None) => return Err(ctx("needs a value".into())),
            (_, Some(v)) => v,
        };
        self.set(name, v).map_err(ctx)
    }

    fn set(&mut self, name: &str, v: &str) -> Result<(), String> {
        match name {
            "foreground" => self.foreground = parse_bool(v)?,
            "endpoint_url" => self.endpoint_url = Some(normalize_endpoint(v)?),
            "region" => self.region = Some(non_empty(v, "region")?),
            "force_path_style" => self.force_path_style = parse_bool(v)?,
            "profile" => self.profile = Some(non_empty(v, "profile name")?),
            "read_only" => self.read_only = parse_bool(v)?,
            "uid" => self.uid = Some(parse_id(v)?),
            "gid" => self.gid = Some(parse_id(v)?),
            "file_mode" => self.file_mode = parse_mode(v)?,
            "dir_mode" => self.dir_mode = parse_mode(v)?,
            "umask" => self.umask = parse_mode(v)?,
            "mp_umask" => self.mp_umask = parse_mode(v)?,
            "allow_other" => self.allow_other = parse_bool(v)?,
            "allow_root" => self.allow_root = parse_bool(v)?,
            "nonempty" => self.nonempty = parse_bool(v)?,
            "allow_stacking" => self.allow_stacking = parse_bool(v)?,
            "part_size" => {
                let n = parse_size(v)?;
                // Checked before any store is open: S3's sizes, which every store here keeps.
                let limits = bucketfs_store::StoreLimits::S3;
                if !(limits.min_part..=limits.max_part).contains(&n) {
                    return Err(format!(
                        "part size {v} is out of range (5 MiB to 5 GiB, the S3 limits)"
                    ));
                }
                self.part_size = n;
            }
            "stat_ttl" => self.stat_ttl = parse_duration(v)?,
            "negative_ttl" => self.negative_ttl = parse_duration(v)?,
            "stat_cache_size" => self.stat_cache_size = parse_count(v, 0, 100_000_000)?,
            "cache_dir" => self.cache_dir = PathBuf::from(non_empty(v, "path")?),
            "cache_min_free" => self.cache_min_free = parse_min_free(v)?,
            "state_dir" => self.state_dir = Some(PathBuf::from(non_empty(v, "path")?)),
            "max_dir_rename" => self.max_dir_rename = parse_count(v, 0, usize::MAX)?,
            "upload_concurrency" => self.upload_concurrency = parse_count(v, 1, 256)?,
            "upload" => {
                self.background_upload = match v.trim() {
                    "sync" => false,
                    "background" => true,
                    _ => return Err(format!("upload mode {v:?}: sync or background")),
                }
            }
            "upload_fsync" => {
                self.fsync_waits_upload = match v.trim() {
                    "local" => false,
                    "bucket" => true,
                    _ => return Err(format!("upload fsync {v:?}: local or bucket")),
                }
            }
            "upload_delay" => self.upload_delay = parse_duration(v)?,
            "writeback_size" => {
                let n = parse_size(v)?;
                if n < 1 << 20 {
                    return Err(format!("write-back size {v} is too small (at least 1M)"));
                }
                self.writeback_size = n;
            }
            "max_memory" => {
                let n = parse_size(v)?;
                if n < 32 << 20 {
                    return Err(format!("max memory {v} is too small (at least 32M)"));
                }
                self.max_memory = n;
            }
            "max_prefetch" => {
                let n = parse_size(v)?;
                if n < 1 << 20 {
                    return Err(format!("max prefetch {v} is too small (at least 1M)"));
                }
                self.max_prefetch = n;
            }
            "data_cache" => self.data_cache = Some(PathBuf::from(non_empty(v, "path")?)),
            "data_cache_size" => {
                let n = parse_size(v)?;
                if n < 4 << 20 {
                    return Err(format!("data cache size {v} is too small (at least 4M)"));
                }
                self.data_cache_size = n;
            }
            "fuse_threads" => self.fuse_threads = parse_count(v, 1, 64)?,
            "metrics_addr" => {
                self.metrics_addr = Some(
                    v.trim()
                        .parse()
                        .map_err(|_| format!("{v:?} is not an address like 127.0.0.1:9100"))?,
                )
            }
            "log_file" => self.log_file = Some(PathBuf::from(non_empty(v, "path")?)),
            "log_level" => self.log_level = parse_log_level(v)?,
            "syslog" => self.syslog = parse_bool(v)?,
            "ca_bundle" => self.ca_bundle = Some(PathBuf::from(non_empty(v, "path")?)),
            "no_verify_ssl" => self.no_verify_ssl = parse_bool(v)?,
            "passthrough" => self.passthrough = parse_bool(v)?,
            "no_passthrough" => self.no_passthrough = parse_bool(v)?,
            "unsigned_payload" => self.unsigned_payload = Some(parse_bool(v)?),
            "retry_timeout" => {
                let t = parse_duration(v)?;
                // Below a second no request can answer in time: every call would fail.
                if !t.is_zero() && t < Duration::from_secs(1) {
                    return Err(format!(
                        "{v}: at least 1 second (0 turns retries and the bound off)"
                    ));
                }
                self.retry_timeout = t;
            }
            "list_metadata" => self.list_metadata = v.parse()?,
            "max_connections" => self.max_connections = parse_count(v, 1, 4096)?,
            "content_type" => {
                self.guess_content_type = match v.trim().to_ascii_lowercase().as_str() {
                    "guess" => true,
                    "none" => false,
                    _ => return Err(format!("{v:?} is not one of guess, none")),
                }
            }
            "bucket" => self.bucket = Some(non_empty(v, "bucket name")?),
            "prefix" => self.prefix = Some(v.trim().to_string()),
            "access_key_id" => self.access_key_id = Some(non_empty(v, "access key id")?),
            "secret_access_key" => {
                self.secret_access_key = Some(non_empty(v, "secret access key")?)
            }
            "session_token" => self.session_token = Some(non_empty(v, "session token")?),
            _ => unreachable!("key table and setter disagree on {name}"),
        }
        Ok(())
    }

    /// Applies a comma-separated `-o` list (`ro,allow_other,part_size=16M`). `config=FILE` is
    /// not a setting: it is returned so the caller can load that file first.
    pub fn apply_mount_options(&mut self, opts: &[String]) -> Result<(), String> {
        for (key, value) in split_mount_options(opts) {
            if ignored_mount_option(&key.trim().to_ascii_lowercase()) {
                continue;
            }
            match canonical(&key).as_str() {
                "config" => {}
                "ro" => self.read_only = value.as_deref().map_or(Ok(true), parse_bool)?,
                "noexec" => self.no_exec = true,
                "exec" => self.no_exec = false,
                "url" => self.apply("endpoint_url", value.as_deref(), Origin::Opt)?,
                "use_path_request_style" => {
                    self.apply("force_path_style", value.as_deref(), Origin::Opt)?
                }
                _ => self.apply(&key, value.as_deref(), Origin::Opt)?,
            }
        }
        Ok(())
    }

    /// Loads a config file (TOML or ossfs 2.0 format) into these settings.
    pub fn apply_file(&mut self, path: &Path) -> Result<(), String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("config {}: {e}", path.display()))?;
        let ParsedConfig { pairs, notices } = parse_config_text(&text, path)?;
        if pairs
            .iter()
            .any(|(k, _)| CREDENTIAL_KEYS.contains(&k.as_str()))
        {
            let mode = std::fs::metadata(path)
                .map_err(|e| format!("config {}: {e}", path.display()))?
                .permissions()
                .mode();
            // Writable by others, it could send the keys' signatures to another endpoint.
            if mode & 0o066 != 0 {
                return Err(format!(
                    "config {} holds credentials but is readable or writable by group or others \
                     (mode {:04o}): run chmod 600 {}",
                    path.display(),
                    mode & 0o7777,
                    path.display()
                ));
            }
        }
        for (k, v) in pairs {
            self.apply(&k, v.as_deref(), Origin::File(path))?;
        }
        self.notices.extend(notices);
        Ok(())
    }

    /// Credentials come as a pair: half of one is refused (before, a key id without its
    /// secret was ignored without a word, and the mount ran as whoever the AWS chain found).
    pub fn check_credentials(&self) -> Result<(), String> {
        match (&self.access_key_id, &self.secret_access_key) {
            (Some(_), None) => Err("access_key_id is given without secret_access_key: give \
                 both, or neither to use the AWS credential chain"
                .into()),
            (None, Some(_)) => Err("secret_access_key is given without access_key_id: give \
                 both, or neither to use the AWS credential chain"
                .into()),
            (None, None) if self.session_token.is_some() => Err("session_token is given \
                 without access_key_id and secret_access_key: give all three"
                .into()),
            _ => Ok(()),
        }
    }

    /// The fs-core settings for a mount of `prefix` (already normalized).
    pub fn fs_config(&self, prefix: String) -> FsConfig {
        let mut c = FsConfig {
            prefix,
            file_mode: self.file_mode,
            dir_mode: self.dir_mode,
            umask: self.umask,
            mp_umask: self.mp_umask,
            read_only: self.read_only,
            stat_ttl: self.stat_ttl,
            negative_ttl: self.negative_ttl,
            stat_cache_size: self.stat_cache_size,
            part_size: self.part_size,
            upload_concurrency: self.upload_concurrency,
            max_memory: self.max_memory,
            max_prefetch: self.max_prefetch,
            cache_dir: self.cache_dir.clone(),
            cache_min_free: self.cache_min_free,
            max_dir_rename_objects: self.max_dir_rename,
            // The scope (which store) is the caller's to fill in.
            data_cache: self.data_cache.clone().map(|dir| DataCacheConfig {
                dir,
                max_bytes: self.data_cache_size,
                scope: String::new(),
            }),
            // The directory (under the state directory, per bucket) and what it is for are
            // the caller's too.
            writeback: self.background_upload.then(|| WriteBackConfig {
                dir: PathBuf::new(),
                store: String::new(),
                max_bytes: self.writeback_size,
                concurrency: BACKGROUND_UPLOADS,
                fsync_waits_upload: self.fsync_waits_upload,
                delay: self.upload_delay,
                // A close waiting for room fails (ENOSPC) after a minute without an upload.
                space_wait: std::time::Duration::from_secs(60),
            }),
            ..FsConfig::default()
        };
        if let Some(u) = self.uid {
            c.uid = u;
            c.force_uid = Some(u);
        }
        if let Some(g) = self.gid {
            c.gid = g;
            c.force_gid = Some(g);
        }
        c
    }
}

/// Splits `-o` arguments into `(key, value)` pairs.
pub fn split_mount_options(opts: &[String]) -> Vec<(String, Option<String>)> {
    opts.iter()
        .flat_map(|o| o.split(','))
        .map(str::trim)
        .filter(|o| !o.is_empty())
        .map(|o| match o.split_once('=') {
            Some((k, v)) => (k.trim().to_string(), Some(v.to_string())),
            None => (o.to_string(), None),
        })
        .collect()
}

/// The `config=FILE` given among `-o` options, if any.
pub fn config_from_mount_options(opts: &[String]) -> Option<PathBuf> {
    split_mount_options(opts)
        .into_iter()
        .rev()
        .filter(|(k, _)| canonical(k) == "config")
        .find_map(|(_, v)| v.map(PathBuf::from))
}

/// Whether a config file is in the ossfs 2.0 `--key=value` format.
fn is_ossfs_format(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .is_some_and(|l| l.starts_with("--"))
}

/// A config file's settings: canonical `(key, value)` pairs (checked by the caller), and the
/// notices of foreign keys accepted without effect.
#[derive(Debug, Default)]
pub struct ParsedConfig {
    pub pairs: Vec<(String, Option<String>)>,
    pub notices: Vec<String>,
}

/// Parses a config file.
pub fn parse_config_text(text: &str, path: &Path) -> Result<ParsedConfig, String> {
    if is_ossfs_format(text) {
        parse_ossfs(text, path)
    } else {
        Ok(ParsedConfig {
            pairs: parse_toml(text, path)?,
            notices: Vec::new(),
        })
    }
}

fn parse_toml(text: &str, path: &Path) -> Result<Vec<(String, Option<String>)>, String> {
    let table: toml::Table = toml::from_str(text).map_err(|e| {
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        let msg = e.message().replace('\n', " ");
        match line {
            Some(l) => format!("config {}: invalid TOML at line {l}: {msg}", path.display()),
            None => format!("config {}: invalid TOML: {msg}", path.display()),
        }
    })?;
    // Where each value is written: the text of a number says how (`0o077` is 63). None
    // where a key is a table (refused below, by name).
    let spans: Option<std::collections::BTreeMap<String, toml::Spanned<toml::Value>>> =
        toml::from_str(text).ok();
    let mut out: Vec<(String, Option<String>)> = Vec::new();
    for (k, v) in table {
        let ck = canonical(&k);
        // TOML refuses a key given twice, not two spellings of it (`part-size`, `part_size`):
        // which one won would depend on their order.
        if out.iter().any(|(seen, _)| *seen == ck) {
            return Err(format!(
                "config {}: {k}: given twice (under two spellings)",
                path.display()
            ));
        }
        let raw = spans
            .as_ref()
            .and_then(|s| s.get(&k))
            .and_then(|v| text.get(v.span()))
            .unwrap_or_default()
            .replace('_', "");
        let s = match v {
            toml::Value::String(s) => s,
            toml::Value::Boolean(b) => b.to_string(),
            // `umask = 0o077`: the octal digits, with their prefix (a mode; a size refuses it).
            toml::Value::Integer(i) if raw.starts_with("0o") => format!("0o{i:o}"),
            toml::Value::Integer(_) if raw.starts_with("0x") || raw.starts_with("0b") => {
                return Err(format!(
                    "config {}: {k} = {raw}: write numbers in decimal, and modes as octal \
                     (`0o640`, or \"0640\")",
                    path.display()
                ))
            }
            // `file_mode = 644` means 0644: modes are parsed from these digits as octal.
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            _ => {
                return Err(format!(
                    "config {}: {k}: expected a string, number or boolean",
                    path.display()
                ))
            }
        };
        out.push((ck, Some(s)));
    }
    Ok(out)
}

/// ossfs 2.0 keys are translated by [`crate::dropin::ossfs2_key`]; bucketfs's own keys work too.
fn parse_ossfs(text: &str, path: &Path) -> Result<ParsedConfig, String> {
    let mut out = ParsedConfig::default();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some(body) = line.strip_prefix("--") else {
            return Err(format!(
                "config {}: line {}: expected --key=value",
                path.display(),
                n + 1
            ));
        };
        let (key, value) = match body.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v.trim().to_string())),
            None => (body.trim(), None),
        };
        if key.contains(char::is_whitespace) {
            // What follows the space may be a secret: not repeated.
            return Err(format!(
                "config {}: line {}: expected --key=value (a space is not `=`)",
                path.display(),
                n + 1
            ));
        }
        let ck = canonical(key);
        match crate::dropin::ossfs2_key(&mut out.notices, &ck, value.clone()) {
            Some(pairs) => out
                .pairs
                .extend(pairs.map_err(|e| format!("config {}: {e}", path.display()))?),
            // bucketfs's own keys are accepted too; unknown ones fail in `apply`.
            None if setting(&ck).is_some() => out.pairs.push((ck, value)),
            None => return Err(format!("config {}: unknown key \"{key}\"", path.display())),
        }
    }
    Ok(out)
}

/// What to mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `s3://bucket/prefix`; an empty bucket means "from the config file".
    S3 { bucket: String, prefix: String },
    /// A local directory used as a bucket.
    Local(PathBuf),
}

pub fn parse_source(s: &str) -> Result<Source, String> {
    if let Some(rest) = s.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.contains(char::is_whitespace) {
            return Err(format!("invalid bucket name \"{bucket}\""));
        }
        return Ok(Source::S3 {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        });
    }
    if s.contains("://") {
        return Err(format!(
            "unsupported source \"{s}\": use s3://BUCKET[/PREFIX] or a local directory"
        ));
    }
    if s.is_empty() {
        return Err("empty source".into());
    }
    Ok(Source::Local(PathBuf::from(s)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(text: &str, mode: u32) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        f
    }

    #[test]
    fn min_free_is_a_size_or_a_percentage() {
        assert_eq!(parse_min_free("10%"), Ok(MinFree::Percent(10)));
        assert_eq!(parse_min_free(" 0% "), Ok(MinFree::Percent(0)));
        assert_eq!(parse_min_free("2G"), Ok(MinFree::Bytes(2 << 30)));
        assert!(parse_min_free("101%").is_err());
        assert!(parse_min_free("x%").is_err());
        let mut s = Settings::default();
        assert_eq!(s.cache_min_free, MinFree::Bytes(1 << 30));
        s.apply_mount_options(&["cache-min-free=512M".to_string()])
            .unwrap();
        assert_eq!(s.cache_min_free, MinFree::Bytes(512 << 20));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("8388608"), Ok(8 << 20));
        assert_eq!(parse_size("8M"), Ok(8 << 20));
        assert_eq!(parse_size("16MiB"), Ok(16 << 20));
        assert_eq!(parse_size("16mb"), Ok(16 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert!(parse_size("").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("8X").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999T").is_err());
    }

    #[test]
    fn modes_durations_bools() {
        assert_eq!(parse_mode("0644"), Ok(0o644));
        assert_eq!(parse_mode("755"), Ok(0o755));
        assert_eq!(parse_mode("0o1777"), Ok(0o1777));
        assert!(parse_mode("0899").is_err());
        assert!(parse_mode("17777").is_err());
        assert!(parse_mode("").is_err());
        assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("soon").is_err());
        let mut s = Settings::default();
        assert!(s.apply("retry_timeout", Some("1ms"), Origin::Flag).is_err());
        s.apply("retry_timeout", Some("0"), Origin::Flag).unwrap();
        s.apply("retry_timeout", Some("1.5"), Origin::Flag).unwrap();
        assert_eq!(s.retry_timeout, Duration::from_millis(1500));
        assert_eq!(parse_bool("Yes"), Ok(true));
        assert_eq!(parse_bool("off"), Ok(false));
        assert!(parse_bool("maybe").is_err());
        assert_eq!(parse_log_level("WARNING"), Ok(LogLevel::Warn));
        assert!(parse_log_level("loud").is_err());
    }

    #[test]
    fn toml_file() {
        let f = file(
            "# comment\nendpoint-url = \"http://127.0.0.1:9000\"\nforce_path_style = true\n\
             part_size = \"16MiB\"\nstat_ttl = 1.5\nfile_mode = 640\ndir_mode = \"0750\"\n\
             uid = 1000\nupload-concurrency = 8\nbucket = \"b\"\nprefix = \"p/q\"\n",
            0o644,
        );
        let mut s = Settings::default();
        s.apply_file(f.path()).unwrap();
        assert_eq!(s.endpoint_url.as_deref(), Some("http://127.0.0.1:9000"));
        assert!(s.force_path_style);
        assert_eq!(s.part_size, 16 << 20);
        assert_eq!(s.stat_ttl, Duration::from_millis(1500));
        assert_eq!((s.file_mode, s.dir_mode), (0o640, 0o750));
        assert_eq!(s.uid, Some(1000));
        assert_eq!(s.upload_concurrency, 8);
        assert_eq!(s.bucket.as_deref(), Some("b"));
        assert_eq!(s.prefix.as_deref(), Some("p/q"));
        let c = s.fs_config("p/q/".into());
        assert_eq!((c.uid, c.force_uid, c.force_gid), (1000, Some(1000), None));
        assert_eq!(c.part_size, 16 << 20);
    }

    /// A mode written as a TOML octal number is that mode: `0o077` is 63 to TOML, and was
    /// read as the digits "63", octal (umask 063: new files readable by every user).
    #[test]
    fn toml_modes_in_octal_are_those_modes() {
        let f = file("umask = 0o077\nfile_mode = 0o6_40\ndir_mode = 750\n", 0o600);
        let mut s = Settings::default();
        s.apply_file(f.path()).unwrap();
        assert_eq!((s.umask, s.file_mode, s.dir_mode), (0o077, 0o640, 0o750));
        let f = file("umask = 0x12\n", 0o600);
        let e = Settings::default().apply_file(f.path()).unwrap_err();
        assert!(e.contains("umask = 0x12: write numbers in decimal"), "{e}");
        // A key that is a table is named, as before.
        let f = file("umask.x = 1\n", 0o600);
        let e = Settings::default().apply_file(f.path()).unwrap_err();
        assert!(
            e.contains("umask: expected a string, number or boolean"),
            "{e}"
        );
    }

    #[test]
    fn half_a_credential_is_refused() {
        for (text, missing) in [
            ("access_key_id = \"AK\"\n", "without secret_access_key"),
            ("secret_access_key = \"SK\"\n", "without access_key_id"),
            ("session_token = \"T\"\n", "give all three"),
        ] {
            let f = file(text, 0o600);
            let mut s = Settings::default();
            s.apply_file(f.path()).unwrap();
            let e = s.check_credentials().unwrap_err();
            assert!(e.contains(missing), "{e}");
        }
        let f = file(
            "access_key_id = \"AK\"\nsecret_access_key = \"SK\"\n",
            0o600,
        );
        let mut s = Settings::default();
        s.apply_file(f.path()).unwrap();
        s.check_credentials().unwrap();
        Settings::default().check_credentials().unwrap();
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_file() {
        let f = file("foo = 1\n", 0o600);
        let e = Settings::default().apply_file(f.path()).unwrap_err();
        assert_eq!(
            e,
            format!("config {}: unknown key \"foo\"", f.path().display())
        );
        let f = file("part_size = \"1M\"\n", 0o600);
        let e = Settings::default().apply_file(f.path()).unwrap_err();
        assert!(
            e.starts_with(&format!("config {}: part_size: ", f.path().display())),
            "{e}"
        );
        let f = file("region = [1, 2]\n", 0o600);
        assert!(Settings::default().apply_file(f.path()).is_err());
        let f = file("region = \n", 0o600);
        let e = Settings::default().apply_file(f.path()).unwrap_err();
        assert!(e.contains("invalid TOML at line 1"), "{e}");
        assert!(!e.contains('\n'));
        let f = file("--oss_bucket=b\n--bogus=1\n", 0o600);
        let e = Settings::default().apply_file(f.path()).unwrap_err();
        assert_eq!(
            e,
            format!("config {}: unknown key \"bogus\"", f.path().display())
        );
    }

    #[test]
    fn ossfs_file() {
        let f = file(
            "# ossfs 2.0\n\n--oss_endpoint=oss-cn-hangzhou.aliyuncs.com\n--oss_bucket=bkt\n\
             --oss_bucket_prefix=data/\n--oss_access_key_id=AK\n--oss_access_key_secret=never-shown\n\
             --ro\n--allow_other=false\n--log_dir=/var/log/ossfs\n--log_level=warning\n\
             --upload_buffer_size=33554432\n--readdirplus=true\n--upload_concurrency=4\n",
            0o600,
        );
        let mut s = Settings::default();
        s.apply_file(f.path()).unwrap();
        assert_eq!(
            s.endpoint_url.as_deref(),
            Some("https://oss-cn-hangzhou.aliyuncs.com")
        );
        assert_eq!(s.bucket.as_deref(), Some("bkt"));
        assert_eq!(s.prefix.as_deref(), Some("data/"));
        assert_eq!(s.access_key_id.as_deref(), Some("AK"));
        assert_eq!(s.secret_access_key.as_deref(), Some("never-shown"));
        assert!(s.read_only);
        assert!(!s.allow_other);
        assert_eq!(
            s.log_file.as_deref(),
            Some(Path::new("/var/log/ossfs/bucketfs.log"))
        );
        assert_eq!(s.log_level, LogLevel::Warn);
        assert_eq!(s.part_size, 32 << 20);
        assert_eq!(s.upload_concurrency, 4);
        assert_eq!(s.notices.len(), 1);
        assert!(s.notices[0].starts_with("notice: --readdirplus: "));
        assert!(!format!("{s:?}").contains("never-shown"));
    }

    /// An ossfs line written with a space instead of `=` named its whole text as the
    /// unknown key, so the error (on stderr, and in the journal of a mount unit) showed the
    /// secret.
    #[test]
    fn a_line_without_its_equals_sign_never_shows_its_value() {
        let f = file(
            "--oss_bucket=b\n--oss_access_key_secret never-shown\n",
            0o600,
        );
        let e = Settings::default().apply_file(f.path()).unwrap_err();
        assert!(!e.contains("never-shown"), "{e}");
        assert!(e.contains("line 2") && e.contains("--key=value"), "{e}");
    }

    #[test]
    fn a_key_under_two_spellings_is_an_error() {
        let f = file("part-size = \"8M\"\npart_size = \"16M\"\n", 0o644);
        let e = Settings::default().apply_file(f.path()).unwrap_err();
        assert!(e.contains("given twice"), "{e}");
    }

    #[test]
    fn credentials_need_a_private_file() {
        let f = file(
            "access_key_id = \"AK\"\nsecret_access_key = \"never-shown\"\n",
            0o644,
        );
        let e = Settings::default().apply_file(f.path()).unwrap_err();
        assert!(
            e.contains("readable or writable by group or others (mode 0644)"),
            "{e}"
        );
        assert!(!e.contains("never-shown"));
        // Writable by the group: it could point the keys at another endpoint.
        let f = file(
            "access_key_id = \"AK\"\nsecret_access_key = \"never-shown\"\n",
            0o620,
        );
        let e = Settings::default().apply_file(f.path()).unwrap_err();
        assert!(e.contains("(mode 0620)"), "{e}");
        let f = file(
            "access_key_id = \"AK\"\nsecret_access_key = \"never-shown\"\n",
            0o600,
        );
        Settings::default().apply_file(f.path()).unwrap();
        // Without credentials any mode is fine.
        let f = file("region = \"x\"\n", 0o644);
        Settings::default().apply_file(f.path()).unwrap();
    }

    #[test]
    fn mount_options() {
        let mut s = Settings::default();
        let opts = vec![
            "rw,_netdev,nofail,noauto,user,defaults,x-systemd.automount".to_string(),
            "allow_other,ro,part-size=16M,uid=1000,url=http://h:9000,use_path_request_style"
                .to_string(),
            "config=/etc/bucketfs.toml".to_string(),
        ];
        s.apply_mount_options(&opts).unwrap();
        assert!(s.allow_other && s.read_only && s.force_path_style);
        assert_eq!(s.part_size, 16 << 20);
        assert_eq!(s.uid, Some(1000));
        assert_eq!(s.endpoint_url.as_deref(), Some("http://h:9000"));
        assert_eq!(
            config_from_mount_options(&opts),
            Some(PathBuf::from("/etc/bucketfs.toml"))
        );
        let e = s.apply_mount_options(&["bogus=1".to_string()]).unwrap_err();
        assert_eq!(e, "-o: unknown option \"bogus\"");
        let e = s
            .apply_mount_options(&["secret_access_key=xyz".to_string()])
            .unwrap_err();
        assert!(e.contains("not accepted"), "{e}");
        assert!(!e.contains("xyz"));
        assert!(s.apply_mount_options(&["region".to_string()]).is_err());
    }

    /// `noexec` reaches the mount (it was accepted and ignored), and `ro` takes a value.
    #[test]
    fn noexec_and_ro_with_a_value() {
        let mut s = Settings::default();
        s.apply_mount_options(&["noexec,ro=false".to_string()])
            .unwrap();
        assert!(s.no_exec && !s.read_only);
        s.apply_mount_options(&["exec,ro=true".to_string()])
            .unwrap();
        assert!(!s.no_exec && s.read_only);
        assert!(s.apply_mount_options(&["ro=maybe".to_string()]).is_err());
    }

    #[test]
    fn list_metadata_from_every_source() {
        let mut s = Settings::default();
        assert_eq!(s.list_metadata, ListMetadata::Auto);
        let f = file("list_metadata = \"off\"\n", 0o644);
        s.apply_file(f.path()).unwrap();
        assert_eq!(s.list_metadata, ListMetadata::Off);
        s.apply_mount_options(&["list-metadata=on".to_string()])
            .unwrap();
        assert_eq!(s.list_metadata, ListMetadata::On);
        s.apply("list_metadata", Some("auto"), Origin::Flag)
            .unwrap();
        assert_eq!(s.list_metadata, ListMetadata::Auto);
        let e = s
            .apply("list_metadata", Some("sometimes"), Origin::Flag)
            .unwrap_err();
        assert_eq!(
            e,
            "--list-metadata: \"sometimes\" is not one of auto, on, off"
        );
    }

    /// Every setting of the table has a setter (`set` panics on a key it does not know) and
    /// shows in the settings' Debug output (logged at startup).
    #[test]
    fn every_setting_of_the_table_can_be_set_and_shown() {
        let shown = format!("{:?}", Settings::default());
        for o in crate::options::OPTIONS.iter().filter(|o| o.is_setting()) {
            let _ = Settings::default().set(o.key, "1");
            assert!(
                shown.contains(&format!(" {}: ", o.key)),
                "{} not in {shown}",
                o.key
            );
        }
    }

    #[test]
    fn flags_name_themselves() {
        let mut s = Settings::default();
        let e = s
            .apply("part_size", Some("lots"), Origin::Flag)
            .unwrap_err();
        assert!(e.starts_with("--part-size: invalid size"), "{e}");
    }

    #[test]
    fn sources() {
        assert_eq!(
            parse_source("s3://b/p/q"),
            Ok(Source::S3 {
                bucket: "b".into(),
                prefix: "p/q".into()
            })
        );
        assert_eq!(
            parse_source("s3://b"),
            Ok(Source::S3 {
                bucket: "b".into(),
                prefix: "".into()
            })
        );
        assert_eq!(
            parse_source("/srv/data"),
            Ok(Source::Local("/srv/data".into()))
        );
        assert!(parse_source("gs://x").is_err());
    }
}
