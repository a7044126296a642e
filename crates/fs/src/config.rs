//! Settings of the fs core (the CLI fills them from flags and the config file).

pub use crate::files::cache::DataCacheConfig;
pub use crate::files::writeback::WriteBackConfig;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Free space a disk keeps (`--cache-min-free`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MinFree {
    Bytes(u64),
    /// Percent of the disk's size.
    Percent(u8),
}

impl MinFree {
    /// Whether the disk holding `dir` has `more` bytes free above the floor. A disk that
    /// cannot be asked counts as having room: the write itself then says.
    pub fn room_for(self, dir: &Path, more: u64) -> bool {
        let Ok(st) = statvfs(dir) else {
            return true;
        };
        let (free, size) = (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize);
        let floor = match self {
            MinFree::Bytes(b) => b,
            MinFree::Percent(p) => size / 100 * u64::from(p),
        };
        free >= floor.saturating_add(more)
    }
}

/// statvfs(2) of `path`.
pub fn statvfs(path: &Path) -> std::io::Result<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: statvfs only fills the struct it is given.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(st)
    }
}

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
    /// Permission bits cleared from every file and directory shown (s3fs `-o umask`).
    pub umask: u16,
    /// Permission bits cleared from the mount point's own mode (the root directory), after
    /// `umask` (s3fs `-o mp_umask`).
    pub mp_umask: u16,
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
    /// Free space `cache_dir`'s disk keeps: below it, a streamed part gets no staging copy.
    pub cache_min_free: MinFree,
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
            umask: 0,
            mp_umask: 0,
            read_only: false,
            stat_ttl: Duration::from_secs(5),
            negative_ttl: Duration::from_secs(5),
            stat_cache_size: 200_000,
            part_size: 8 * 1024 * 1024,
            upload_concurrency: 8,
            max_prefetch: 256 * 1024 * 1024,
            max_memory: crate::budget::default_budget(),
            cache_dir: std::env::temp_dir(),
            cache_min_free: MinFree::Bytes(1 << 30),
            max_dir_rename_objects: 10_000,
            data_cache: None,
            writeback: None,
        }
    }
}
