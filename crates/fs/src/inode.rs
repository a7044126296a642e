//! The inode table.

/// An inode number as the kernel sees it.
pub type Ino = u64;

/// The mount root.
pub const ROOT_INO: Ino = 1;
