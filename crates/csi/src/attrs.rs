//! Volume attributes (PV `volumeAttributes`, StorageClass `parameters`), mount options and
//! secrets: what they may say, and the `bucketfs mount` arguments they become.
//!
//! Every value becomes one `--flag=value` argument, so no value can turn into another flag.
//! Options that would point a mount at files of the node (config, logs, caches, CA bundles) or
//! carry credentials are refused: volume attributes are not the place for either.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Attribute name -> `bucketfs mount` flag, for attributes that take a value.
const VALUE_ATTRS: &[(&str, &str)] = &[
    ("endpoint", "--endpoint-url"),
    ("region", "--region"),
    ("uid", "--uid"),
    ("gid", "--gid"),
    ("fileMode", "--file-mode"),
    ("dirMode", "--dir-mode"),
    ("maxMemory", "--max-memory"),
    ("statTTL", "--stat-ttl"),
    ("partSize", "--part-size"),
];

/// Boolean attributes ("true"/"false") -> flag.
const BOOL_ATTRS: &[(&str, &str)] = &[
    ("readOnly", "--read-only"),
    ("forcePathStyle", "--force-path-style"),
];

/// `-o` option keys a volume may use (through `options` or the PV's `mountOptions`), besides
/// the generic mount options bucketfs ignores anyway.
const MOUNT_OPTIONS: &[&str] = &[
    "ro",
    "rw",
    "read_only",
    "uid",
    "gid",
    "file_mode",
    "dir_mode",
    "max_memory",
    "stat_ttl",
    "negative_ttl",
    "stat_cache_size",
    "part_size",
    "upload_concurrency",
    "max_prefetch",
    "fuse_threads",
    "retry_timeout",
    "max_connections",
    "list_metadata",
    "max_dir_rename",
    "unsigned_payload",
    "force_path_style",
    "use_path_request_style",
    "endpoint_url",
    "url",
    "region",
    "log_level",
    "data_cache_size",
    "defaults",
    "noatime",
    "relatime",
    "nodev",
    "nosuid",
    "noexec",
    "allow_other",
    "_netdev",
];

/// Attributes that are not mount settings: where the volume is, and the cache switch.
const PLACE_ATTRS: &[&str] = &["bucket", "prefix", "options", "dataCacheSize"];

/// The memory budget of a volume's daemon when its attributes give none.
pub const DEFAULT_MAX_MEMORY: &str = "256M";

/// Keys of the volume's secret.
pub const SECRET_ACCESS_KEY_ID: &str = "accessKeyID";
pub const SECRET_SECRET_ACCESS_KEY: &str = "secretAccessKey";
pub const SECRET_SESSION_TOKEN: &str = "sessionToken";

/// Where a volume is and how to mount it, without its credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSpec {
    pub bucket: String,
    /// Without leading or trailing `/`; empty for the whole bucket.
    pub prefix: String,
    /// `bucketfs mount` flags, in a fixed order (attribute order does not matter).
    pub args: Vec<String>,
    /// The size of the volume's data cache, if it has one.
    pub data_cache_size: Option<String>,
    pub read_only: bool,
}

/// Credentials from a secret. Debug never shows them.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credentials(hidden)")
    }
}

impl Credentials {
    pub fn from_secrets(secrets: &HashMap<String, String>) -> Result<Credentials, String> {
        let get = |k: &str| secrets.get(k).filter(|v| !v.is_empty()).cloned();
        let c = Credentials {
            access_key_id: get(SECRET_ACCESS_KEY_ID),
            secret_access_key: get(SECRET_SECRET_ACCESS_KEY),
            session_token: get(SECRET_SESSION_TOKEN),
        };
        if c.access_key_id.is_some() != c.secret_access_key.is_some() {
            return Err(format!(
                "the secret needs both {SECRET_ACCESS_KEY_ID} and {SECRET_SECRET_ACCESS_KEY}, or neither"
            ));
        }
        // Alone it would be dropped, and the daemon would run as the node's credentials.
        if c.session_token.is_some() && c.access_key_id.is_none() {
            return Err(format!(
                "the secret's {SECRET_SESSION_TOKEN} needs {SECRET_ACCESS_KEY_ID} and \
                 {SECRET_SECRET_ACCESS_KEY} too"
            ));
        }
        Ok(c)
    }

    pub fn is_empty(&self) -> bool {
        self.access_key_id.is_none()
    }
}

/// Keys Kubernetes adds to volume attributes on its own (pod info, provisioner identity).
fn added_by_kubernetes(key: &str) -> bool {
    key.starts_with("csi.storage.k8s.io/") || key.starts_with("storage.kubernetes.io/")
}

pub(crate) fn parse_bool(key: &str, v: &str) -> Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "1" | "on" => Ok(true),
        "false" | "no" | "0" | "off" | "" => Ok(false),
        _ => Err(format!("attribute {key}: {v:?} is not true or false")),
    }
}

/// Checks one `-o` option (`key` or `key=value`) against [`MOUNT_OPTIONS`].
fn check_option(opt: &str) -> Result<(), String> {
    let key = opt.split('=').next().unwrap_or("").trim();
    let canon = key.replace('-', "_").to_ascii_lowercase();
    if opt.starts_with('-') || !MOUNT_OPTIONS.contains(&canon.as_str()) {
        return Err(format!(
            "mount option {key:?} is not allowed for a CSI volume (allowed: {})",
            MOUNT_OPTIONS.join(", ")
        ));
    }
    // Requests at debug/trace show signing details of the credentials, and a daemon's log is
    // read by whoever runs the node: a volume may not turn them on.
    if canon == "log_level" {
        let v = opt.split_once('=').map_or("", |(_, v)| v.trim());
        if !matches!(
            v.to_ascii_lowercase().as_str(),
            "error" | "err" | "fatal" | "critical" | "warn" | "warning" | "info"
        ) {
            return Err(format!(
                "mount option log_level={v}: a CSI volume may use error, warn or info only \
                 (debug and trace could log details of the volume's credentials)"
            ));
        }
    }
    Ok(())
}

fn normalize_prefix(p: &str) -> Result<String, String> {
    let p = p.trim_matches('/');
    if p.split('/').any(|c| c.is_empty() || c == "." || c == "..") && !p.is_empty() {
        return Err(format!("prefix {p:?}: empty, . or .. components"));
    }
    Ok(p.to_string())
}

/// Reads the attributes of a volume. `mount_flags` are the PV's `mountOptions`; `read_only`
/// is the publish request's flag or a reader-only access mode.
pub fn volume_spec(
    attrs: &HashMap<String, String>,
    secrets: &HashMap<String, String>,
    mount_flags: &[String],
    read_only: bool,
) -> Result<VolumeSpec, String> {
    let known = |k: &str| {
        VALUE_ATTRS.iter().any(|(a, _)| *a == k)
            || BOOL_ATTRS.iter().any(|(a, _)| *a == k)
            || PLACE_ATTRS.contains(&k)
    };
    // Sorted, so the same attributes always give the same arguments.
    let sorted: BTreeMap<&str, &str> = attrs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    for k in sorted.keys() {
        if !known(k) && !added_by_kubernetes(k) {
            return Err(format!("unknown volume attribute {k:?}"));
        }
    }
    let bucket = sorted
        .get("bucket")
        .map(|b| b.trim().to_string())
        .filter(|b| !b.is_empty())
        .ok_or("volume attribute bucket is missing")?;
    if bucket.contains('/') {
        return Err(format!("bucket {bucket:?} contains /"));
    }
    let prefix = normalize_prefix(sorted.get("prefix").copied().unwrap_or(""))?;
    let mut args = Vec::new();
    // The endpoint and region may come from the secret, so one secret serves every volume.
    let mut values: BTreeMap<&str, String> = BTreeMap::new();
    for k in ["endpoint", "region"] {
        if let Some(v) = secrets.get(k).filter(|v| !v.is_empty()) {
            values.insert(k, v.clone());
        }
    }
    for (k, v) in &sorted {
        if VALUE_ATTRS.iter().any(|(a, _)| a == k) && !v.is_empty() {
            values.insert(k, v.to_string());
        }
    }
    for (attr, flag) in VALUE_ATTRS {
        if let Some(v) = values.get(attr) {
            args.push(format!("{flag}={v}"));
        }
    }
    let mut ro = read_only;
    let mut path_style = secrets
        .get("forcePathStyle")
        .map(|v| parse_bool("forcePathStyle", v))
        .transpose()?
        .unwrap_or(false);
    for (attr, _) in BOOL_ATTRS {
        if let Some(v) = sorted.get(attr) {
            let b = parse_bool(attr, v)?;
            match *attr {
                "readOnly" => ro |= b,
                _ => path_style = b,
            }
        }
    }
    if path_style {
        args.push("--force-path-style".into());
    }
    if ro {
        args.push("--read-only".into());
    }
    let mut opts: Vec<String> = Vec::new();
    let extra = sorted.get("options").copied().unwrap_or("");
    for o in extra
        .split(',')
        .chain(mount_flags.iter().flat_map(|f| f.split(',')))
        .map(str::trim)
        .filter(|o| !o.is_empty())
    {
        check_option(o)?;
        if matches!(o, "ro" | "read_only" | "read-only") {
            ro = true;
        }
        opts.push(o.to_string());
    }
    if ro && !args.iter().any(|a| a == "--read-only") {
        args.push("--read-only".into());
    }
    // One budget per pod volume: the machine-sized default would let a node's mounts together
    // claim many times its memory (and the container's limit covers them all).
    if !values.contains_key("maxMemory")
        && !opts.iter().any(|o| {
            o.split('=')
                .next()
                .is_some_and(|k| k.replace('-', "_") == "max_memory")
        })
    {
        args.push(format!("--max-memory={DEFAULT_MAX_MEMORY}"));
    }
    if !opts.is_empty() {
        // Checked above: no option starts with `-`, so this stays the value of -o.
        args.push("-o".into());
        args.push(opts.join(","));
    }
    let data_cache_size = sorted
        .get("dataCacheSize")
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty() && s != "0");
    Ok(VolumeSpec {
        bucket,
        prefix,
        args,
        data_cache_size,
        read_only: ro,
    })
}

impl VolumeSpec {
    /// `s3://BUCKET[/PREFIX]`.
    pub fn source(&self) -> String {
        if self.prefix.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{}", self.bucket, self.prefix)
        }
    }

    /// The whole `bucketfs mount` argument list after `mount -f SOURCE TARGET`, with the
    /// node's directories for the daemon state and the data cache.
    pub fn mount_args(&self, state_dir: &Path, cache_dir: &Path) -> Vec<String> {
        let mut a = self.args.clone();
        // Pods run as other users than the driver.
        a.push("--allow-other".into());
        a.push(format!("--state-dir={}", state_dir.display()));
        if let Some(size) = &self.data_cache_size {
            a.push(format!("--data-cache={}", cache_dir.display()));
            a.push(format!("--data-cache-size={size}"));
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn attributes_become_flags_in_a_fixed_order() {
        let s = volume_spec(
            &map(&[
                ("bucket", "b"),
                ("prefix", "/p/q/"),
                ("uid", "1000"),
                ("gid", "2000"),
                ("readOnly", "true"),
                ("forcePathStyle", "true"),
                ("options", "stat_ttl=1"),
                ("csi.storage.k8s.io/pod.name", "x"),
            ]),
            &map(&[("endpoint", "http://e:9000"), ("accessKeyID", "AK")]),
            &["noatime".to_string()],
            false,
        )
        .unwrap();
        assert_eq!(s.source(), "s3://b/p/q");
        assert_eq!(
            s.args,
            [
                "--endpoint-url=http://e:9000",
                "--uid=1000",
                "--gid=2000",
                "--force-path-style",
                "--read-only",
                "--max-memory=256M",
                "-o",
                "stat_ttl=1,noatime"
            ]
        );
        assert!(!s.args.iter().any(|a| a.contains("AK")));
    }

    #[test]
    fn refuses_options_that_reach_node_files_or_carry_credentials() {
        for bad in [
            "config=/etc/shadow",
            "log_file=/x",
            "secret_access_key=x",
            "data_cache=/",
            "-f",
            "log_level=debug",
            "log-level=TRACE",
        ] {
            let r = volume_spec(
                &map(&[("bucket", "b"), ("options", bad)]),
                &HashMap::new(),
                &[],
                false,
            );
            assert!(r.is_err(), "{bad} accepted");
        }
        assert!(volume_spec(
            &map(&[("bucket", "b"), ("typo", "1")]),
            &HashMap::new(),
            &[],
            false
        )
        .is_err());
        assert!(volume_spec(&map(&[("prefix", "p")]), &HashMap::new(), &[], false).is_err());
    }

    #[test]
    fn log_levels_that_could_show_credentials_are_refused_in_mount_options() {
        let attrs = map(&[("bucket", "b")]);
        for level in ["debug", "trace", "Trace", ""] {
            let e = volume_spec(
                &attrs,
                &HashMap::new(),
                &[format!("log_level={level}")],
                false,
            )
            .unwrap_err();
            assert!(e.contains("log_level"), "{e}");
        }
        let s = volume_spec(&attrs, &HashMap::new(), &["log_level=warn".into()], false).unwrap();
        assert!(s.args.iter().any(|a| a == "log_level=warn"), "{:?}", s.args);
    }

    #[test]
    fn credentials_need_both_halves_and_hide_in_debug() {
        let c =
            Credentials::from_secrets(&map(&[("accessKeyID", "AK"), ("secretAccessKey", "SK")]))
                .unwrap();
        assert!(!format!("{c:?}").contains("SK"));
        assert!(Credentials::from_secrets(&map(&[("accessKeyID", "AK")])).is_err());
        assert!(Credentials::from_secrets(&map(&[("sessionToken", "T")])).is_err());
    }
}
