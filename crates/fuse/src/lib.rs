//! FUSE adapter of bucketfs: turns kernel requests into fs-core calls and their results into
//! replies.
//!
//! This crate owns everything between `/dev/fuse` and [`bucketfs_fs::Fs`]: the mount options
//! (`default_permissions`, `fsname`, `allow_other`, `ro`), the kernel connection settings
//! negotiated at `init` (1 MiB `max_write`, asynchronous reads, no writeback cache, raised
//! `max_background`), the pool of FUSE request threads, the per-mount readahead raised through
//! `/sys/class/bdi`, and unmounting. It knows nothing about S3: every request becomes one async
//! call on `Fs`, run as a task on the tokio runtime the caller hands in.
//!
//! Public surface: [`mount`] with [`MountOptions`] returns a [`MountHandle`] that unmounts on
//! drop, can be awaited until the kernel drops the mount ([`MountHandle::unmounted`]), and
//! unmounts explicitly ([`MountHandle::unmount`]); [`unmount_path`] unmounts any FUSE mount point
//! (used by `bucketfs umount` and to clear dead mounts).

mod adapter;
mod mount;

pub use adapter::{file_attr, REFRESH_IOCTL, REFRESH_XATTR};
pub use mount::{absolute, mount, mount_info, unmount_path, MountHandle, MountInfo, MountOptions};
