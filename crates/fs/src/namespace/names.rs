//! Which names can be entries, and the mount prefix.
//!
//! A file `a/b` under mount prefix `p/` is the key `p/a/b`; a directory is `p/a/b/` (a marker
//! object) or just the prefix of other keys (the rule is [`crate::paths::Keys`]). Names the
//! kernel cannot show are skipped in listings: empty segments (`a//b`), `.` and `..`, and names over 255 bytes; so is
//! [`UNLINKED_DIR`] at the root.

use crate::error::{FsError, FsResult};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

/// Longest file name, in bytes.
pub const NAME_MAX: usize = 255;

/// Directory at the mount root, never listed, that keeps the objects of files unlinked while
/// still open here until their last close (as NFS keeps `.nfsXXXX` files). Nothing may be
/// created under this name at the root.
pub const UNLINKED_DIR: &str = ".bucketfs-unlinked";

/// The suffix under which MinIO stores a directory marker `name/` (as the file
/// `name__XLDIR__`): to MinIO a key ending with it is that marker, so a file of such a name
/// would be, or overwrite, the directory `name` and its attributes. Names ending with it are
/// neither shown nor made, on every store.
pub const MARKER_ALIAS_SUFFIX: &str = "__XLDIR__";

/// Checks a name coming from the kernel and returns it as UTF-8.
pub fn check_name(name: &OsStr) -> FsResult<&str> {
    let b = name.as_bytes();
    if b.len() > NAME_MAX {
        return Err(FsError::ENAMETOOLONG);
    }
    if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') {
        return Err(FsError::EINVAL);
    }
    // Object keys are UTF-8; a name that is not cannot be stored.
    std::str::from_utf8(b).map_err(|_| FsError::EINVAL)
}

/// Whether a name found in a listing can be shown as a directory entry.
pub fn listable(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= NAME_MAX
        && !name.contains('\0')
        && !name.ends_with(MARKER_ALIAS_SUFFIX)
}

/// Key prefix of the hidden copies of files unlinked while open, for a mount of `prefix`
/// (normalized): objects there belong to the daemon that wrote them and must not outlive it.
pub fn unlinked_key_prefix(prefix: &str) -> String {
    format!("{prefix}{UNLINKED_DIR}/")
}

/// Turns a user-supplied prefix (`some/prefix`, `/x/`, ``) into the key prefix of the mount
/// root: empty, or ending with exactly one `/`.
pub fn normalize_prefix(p: &str) -> String {
    let t = p.trim_matches('/');
    if t.is_empty() {
        String::new()
    } else {
        format!("{t}/")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(check_name(OsStr::new(&"a".repeat(255))).is_ok());
        assert_eq!(
            check_name(OsStr::new(&"a".repeat(256))),
            Err(FsError::ENAMETOOLONG)
        );
        assert_eq!(check_name(OsStr::new("..")), Err(FsError::EINVAL));
        assert!(check_name(OsStr::new("sp ace%+?#\nü")).is_ok());
        assert_eq!(normalize_prefix("/a/b/"), "a/b/");
        assert_eq!(normalize_prefix(""), "");
        assert!(!listable(""));
    }
}
