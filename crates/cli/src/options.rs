//! The one list of `bucketfs mount` settings. Everything else that names them comes from it or
//! is checked against it:
//!
//! * the clap arguments of `bucketfs mount` ([`SettingArgs`]: flag, short flag, `BUCKETFS_*`
//!   variable, value name, help line with its default);
//! * the keys [`crate::config::Settings::apply`] accepts from the config file, `-o` and flags,
//!   and who may set each ([`Scope`]);
//! * the keys the config fuzz test draws from;
//! * the tests below, which fail when the README's options table, the man page's OPTIONS, the
//!   lists of file-only keys and of ignored mount options disagree with this table, or when a
//!   documented default is not the built-in one.
//!
//! What a value means and how it is parsed stays in `Settings::set` (one typed field each).

use clap::builder::FalseyValueParser;
use clap::{Arg, ArgAction, ArgMatches, Command};
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// On when given bare (`--allow-other`, `-o allow_other`), or `true`/`false`.
    Bool,
    /// Needs a value.
    Value,
}

/// Who may set a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Flags, `-o` and the config file.
    All,
    /// The config file only (credentials; bucket and prefix).
    FileOnly,
    /// The config file's own path: a flag and `-o config=FILE`, not a setting.
    CommandLineOnly,
}

/// A documented default: a value the setting parses to its built-in default (checked by a
/// test), or a description of a computed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultValue {
    Value(&'static str),
    Described(&'static str),
}

#[derive(Debug, Clone, Copy)]
pub struct OptionSpec {
    /// The config key and `-o` name; the flag is `--` and this with `-` for `_`.
    pub key: &'static str,
    pub kind: Kind,
    pub scope: Scope,
    pub short: Option<char>,
    /// Placeholder of the value in `--help` (`SIZE`); empty for booleans.
    pub value_name: &'static str,
    /// Whether the flag has the environment variable `BUCKETFS_<KEY>`.
    pub env: bool,
    pub default: Option<DefaultValue>,
    /// The `--help` line, without its default.
    pub help: &'static str,
}

const fn flag(key: &'static str) -> OptionSpec {
    OptionSpec {
        key,
        kind: Kind::Bool,
        scope: Scope::All,
        short: None,
        value_name: "",
        env: false,
        default: None,
        help: "",
    }
}

const fn value(key: &'static str, value_name: &'static str) -> OptionSpec {
    OptionSpec {
        kind: Kind::Value,
        value_name,
        ..flag(key)
    }
}

impl OptionSpec {
    const fn short(self, c: char) -> Self {
        Self {
            short: Some(c),
            ..self
        }
    }
    const fn env(self) -> Self {
        Self { env: true, ..self }
    }
    const fn default(self, v: &'static str) -> Self {
        Self {
            default: Some(DefaultValue::Value(v)),
            ..self
        }
    }
    const fn default_text(self, v: &'static str) -> Self {
        Self {
            default: Some(DefaultValue::Described(v)),
            ..self
        }
    }
    const fn file_only(self) -> Self {
        Self {
            scope: Scope::FileOnly,
            ..self
        }
    }
    const fn command_line_only(self) -> Self {
        Self {
            scope: Scope::CommandLineOnly,
            ..self
        }
    }
    const fn help(self, help: &'static str) -> Self {
        Self { help, ..self }
    }

    /// `--part-size` for `part_size`.
    pub fn long(&self) -> String {
        self.key.replace('_', "-")
    }

    /// `BUCKETFS_PART_SIZE` for `part_size`, if the flag has a variable.
    pub fn env_var(&self) -> Option<String> {
        self.env
            .then(|| format!("BUCKETFS_{}", self.key.to_ascii_uppercase()))
    }

    /// Whether `bucketfs mount` has a flag for it.
    pub fn is_flag(&self) -> bool {
        self.scope != Scope::FileOnly
    }

    /// Whether it is a setting (`Settings::apply` knows it).
    pub fn is_setting(&self) -> bool {
        self.scope != Scope::CommandLineOnly
    }

    /// The `--help` line: the help and the default.
    fn help_line(&self) -> String {
        match self.default {
            Some(DefaultValue::Value(d) | DefaultValue::Described(d)) => {
                format!("{} [default: {d}]", self.help)
            }
            None => self.help.to_string(),
        }
    }
}

/// Every setting, in the order of `bucketfs mount --help`.
pub const OPTIONS: &[OptionSpec] = &[
    flag("foreground").short('f').help(
        "Stay in the foreground (log to stderr unless --log-file/--syslog). Default: run \
         in the background once the mount is ready",
    ),
    value("config", "FILE")
        .short('c')
        .env()
        .command_line_only()
        .help(
            "Config file: TOML (key = value) or ossfs 2.0 style (--key=value lines). Flags \
             override it",
        ),
    value("endpoint_url", "URL").env().help(
        "S3 endpoint, e.g. http://127.0.0.1:9000 or https://oss-cn-hangzhou.aliyuncs.com \
         (a bare host gets https://). Default: AWS S3",
    ),
    value("region", "REGION").env().help(
        "S3 region used for signing. Default: from the AWS profile/environment, else \
         us-east-1",
    ),
    flag("force_path_style").env().help(
        "Address buckets as ENDPOINT/BUCKET (MinIO, Ceph) instead of BUCKET.ENDPOINT \
         (AWS, OSS)",
    ),
    value("profile", "NAME")
        .env()
        .help("Named AWS profile from ~/.aws/config and ~/.aws/credentials (like AWS_PROFILE)"),
    flag("read_only")
        .env()
        .help("Mount read-only: writes fail with EROFS"),
    value("uid", "UID").env().help(
        "Owner uid of every file and directory (overrides stored metadata). Default: \
         objects without uid metadata belong to the user who mounts",
    ),
    value("gid", "GID").env().help(
        "Group gid of every file and directory (overrides stored metadata). Default: \
         objects without gid metadata get the group of the user who mounts",
    ),
    value("file_mode", "OCTAL")
        .env()
        .default("0644")
        .help("Permission bits (octal) of files that have no mode metadata."),
    value("dir_mode", "OCTAL")
        .env()
        .default("0755")
        .help("Permission bits (octal) of directories that have no mode metadata."),
    value("umask", "OCTAL").env().default("0000").help(
        "Permission bits (octal) cleared from every file and directory, whatever mode it \
         stores (as s3fs's -o umask): 0077 keeps a mount shared with allow_other private to \
         its owner",
    ),
    value("mp_umask", "OCTAL").env().default("0000").help(
        "Permission bits (octal) cleared from the mount point's own mode (the root \
         directory), after --umask (as s3fs's -o mp_umask): 0077 lets other users of an \
         allow_other mount reach nothing through it",
    ),
    flag("allow_other").env().help(
        "Let other users use the mount (non-root needs user_allow_other in \
         /etc/fuse.conf). Permissions are checked by the kernel against each entry's mode \
         and owner",
    ),
    flag("allow_root").env().help(
        "Let root use the mount besides the user who mounts (FUSE allow_root; needs \
         user_allow_other in /etc/fuse.conf when not root); every other user gets EACCES",
    ),
    flag("nonempty").help(
        "Mount even if the mount point is not empty (its contents are hidden while \
         mounted)",
    ),
    flag("allow_stacking").help(
        "Mount even if the mount point is already a mount point (of any file system, a \
         live bucketfs included): the new mount stacks over it and hides it. Default: \
         refused",
    ),
    value("part_size", "SIZE").env().default("8M").help(
        "Multipart part size for uploads (a sequential reader's prefetch requests grow to at \
         least this), in bytes or with a K/M/G suffix (powers of 1024): 8M, 16MiB, 8388608. \
         5M to 5G, and at most a quarter of --max-memory.",
    ),
    value("stat_ttl", "SECONDS").env().default("5").help(
        "How long file attributes and directory entries are cached, in seconds (0.5, 5) \
         or with a unit (500ms, 2m). Changes made by other clients show up after this (one \
         exception: docs/SEMANTICS.md, lookup and stat).",
    ),
    value("negative_ttl", "SECONDS").env().default("5").help(
        "How long a name the bucket does not have is remembered as missing (same formats \
         as --stat-ttl; 0 asks the store every time). Another client's new file shows up \
         after this.",
    ),
    value("stat_cache_size", "N").env().default("200000").help(
        "Most paths the stat cache remembers (attributes, file/directory type, missing \
         names); each costs about 200 bytes.",
    ),
    value("cache_dir", "DIR")
        .env()
        .default_text("$TMPDIR or /tmp")
        .help("Directory for staging files of random writes and rewrites."),
    value("cache_min_free", "SIZE|PCT%")
        .env()
        .default("1G")
        .help(
            "Free space to leave on --cache-dir's disk (K/M/G or a percentage of the disk): \
         parts of a large write that are already uploaded get no local copy past it.",
        ),
    value("state_dir", "DIR")
        .env()
        .default_text(
            "/var/lib/bucketfs for root, else $XDG_STATE_HOME/bucketfs or \
             ~/.local/state/bucketfs",
        )
        .help(
            "Private directory (0700) for the upload journals that let the next mount clean \
             up after a crash, and for the background log when there is no syslog. Keep it on \
             a persistent disk.",
        ),
    value("max_dir_rename", "OBJECTS")
        .env()
        .default("10000")
        .help(
            "Most objects a directory rename may copy; renaming a bigger directory fails with \
             EXDEV (mv then falls back to copying).",
        ),
    value("upload_concurrency", "N")
        .env()
        .default("8")
        .help("Parts of one file uploaded at the same time (1-256)."),
    value("upload", "MODE").env().default("sync").help(
        "When close(2) returns: sync, once the file is in the bucket; background, once it \
         is durable (fsync'd) in a write-back directory under --state-dir, uploads \
         following in the background, resumed by the next mount after a crash.",
    ),
    value("upload_fsync", "WHERE").env().default("local").help(
        "What fsync(2) waits for with --upload background: local (the write-back \
         directory; a file fsync'd and kept open goes up at its close, or 5 s after) or \
         bucket (the upload).",
    ),
    value("upload_delay", "SECONDS").env().default("0").help(
        "With --upload background, how long a closed file waits before its upload starts \
         (same formats as --stat-ttl): a file renamed, removed or rewritten meanwhile is \
         uploaded once, under its last name, or not at all; an fsync with --upload-fsync \
         bucket starts its file's upload at once.",
    ),
    value("writeback_size", "SIZE").env().default("4G").help(
        "Most bytes of files waiting for upload with --upload background (K/M/G); a close \
         waits for room when it is full, then uploads its file itself (as --upload sync).",
    ),
    value("max_memory", "SIZE")
        .env()
        .default_text("an eighth of RAM or of the cgroup memory limit, 256M to 4G, at most half of that memory less 64M")
        .help(
            "Memory for prefetched data and upload buffers of all files together (K/M/G). \
             When it is full, read-ahead shrinks and writers wait; the daemon does not grow \
             past it.",
        ),
    value("data_cache", "DIR").env().help(
        "Keep the data files read in a cache on local disk in this directory (created 0700; \
         refused if another user owns it or can write it), so later reads, after a remount \
         too, come from the disk instead of the bucket. Default: off",
    ),
    value("data_cache_size", "SIZE").env().default("10G").help(
        "Most disk space the --data-cache directory's files take (in 4 KiB blocks); the least \
         recently used blocks go first (K/M/G).",
    ),
    flag("passthrough").env().help(
        "With --data-cache, let the kernel read a file the cache holds whole itself (FUSE \
         passthrough; Linux 6.9+, CAP_SYS_ADMIN): its reads never reach the daemon. Not POSIX: \
         while such a reader is open, opening the file for writing or truncating it fails with \
         ETXTBSY after 1 s, and that reader keeps reading the version it opened. Default: off",
    ),
    flag("no_passthrough")
        .env()
        .help("Turn --passthrough off (the default; kept for older configurations)."),
    value("max_prefetch", "SIZE").env().default("256M").help(
        "Most data one sequential reader prefetches ahead of itself (K/M/G; at most a \
         quarter of --max-memory).",
    ),
    value("fuse_threads", "N")
        .env()
        .default("4")
        .help("FUSE request threads (1-64)."),
    value("metrics_addr", "ADDR").env().help(
        "Serve request/byte counters in the Prometheus text format at http://ADDR/metrics \
         (e.g. 127.0.0.1:9100). Default: off",
    ),
    value("log_file", "PATH")
        .env()
        .help("Append the log to this file (default: see LOGGING in --help)"),
    value("log_level", "LEVEL")
        .env()
        .default("info")
        .help("Log level: error, warn, info, debug or trace."),
    flag("syslog").help("Log to syslog (/dev/log, facility daemon) instead of stderr or a file"),
    value("ca_bundle", "FILE").env().help(
        "PEM file of the CA certificates to trust for HTTPS instead of the system's (a \
         private CA of MinIO, Ceph or a proxy)",
    ),
    flag("no_verify_ssl").help(
        "Do not verify the server's HTTPS certificate. Anyone on the network path can \
         then read and change the traffic, credentials included: use --ca-bundle instead \
         where possible",
    ),
    flag("unsigned_payload").help(
        "Send upload bodies as UNSIGNED-PAYLOAD instead of signing their SHA-256 (a \
         quarter of an upload's CPU). Default: unsigned over HTTPS (TLS protects the \
         body), signed over plain HTTP; `unsigned_payload = false` in the config file \
         forces signing",
    ),
    value("retry_timeout", "SECONDS").env().default("30").help(
        "How long a failing S3 request is retried (with exponential backoff and jitter) \
         before the file operation fails with EIO; 0 turns retries off, otherwise at least 1.",
    ),
    value("list_metadata", "auto|on|off")
        .env()
        .default("auto")
        .help(
            "Whether directory listings ask for user metadata (mode, owner, mtime) so that \
             `ls -l` needs no HEAD per file: auto (only when the server is MinIO, which \
             supports it), on, or off.",
        ),
    value("max_connections", "N").env().default("128").help(
        "Most S3 requests moving data in flight at once (1-4096), and so most connections \
         open to the store; N/8 more slots (N + N/8 in all) are kept for metadata requests \
         (HEAD, LIST, DELETE), so lookups and listings do not wait behind transfers. \
         Further requests wait for one to finish.",
    ),
    value("content_type", "guess|none")
        .env()
        .default("guess")
        .help(
            "The Content-Type of new files this mount writes: guess (from the name's \
         extension, index.html: text/html, as s3fs and rclone do) or none (the store's \
         default, binary/octet-stream on S3). A file written again, chmod, chown, utimens and \
         renames keep an object's Content-Type and other headers, except that a file this \
         mount wrote gets its new name's when renamed.",
        ),
    value("bucket", "NAME")
        .file_only()
        .help("The bucket, when SOURCE is s3:// without one"),
    value("prefix", "PREFIX")
        .file_only()
        .help("The prefix, when SOURCE has none"),
    value("access_key_id", "KEY")
        .file_only()
        .help("S3 access key id (the file must be chmod 600)"),
    value("secret_access_key", "SECRET")
        .file_only()
        .help("S3 secret access key (the file must be chmod 600)"),
    value("session_token", "TOKEN")
        .file_only()
        .help("S3 session token (the file must be chmod 600)"),
];

/// The setting `key` (canonical spelling), if there is one.
pub fn setting(key: &str) -> Option<&'static OptionSpec> {
    OPTIONS.iter().find(|o| o.key == key && o.is_setting())
}

/// Generic mount(8)/fstab options that mean nothing to bucketfs and are accepted silently (and
/// every `x-*` option).
pub const IGNORED_MOUNT_OPTIONS: &[&str] = &[
    "rw",
    "defaults",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "owner",
    "group",
    "_netdev",
    "nofail",
    "suid",
    "nosuid",
    "dev",
    "nodev",
    "async",
    "atime",
    "noatime",
    "relatime",
    "norelatime",
    "strictatime",
    "diratime",
    "nodiratime",
    "comment",
];

/// The flags of `bucketfs mount` made from [`OPTIONS`]: what was given, in table order.
#[derive(Debug, Default)]
pub struct SettingArgs {
    /// `-c FILE` (or `BUCKETFS_CONFIG`).
    pub config: Option<PathBuf>,
    /// Settings given as flags: key and value (`None`: a boolean flag that is on).
    pub given: Vec<(&'static str, Option<String>)>,
}

impl clap::Args for SettingArgs {
    fn augment_args(mut cmd: Command) -> Command {
        for o in OPTIONS.iter().filter(|o| o.is_flag()) {
            let mut arg = Arg::new(o.key).long(o.long()).help(o.help_line());
            if let Some(c) = o.short {
                arg = arg.short(c);
            }
            arg = match o.kind {
                Kind::Bool => arg.action(ArgAction::SetTrue),
                Kind::Value => arg.action(ArgAction::Set).value_name(o.value_name),
            };
            if o.scope == Scope::CommandLineOnly {
                arg = arg.value_parser(clap::value_parser!(PathBuf));
            }
            if let Some(var) = o.env_var() {
                arg = arg.env(var).hide_env_values(true);
                if o.kind == Kind::Bool {
                    // BUCKETFS_READ_ONLY=0/false/no/off leaves the flag off.
                    arg = arg.value_parser(FalseyValueParser::new());
                }
            }
            cmd = cmd.arg(arg);
        }
        cmd
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for SettingArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut out = SettingArgs::default();
        for o in OPTIONS.iter().filter(|o| o.is_flag()) {
            match (o.scope, o.kind) {
                (Scope::CommandLineOnly, _) => out.config = m.get_one::<PathBuf>(o.key).cloned(),
                (_, Kind::Bool) => {
                    if m.get_flag(o.key) {
                        out.given.push((o.key, None));
                    }
                }
                (_, Kind::Value) => {
                    if let Some(v) = m.get_one::<String>(o.key) {
                        out.given.push((o.key, Some(v.clone())));
                    }
                }
            }
        }
        Ok(out)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

/// The docs must agree with the table: an option added, renamed or dropped here fails these
/// until the README and the man page say the same.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Origin, Settings};
    use std::collections::{BTreeMap, BTreeSet};

    fn doc(rel: &str) -> String {
        let path = format!("{}/../../{rel}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// The text from the line `heading` to the next heading of the same level.
    fn section<'a>(text: &'a str, heading: &str) -> &'a str {
        let start = text
            .find(&format!("\n{heading}\n"))
            .unwrap_or_else(|| panic!("no {heading}"))
            + heading.len()
            + 2;
        let level = heading.split(' ').next().unwrap();
        let end = text[start..]
            .find(&format!("\n{level} "))
            .map_or(text.len(), |e| start + e);
        &text[start..end]
    }

    /// The `code` spans of `text`.
    fn code_spans(text: &str) -> Vec<&str> {
        text.split('`').skip(1).step_by(2).collect()
    }

    /// The text from `from` to the first `to` after it.
    fn between<'a>(text: &'a str, from: &str, to: &str) -> &'a str {
        let s = text.find(from).unwrap_or_else(|| panic!("no {from:?}")) + from.len();
        let e = text[s..].find(to).unwrap_or_else(|| panic!("no {to:?}")) + s;
        &text[s..e]
    }

    fn flags() -> impl Iterator<Item = &'static OptionSpec> {
        OPTIONS.iter().filter(|o| o.is_flag())
    }

    fn file_only() -> BTreeSet<&'static str> {
        OPTIONS
            .iter()
            .filter(|o| o.scope == Scope::FileOnly)
            .map(|o| o.key)
            .collect()
    }

    #[test]
    fn keys_are_unique_and_canonical() {
        let mut seen = BTreeSet::new();
        for o in OPTIONS {
            assert!(seen.insert(o.key), "{} twice", o.key);
            assert_eq!(o.key, o.key.to_ascii_lowercase().replace('-', "_"));
            assert_eq!(o.kind == Kind::Bool, o.value_name.is_empty(), "{}", o.key);
            assert!(!o.help.is_empty(), "{} has no help", o.key);
        }
    }

    /// A default the docs state as a value is the built-in one.
    #[test]
    fn stated_defaults_are_the_built_in_ones() {
        let built_in = format!("{:?}", Settings::default());
        for o in OPTIONS {
            if let Some(DefaultValue::Value(d)) = o.default {
                let mut s = Settings::default();
                s.apply(o.key, Some(d), Origin::Flag).unwrap();
                assert_eq!(format!("{s:?}"), built_in, "--{} {d}", o.long());
            }
        }
    }

    /// Every flag reaches the settings under its key.
    #[test]
    fn every_flag_is_parsed_into_its_setting() {
        use clap::Parser;
        for o in flags() {
            let mut argv = vec!["bucketfs".to_string(), "mount".into(), "s3://b".into()];
            argv.push("/mnt".into());
            argv.push(format!("--{}", o.long()));
            if o.kind == Kind::Value {
                argv.push("/some/value".into());
            }
            let cli = crate::args::Cli::try_parse_from(&argv).unwrap();
            let crate::args::Command::Mount(m) = cli.command else {
                panic!()
            };
            match (o.scope, o.kind) {
                (Scope::CommandLineOnly, _) => {
                    assert_eq!(m.flags.config, Some(PathBuf::from("/some/value")))
                }
                (_, Kind::Bool) => assert_eq!(m.flags.given, [(o.key, None)]),
                (_, Kind::Value) => {
                    assert_eq!(m.flags.given, [(o.key, Some("/some/value".into()))])
                }
            }
        }
    }

    /// README's options table: one row per flag (and `-o`) with the same short flag, value
    /// name, variable and stated default.
    #[test]
    fn readme_options_table_matches() {
        let readme = doc("README.md");
        let mut rows = BTreeMap::new();
        for line in section(&readme, "## Options").lines() {
            if !line.starts_with("| `") {
                continue;
            }
            let line = line.replace("\\|", "\u{0}");
            let cells: Vec<String> = line
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().replace('\u{0}', "|"))
                .collect();
            let (mut long, mut value_name, mut short) = (String::new(), String::new(), None);
            for span in code_spans(&cells[0]) {
                if let Some(rest) = span.strip_prefix("--") {
                    let (l, v) = rest.split_once(' ').unwrap_or((rest, ""));
                    (long, value_name) = (l.to_string(), v.to_string());
                } else if let Some(rest) = span.strip_prefix('-') {
                    short = rest.chars().next();
                }
            }
            if long.is_empty() && short == Some('o') {
                continue;
            }
            assert!(rows
                .insert(long.clone(), (short, value_name, cells.clone()))
                .is_none());
        }
        let table: BTreeSet<String> = flags().map(|o| o.long()).collect();
        let listed: BTreeSet<String> = rows.keys().cloned().collect();
        assert_eq!(listed, table, "README options table vs OPTIONS");
        for o in flags() {
            let (short, value_name, cells) = &rows[&o.long()];
            assert_eq!(*short, o.short, "README: short flag of --{}", o.long());
            assert_eq!(value_name, o.value_name, "README: value of --{}", o.long());
            let env = code_spans(&cells[1]).first().map(|s| s.to_string());
            assert_eq!(env, o.env_var(), "README: variable of --{}", o.long());
            if let Some(DefaultValue::Value(d)) = o.default {
                assert_eq!(
                    cells[2],
                    format!("`{d}`"),
                    "README: default of --{}",
                    o.long()
                );
            }
        }
    }

    /// The man page's OPTIONS: each flag in one entry's heading, with its variable when it has
    /// one, and its stated default in the entry.
    #[test]
    fn man_page_options_match() {
        let man = doc("docs/bucketfs.1.md");
        let mut entries: BTreeMap<String, (String, String)> = BTreeMap::new();
        let mut lines = section(&man, "## OPTIONS").lines().peekable();
        while let Some(line) = lines.next() {
            if !line.starts_with("`-") {
                continue;
            }
            let mut body = String::new();
            while let Some(l) = lines.next_if(|l| l.starts_with(":   ") || l.starts_with("    ")) {
                body.push_str(l);
                body.push('\n');
            }
            for span in code_spans(line) {
                if let Some(long) = span.strip_prefix("--") {
                    let prev = entries.insert(long.to_string(), (line.to_string(), body.clone()));
                    assert!(prev.is_none(), "--{long} twice in the man page");
                }
            }
        }
        let table: BTreeSet<String> = flags().map(|o| o.long()).collect();
        let listed: BTreeSet<String> = entries.keys().cloned().collect();
        assert_eq!(listed, table, "man page OPTIONS vs OPTIONS");
        for o in flags() {
            let (heading, body) = &entries[&o.long()];
            let vars: Vec<&str> = code_spans(heading)
                .into_iter()
                .filter(|s| s.starts_with("BUCKETFS_"))
                .collect();
            match o.env_var() {
                Some(v) => assert!(vars.contains(&v.as_str()), "man: {v} in {heading}"),
                // A heading of two flags names the variables of both.
                None => assert!(vars.is_empty() || heading.matches("`--").count() > 1),
            }
            if let Some(c) = o.short {
                assert!(
                    heading.contains(&format!("`-{c}`")),
                    "man: -{c} in {heading}"
                );
            }
            if let Some(DefaultValue::Value(d)) = o.default {
                let after = &body[body
                    .find("efault")
                    .unwrap_or_else(|| panic!("man: --{} states no default", o.long()))..];
                let words: Vec<&str> = after.split(|c: char| !c.is_ascii_alphanumeric()).collect();
                // A default with punctuation (`5%`) is matched as a code span.
                assert!(
                    words.contains(&d) || after.contains(&format!("`{d}`")),
                    "man: default {d} of --{}",
                    o.long()
                );
            }
        }
    }

    /// The keys only a config file may hold, as README, the man page and `--help` list them.
    #[test]
    fn file_only_keys_match() {
        let keys = file_only();
        let readme = doc("README.md");
        let listed = between(&readme, "The config file is the only place for", ".");
        assert_eq!(
            code_spans(listed).into_iter().collect::<BTreeSet<_>>(),
            keys
        );
        let man = doc("docs/bucketfs.1.md");
        let listed = between(&man, "Only the config file may hold these keys:", ".");
        assert_eq!(
            code_spans(listed).into_iter().collect::<BTreeSet<_>>(),
            keys
        );
        let help = crate::args::MOUNT_AFTER_HELP;
        let listed = between(help, "Keys only the file may hold:", ".");
        let listed: BTreeSet<&str> = listed.split(',').map(str::trim).collect();
        assert_eq!(listed, keys);
    }

    /// The man page lists every ignored mount option; README and `--help` list some of them.
    #[test]
    fn ignored_mount_options_match() {
        let all: BTreeSet<&str> = IGNORED_MOUNT_OPTIONS.iter().copied().collect();
        let man = doc("docs/bucketfs.1.md");
        let listed = between(&man, "Generic options (", ")");
        let mut expected = all.clone();
        expected.insert("x-*");
        assert_eq!(
            code_spans(listed).into_iter().collect::<BTreeSet<_>>(),
            expected
        );
        let readme = doc("README.md");
        for o in code_spans(between(&readme, "Generic\nmount options (", ")")) {
            assert!(all.contains(o) || o.starts_with("x-"), "README: {o}");
        }
        let help = crate::args::MOUNT_AFTER_HELP;
        for o in between(help, "Generic mount options\n(", ")").split(',') {
            let o = o.trim();
            assert!(
                all.contains(o) || o.starts_with("x-") || o == "...",
                "--help: {o}"
            );
        }
    }

    /// docs/migration.md has one row per option of the ossfs 2.0 and s3fs/ossfs 1.x tables,
    /// in its section for that tool.
    #[test]
    fn migration_doc_lists_every_foreign_option() {
        let doc = doc("docs/migration.md");
        for (heading, table) in [
            ("## ossfs 2.0", crate::dropin::OSSFS2_OPTIONS),
            ("## s3fs-fuse and ossfs 1.x", crate::dropin::S3FS_OPTIONS),
        ] {
            let rows: BTreeSet<&str> = section(&doc, heading)
                .lines()
                .filter(|l| l.starts_with("| `"))
                .filter_map(|l| code_spans(l).first().copied())
                .collect();
            let keys: BTreeSet<&str> = table.iter().map(|(k, _)| *k).collect();
            assert_eq!(rows, keys, "docs/migration.md {heading}");
        }
    }
}
