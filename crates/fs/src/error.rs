//! Errors of the fs core are errnos: that is all the kernel can carry.

use bucketfs_store::StoreError;
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsError(pub i32);

pub type FsResult<T> = Result<T, FsError>;

impl FsError {
    pub const ENOENT: FsError = FsError(libc::ENOENT);
    pub const EIO: FsError = FsError(libc::EIO);
    pub const EEXIST: FsError = FsError(libc::EEXIST);
    pub const ENOTDIR: FsError = FsError(libc::ENOTDIR);
    pub const EISDIR: FsError = FsError(libc::EISDIR);
    pub const ENOTEMPTY: FsError = FsError(libc::ENOTEMPTY);
    pub const EINVAL: FsError = FsError(libc::EINVAL);
    pub const EROFS: FsError = FsError(libc::EROFS);
    pub const EBADF: FsError = FsError(libc::EBADF);
    pub const ENAMETOOLONG: FsError = FsError(libc::ENAMETOOLONG);
    pub const EXDEV: FsError = FsError(libc::EXDEV);
    pub const EPERM: FsError = FsError(libc::EPERM);
    pub const EFBIG: FsError = FsError(libc::EFBIG);
    pub const ENOTSUP: FsError = FsError(libc::ENOTSUP);
    pub const ELOOP: FsError = FsError(libc::ELOOP);
    /// The object changed in the store since the file was opened (see `write.rs`).
    pub const ESTALE: FsError = FsError(libc::ESTALE);
    pub const EAGAIN: FsError = FsError(libc::EAGAIN);
}

impl fmt::Display for FsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
    }
}

impl std::error::Error for FsError {}

/// The errno a file-system call that hit a store error returns.
impl From<StoreError> for FsError {
    fn from(e: StoreError) -> Self {
        FsError(match e {
            StoreError::NotFound(_) => libc::ENOENT,
            StoreError::PreconditionFailed(_) => libc::ESTALE,
            StoreError::AccessDenied(_) => libc::EACCES,
            StoreError::NoSuchBucket(_) => libc::ENODEV,
            StoreError::NoSpace(_) => libc::ENOSPC,
            StoreError::Invalid(_) => libc::EINVAL,
            StoreError::Transient(_) | StoreError::Other(_) => libc::EIO,
        })
    }
}

impl From<std::io::Error> for FsError {
    fn from(e: std::io::Error) -> Self {
        FsError(e.raw_os_error().unwrap_or(libc::EIO))
    }
}

/// Logs a store error once with its context and converts it to an errno.
pub(crate) fn log_store_err(op: &str, e: StoreError) -> FsError {
    match &e {
        StoreError::NotFound(_) => tracing::debug!("{op}: {e}"),
        _ => tracing::warn!("{op}: {e}"),
    }
    e.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_become_errnos() {
        let cases = [
            (StoreError::NotFound("k".into()), FsError::ENOENT),
            (StoreError::PreconditionFailed("k".into()), FsError::ESTALE),
            (StoreError::AccessDenied("k".into()), FsError(libc::EACCES)),
            (StoreError::NoSuchBucket("b".into()), FsError(libc::ENODEV)),
            (StoreError::NoSpace("k".into()), FsError(libc::ENOSPC)),
            (StoreError::Invalid("k".into()), FsError::EINVAL),
            (StoreError::Transient("k".into()), FsError::EIO),
            (StoreError::Other("k".into()), FsError::EIO),
        ];
        for (e, errno) in cases {
            assert_eq!(FsError::from(e), errno);
        }
    }
}
