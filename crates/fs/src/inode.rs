//! The inode table: which inode numbers the kernel holds, what path each names, and the
//! attributes last learned for it.
//!
//! An inode lives while the kernel holds lookups on it or a handle is open; `forget` and the
//! last `release` drop it. Paths are relative to the mount prefix, without a trailing `/`; the
//! root is the empty path.

use crate::meta::{Attr, FileKind};
use crate::write::WriteState;
use bucketfs_store::UserMeta;
use bytes::Bytes;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

/// An inode number as the kernel sees it.
pub type Ino = u64;

/// The mount root.
pub const ROOT_INO: Ino = 1;

/// The names a complete listing of a directory showed, for negative lookups and statahead.
pub struct DirListing {
    pub at: Instant,
    /// Sorted by byte order.
    pub names: Vec<String>,
    /// Names created here since the listing.
    pub added: HashSet<String>,
    /// Lookups of names it showed so far: statahead waits for the second (see `listing_says`).
    pub hits: u32,
}

impl DirListing {
    pub fn new(names: Vec<String>) -> Self {
        Self {
            at: Instant::now(),
            names,
            added: HashSet::new(),
            hits: 0,
        }
    }
}

/// A file open for writing: its shared dirty state and its size (readable without the lock).
pub struct OpenWrite {
    pub state: tokio::sync::Mutex<WriteState>,
    pub size: Arc<AtomicU64>,
}

pub struct Inode {
    pub ino: Ino,
    pub parent: Ino,
    pub name: String,
    pub path: String,
    pub kind: FileKind,
    pub attr: Attr,
    /// When `attr` came from the store; `None` for inodes that exist only here so far.
    pub fetched: Option<Instant>,
    pub etag: Option<String>,
    /// Stored user metadata, kept so rewrites and chmod preserve keys we do not interpret.
    pub user: UserMeta,
    /// Directories: whether a `path/` marker object exists.
    pub has_marker: bool,
    pub symlink_target: Option<Bytes>,
    /// ETag of the content the kernel may hold in its page cache from an earlier open.
    pub cached_etag: Option<String>,
    pub lookups: u64,
    pub open_handles: u64,
    /// Open handles that may write (they share `write`).
    pub writers: u64,
    pub write: Option<Arc<OpenWrite>>,
    /// Directories: the last complete listing.
    pub listing: Option<DirListing>,
    /// Removed from its directory while still referenced.
    pub unlinked: bool,
    /// Unlinked while open: `path` is now a hidden one (see [`crate::names::UNLINKED_DIR`])
    /// whose object the last close deletes.
    pub hidden: bool,
}

impl Inode {
    /// An inode just learned from the store (or made here), not referenced by anyone yet.
    pub fn new(
        ino: Ino,
        parent: Ino,
        name: String,
        path: String,
        kind: FileKind,
        attr: Attr,
    ) -> Self {
        Inode {
            ino,
            parent,
            name,
            path,
            kind,
            attr,
            fetched: Some(Instant::now()),
            etag: None,
            user: UserMeta::new(),
            has_marker: false,
            symlink_target: None,
            cached_etag: None,
            listing: None,
            lookups: 0,
            open_handles: 0,
            writers: 0,
            write: None,
            unlinked: false,
            hidden: false,
        }
    }
}

#[derive(Default)]
pub struct InodeTable {
    inodes: HashMap<Ino, Inode>,
    children: HashMap<(Ino, String), Ino>,
    next: Ino,
}

impl InodeTable {
    pub fn new(root: Inode) -> Self {
        let mut t = InodeTable {
            next: ROOT_INO + 1,
            ..Default::default()
        };
        t.inodes.insert(ROOT_INO, root);
        t
    }

    pub fn get(&self, ino: Ino) -> Option<&Inode> {
        self.inodes.get(&ino)
    }

    pub fn get_mut(&mut self, ino: Ino) -> Option<&mut Inode> {
        self.inodes.get_mut(&ino)
    }

    pub fn child(&self, parent: Ino, name: &str) -> Option<Ino> {
        self.children.get(&(parent, name.to_string())).copied()
    }

    pub fn alloc(&mut self) -> Ino {
        let ino = self.next;
        self.next += 1;
        ino
    }

    /// Adds `inode` as `name` in its parent, replacing whatever was there.
    pub fn insert(&mut self, inode: Inode) {
        let key = (inode.parent, inode.name.clone());
        if let Some(old) = self.children.insert(key, inode.ino) {
            if old != inode.ino {
                self.detach(old);
            }
        }
        self.inodes.insert(inode.ino, inode);
    }

    /// Marks an inode as gone from its directory; it stays until the kernel forgets it.
    pub fn detach(&mut self, ino: Ino) {
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.unlinked = true;
            let key = (i.parent, i.name.clone());
            if self.children.get(&key) == Some(&ino) {
                self.children.remove(&key);
            }
        }
        self.maybe_drop(ino);
    }

    /// Removes the entry `name` of `parent`, if any.
    pub fn remove_child(&mut self, parent: Ino, name: &str) {
        if let Some(ino) = self.child(parent, name) {
            self.detach(ino);
        }
    }

    /// Drops an inode nobody references any more.
    pub fn maybe_drop(&mut self, ino: Ino) {
        let Some(i) = self.inodes.get(&ino) else {
            return;
        };
        if ino == ROOT_INO || i.lookups > 0 || i.open_handles > 0 || i.write.is_some() {
            return;
        }
        let key = (i.parent, i.name.clone());
        if self.children.get(&key) == Some(&ino) {
            self.children.remove(&key);
        }
        self.inodes.remove(&ino);
    }

    /// The paths of files unlinked while open whose hidden objects are still to delete,
    /// which are then no longer theirs to delete (at shutdown).
    pub fn take_hidden(&mut self) -> Vec<String> {
        self.inodes
            .values_mut()
            .filter(|i| i.hidden)
            .map(|i| {
                i.hidden = false;
                i.path.clone()
            })
            .collect()
    }

    pub fn forget(&mut self, ino: Ino, n: u64) {
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.lookups = i.lookups.saturating_sub(n);
        }
        self.maybe_drop(ino);
    }

    /// Moves `ino` to `name` in `parent` and rewrites the paths of everything below it.
    pub fn rename(&mut self, ino: Ino, parent: Ino, name: &str, parent_path: &str) {
        let Some(i) = self.inodes.get(&ino) else {
            return;
        };
        let old_key = (i.parent, i.name.clone());
        let old_path = i.path.clone();
        if self.children.get(&old_key) == Some(&ino) {
            self.children.remove(&old_key);
        }
        if let Some(replaced) = self.children.insert((parent, name.to_string()), ino) {
            if replaced != ino {
                self.detach(replaced);
            }
        }
        let new_path = join(parent_path, name);
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.parent = parent;
            i.name = name.to_string();
            i.path = new_path.clone();
        }
        let below = format!("{old_path}/");
        for i in self.inodes.values_mut() {
            if i.path.starts_with(&below) {
                i.path = format!("{new_path}/{}", &i.path[below.len()..]);
            }
        }
    }

    /// Inodes below directory path `dir` (any depth).
    pub fn descendants(&self, dir: &str) -> Vec<Ino> {
        let below = if dir.is_empty() {
            String::new()
        } else {
            format!("{dir}/")
        };
        self.inodes
            .values()
            .filter(|i| i.ino != ROOT_INO && i.path.starts_with(&below) && !i.unlinked)
            .map(|i| i.ino)
            .collect()
    }

    /// Children of `parent` known here (including ones not yet in the store).
    pub fn children_of(&self, parent: Ino) -> Vec<&Inode> {
        self.inodes
            .values()
            .filter(|i| i.parent == parent && i.ino != ROOT_INO && !i.unlinked)
            .collect()
    }

    pub fn all_writes(&self) -> Vec<Arc<OpenWrite>> {
        self.inodes
            .values()
            .filter_map(|i| i.write.clone())
            .collect()
    }

    pub fn len(&self) -> usize {
        self.inodes.len()
    }
}

/// `dir/name`, or `name` at the root.
pub fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}
