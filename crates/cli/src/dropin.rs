//! Drop-in for the tools users come from: the ossfs 2.0 config file format, and the command
//! line of s3fs-fuse and ossfs 1.x (`bucketfs s3fs ARGS`, or the binary invoked as `s3fs` or
//! `ossfs`), with their `passwd_file`.
//!
//! Each foreign option is in one table here: it becomes a bucketfs setting, or is accepted
//! with a one-line notice saying what bucketfs does instead, or is refused because accepting
//! it would silently store data differently than asked (encryption, storage class, ACL).
//! Anything in neither table nor bucketfs's own is an error. docs/migration.md lists the same
//! tables (a test keeps them in step).

use crate::config::{canonical, split_mount_options, Origin, Settings};
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// What a foreign option becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meaning {
    /// The bucketfs setting of this key, with the value as given.
    Setting(&'static str),
    /// Translated by code (a unit, a derived value, several settings).
    Translated(&'static str),
    /// Accepted and ignored, with this notice (what bucketfs does instead).
    Notice(&'static str),
    /// Refused with this message.
    Refused(&'static str),
}

use Meaning::*;

const NO_LOG_ROTATION: &str =
    "bucketfs does not rotate its log: use logrotate with copytruncate, or syslog";
const PREFETCH: &str = "bucketfs sizes read-ahead per reader by --max-prefetch, within \
                        --max-memory and --max-connections";
const SDK_CREDENTIALS: &str = "bucketfs takes credentials from the config file keys or the AWS \
                               SDK chain (AWS_* variables, ~/.aws profiles with \
                               credential_process, EC2/ECS roles): this option is ignored";

/// The options of ossfs 2.0's config file, from Alibaba Cloud's "ossfs 2.0 mount options" page
/// (help/en/oss/developer-reference/description-of-mount-options): basic, common and advanced
/// options, in the page's order.
pub const OSSFS2_OPTIONS: &[(&str, Meaning)] = &[
    ("oss_endpoint", Setting("endpoint_url")),
    ("oss_bucket", Setting("bucket")),
    ("oss_access_key_id", Setting("access_key_id")),
    ("oss_access_key_secret", Setting("secret_access_key")),
    ("ram_role", Notice(SDK_CREDENTIALS)),
    ("credential_process", Notice(SDK_CREDENTIALS)),
    ("oss_bucket_prefix", Setting("prefix")),
    ("oss_region", Setting("region")),
    ("attr_timeout", Setting("stat_ttl")),
    ("negative_timeout", Setting("negative_ttl")),
    (
        "readdirplus",
        Notice("bucketfs always takes attributes from listings where the server gives them (--list-metadata)"),
    ),
    ("log_level", Setting("log_level")),
    ("log_dir", Translated("log_file = DIR/bucketfs.log")),
    ("log_file_max_size", Notice(NO_LOG_ROTATION)),
    ("log_file_max_count", Notice(NO_LOG_ROTATION)),
    ("f", Setting("foreground")),
    ("d", Translated("foreground, log_level = debug")),
    ("ro", Setting("read_only")),
    ("allow_other", Setting("allow_other")),
    ("uid", Setting("uid")),
    ("gid", Setting("gid")),
    ("dir_mode", Setting("dir_mode")),
    ("file_mode", Setting("file_mode")),
    ("upload_buffer_size", Setting("part_size")),
    ("upload_concurrency", Setting("upload_concurrency")),
    ("prefetch_concurrency", Notice(PREFETCH)),
    ("prefetch_concurrency_per_file", Notice(PREFETCH)),
    ("prefetch_chunks", Notice(PREFETCH)),
    ("total_mem_limit", Setting("max_memory")),
    (
        "close_to_open",
        Notice("bucketfs always re-checks at open the attributes older than --stat-ttl"),
    ),
    (
        "sync_upload",
        Notice("bucketfs uploads parts while a file is written and stores it at close and fsync"),
    ),
];

pub const OSSFS2_USAGE: &str =
    "usage: ossfs2 mount MOUNTPOINT [-c CONFIG] [-f] [--KEY=VALUE ...]\n\
bucketfs runs ossfs 2.0 command lines (also as `bucketfs ossfs2 ...`): the options are the \
config file's keys; see docs/migration.md.";

/// Parses `ossfs2 mount MOUNTPOINT [-c FILE] [--key=value ...]` (`args` without the program
/// name): the config file, then the command line's keys, which are read as the file's are
/// (credentials excepted: they would show in ps).
pub fn ossfs2_call(args: &[OsString]) -> Result<S3fsCall, String> {
    let mut args = args.iter().map(|a| a.to_string_lossy().into_owned());
    match args.next().as_deref() {
        Some("mount") => {}
        Some("-h" | "--help") | None => return Ok(S3fsCall::Help),
        Some("-v" | "--version") => return Ok(S3fsCall::Version),
        Some(other) => return Err(format!("unknown command {other}\n{OSSFS2_USAGE}")),
    }
    let (mut config, mut lines, mut positional) = (None, String::new(), Vec::new());
    while let Some(a) = args.next() {
        if a == "-c" || a == "--conf" || a == "--config" {
            config = Some(args.next().ok_or(format!("{a} needs a file"))?);
        } else if let Some(f) = a.strip_prefix("--conf=").or(a.strip_prefix("--config=")) {
            config = Some(f.to_string());
        } else if a == "-f" {
            lines.push_str("--f\n");
        } else if a == "-h" || a == "--help" {
            return Ok(S3fsCall::Help);
        } else if a.starts_with("--") {
            lines.push_str(&a);
            lines.push('\n');
        } else if a.starts_with('-') && a.len() > 1 {
            return Err(format!("unknown option {a}\n{OSSFS2_USAGE}"));
        } else {
            positional.push(a);
        }
    }
    let [mountpoint] = positional.as_slice() else {
        return Err(OSSFS2_USAGE.into());
    };
    let mut s = Settings::default();
    if let Some(c) = &config {
        s.apply_file(Path::new(c))?;
    }
    if !lines.is_empty() {
        let here = Path::new("(command line)");
        let parsed = crate::config::parse_config_text(&lines, here)?;
        for (k, v) in parsed.pairs {
            if ["access_key_id", "secret_access_key", "session_token"].contains(&k.as_str()) {
                return Err(format!(
                    "{k}: credentials are not accepted on the command line (they show in ps): \
                     put them in the config file (chmod 600)"
                ));
            }
            s.apply(&k, v.as_deref(), Origin::File(here))?;
        }
        s.notices.extend(parsed.notices);
    }
    Ok(S3fsCall::Mount {
        source: "s3://".into(),
        mountpoint: PathBuf::from(mountpoint),
        settings: Box::new(s),
    })
}

const NO_DISK_CACHE: &str = "bucketfs keeps file data on disk only with --data-cache DIR \
                             (checked by ETag on every read)";
const MIN_FREE: &str = "bucketfs leaves --cache-min-free (SIZE or PCT%, default 1G) free on \
                        the disk of --cache-dir";
const STREAMS: &str = "bucketfs always uploads parts while the file is written, copying \
                       unchanged parts server-side";
const TIMEOUTS: &str = "bucketfs bounds each file operation by --retry-timeout instead";
const ALWAYS: &str = "bucketfs always does this";
const NOT_HERE: &str = "has no meaning for bucketfs";

/// The `-o` options of s3fs-fuse (its man page, s3fs.1) and of ossfs 1.x (Alibaba Cloud's
/// "ossfs mount options" page, which adds `direct_read` and `readdir_optimize`), and the FUSE
/// options s3fs passes on. Generic mount(8) options are accepted as for `bucketfs mount`.
pub const S3FS_OPTIONS: &[(&str, Meaning)] = &[
    ("bucket", Translated("the bucket (and :/PREFIX) of SOURCE")),
    (
        "default_acl",
        Translated("private only: other ACLs are refused"),
    ),
    ("retries", Notice(TIMEOUTS)),
    ("tmpdir", Setting("cache_dir")),
    (
        "use_cache",
        Translated("--data-cache DIR (an empty value: off)"),
    ),
    ("check_cache_dir_exist", Notice(NO_DISK_CACHE)),
    ("del_cache", Notice(NO_DISK_CACHE)),
    (
        "storage_class",
        Translated("standard only: other classes are refused"),
    ),
    (
        "use_rrs",
        Refused("reduced redundancy storage is not supported"),
    ),
    (
        "use_sse",
        Refused(
            "server-side encryption options are not supported: use the bucket's default encryption",
        ),
    ),
    ("load_sse_c", Refused("SSE-C is not supported")),
    (
        "passwd_file",
        Translated("credentials (ACCESS:SECRET or BUCKET:ACCESS:SECRET)"),
    ),
    (
        "ahbe_conf",
        Refused("extra HTTP headers per file are not supported"),
    ),
    ("profile", Setting("profile")),
    (
        "public_bucket",
        Refused("anonymous access is not supported"),
    ),
    ("connect_timeout", Notice(TIMEOUTS)),
    ("readwrite_timeout", Notice(TIMEOUTS)),
    (
        "list_object_max_keys",
        Notice("bucketfs lists 1,000 keys per request"),
    ),
    ("max_stat_cache_size", Setting("stat_cache_size")),
    ("stat_cache_expire", Setting("stat_ttl")),
    ("stat_cache_interval_expire", Setting("stat_ttl")),
    ("disable_noobj_cache", Translated("negative_ttl = 0")),
    (
        "enable_noobj_cache",
        Notice("bucketfs remembers missing names for --negative-ttl (5 s)"),
    ),
    ("no_check_certificate", Setting("no_verify_ssl")),
    ("ssl_verify_hostname", Translated("0: no_verify_ssl")),
    ("nodnscache", Notice(NOT_HERE)),
    ("nosscache", Notice(NOT_HERE)),
    (
        "multireq_max",
        Notice("bucketfs bounds all requests by --max-connections"),
    ),
    ("parallel_count", Setting("upload_concurrency")),
    ("multipart_size", Translated("part_size = N MiB")),
    (
        "multipart_copy_size",
        Notice("bucketfs copies in parts of --part-size"),
    ),
    ("max_dirty_data", Notice(STREAMS)),
    (
        "bucket_size",
        Notice("bucketfs reports a large constant capacity"),
    ),
    ("ensure_diskfree", Notice(MIN_FREE)),
    ("free_space_ratio", Notice(MIN_FREE)),
    (
        "multipart_threshold",
        Notice("bucketfs uses multipart above one --part-size"),
    ),
    (
        "singlepart_copy_limit",
        Notice("bucketfs copies in parts above 5 GiB"),
    ),
    ("host", Setting("endpoint_url")),
    (
        "servicepath",
        Refused("a service path is not supported: give the whole URL with url="),
    ),
    ("url", Setting("endpoint_url")),
    ("endpoint", Setting("region")),
    ("sigv2", Refused("signature version 2 is not supported")),
    ("sigv4", Notice(ALWAYS)),
    ("mp_umask", Setting("mp_umask")),
    (
        "umask",
        Translated("umask = umask, file_mode = 0666, dir_mode = 0777"),
    ),
    ("nomultipart", Notice(STREAMS)),
    ("streamupload", Notice(STREAMS)),
    ("max_thread_count", Notice(STREAMS)),
    (
        "enable_content_md5",
        Notice("bucketfs signs upload bodies (SHA-256) over HTTP; TLS protects them over HTTPS"),
    ),
    ("enable_unsigned_payload", Setting("unsigned_payload")),
    ("ecs", Notice(SDK_CREDENTIALS)),
    ("iam_role", Notice(SDK_CREDENTIALS)),
    ("imdsv1only", Notice(SDK_CREDENTIALS)),
    (
        "ibm_iam_auth",
        Refused("IBM IAM authentication is not supported"),
    ),
    (
        "ibm_iam_endpoint",
        Refused("IBM IAM authentication is not supported"),
    ),
    ("credlib", Refused("credential libraries are not supported")),
    (
        "credlib_opts",
        Refused("credential libraries are not supported"),
    ),
    (
        "use_xattr",
        Notice("bucketfs does not store extended attributes (EOPNOTSUPP)"),
    ),
    ("noxmlns", Notice(NOT_HERE)),
    ("nomixupload", Notice(STREAMS)),
    (
        "nocopyapi",
        Refused("bucketfs needs CopyObject (rename, chmod, partial rewrites)"),
    ),
    (
        "norenameapi",
        Refused("bucketfs needs CopyObject (rename, chmod, partial rewrites)"),
    ),
    ("use_path_request_style", Setting("force_path_style")),
    ("listobjectsv2", Notice(ALWAYS)),
    ("noua", Notice(NOT_HERE)),
    ("cipher_suites", Notice(NOT_HERE)),
    ("instance_name", Notice(NOT_HERE)),
    ("complement_stat", Notice(ALWAYS)),
    (
        "compat_dir",
        Notice("bucketfs shows name/ markers and implied directories, not dir_$folder$ objects"),
    ),
    ("use_wtf8", Refused("re-encoding names is not supported")),
    ("use_session_token", Notice(SDK_CREDENTIALS)),
    (
        "requester_pays",
        Refused("requester-pays buckets are not supported"),
    ),
    (
        "mime",
        Notice(
            "bucketfs guesses Content-Type from a built-in table of extensions (--content-type)",
        ),
    ),
    ("proxy", Refused("an HTTP proxy is not supported")),
    ("proxy_cred_file", Refused("an HTTP proxy is not supported")),
    ("ipresolve", Notice(NOT_HERE)),
    ("logfile", Setting("log_file")),
    ("dbglevel", Translated("log_level (crit = error)")),
    ("curldbg", Notice("use --log-level trace")),
    ("no_time_stamp_msg", Notice(NOT_HERE)),
    ("set_check_cache_sigusr1", Notice(NO_DISK_CACHE)),
    (
        "update_parent_dir_stat",
        Notice("bucketfs keeps parent directories' times in memory only"),
    ),
    // ossfs 1.x
    (
        "direct_read",
        Notice("bucketfs reads straight from the store unless --data-cache is given"),
    ),
    (
        "readdir_optimize",
        Notice("bucketfs lists without a HEAD per entry where the server allows (--list-metadata)"),
    ),
    ("region", Setting("region")),
    // FUSE options s3fs passes to libfuse
    ("allow_other", Setting("allow_other")),
    ("allow_root", Setting("allow_root")),
    ("uid", Setting("uid")),
    ("gid", Setting("gid")),
    ("nonempty", Setting("nonempty")),
    ("default_permissions", Notice(ALWAYS)),
    (
        "kernel_cache",
        Notice("bucketfs keeps the page cache while a file's ETag is unchanged"),
    ),
    (
        "auto_cache",
        Notice("bucketfs keeps the page cache while a file's ETag is unchanged"),
    ),
    ("attr_timeout", Setting("stat_ttl")),
    ("entry_timeout", Setting("stat_ttl")),
    ("negative_timeout", Setting("negative_ttl")),
    ("max_read", Notice(NOT_HERE)),
    ("max_write", Notice(NOT_HERE)),
    ("big_writes", Notice(ALWAYS)),
    ("large_read", Notice(NOT_HERE)),
    ("max_background", Notice(NOT_HERE)),
    ("use_ino", Notice(NOT_HERE)),
    ("readdir_ino", Notice(NOT_HERE)),
    ("direct_io", Notice(NOT_HERE)),
    ("fsname", Notice("the file system is named by SOURCE")),
    ("subtype", Notice(NOT_HERE)),
];

fn lookup(table: &[(&str, Meaning)], key: &str) -> Option<Meaning> {
    table.iter().find(|(k, _)| *k == key).map(|(_, m)| *m)
}

fn notice(notices: &mut Vec<String>, origin: &str, key: &str, text: &str) {
    let line = format!("notice: {origin}{key}: {text}");
    if !notices.contains(&line) {
        notices.push(line);
    }
}

/// Config `(key, value)` pairs.
pub type Pairs = Vec<(String, Option<String>)>;

/// An ossfs 2.0 config key (canonical) and its value, as bucketfs `(key, value)` pairs; `None`
/// for a key that is not ossfs's (the caller then tries bucketfs's own keys).
pub fn ossfs2_key(
    notices: &mut Vec<String>,
    key: &str,
    value: Option<String>,
) -> Option<Result<Pairs, String>> {
    let pair = |k: &str, v: Option<String>| Ok(vec![(k.to_string(), v)]);
    Some(match lookup(OSSFS2_OPTIONS, key)? {
        Setting(k) => pair(k, value),
        Notice(text) => {
            notice(notices, "--", key, text);
            Ok(vec![])
        }
        Refused(text) => Err(format!("{key}: {text}")),
        Translated(_) => match key {
            "log_dir" => match value {
                Some(dir) => pair(
                    "log_file",
                    Some(Path::new(&dir).join("bucketfs.log").display().to_string()),
                ),
                None => Err("log_dir: needs a value".into()),
            },
            "d" => Ok(vec![
                ("foreground".into(), value),
                ("log_level".into(), Some("debug".into())),
            ]),
            _ => unreachable!("no translation for ossfs key {key}"),
        },
    })
}

/// Which tool's conventions an s3fs-style command line follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    S3fs,
    Ossfs,
}

impl Flavor {
    fn name(self) -> &'static str {
        match self {
            Flavor::S3fs => "s3fs",
            Flavor::Ossfs => "ossfs",
        }
    }
}

/// A parsed s3fs/ossfs command line.
#[derive(Debug)]
pub enum S3fsCall {
    Mount {
        source: String,
        mountpoint: PathBuf,
        settings: Box<Settings>,
    },
    Help,
    Version,
}

pub const S3FS_USAGE: &str =
    "usage: s3fs BUCKET[:/PREFIX] MOUNTPOINT [-f] [-d] [-s] [-o OPT[=VAL],...]\n       \
                              s3fs MOUNTPOINT -o bucket=BUCKET [...]\n\
bucketfs runs s3fs-fuse and ossfs 1.x command lines (also as `bucketfs s3fs ...`). Options \
without a meaning here are accepted with a notice; see docs/migration.md.";

/// Parses `s3fs|ossfs BUCKET[:/PREFIX] MOUNTPOINT [options]` (`args` without the program name)
/// into the settings of a bucketfs mount. `home` is where `.passwd-s3fs` is looked for.
pub fn s3fs_call(
    args: &[OsString],
    flavor: Flavor,
    home: Option<&Path>,
) -> Result<S3fsCall, String> {
    let mut s = Settings::default();
    let mut positional: Vec<String> = Vec::new();
    let mut opts: Vec<String> = Vec::new();
    let mut it = args.iter().map(|a| a.to_string_lossy().into_owned());
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => return Ok(S3fsCall::Help),
            "--version" => return Ok(S3fsCall::Version),
            "-o" => opts.push(it.next().ok_or("-o needs a value")?),
            "-f" => s.foreground = true,
            "-d" | "--debug" => {
                s.foreground = true;
                s.log_level = crate::config::LogLevel::Debug;
            }
            "-s" => s.fuse_threads = 1,
            "-u" | "--incomplete-mpu-list" => {
                return Err(format!(
                    "{a}: not supported: bucketfs aborts the uploads a crashed mount left at the \
                     next mount of the bucket"
                ))
            }
            _ if a.starts_with("--incomplete-mpu-abort") => {
                return Err(format!(
                    "{a}: not supported: bucketfs aborts the uploads a crashed mount left at the \
                     next mount of the bucket"
                ))
            }
            _ if a.starts_with("-o") => opts.push(a[2..].to_string()),
            _ if a.starts_with('-') && a.len() > 1 => {
                return Err(format!("unknown option {a}\n{S3FS_USAGE}"))
            }
            _ => positional.push(a),
        }
    }
    // `-o config=FILE`: the file's settings first, the other options over them (as for
    // `bucketfs mount -o`).
    if let Some(path) = crate::config::config_from_mount_options(&opts) {
        s.apply_file(&path)?;
    }
    let mut bucket_opt = None;
    let mut passwd_file = None;
    // A mode given (an option, the config file) is kept whatever the order: s3fs's `umask`
    // masks the defaults it implies (0666, 0777), never widens a mode given next to it.
    let keys: Vec<String> = split_mount_options(&opts)
        .iter()
        .map(|(k, _)| canonical(k))
        .collect();
    let defaults = Settings::default();
    let file_mode_given =
        s.file_mode != defaults.file_mode || keys.iter().any(|k| k == "file_mode");
    let dir_mode_given = s.dir_mode != defaults.dir_mode || keys.iter().any(|k| k == "dir_mode");
    for (key, value) in split_mount_options(&opts) {
        let ckey = canonical(&key);
        match lookup(S3FS_OPTIONS, &ckey) {
            None => s.apply_mount_options(&[match &value {
                Some(v) => format!("{key}={v}"),
                None => key.clone(),
            }])?,
            Some(m) => apply_s3fs(
                &mut s,
                flavor,
                &ckey,
                m,
                value,
                &mut bucket_opt,
                &mut passwd_file,
            )?,
        }
    }
    if keys.iter().any(|k| k == "umask") {
        if !file_mode_given {
            s.file_mode = 0o666;
        }
        if !dir_mode_given {
            s.dir_mode = 0o777;
        }
    }
    let (spec, mountpoint) = match positional.as_slice() {
        [b, m] => (b.clone(), PathBuf::from(m)),
        [m] => (
            bucket_opt.clone().ok_or_else(|| {
                format!("no bucket: give BUCKET[:/PREFIX] before the mount point or -o bucket=BUCKET\n{S3FS_USAGE}")
            })?,
            PathBuf::from(m),
        ),
        _ => return Err(S3FS_USAGE.into()),
    };
    let (bucket, prefix) = match spec.split_once(':') {
        Some((b, p)) => (b.to_string(), p.trim_matches('/').to_string()),
        None => (spec.clone(), String::new()),
    };
    if bucket.is_empty() || bucket.contains(['/', ' ']) {
        return Err(format!(
            "invalid bucket \"{spec}\" (use BUCKET or BUCKET:/PREFIX)"
        ));
    }
    // As s3fs: a passwd file given is used; else s3fs's own AWSACCESSKEYID and
    // AWSSECRETACCESSKEY variables; the default passwd files only when no other credentials
    // are named (keys in a config file or those variables, a profile, AWS_ACCESS_KEY_ID),
    // and one this user may not read (a root-only /etc/passwd-s3fs) is passed over.
    if passwd_file.is_none() && s.access_key_id.is_none() {
        let var = |v: &str| std::env::var(v).ok().filter(|x| !x.is_empty());
        if let (Some(ak), Some(sk)) = (var("AWSACCESSKEYID"), var("AWSSECRETACCESSKEY")) {
            s.access_key_id = Some(ak);
            s.secret_access_key = Some(sk);
            s.session_token = s.session_token.take().or_else(|| var("AWSSESSIONTOKEN"));
        }
    }
    let named = s.access_key_id.is_some()
        || s.profile.is_some()
        || std::env::var_os("AWS_ACCESS_KEY_ID").is_some();
    let file = match passwd_file {
        Some(p) => Some((p, true)),
        None if !named => default_passwd_file(flavor, home).map(|p| (p, false)),
        None => None,
    };
    if let Some((p, given)) = file {
        let unreadable = || {
            std::fs::File::open(&p).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied)
        };
        match read_passwd_file(&p, &bucket) {
            Ok((ak, sk)) => {
                s.access_key_id = Some(ak);
                s.secret_access_key = Some(sk);
            }
            Err(_) if !given && unreadable() => {}
            Err(e) => return Err(e),
        }
    }
    let source = if prefix.is_empty() {
        format!("s3://{bucket}")
    } else {
        format!("s3://{bucket}/{prefix}")
    };
    Ok(S3fsCall::Mount {
        source,
        mountpoint,
        settings: Box::new(s),
    })
}

fn apply_s3fs(
    s: &mut Settings,
    flavor: Flavor,
    key: &str,
    meaning: Meaning,
    value: Option<String>,
    bucket: &mut Option<String>,
    passwd_file: &mut Option<PathBuf>,
) -> Result<(), String> {
    let ctx = |m: String| format!("-o {key}: {m}");
    let need = |v: &Option<String>| v.clone().ok_or_else(|| ctx("needs a value".into()));
    match meaning {
        Setting(k) => {
            let mut v = value;
            if matches!(key, "url" | "host") {
                // ossfs 1.x defaults to HTTP for a bare host; s3fs needs a scheme anyway.
                if let Some(u) = &v {
                    if flavor == Flavor::Ossfs && !u.contains("://") {
                        v = Some(format!("http://{u}"));
                    }
                }
            }
            s.apply(k, v.as_deref(), Origin::Opt).map_err(|e| {
                // Name the option the user wrote, not the bucketfs key.
                let inner = e
                    .split_once(": ")
                    .map_or(e.as_str(), |(_, m)| m)
                    .to_string();
                ctx(inner)
            })
        }
        Notice(text) => {
            notice(&mut s.notices, "-o ", key, text);
            Ok(())
        }
        Refused(text) => Err(ctx(format!("not supported by bucketfs: {text}"))),
        Translated(_) => {
            match key {
                "bucket" => *bucket = Some(need(&value)?),
                "use_cache" => {
                    let dir = value.unwrap_or_default();
                    if !dir.trim().is_empty() {
                        s.apply("data_cache", Some(&dir), Origin::Opt)
                            .map_err(|e| {
                                ctx(e.split_once(": ").map_or(e.clone(), |x| x.1.to_string()))
                            })?;
                    }
                }
                "passwd_file" => *passwd_file = Some(PathBuf::from(need(&value)?)),
                "default_acl" => {
                    let v = need(&value)?;
                    if v != "private" {
                        return Err(ctx(format!(
                            "not supported by bucketfs: objects get the bucket's default ACL, not {v}"
                        )));
                    }
                }
                "storage_class" => {
                    let v = need(&value)?;
                    if !v.eq_ignore_ascii_case("standard") {
                        return Err(ctx(format!(
                            "not supported by bucketfs: objects get the bucket's default storage class, not {v}"
                        )));
                    }
                }
                "disable_noobj_cache" => s.negative_ttl = std::time::Duration::ZERO,
                "ssl_verify_hostname" => {
                    if value.as_deref().map(str::trim) == Some("0") {
                        s.no_verify_ssl = true;
                    }
                }
                "multipart_size" => {
                    let mb: u64 = need(&value)?
                        .trim()
                        .parse()
                        .map_err(|_| ctx("expected a number of MB".into()))?;
                    s.apply("part_size", Some(&format!("{mb}M")), Origin::Opt)
                        .map_err(|e| {
                            ctx(e.split_once(": ").map_or(e.clone(), |x| x.1.to_string()))
                        })?;
                }
                "umask" => {
                    // As s3fs: every object's mode is shown masked, the defaults included
                    // (set by the caller); what is stored (a mode filled in for an object
                    // without one) is not.
                    s.umask = crate::config::parse_mode(&need(&value)?).map_err(ctx)?;
                }
                "dbglevel" => {
                    let v = need(&value)?;
                    let level = match v.trim().to_ascii_lowercase().as_str() {
                        "crit" | "critical" | "err" | "error" => "error",
                        "dbg" => "debug",
                        other => other,
                    }
                    .to_string();
                    s.log_level = crate::config::parse_log_level(&level).map_err(ctx)?;
                }
                _ => unreachable!("no translation for s3fs option {key}"),
            }
            Ok(())
        }
    }
}

/// The passwd file s3fs (ossfs) reads when none is given: `$HOME/.passwd-s3fs`, then
/// `/etc/passwd-s3fs` (`.passwd-ossfs`, `/etc/passwd-ossfs` for ossfs), if one exists.
fn default_passwd_file(flavor: Flavor, home: Option<&Path>) -> Option<PathBuf> {
    let name = format!("passwd-{}", flavor.name());
    let mut candidates = Vec::new();
    if let Some(h) = home {
        candidates.push(h.join(format!(".{name}")));
    }
    candidates.push(Path::new("/etc").join(&name));
    candidates.into_iter().find(|p| p.exists())
}

/// The access key and secret for `bucket` from an s3fs passwd file: `ACCESS:SECRET` lines, or
/// `BUCKET:ACCESS:SECRET` lines (a line for the bucket wins over a plain one). As s3fs, refuses
/// a file that others may read, or that the group may read unless it is the system-wide
/// `/etc/passwd-s3fs` (`/etc/passwd-ossfs`).
pub fn read_passwd_file(path: &Path, bucket: &str) -> Result<(String, String), String> {
    let shown = path.display();
    let md = std::fs::metadata(path).map_err(|e| format!("passwd_file {shown}: {e}"))?;
    let mode = md.permissions().mode() & 0o7777;
    let system_wide = [
        Path::new("/etc/passwd-s3fs"),
        Path::new("/etc/passwd-ossfs"),
    ]
    .contains(&path);
    let who = if mode & 0o007 != 0 {
        Some("others")
    } else if mode & 0o070 != 0 && !system_wide {
        Some("its group")
    } else {
        None
    };
    if let Some(who) = who {
        return Err(format!(
            "passwd_file {shown} may be read by {who} (mode {mode:04o}): run chmod 600 {shown}"
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("passwd_file {shown}: {e}"))?;
    let (mut plain, mut for_bucket) = (None, None);
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split(':').map(str::trim).collect();
        match fields.as_slice() {
            [a, k] if !a.is_empty() && !k.is_empty() => {
                plain.get_or_insert((a.to_string(), k.to_string()));
            }
            [b, a, k] if !a.is_empty() && !k.is_empty() => {
                if *b == bucket {
                    for_bucket.get_or_insert((a.to_string(), k.to_string()));
                }
            }
            _ => {
                return Err(format!(
                    "passwd_file {shown}: line {}: expected ACCESS_KEY:SECRET or \
                     BUCKET:ACCESS_KEY:SECRET",
                    n + 1
                ))
            }
        }
    }
    for_bucket
        .or(plain)
        .ok_or_else(|| format!("passwd_file {shown}: no credentials for bucket {bucket}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    fn file(text: &str, mode: u32) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        f
    }

    fn mount(args: &[&str], flavor: Flavor) -> Result<(String, PathBuf, Settings), String> {
        match s3fs_call(&os(args), flavor, None)? {
            S3fsCall::Mount {
                source,
                mountpoint,
                settings,
            } => Ok((source, mountpoint, *settings)),
            other => panic!("{other:?}"),
        }
    }

    /// A file_mode or dir_mode given next to umask is kept whatever the order (before: a
    /// umask after them set them back to 0666 and 0777, widening 0600 to 0644).
    #[test]
    fn s3fs_umask_never_widens_a_mode_given() {
        for opts in [
            "umask=0022,file_mode=0600,dir_mode=0700",
            "file_mode=0600,dir_mode=0700,umask=0022",
        ] {
            let (_, _, s) = mount(&["b", "/mnt/x", "-o", opts], Flavor::S3fs).unwrap();
            assert_eq!(
                (s.file_mode, s.dir_mode, s.umask),
                (0o600, 0o700, 0o022),
                "{opts}"
            );
        }
        let (_, _, s) = mount(
            &["b", "/mnt/x", "-o", "dir_mode=0700,umask=0027"],
            Flavor::S3fs,
        )
        .unwrap();
        assert_eq!((s.file_mode, s.dir_mode, s.umask), (0o666, 0o700, 0o027));
    }

    #[test]
    fn s3fs_command_line() {
        let pw = file("other:X:Y\nAK:SK\nbkt:AK2:SK2\n", 0o600);
        let (source, mp, s) = mount(
            &[
                "bkt:/some/prefix",
                "/mnt/x",
                "-o",
                &format!(
                    "url=http://h:9000,use_path_request_style,passwd_file={},allow_other,\
                     uid=1000,gid=1001,umask=0022,mp_umask=0022,multipart_size=16,\
                     parallel_count=4,use_cache=/tmp/c,del_cache,_netdev",
                    pw.path().display()
                ),
                "-f",
            ],
            Flavor::S3fs,
        )
        .unwrap();
        assert_eq!(source, "s3://bkt/some/prefix");
        assert_eq!(mp, PathBuf::from("/mnt/x"));
        assert_eq!(s.endpoint_url.as_deref(), Some("http://h:9000"));
        assert!(s.force_path_style && s.allow_other && s.foreground);
        assert_eq!((s.uid, s.gid), (Some(1000), Some(1001)));
        assert_eq!((s.file_mode, s.dir_mode, s.umask), (0o666, 0o777, 0o022));
        assert_eq!(s.part_size, 16 << 20);
        assert_eq!(s.upload_concurrency, 4);
        assert_eq!(s.access_key_id.as_deref(), Some("AK2"));
        assert_eq!(s.secret_access_key.as_deref(), Some("SK2"));
        assert_eq!(s.mp_umask, 0o022);
        assert_eq!(s.notices.len(), 1, "{:?}", s.notices);
        assert!(
            s.notices[0].starts_with("notice: -o del_cache: "),
            "{:?}",
            s.notices
        );
        assert_eq!(s.data_cache.as_deref(), Some(Path::new("/tmp/c")));
    }

    #[test]
    fn ossfs_guide_command_line() {
        let (source, _, s) = mount(
            &[
                "bucket-test",
                "/mnt/ossfs",
                "-ourl=oss-cn-hangzhou.aliyuncs.com",
                "-odirect_read",
                "-oreaddir_optimize",
            ],
            Flavor::Ossfs,
        )
        .unwrap();
        assert_eq!(source, "s3://bucket-test");
        assert_eq!(
            s.endpoint_url.as_deref(),
            Some("http://oss-cn-hangzhou.aliyuncs.com")
        );
        assert_eq!(s.notices.len(), 2);
        assert!(!s.foreground);
    }

    #[test]
    fn bucket_option_and_errors() {
        let (source, mp, _) = mount(&["/mnt/y", "-o", "bucket=b"], Flavor::S3fs).unwrap();
        assert_eq!((source.as_str(), mp), ("s3://b", PathBuf::from("/mnt/y")));
        let e = mount(&["b", "/m", "-o", "bogus_opt=1"], Flavor::S3fs).unwrap_err();
        assert_eq!(e, "-o: unknown option \"bogus_opt\"");
        let e = mount(&["b", "/m", "-o", "use_sse"], Flavor::S3fs).unwrap_err();
        assert!(e.starts_with("-o use_sse: not supported"), "{e}");
        let e = mount(&["b", "/m", "-o", "storage_class=glacier"], Flavor::S3fs).unwrap_err();
        assert!(e.contains("glacier"), "{e}");
        mount(
            &[
                "b",
                "/m",
                "-o",
                "storage_class=standard,default_acl=private",
            ],
            Flavor::S3fs,
        )
        .unwrap();
        let e = mount(&["b", "/m", "-o", "multipart_size=1"], Flavor::S3fs).unwrap_err();
        assert!(e.starts_with("-o multipart_size: "), "{e}");
        assert!(mount(&["/m"], Flavor::S3fs).is_err());
        assert!(mount(&["b", "/m", "-x"], Flavor::S3fs).is_err());
        // bucketfs's own keys work too.
        let (_, _, s) = mount(&["b", "/m", "-o", "part_size=32M,ro"], Flavor::S3fs).unwrap();
        assert!(s.read_only);
        assert_eq!(s.part_size, 32 << 20);
    }

    #[test]
    fn passwd_files() {
        let f = file("AK:SK\n", 0o600);
        assert_eq!(
            read_passwd_file(f.path(), "b").unwrap(),
            ("AK".into(), "SK".into())
        );
        let f = file("# c\nb:AK:SK\n", 0o400);
        assert_eq!(
            read_passwd_file(f.path(), "b").unwrap(),
            ("AK".into(), "SK".into())
        );
        assert!(read_passwd_file(f.path(), "other").is_err());
        for mode in [0o644, 0o604, 0o640] {
            let f = file("AK:SECRETVALUE\n", mode);
            let e = read_passwd_file(f.path(), "b").unwrap_err();
            assert!(e.contains(&format!("(mode {mode:04o})")), "{e}");
            assert!(e.contains("chmod 600") && !e.contains("SECRETVALUE"), "{e}");
            assert!(!e.contains('\n'));
        }
        let f = file("garbage\n", 0o600);
        assert!(read_passwd_file(f.path(), "b")
            .unwrap_err()
            .contains("line 1"));
    }

    /// `-o config=FILE` under s3fs applies the file (before: accepted and dropped: a
    /// read-only mount, its credentials, its endpoint silently not applied); the other `-o`
    /// options win over it.
    #[test]
    fn an_s3fs_config_option_applies_the_file() {
        let conf = file("read_only = true\nregion = \"eu-west-1\"\n", 0o600);
        let opts = format!("config={},region=us-east-2", conf.path().display());
        let (_, _, s) = mount(&["b", "/m", "-o", &opts], Flavor::S3fs).unwrap();
        assert!(s.read_only);
        assert_eq!(s.region.as_deref(), Some("us-east-2"));
    }

    /// As s3fs: a default passwd file does not override a profile named on the command line
    /// (before: its keys did, silently), and a default one this user may not read is passed
    /// over.
    #[test]
    fn a_default_passwd_file_never_overrides_a_named_profile() {
        let home = tempfile::tempdir().unwrap();
        let pw = home.path().join(".passwd-s3fs");
        std::fs::write(&pw, "AK:SK\n").unwrap();
        std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o600)).unwrap();
        let call = |args: &[&str]| match s3fs_call(&os(args), Flavor::S3fs, Some(home.path())) {
            Ok(S3fsCall::Mount { settings, .. }) => *settings,
            other => panic!("{other:?}"),
        };
        let s = call(&["b", "/m", "-o", "profile=prod"]);
        assert_eq!(s.access_key_id, None);
        assert_eq!(s.profile.as_deref(), Some("prod"));
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_none()
            && std::env::var_os("AWSACCESSKEYID").is_none()
        {
            assert_eq!(call(&["b", "/m"]).access_key_id.as_deref(), Some("AK"));
        }
    }

    #[test]
    fn ossfs2_command_line() {
        let conf = file(
            "--oss_bucket=b\n--oss_access_key_id=AK\n--oss_access_key_secret=SK\n",
            0o600,
        );
        let call = ossfs2_call(&os(&[
            "mount",
            "/mnt/o",
            "-c",
            conf.path().to_str().unwrap(),
            "--oss_endpoint=http://h:1",
            "--oss_bucket_prefix=p/",
            "--ro=true",
            "--sync_upload=true",
            "--total_mem_limit=134217728",
        ]))
        .unwrap();
        let S3fsCall::Mount {
            source,
            mountpoint,
            settings: s,
        } = call
        else {
            panic!()
        };
        assert_eq!(
            (source.as_str(), mountpoint),
            ("s3://", PathBuf::from("/mnt/o"))
        );
        assert_eq!(s.bucket.as_deref(), Some("b"));
        assert_eq!(s.prefix.as_deref(), Some("p/"));
        assert_eq!(s.access_key_id.as_deref(), Some("AK"));
        assert!(s.read_only);
        assert_eq!(s.max_memory, 128 << 20);
        assert_eq!(s.notices.len(), 1);
        let e = ossfs2_call(&os(&["mount", "/m", "--oss_access_key_secret=SK"])).unwrap_err();
        assert!(
            e.contains("not accepted on the command line") && !e.contains("SK\""),
            "{e}"
        );
        let e = ossfs2_call(&os(&["mount", "/m", "--bogus=1"])).unwrap_err();
        assert_eq!(e, "config (command line): unknown key \"bogus\"");
    }

    #[test]
    fn tables_have_no_duplicates_and_settings_exist() {
        for table in [OSSFS2_OPTIONS, S3FS_OPTIONS] {
            let mut seen = std::collections::BTreeSet::new();
            for (k, m) in table {
                assert!(seen.insert(k), "{k} twice");
                if let Setting(b) = m {
                    assert!(crate::options::setting(b).is_some(), "{k} -> {b}");
                }
            }
        }
    }
}
