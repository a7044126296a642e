//! The inode table: which inode numbers the kernel holds, what path each names, and the
//! attributes last learned for it.
//!
//! An inode lives while the kernel holds lookups on it or a handle is open; `forget` and the
//! last `release` drop it. Its number outlives it (see [`Origins`]): the next lookup of the same
//! file gives the same `st_ino`. Paths are relative to the mount prefix, without a trailing
//! `/`; the root is the empty path.

use crate::meta::{Attr, FileKind, Ino, ROOT_INO};
use crate::paths::MountPath;
use bucketfs_store::UserMeta;
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::ops::Bound;
use std::time::{Duration, Instant};

/// The names a complete listing of a directory showed, for negative lookups and statahead.
pub struct DirListing {
    pub at: Instant,
    /// Sorted by byte order.
    pub names: Vec<String>,
    /// Names created here since the listing.
    pub added: HashSet<String>,
    /// Names removed here since the listing (unlinked, removed, renamed away).
    pub removed: HashSet<String>,
    /// Lookups of names it showed so far: statahead waits for the second (see `listing_says`).
    pub hits: u32,
}

impl DirListing {
    /// Whether some entry is left, as far as this listing and the changes made here since
    /// say.
    pub fn holds_entries(&self) -> bool {
        !self.added.is_empty() || self.names.iter().any(|n| !self.removed.contains(n))
    }

    /// A listing of `names` as the store said them at `at`.
    pub fn new(names: Vec<String>, at: Instant) -> Self {
        Self {
            at,
            names,
            added: HashSet::new(),
            removed: HashSet::new(),
            hits: 0,
        }
    }
}

/// What the kernel's page cache of a file holds, as far as this mount can tell. The kernel
/// fills it from this mount's reads and hands it to any descriptor without asking; an open
/// without `FOPEN_KEEP_CACHE` (other than a passthrough one) drops it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelPages {
    /// Nothing since an open dropped them.
    Dropped,
    /// Only bytes of this version, read through this mount.
    Of(String),
    /// Bytes of several versions, or of content written here, or not known: the next open
    /// drops them.
    Unknown,
}

impl KernelPages {
    /// A read through this mount filled pages with bytes of version `etag` (None: not
    /// known).
    pub fn filled(&mut self, etag: Option<&str>) {
        *self = match (&*self, etag) {
            (Self::Dropped, Some(e)) => Self::Of(e.to_string()),
            (Self::Of(o), Some(e)) if o == e => return,
            _ => Self::Unknown,
        };
    }

    /// This mount's own copy gave version `old` the ETag `new`: the same bytes.
    pub fn retag(&mut self, old: &str, new: &str) {
        if matches!(self, Self::Of(e) if e == old) {
            *self = Self::Of(new.to_string());
        }
    }

    /// Whether a read of version `etag` can leave this as it is.
    pub fn holds(&self, etag: Option<&str>) -> bool {
        match self {
            Self::Dropped => false,
            Self::Of(o) => Some(o.as_str()) == etag,
            Self::Unknown => true,
        }
    }

    /// Whether every page held is of version `etag` (none is).
    pub fn only_of(&self, etag: Option<&str>) -> bool {
        match self {
            Self::Dropped => true,
            Self::Of(o) => Some(o.as_str()) == etag,
            Self::Unknown => false,
        }
    }
}

pub struct Inode {
    pub ino: Ino,
    pub parent: Ino,
    pub name: String,
    pub path: MountPath,
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
    /// What the kernel's page cache of the file holds.
    pub pages: KernelPages,
    /// Opens that made the kernel drop its pages (see [`KernelPages`]).
    pub page_drops: u64,
    /// `learned_changes` at the last of them: an open keeps the pages only while it is
    /// unchanged (after another client's change the next open drops them, so that a file
    /// changed over and over is read anew by each open, as before the pages were kept).
    pub pages_learned: u64,
    /// Times this mount learnt from the store a version other than the one it knew (another
    /// client's change): a descriptor opened before then reads the version it opened.
    pub learned_changes: u64,
    /// The sizes the kernel may still hold valid while the inode names another client's
    /// version learnt here (see [`KernelSizes`]).
    pub kernel_sizes: Option<KernelSizes>,
    pub lookups: u64,
    pub open_handles: u64,
    /// A write state of this mount holds the file's content and attributes (see
    /// [`crate::files`]): they are newer than the store's, and the inode stays.
    pub writing: bool,
    /// Directories: the last complete listing.
    pub listing: Option<DirListing>,
    /// Removed from its directory while still referenced.
    pub unlinked: bool,
    /// Unlinked while open: `path` is now a hidden one (see [`crate::namespace::names::UNLINKED_DIR`])
    /// whose object the last close deletes.
    pub hidden: bool,
    /// An unlink of the file, or a rename over it, that counted its open descriptors (those
    /// it keeps the file's bytes for) is under way: opens wait for it to end.
    pub removing: u32,
}

/// The sizes the kernel may still hold valid for another client's version `etag`, learnt
/// here at `learnt`, for T after that: those of the versions learnt within T before it, and
/// of the one before them. The kernel drops a reply that told it a later version when one of
/// its own updates of the inode's attributes races it (see
/// [`super::Namespace::stale_attrs_soon`]), so it may still hold any of them.
pub struct KernelSizes {
    pub etag: String,
    pub least: u64,
    pub most: u64,
    pub learnt: Instant,
}

impl Inode {
    /// Attributes `a` of the object as the store has it now (ETag `etag`, user metadata
    /// `user`) keep the ctime this inode shows while it is the same version with the same
    /// metadata: after a change made here that is the time of the change, which the object's
    /// `Last-Modified` (set by the store a moment later) would replace once T passed, with no
    /// change to the file. GNU tar compares a file's ctime before and after reading it: such
    /// a jump was "file changed as we read it" (exit 1). Another client's chmod keeps the
    /// ETag on some stores, not the metadata: its ctime is the store's.
    pub fn keep_ctime(&self, etag: &Option<String>, user: &UserMeta, a: &mut Attr) {
        if self.etag.is_some() && self.etag == *etag && self.user == *user {
            a.ctime = self.attr.ctime;
        }
    }

    /// Notes that another client's version `etag` of `size` bytes replaces the one `self`
    /// names (before `attr` and `etag` take it in), and the sizes the kernel may hold for it
    /// (see [`KernelSizes`]); true if one of them is less than `size`. Not for a file being
    /// written here, whose size the kernel has from this mount. `ttl`: T.
    pub fn learned_version(&mut self, size: u64, etag: &Option<String>, ttl: Duration) -> bool {
        self.learned_changes += 1;
        let (least, most) = self.kernel_size_range(ttl);
        self.kernel_sizes = match (self.writing, etag) {
            (false, Some(e)) => Some(KernelSizes {
                etag: e.clone(),
                least: least.min(size),
                most: most.max(size),
                learnt: Instant::now(),
            }),
            _ => None,
        };
        self.kernel_sizes.is_some() && least < size
    }

    /// Whether the kernel may hold valid a size smaller (`.0`) or larger (`.1`) than that of
    /// the version `self` names (see [`KernelSizes`]). Neither once T (`ttl`) passed since it
    /// was learnt: every size the kernel was told before then has expired.
    pub fn kernel_may_hold_other_sizes(&self, ttl: Duration) -> (bool, bool) {
        let (least, most) = self.kernel_size_range(ttl);
        (least < self.attr.size, most > self.attr.size)
    }

    /// The least and the most size the kernel may hold valid for the version `self` names: a
    /// size it was told T (`ttl`) or longer before has expired (a stat, a lookup or a read
    /// past it asks again; a read within it does not, which is left).
    fn kernel_size_range(&self, ttl: Duration) -> (u64, u64) {
        let size = self.attr.size;
        match &self.kernel_sizes {
            Some(k) if self.etag.as_ref() == Some(&k.etag) && k.learnt.elapsed() < ttl => {
                (size.min(k.least), size.max(k.most))
            }
            _ => (size, size),
        }
    }

    /// An inode just learned from the store (or made here), not referenced by anyone yet.
    pub fn new(
        ino: Ino,
        parent: Ino,
        name: String,
        path: MountPath,
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
            pages: KernelPages::Unknown,
            page_drops: 0,
            pages_learned: 0,
            learned_changes: 0,
            kernel_sizes: None,
            listing: None,
            lookups: 0,
            open_handles: 0,
            writing: false,
            unlinked: false,
            hidden: false,
            removing: 0,
        }
    }
}

#[derive(Default)]
pub struct InodeTable {
    inodes: HashMap<Ino, Inode>,
    /// Each directory's entries, in order: one directory's are a range (see
    /// [`Self::children_of`]), not a scan of every inode.
    children: BTreeMap<(Ino, String), Ino>,
    /// The next fresh number (see [`Origins`]); hashed numbers have the top bit set instead.
    next: Ino,
    origins: Origins,
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

    /// The number of a file found or made at `path` that has no inode here now: the number it
    /// had before the kernel forgot it, if it had one. Never one an inode here holds.
    pub fn ino_for(&mut self, path: &MountPath) -> Ino {
        let path = path.as_str();
        let origin = self.origins.origin(path, &mut self.next);
        let ino = ino_of_origin(&origin);
        if !self.inodes.contains_key(&ino) {
            return ino;
        }
        // A file still held under that number (unlinked but open, replaced by one of another
        // type, or a hash collision): this one starts an origin of its own.
        self.origins.fresh(path, &mut self.next)
    }

    /// The number readdir shows for `name` in `parent` at `path`: the one lookup gives.
    pub fn entry_ino(&mut self, parent: Ino, name: &str, path: &MountPath) -> Ino {
        match self.child(parent, name) {
            Some(ino) => ino,
            None => self.ino_for(path),
        }
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

    /// `ino` was deleted (unlink, rmdir, or a file that was never stored): its number and those
    /// of anything that was below it need not be kept any more.
    pub fn removed(&mut self, ino: Ino) {
        if let Some(i) = self.inodes.get(&ino) {
            // Still its parent's entry: not already replaced by a rename or a new file.
            if self.children.get(&(i.parent, i.name.clone())) == Some(&ino) {
                let path = i.path.clone();
                self.origins.remove_tree(path.as_str());
            }
        }
        self.detach(ino);
    }

    /// The store says `name` of `parent` does not exist (any more): drops its entry, if any,
    /// and the numbers kept for it.
    /// Whether `name` in directory `parent` is at `path` (a rename of the directory, or of
    /// one above it, changes that).
    pub fn names_at(&self, parent: Ino, name: &str, path: &MountPath) -> bool {
        self.get(parent).is_some_and(|p| p.path.join(name) == *path)
    }

    pub fn remove_child(&mut self, parent: Ino, name: &str) {
        if let Some(p) = self.inodes.get(&parent) {
            let path = p.path.join(name);
            self.origins.remove_tree(path.as_str());
        }
        if let Some(ino) = self.child(parent, name) {
            self.detach(ino);
        }
    }

    /// Drops an inode nobody references any more.
    pub fn maybe_drop(&mut self, ino: Ino) {
        let Some(i) = self.inodes.get(&ino) else {
            return;
        };
        if ino == ROOT_INO || i.lookups > 0 || i.open_handles > 0 || i.writing {
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
    pub fn take_hidden(&mut self) -> Vec<MountPath> {
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
    pub fn rename(&mut self, ino: Ino, parent: Ino, name: &str, parent_path: &MountPath) {
        let Some(i) = self.inodes.get(&ino) else {
            return;
        };
        let old_key = (i.parent, i.name.clone());
        let old_path = i.path.clone();
        let new_path = parent_path.join(name);
        // The file keeps its number, and a directory's descendants theirs, under the new name.
        let mut origin = self.origins.origin(old_path.as_str(), &mut self.next);
        if ino_of_origin(&origin) != ino {
            origin = fresh_origin(ino);
        }
        self.origins
            .rename(old_path.as_str(), new_path.as_str(), origin);
        if self.children.get(&old_key) == Some(&ino) {
            self.children.remove(&old_key);
        }
        if let Some(replaced) = self.children.insert((parent, name.to_string()), ino) {
            if replaced != ino {
                self.detach(replaced);
            }
        }
        let mut is_dir = false;
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.parent = parent;
            i.name = name.to_string();
            i.path = new_path.clone();
            is_dir = i.kind == FileKind::Dir;
        }
        // Only a directory has paths below it: a file's rename scans no other inode.
        if is_dir {
            for i in self.inodes.values_mut() {
                if i.path.is_below(&old_path) {
                    i.path = i.path.moved(&old_path, &new_path);
                }
            }
        }
    }

    /// Inodes below directory path `dir` (any depth).
    pub fn descendants(&self, dir: &MountPath) -> Vec<Ino> {
        self.inodes
            .values()
            .filter(|i| i.ino != ROOT_INO && i.path.is_below(dir) && !i.unlinked)
            .map(|i| i.ino)
            .collect()
    }

    /// Children of `parent` known here (including ones not yet in the store).
    pub fn children_of(&self, parent: Ino) -> Vec<&Inode> {
        self.children
            .range((parent, String::new())..)
            .take_while(|((p, _), _)| *p == parent)
            .filter_map(|(_, ino)| self.inodes.get(ino))
            .filter(|i| i.parent == parent && i.ino != ROOT_INO && !i.unlinked)
            .collect()
    }

    pub fn len(&self) -> usize {
        self.inodes.len()
    }
}

/// Bytes [`Origins`] keeps at most (about 100,000 files renamed from and to 100-byte paths).
const MAX_ORIGIN_BYTES: usize = 64 << 20;
/// What one kept path costs beyond its strings (map nodes, the eviction order).
const ORIGIN_OVERHEAD: usize = 96;

/// Inode numbers that survive forget. A path's number is a hash of its *origin*: the path it
/// had when this mount first numbered it. For almost every file that is the path itself, so
/// nothing is stored and a file the kernel forgot gets its number back at the next lookup.
/// Stored are only the exceptions: a path renamed here keeps the origin it had (and, being a
/// prefix, so do the paths below a renamed directory) unless its new parent's origin joined
/// with its name gives that anyway (see [`Origins::derived`]: not always its own path), and
/// a path whose origin belongs to another file still known (a renamed one, or an inode still
/// held under that number) starts a fresh one, `"\0#<number>"` (no name holds NUL). An
/// exception is dropped when its path is deleted; past [`MAX_ORIGIN_BYTES`] the oldest is
/// dropped (that path's number changes after its next forget; numbers stay unique).
#[derive(Default)]
struct Origins {
    /// Path -> its origin and when it was stored.
    of: BTreeMap<String, (String, u64)>,
    /// Origin -> the path that holds it (the reverse of `of`).
    held: HashMap<String, String>,
    /// Stored when -> path, oldest first.
    order: BTreeMap<u64, String>,
    seq: u64,
    bytes: usize,
}

/// What [`Origins`] spends on one stored path (it holds the path three times, the origin twice).
fn cost(path: &str, origin: &str) -> usize {
    3 * path.len() + 2 * origin.len() + ORIGIN_OVERHEAD
}

fn fresh_origin(ino: Ino) -> String {
    format!("\0#{ino:x}")
}

/// The number of an origin: a fresh one's own, else a hash with the top bit set (fresh
/// numbers count up from 2, so the two never meet).
fn ino_of_origin(origin: &str) -> Ino {
    if let Some(n) = origin.strip_prefix("\0#") {
        if let Ok(ino) = Ino::from_str_radix(n, 16) {
            return ino;
        }
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    origin.hash(&mut h);
    h.finish() | (1 << 63)
}

impl Origins {
    /// The origin of `path`, walking down from the root: a stored one where there is one,
    /// else the parent's origin joined with the name, unless another path holds that (then a
    /// fresh one, stored).
    fn origin(&mut self, path: &str, next: &mut Ino) -> String {
        if self.of.is_empty() {
            // Nothing renamed: every path is its own origin.
            return path.to_string();
        }
        let mut origin = String::new();
        let mut end = 0;
        for name in path.split('/') {
            end += name.len();
            let at = &path[..end];
            match self.of.get(at) {
                Some((o, _)) => origin.clone_from(o),
                None => {
                    origin = join(&origin, name);
                    if self.held.contains_key(&origin) {
                        origin = fresh_origin(self.fresh(at, next));
                    }
                }
            }
            end += 1;
        }
        origin
    }

    /// Gives `path` a fresh origin; returns its number.
    fn fresh(&mut self, path: &str, next: &mut Ino) -> Ino {
        let ino = *next;
        *next += 1;
        self.set(path.to_string(), fresh_origin(ino));
        ino
    }

    fn set(&mut self, path: String, origin: String) {
        self.remove(&path);
        // Not kept when a lookup derives it anyway. Not merely when it is the path itself:
        // below a directory whose origin is not its own path (made fresh where a renamed one
        // was), a file moved back to the path it was first numbered at derives another one.
        if self.derived(&path).as_deref() == Some(origin.as_str()) {
            return;
        }
        self.seq += 1;
        self.bytes += cost(&path, &origin);
        self.held.insert(origin.clone(), path.clone());
        self.order.insert(self.seq, path.clone());
        self.of.insert(path, (origin, self.seq));
        while self.bytes > MAX_ORIGIN_BYTES {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.remove(&oldest);
        }
    }

    /// The origin [`Self::origin`] gives `path` while nothing is stored for `path` itself:
    /// its parent's origin joined with its name. None where that walk would start a fresh
    /// origin (an origin on the way is held by another path), which only a stored one
    /// avoids. Changes nothing.
    fn derived(&self, path: &str) -> Option<String> {
        let mut origin = String::new();
        let mut end = 0;
        for name in path.split('/') {
            end += name.len();
            let at = &path[..end];
            match self.of.get(at).filter(|_| end < path.len()) {
                Some((o, _)) => origin.clone_from(o),
                None => {
                    origin = join(&origin, name);
                    if self.held.contains_key(&origin) {
                        return None;
                    }
                }
            }
            end += 1;
        }
        Some(origin)
    }

    fn remove(&mut self, path: &str) {
        if let Some((origin, seq)) = self.of.remove(path) {
            self.bytes -= cost(path, &origin);
            self.order.remove(&seq);
            if self.held.get(&origin).is_some_and(|p| p == path) {
                self.held.remove(&origin);
            }
        }
    }

    /// Stored paths at and below `path`.
    fn tree(&self, path: &str) -> Vec<String> {
        let below = format!("{path}/");
        let mut v: Vec<String> = self
            .of
            .range::<str, _>((Bound::Included(below.as_str()), Bound::Unbounded))
            .take_while(|(p, _)| p.starts_with(&below))
            .map(|(p, _)| p.clone())
            .collect();
        if self.of.contains_key(path) {
            v.push(path.to_string());
        }
        v
    }

    fn remove_tree(&mut self, path: &str) {
        if self.of.is_empty() {
            return;
        }
        for p in self.tree(path) {
            self.remove(&p);
        }
    }

    /// `old` (with origin `origin`) is now `new`: what was at `new` is gone, and what is
    /// stored below `old` moves below `new`.
    fn rename(&mut self, old: &str, new: &str, origin: String) {
        self.remove_tree(new);
        for p in self.tree(old) {
            if p == old {
                self.remove(&p);
                continue;
            }
            let (o, seq) = self.of.remove(&p).expect("listed");
            let moved = format!("{new}{}", &p[old.len()..]);
            self.bytes = self.bytes + cost(&moved, &o) - cost(&p, &o);
            self.held.insert(o.clone(), moved.clone());
            self.order.insert(seq, moved.clone());
            self.of.insert(moved, (o, seq));
        }
        self.set(new.to_string(), origin);
    }
}

/// `dir/name`, or `name` at the root.
fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}
