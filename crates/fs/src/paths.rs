//! The two names of a file: its path below the mount root ([`MountPath`]), which the kernel's
//! calls resolve, and its object key ([`ObjectKey`]), which the store is asked about; and the
//! one rule from the first to the second ([`Keys`]). Separate types, so that one is never
//! passed where the other is meant.

use std::fmt;
use std::ops::Deref;

/// Where a file is below the mount root: names joined by `/`, no `/` at either end; the root
/// is the empty path. Never a key: [`crate::namespace::Namespace::key`] maps it to one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MountPath(String);

impl MountPath {
    /// The mount root.
    pub fn root() -> Self {
        Self(String::new())
    }

    /// A path spelled `s` (names joined by `/`, as the namespace writes them).
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    /// `name` in this directory.
    pub fn join(&self, name: &str) -> MountPath {
        if self.0.is_empty() {
            Self(name.to_string())
        } else {
            Self(format!("{}/{name}", self.0))
        }
    }

    /// Whether this path is strictly below directory `dir`.
    pub fn is_below(&self, dir: &MountPath) -> bool {
        match dir.0.is_empty() {
            true => !self.0.is_empty(),
            false => {
                self.0.len() > dir.0.len() + 1
                    && self.0.starts_with(&dir.0)
                    && self.0.as_bytes()[dir.0.len()] == b'/'
            }
        }
    }

    /// This path with directory `from` (which it is at or below) replaced by `to`.
    pub fn moved(&self, from: &MountPath, to: &MountPath) -> MountPath {
        if self == from {
            return to.clone();
        }
        let rest = &self.0[from.0.len() + usize::from(!from.0.is_empty())..];
        to.join(rest)
    }
}

impl fmt::Display for MountPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The mount's rule from paths to keys: a path below the mount root is a key below its
/// prefix (empty, or ending in `/`).
#[derive(Clone, Debug, Default)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// The rule for a mount of key prefix `prefix` (normalized, see [`crate::namespace::names::normalize_prefix`]).
    pub fn new(prefix: String) -> Self {
        Self { prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The key of the file at `path`.
    pub fn key(&self, path: &MountPath) -> ObjectKey {
        ObjectKey(format!("{}{path}", self.prefix))
    }

    /// Key prefix of a directory's children (and its marker's key).
    pub fn dir_key(&self, path: &MountPath) -> ObjectKey {
        if path.is_root() {
            ObjectKey(self.prefix.clone())
        } else {
            ObjectKey(format!("{}{path}/", self.prefix))
        }
    }
}

/// An object key of the bucket: the mount prefix, then a mount path (a directory's key, the
/// key of its marker and the prefix of its children, ends in `/`). What the store is asked
/// about; it reads as the `&str` the store takes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey(String);

impl ObjectKey {
    /// A key spelled `s`, as the store gives or takes it.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl Deref for ObjectKey {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for MountPath {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}

impl From<&str> for ObjectKey {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}

impl PartialEq<str> for ObjectKey {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        let (a, ab, abc) = (
            MountPath::new("a"),
            MountPath::new("a/b"),
            MountPath::new("a/bc"),
        );
        assert_eq!(MountPath::root().join("a"), a);
        assert_eq!(a.join("b"), ab);
        assert!(ab.is_below(&a) && abc.is_below(&a) && a.is_below(&MountPath::root()));
        assert!(!a.is_below(&a) && !MountPath::new("ab").is_below(&a));
        assert!(!abc.is_below(&ab));
        let x = MountPath::new("x");
        assert_eq!(ab.moved(&a, &x), MountPath::new("x/b"));
        assert_eq!(a.moved(&a, &x), x);
        assert_eq!(a.moved(&MountPath::root(), &x), MountPath::new("x/a"));
    }
}
