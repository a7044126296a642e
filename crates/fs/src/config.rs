//! Settings of the fs core (the CLI fills them from flags and the config file).

pub use crate::files::cache::DataCacheConfig;
pub use crate::files::writeback::WriteBackConfig;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct FsConfig {
    /// Key prefix the mount shows as its root: empty or ending with `/`.
    pub prefix: String,
    /// Owner shown for objects without `uid`/`gid` metadata.
    pub uid: u32,
    pub gid: u32,
    /// When set, every entry shows this owner regardless of metadata (like s3fs `-o uid=`).
    pub force_uid: Option<u32>,
    pub force_gid: Option<u32>,
    /// Permission bits for objects without `mode` metadata.
    pub file_mode: u16,
    pub dir_mode: u16,
    pub read_only: bool,
    /// How long attributes learned from the store are trusted.
    pub stat_ttl: Duration,
    /// How long "no such file" from the store is trusted (0: always ask again).
    pub negative_ttl: Duration,
    /// Most paths the stat cache holds (attributes, types and negative entries).
    pub stat_cache_size: usize,
    /// Size of a multipart part and of a prefetch request.
    pub part_size: u64,
    /// Parts of one file uploading at once.
    pub upload_concurrency: usize,
    /// Most bytes a single read handle prefetches ahead of the reader.
    pub max_prefetch: u64,
    /// Global budget for prefetched data and part buffers.
    pub max_memory: u64,
    /// Where staging files for rewrites go.
    pub cache_dir: PathBuf,
    /// Most objects a directory rename may copy; bigger directories get EXDEV (mv then copies).
    pub max_dir_rename_objects: usize,
    /// The data cache on local disk, if any (`--data-cache`).
    pub data_cache: Option<DataCacheConfig>,
    /// `--upload background`: the write-back directory close commits to.
    pub writeback: Option<WriteBackConfig>,
}

impl Default for FsConfig {
    fn default() -> Self {
        Self {
            prefix: String::new(),
            // SAFETY: getuid/getgid cannot fail.
            uid: unsafe { libc::getuid() },
            gid: unsafe { libc::getgid() },
            force_uid: None,
            force_gid: None,
            file_mode: 0o644,
            dir_mode: 0o755,
            read_only: false,
            stat_ttl: Duration::from_secs(5),
            negative_ttl: Duration::from_secs(5),
            stat_cache_size: 200_000,
            part_size: 8 * 1024 * 1024,
            upload_concurrency: 8,
            max_prefetch: 64 * 1024 * 1024,
            max_memory: crate::budget::default_budget(),
            cache_dir: std::env::temp_dir(),
            max_dir_rename_objects: 10_000,
            data_cache: None,
            writeback: None,
        }
    }
}
