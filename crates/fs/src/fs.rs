//! The file system: every operation the kernel can ask for, as an async call on [`Fs`].

use crate::config::FsConfig;
use crate::error::{FsError, FsResult};
use crate::inode::Ino;
use crate::meta::{Attr, FileKind};
use bucketfs_store::ObjectStore;
use bytes::Bytes;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Who is making a call (from the FUSE request header); owns what it creates.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// One directory entry as `readdir` returns it.
#[derive(Debug, Clone)]
pub struct DirEntry {
    pub ino: Ino,
    /// Cookie of the entry after this one: pass it back to continue the listing.
    pub next_offset: i64,
    pub kind: FileKind,
    pub name: String,
}

/// Result of `open`/`create`.
#[derive(Debug, Clone, Copy)]
pub struct OpenReply {
    pub fh: u64,
    /// The kernel may keep its page cache for this file (content unchanged since last open).
    pub keep_cache: bool,
}

/// The attribute changes of one `setattr`; `None` leaves a field alone.
#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    /// Permission bits (the type bits are ignored).
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SystemTime>,
    pub mtime: Option<SystemTime>,
}

/// What `statfs` reports: a bucket has no real capacity, so it is large and constant.
#[derive(Debug, Clone, Copy)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

pub struct Fs {
    store: Arc<dyn ObjectStore>,
    cfg: FsConfig,
}

impl Fs {
    pub fn new(store: Arc<dyn ObjectStore>, cfg: FsConfig) -> Arc<Self> {
        Arc::new(Self { store, cfg })
    }

    pub fn config(&self) -> &FsConfig {
        &self.cfg
    }

    /// How long the kernel may cache entries and attributes this fs returns.
    pub fn attr_ttl(&self) -> Duration {
        self.cfg.stat_ttl
    }

    /// Looks `name` up in directory `parent`; on success the inode's lookup count goes up by one.
    pub async fn lookup(&self, parent: Ino, name: &OsStr) -> FsResult<Attr> {
        todo!("{parent} {name:?} {:?}", self.store.describe())
    }

    /// The kernel dropped `nlookup` references to `ino`.
    pub fn forget(&self, ino: Ino, nlookup: u64) {
        todo!("{ino} {nlookup}")
    }

    pub async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        todo!("{ino}")
    }

    /// chmod/chown/utimens/truncate. `fh` is set for ftruncate/futimens on an open file.
    pub async fn setattr(&self, ino: Ino, fh: Option<u64>, set: SetAttr) -> FsResult<Attr> {
        todo!("{ino} {fh:?} {set:?}")
    }

    pub async fn readlink(&self, ino: Ino) -> FsResult<Bytes> {
        todo!("{ino}")
    }

    pub async fn mkdir(
        &self,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        umask: u32,
        caller: Caller,
    ) -> FsResult<Attr> {
        todo!("{parent} {name:?} {mode} {umask} {caller:?}")
    }

    /// Only regular files can be made (FIFOs, sockets and devices cannot live in a bucket).
    pub async fn mknod(
        &self,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        umask: u32,
        caller: Caller,
    ) -> FsResult<Attr> {
        todo!("{parent} {name:?} {mode} {umask} {caller:?}")
    }

    pub async fn unlink(&self, parent: Ino, name: &OsStr) -> FsResult<()> {
        todo!("{parent} {name:?}")
    }

    pub async fn rmdir(&self, parent: Ino, name: &OsStr) -> FsResult<()> {
        todo!("{parent} {name:?}")
    }

    pub async fn symlink(
        &self,
        parent: Ino,
        name: &OsStr,
        target: &Path,
        caller: Caller,
    ) -> FsResult<Attr> {
        todo!("{parent} {name:?} {target:?} {caller:?}")
    }

    /// `flags` are renameat2 flags (`RENAME_NOREPLACE` is honoured, `RENAME_EXCHANGE` is not
    /// supported).
    pub async fn rename(
        &self,
        parent: Ino,
        name: &OsStr,
        new_parent: Ino,
        new_name: &OsStr,
        flags: u32,
    ) -> FsResult<()> {
        todo!("{parent} {name:?} {new_parent} {new_name:?} {flags}")
    }

    /// `flags` are the open(2) flags.
    pub async fn open(&self, ino: Ino, flags: i32) -> FsResult<OpenReply> {
        todo!("{ino} {flags}")
    }

    /// Creates and opens a regular file; the lookup count of the new inode goes up by one.
    pub async fn create(
        &self,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        caller: Caller,
    ) -> FsResult<(Attr, OpenReply)> {
        todo!("{parent} {name:?} {mode} {umask} {flags} {caller:?}")
    }

    /// Reads up to `size` bytes at `offset`; shorter only at end of file.
    pub async fn read(&self, ino: Ino, fh: u64, offset: u64, size: u32) -> FsResult<Bytes> {
        todo!("{ino} {fh} {offset} {size}")
    }

    /// Writes all of `data` at `offset` and returns its length.
    pub async fn write(&self, ino: Ino, fh: u64, offset: u64, data: Bytes) -> FsResult<u32> {
        todo!("{ino} {fh} {offset} {}", data.len())
    }

    /// close(2) of one descriptor: publishes what was written and reports a failed upload.
    pub async fn flush(&self, ino: Ino, fh: u64) -> FsResult<()> {
        todo!("{ino} {fh}")
    }

    /// Makes everything written so far durable in the bucket.
    pub async fn fsync(&self, ino: Ino, fh: u64) -> FsResult<()> {
        todo!("{ino} {fh}")
    }

    /// The last reference to an open file went away.
    pub async fn release(&self, ino: Ino, fh: u64) -> FsResult<()> {
        todo!("{ino} {fh}")
    }

    /// Opens a directory for listing and returns its handle.
    pub async fn opendir(&self, ino: Ino) -> FsResult<u64> {
        todo!("{ino}")
    }

    /// Entries after cookie `offset` (0 = from the start, including `.` and `..`).
    pub async fn readdir(&self, ino: Ino, fh: u64, offset: i64) -> FsResult<Vec<DirEntry>> {
        todo!("{ino} {fh} {offset}")
    }

    pub fn releasedir(&self, ino: Ino, fh: u64) {
        todo!("{ino} {fh}")
    }

    pub fn statfs(&self) -> StatFs {
        todo!()
    }

    /// Publishes every file still being written (unmount, SIGTERM). Returns how many failed.
    pub async fn shutdown(&self) -> usize {
        todo!()
    }
}

#[allow(dead_code)]
fn _unused(_: FsError) {}
