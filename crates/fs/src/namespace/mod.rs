//! What is at each path: the inode table, the stat cache and listings, directory markers
//! and the mapping between file names and object keys.

pub mod inode;
pub mod lookup;
pub mod markers;
pub mod names;
