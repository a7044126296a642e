//! Store errors, classified by what the file system should do about them.

use thiserror::Error;

pub type StoreResult<T> = Result<T, StoreError>;

#[derive(Debug, Clone, Error)]
pub enum StoreError {
    /// The key (or the upload) does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// If-Match failed: the object changed since it was opened.
    #[error("object changed (precondition failed): {0}")]
    PreconditionFailed(String),
    /// Credentials rejected or no permission.
    #[error("access denied: {0}")]
    AccessDenied(String),
    /// The bucket does not exist.
    #[error("no such bucket: {0}")]
    NoSuchBucket(String),
    /// The store is out of space or over quota.
    #[error("no space left in store: {0}")]
    NoSpace(String),
    /// The request was invalid for this store (a bug or an unsupported feature).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A failure that may succeed if tried again (network, 5xx, throttling, timeout).
    #[error("transient store error: {0}")]
    Transient(String),
    /// Anything else.
    #[error("store error: {0}")]
    Other(String),
}

/// What stores answer for a key they cannot hold (AWS's, MinIO's for a name it cannot
/// store, the local store's), as the error's text says it.
const KEY_REFUSALS: [&str; 4] = [
    "KeyTooLong",
    "XMinioInvalidObjectName",
    "InvalidObjectName",
    "cannot be stored in a local directory",
];

impl StoreError {
    /// The store refuses the key itself: no try of the same key can succeed (unlike any
    /// other `400`, which a setting of the bucket or the request may cause).
    pub fn refuses_key(&self) -> bool {
        matches!(self, StoreError::Invalid(d) if KEY_REFUSALS.iter().any(|c| d.contains(c)))
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, StoreError::NotFound(_))
    }

    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Transient(_))
    }
}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::NotFound => StoreError::NotFound(e.to_string()),
            std::io::ErrorKind::PermissionDenied => StoreError::AccessDenied(e.to_string()),
            _ if e.raw_os_error() == Some(libc::ENOSPC) => StoreError::NoSpace(e.to_string()),
            _ => StoreError::Other(e.to_string()),
        }
    }
}
