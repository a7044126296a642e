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

/// Logs a store error once with its context and converts it to an errno. At most
/// [`LogBudget::LINES`] warnings a window: in an outage every failed call of every
/// application would be a line, and a program retrying in a loop would fill the log's disk
/// (a node's, for the CSI driver's daemons); the rest are counted and said once.
pub(crate) fn log_store_err(op: &str, e: StoreError) -> FsError {
    static BUDGET: LogBudget = LogBudget::new();
    match &e {
        StoreError::NotFound(_) => tracing::debug!("{op}: {e}"),
        _ => match BUDGET.admit(std::time::Instant::now()) {
            Admit::Log { suppressed: 0 } => tracing::warn!("{op}: {e}"),
            Admit::Log { suppressed } => tracing::warn!(
                "{op}: {e} ({suppressed} more store errors were not logged in the last {} s)",
                LogBudget::WINDOW.as_secs()
            ),
            Admit::Quiet => tracing::debug!("{op}: {e}"),
        },
    }
    e.into()
}

/// What [`LogBudget::admit`] says of one more line.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Log it, saying how many were held back before it.
    Log { suppressed: u64 },
    /// Over the budget: not at warning level.
    Quiet,
}

/// At most [`LogBudget::LINES`] lines per [`LogBudget::WINDOW`].
pub(crate) struct LogBudget {
    /// The window's start (set at the first line), the lines logged in it, and the lines
    /// held back since the last one logged.
    state: parking_lot::Mutex<Option<(std::time::Instant, u64, u64)>>,
}

impl LogBudget {
    pub(crate) const LINES: u64 = 20;
    pub(crate) const WINDOW: std::time::Duration = std::time::Duration::from_secs(10);

    pub(crate) const fn new() -> Self {
        Self {
            state: parking_lot::Mutex::new(None),
        }
    }

    pub(crate) fn admit(&self, now: std::time::Instant) -> Admit {
        let mut st = self.state.lock();
        let (start, lines, held) = st.get_or_insert((now, 0, 0));
        if now.duration_since(*start) >= Self::WINDOW {
            (*start, *lines) = (now, 0);
        }
        if *lines >= Self::LINES {
            *held += 1;
            return Admit::Quiet;
        }
        *lines += 1;
        Admit::Log {
            suppressed: std::mem::take(held),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_store_errors_logs_a_few_lines_and_counts_the_rest() {
        let b = LogBudget::new();
        let t0 = std::time::Instant::now();
        for _ in 0..LogBudget::LINES {
            assert_eq!(b.admit(t0), Admit::Log { suppressed: 0 });
        }
        for _ in 0..1000 {
            assert_eq!(b.admit(t0), Admit::Quiet);
        }
        let later = t0 + LogBudget::WINDOW;
        assert_eq!(b.admit(later), Admit::Log { suppressed: 1000 });
        assert_eq!(b.admit(later), Admit::Log { suppressed: 0 });
    }

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
