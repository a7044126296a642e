//! File-system core of bucketfs: turns file operations into object operations.
//!
//! Owns the inode table and lookup counts, the POSIX metadata encoding (s3fs-compatible
//! `x-amz-meta-mode/uid/gid/mtime`), directory listing, the read path (ranged GETs with
//! sequential prefetch) and the write path (streaming multipart uploads, local staging for
//! rewrites). It has no FUSE types in its API, so tests drive it in-process against the memory
//! and fault stores; the `bucketfs-fuse` crate adapts it to the kernel.

mod aligned;
mod budget;
mod config;
mod error;
mod files;
mod fs;
mod inline;
mod meta;
mod metrics;
mod namespace;
mod paths;
mod pool;
mod testpoint;

pub use bucketfs_store::liveness::within_operation;
pub use budget::default_budget;
pub use config::{statvfs, DataCacheConfig, FsConfig, MinFree, WriteBackConfig};
pub use error::{FsError, FsResult};
pub use files::cache::prepare_dir as prepare_data_cache_dir;
pub use files::writeback::{PendingFile, WriteBack, STORE_FILE as WRITEBACK_STORE_FILE};
pub use fs::{Caller, DirEntry, Fs, Now, OpenReply, SetAttr, StaleCache, StatFs};
pub use inline::{poll_here, set_fuse_threads};
pub use meta::{Attr, FileKind, Ino, ROOT_INO};
pub use metrics::FsMetrics;
pub use namespace::names::{normalize_prefix, unlinked_key_prefix, NAME_MAX};
