//! What is at each path: the one place that answers it, under one freshness rule.
//!
//! [`Namespace`] owns the inode table ([`inode`]), the stat cache with its single-flight
//! probes, statahead and kept listing pages ([`lookup`]), the listings readdir streams and
//! the negative entries a complete one leaves ([`listing`]), the directory markers still on
//! their way ([`markers`]) and the rule mapping names to keys ([`names`]). It knows nothing of
//! open files' bytes: an inode whose content a write state of this mount holds is only marked
//! [`inode::Inode::writing`], and whoever asks for its size asks [`crate::files`].
//!
//! The freshness rule: what the store said of a path is believed for the stat TTL
//! ([`Namespace::fresh`]); after that, or once [`Namespace::refresh`] or a change made here
//! marks it stale, the next lookup asks the store again. Inodes being written here are always
//! fresh (this mount has the newer version).

pub mod inode;
pub mod listing;
pub mod lookup;
pub mod markers;
pub mod names;
pub mod saved;

use crate::error::{log_store_err, FsError, FsResult};
use crate::meta::{Attr, AttrPolicy, FileKind, Ino, PosixMeta, ROOT_INO};
use crate::metrics::{inc, FsMetrics};
use crate::paths::{Keys, MountPath, ObjectKey};
use bucketfs_store::{ListDetail, ListFrom, ObjectMeta, ObjectStore, UserMeta};
use inode::{Inode, InodeTable};
use listing::{DirMisses, DirStream, ListingSays};
use lookup::{CacheLimits, Found, Lookups};
use markers::PendingMarkers;
use names::{check_name, UNLINKED_DIR};
use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Longest object key S3 accepts, in bytes.
pub(crate) const MAX_KEY_LEN: usize = 1024;

/// Times a lookup asks the store again when its directory moved before the answer came.
const MOVED_TRIES: usize = 3;

/// A name no entry may have: the one at the mount root that holds files unlinked while
/// open, and any ending with MinIO's name for directory markers (see
/// [`names::MARKER_ALIAS_SUFFIX`]).
pub fn is_reserved(parent: Ino, name: &str) -> bool {
    (parent == ROOT_INO && name == UNLINKED_DIR) || name.ends_with(names::MARKER_ALIAS_SUFFIX)
}

/// Per directory, names made (true) or removed (false) here, with when, oldest first.
type RecentChanges = HashMap<Ino, std::collections::VecDeque<(std::time::Instant, String, bool)>>;

pub struct Namespace {
    store: Arc<dyn ObjectStore>,
    /// Paths to keys.
    keys: Keys,
    pub policy: AttrPolicy,
    ttl: Duration,
    metrics: Arc<FsMetrics>,
    table: Mutex<InodeTable>,
    /// Stat cache, single-flight probes and statahead.
    lookups: Arc<Lookups>,
    /// Lookup misses per directory without a listing (see [`Namespace::list_for_lookups`]).
    dir_misses: Mutex<HashMap<Ino, DirMisses>>,
    /// Names created (or renamed to) here per directory within the stat TTL, and removed
    /// (true, false), oldest first: a listing whose first LIST was sent before one of them
    /// lacks it, or shows it (see [`Namespace::note_added`], [`Namespace::note_removed`]).
    recent_changes: Mutex<RecentChanges>,
    /// Directory markers mkdir has not finished uploading.
    pub markers: PendingMarkers,
    /// Open directory listings by handle.
    dirs: Mutex<HashMap<u64, Arc<tokio::sync::Mutex<DirStream>>>>,
    next_dir_fh: AtomicU64,
    /// What tells the kernel its attributes are stale, and the notices waiting to be sent.
    stale_attrs: Arc<StaleAttrs>,
    /// Inodes [`Namespace::stale_attrs_soon`] tells the kernel of, with when, in that order,
    /// to the task that tells it (started with the first). Not in [`StaleAttrs`], which that
    /// task holds: it ends when the namespace goes.
    stale_attrs_queue: Mutex<Option<tokio::sync::mpsc::UnboundedSender<QueuedNotice>>>,
}

/// When to tell the kernel its attributes of an inode are stale, and the version learnt.
type QueuedNotice = (Instant, Ino, Option<String>);

/// See [`Namespace::on_stale_cache`] and [`Namespace::stale_attrs_soon`].
#[derive(Default)]
struct StaleAttrs {
    hook: Mutex<Option<StaleCache>>,
    /// Per inode, the version a queued notice is for: another one learnt before it is sent
    /// takes it back (see [`Namespace::stale_attrs_soon`]).
    queued: Mutex<HashMap<Ino, Option<String>>>,
}

impl StaleAttrs {
    fn tell(&self, ino: Ino) {
        let f = self.hook.lock().clone();
        if let Some(f) = f {
            f(ino);
        }
    }
}

/// Called with an inode whose kernel-cached attributes may be of an older version.
pub type StaleCache = Arc<dyn Fn(Ino) + Send + Sync>;

/// How long after answering with another client's larger version the kernel is told its
/// attributes are stale (see [`Namespace::stale_attrs_soon`]): long after it took in that
/// answer (microseconds), short against the TTL it would otherwise keep an older size for.
pub const STALE_ATTRS_DELAY: Duration = Duration::from_millis(50);

impl Namespace {
    pub fn new(
        store: Arc<dyn ObjectStore>,
        prefix: String,
        policy: AttrPolicy,
        limits: CacheLimits,
        metrics: Arc<FsMetrics>,
    ) -> Self {
        let keys = Keys::new(prefix);
        let root_attr = policy.attr(
            ROOT_INO,
            FileKind::Dir,
            0,
            &PosixMeta::default(),
            Some(SystemTime::now()),
        );
        let mut root = Inode::new(
            ROOT_INO,
            ROOT_INO,
            String::new(),
            MountPath::root(),
            FileKind::Dir,
            root_attr,
        );
        root.lookups = 1;
        Self {
            lookups: Lookups::new(store.clone(), keys.clone(), limits),
            markers: PendingMarkers::new(store.clone()),
            store,
            keys,
            policy,
            ttl: limits.ttl,
            metrics,
            table: Mutex::new(InodeTable::new(root)),
            dir_misses: Mutex::new(HashMap::new()),
            recent_changes: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            // Apart from file handles' numbers, so that one is never taken for the other.
            next_dir_fh: AtomicU64::new(1 << 62),
            stale_attrs: Arc::default(),
            stale_attrs_queue: Mutex::new(None),
        }
    }

    /// Registers what tells the kernel that its cached attributes of an inode are out of
    /// date.
    pub fn on_stale_cache(&self, f: Option<StaleCache>) {
        *self.stale_attrs.hook.lock() = f;
    }

    /// Tells the kernel now that its attributes of `ino` may be of another version than this
    /// mount's: its next stat, or read past the size it knows, asks again. Not inside a lookup
    /// or getattr (the kernel would drop its reply), nor a read whose short reply shrinks the
    /// size the kernel holds (likewise, its shrink).
    pub fn stale_attrs(&self, ino: Ino) {
        self.stale_attrs.tell(ino);
    }

    /// [`Self::stale_attrs`], while `ino` names version `etag` (a notice for a version
    /// learnt since would race the reads of that one).
    pub fn stale_attrs_of(&self, ino: Ino, etag: Option<&str>) {
        let names = self.with(ino, |i| i.etag.as_deref() == etag);
        if names == Some(true) {
            self.stale_attrs(ino);
        }
    }

    /// [`Self::stale_attrs`], [`STALE_ATTRS_DELAY`] from now: after a reply that carries
    /// another client's version larger than a size the kernel may hold. The kernel drops such
    /// a reply when one of its own updates of the inode's attributes races it (a short read's
    /// among them) and keeps the older size valid for the TTL, while reads serve the new
    /// version: a reader stops at the old size (the new version cut short), and an `mmap` of
    /// `fstat`'s size maps a prefix. Told later, the kernel asks again at the next `stat`, or
    /// read past the size it holds; told inside that request, it would drop the reply every
    /// time. Not for a smaller version: the kernel shrinks its size itself at the short read
    /// that ends it, and a notice racing that read would make it refuse (the read gets zeros
    /// up to the old size), as any update of the inode's attributes racing it does; nor, so,
    /// once another version of `etag`'s inode was learnt before it is sent (see
    /// [`Self::version_learnt`], which marks it queued).
    fn stale_attrs_soon(&self, ino: Ino, etag: Option<String>) {
        let notice = (Instant::now() + STALE_ATTRS_DELAY, ino, etag);
        let mut queue = self.stale_attrs_queue.lock();
        let notice = match queue.as_ref() {
            Some(tx) => match tx.send(notice) {
                Ok(()) => return,
                Err(e) => e.0,
            },
            None => notice,
        };
        // None yet, or the runtime that ran it ended.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<QueuedNotice>();
        let stale = self.stale_attrs.clone();
        drop(rt.spawn(async move {
            while let Some((due, ino, etag)) = rx.recv().await {
                tokio::time::sleep_until(due.into()).await;
                // Only while the inode names the version it was queued for (a later larger
                // one has a notice of its own, due after its answer).
                let still = {
                    let mut queued = stale.queued.lock();
                    let still = queued.get(&ino) == Some(&etag);
                    if still {
                        queued.remove(&ino);
                    }
                    still
                };
                if still {
                    stale.tell(ino);
                }
            }
        }));
        let _ = tx.send(notice);
        *queue = Some(tx);
    }

    /// Another client's version of `ino` was learnt (under the table's lock, so that the
    /// last learnt is the one marked): a notice queued for the one before is not sent;
    /// `tell`: one is for this version, `etag` (see [`Self::stale_attrs_soon`]).
    fn version_learnt(&self, ino: Ino, tell: Option<&Option<String>>) {
        let mut queued = self.stale_attrs.queued.lock();
        match tell {
            Some(etag) if self.stale_attrs.hook.lock().is_some() => {
                queued.insert(ino, etag.clone());
            }
            _ => {
                queued.remove(&ino);
            }
        }
    }

    /// See [`lookup::Lookups::changes_end`].
    pub fn changes_end(&self) {
        self.lookups.changes_end();
    }

    /// Saves directory pages on `disk` for later mounts, and uses theirs (see [`saved`]).
    pub fn save_pages_on(&self, disk: Arc<dyn saved::ListingDisk>) {
        self.lookups.save_pages_on(disk);
    }

    /// The inode table, for changes that must see several inodes at once. Never held across
    /// a store request or another lock.
    pub fn table(&self) -> MutexGuard<'_, InodeTable> {
        self.table.lock()
    }

    /// Runs `f` on inode `ino`, if it is known.
    pub fn with<T>(&self, ino: Ino, f: impl FnOnce(&mut Inode) -> T) -> Option<T> {
        self.table.lock().get_mut(ino).map(f)
    }

    /// Number of inodes the table holds (for tests of forget).
    pub fn inode_count(&self) -> usize {
        self.table.lock().len()
    }

    // ---- keys ----

    /// The key of the file at `path`.
    pub fn key(&self, path: &MountPath) -> ObjectKey {
        self.keys.key(path)
    }

    /// Key prefix of a directory's children (and its marker's key).
    pub fn dir_key(&self, path: &MountPath) -> ObjectKey {
        self.keys.dir_key(path)
    }

    /// Whether `path` is the mount root of a mount without a prefix (no marker object).
    pub fn is_bucket_root(&self, path: &MountPath) -> bool {
        path.is_root() && self.keys.prefix().is_empty()
    }

    /// S3 keys are at most 1,024 bytes; a path whose key (or directory marker) would be longer
    /// cannot be stored.
    pub fn check_key_len(&self, path: &MountPath) -> FsResult<()> {
        if self.dir_key(path).len() > MAX_KEY_LEN {
            Err(FsError::ENAMETOOLONG)
        } else {
            Ok(())
        }
    }

    // ---- freshness ----

    /// A fetch time old enough that `fresh` says no: marks attributes to be asked again.
    pub fn stale_instant(&self) -> Option<Instant> {
        Instant::now().checked_sub(self.ttl + Duration::from_secs(1))
    }

    pub fn fresh(&self, fetched: Option<Instant>) -> bool {
        fetched.is_none_or(|t| t.elapsed() < self.ttl)
    }

    /// How long the kernel may keep what this mount tells it now about `ino` (its entry and
    /// its attributes): what is left of the TTL of what was learnt from the store, so that
    /// another client's change shows within one TTL of the store saying it, not two. All
    /// of it for what this mount alone knows: the root, a file being written here, one
    /// never stored, an unlinked one.
    pub fn kernel_ttl(&self, ino: Ino) -> Duration {
        let t = self.table.lock();
        match t.get(ino) {
            Some(i) if ino != ROOT_INO && !i.writing && !i.unlinked => i
                .fetched
                .map_or(self.ttl, |at| self.ttl.saturating_sub(at.elapsed())),
            _ => self.ttl,
        }
    }

    /// Attributes of `ino` answerable without the store: the root, a directory, an unlinked
    /// file, one being written here, or one fetched within the TTL. `None`: ask the store.
    pub fn known_attr(&self, ino: Ino) -> FsResult<Option<Attr>> {
        let t = self.table.lock();
        let i = t.get(ino).ok_or(FsError::ENOENT)?;
        if ino == ROOT_INO
            || i.kind == FileKind::Dir
            || i.unlinked
            || i.writing
            || self.fresh(i.fetched)
        {
            inc(&self.metrics.attr_hits);
            return Ok(Some(i.attr.clone()));
        }
        Ok(None)
    }

    /// Where `ino` is: its parent and name.
    pub fn place(&self, ino: Ino) -> FsResult<(Ino, String)> {
        let t = self.table.lock();
        let i = t.get(ino).ok_or(FsError::ENOENT)?;
        Ok((i.parent, i.name.clone()))
    }

    /// The attributes last recorded for `ino`.
    pub fn attr(&self, ino: Ino) -> FsResult<Attr> {
        let t = self.table.lock();
        t.get(ino).map(|i| i.attr.clone()).ok_or(FsError::ENOENT)
    }

    /// Path of a directory inode.
    pub fn dir_path(&self, ino: Ino) -> FsResult<MountPath> {
        let t = self.table.lock();
        let i = t.get(ino).ok_or(FsError::ENOENT)?;
        if i.kind != FileKind::Dir {
            return Err(FsError::ENOTDIR);
        }
        Ok(i.path.clone())
    }

    // ---- asking the store what a path is ----

    /// Records what the store said about `name` in `parent` (at `path`) at `at`; returns the
    /// inode's attributes. `None`: the parent is no longer at `path`'s parent (a rename of it
    /// or above it while the store was asked): the answer is about a name nothing here has.
    pub fn remember(
        &self,
        parent: Ino,
        name: &str,
        path: MountPath,
        f: Found,
        lookups: u64,
        at: Instant,
    ) -> Option<Attr> {
        let mut t = self.table.lock();
        if !t.names_at(parent, name, &path) {
            return None;
        }
        if let Some(ino) = t.child(parent, name) {
            let i = t.get_mut(ino).expect("child in table");
            let same_object = match &i.etag {
                Some(e) => f.obj.etag.as_ref() == Some(e),
                None => !i.writing && i.open_handles == 0,
            };
            if listing::listed_as_file(f.kind, i.kind) && same_object {
                // A listing without metadata took this symlink for a file: the same object,
                // so the same inode and number (a new number for it, while the kernel still
                // held the file's, changed its st_ino and d_ino after a drop_caches).
                i.kind = f.kind;
                i.symlink_target = None;
            }
            if i.kind == f.kind {
                let mut a = self.policy.attr_of_object(ino, f.kind, &f.obj);
                if f.kind == FileKind::Dir && i.attr.mtime > a.mtime {
                    // Changed here since its marker was stored (see `dir_changed`).
                    (a.mtime, a.ctime) = (i.attr.mtime, i.attr.ctime.max(a.ctime));
                }
                i.keep_ctime(&f.obj.etag, &f.obj.user, &mut a);
                let mut larger = false;
                let other = another_version(&i.etag, &f.obj.etag);
                if other {
                    larger = i.learned_version(a.size, &f.obj.etag, self.ttl);
                    // A symlink another client pointed elsewhere.
                    i.symlink_target = None;
                }
                // Not an inode the kernel does not hold (this reply makes it anew).
                let tell = larger && i.lookups > 0;
                i.attr = a;
                i.etag = f.obj.etag.clone();
                i.user = f.obj.user;
                i.has_marker = f.has_marker;
                i.fetched = Some(at);
                i.lookups += lookups;
                let attr = i.attr.clone();
                if other {
                    self.version_learnt(ino, tell.then_some(&f.obj.etag));
                }
                drop(t);
                if tell {
                    self.stale_attrs_soon(ino, f.obj.etag);
                }
                return Some(attr);
            }
        }
        let ino = t.ino_for(&path);
        let attr = self.policy.attr_of_object(ino, f.kind, &f.obj);
        let mut i = Inode::new(ino, parent, name.to_string(), path, f.kind, attr.clone());
        i.etag = f.obj.etag;
        i.user = f.obj.user;
        i.has_marker = f.has_marker;
        i.lookups = lookups;
        i.fetched = Some(at);
        t.insert(i);
        Some(attr)
    }

    /// Forgets `name` in `parent` (at `path`), which the store says is not there; false if
    /// the parent is no longer at `path`'s parent (see [`Self::remember`]).
    fn remove_missing(&self, parent: Ino, name: &str, path: &MountPath) -> bool {
        let mut t = self.table.lock();
        if !t.names_at(parent, name, path) {
            return false;
        }
        t.remove_child(parent, name);
        true
    }

    /// Finds `name` in `parent`, from the table while fresh, else from the store; adds
    /// `lookups` references to the inode. The size of a file being written is the one
    /// recorded here, not its live one. A directory renamed while the store was asked is
    /// asked again at its new path, a few times, then `ESTALE` (the kernel looks it up again).
    pub async fn resolve(&self, parent: Ino, name: &OsStr, lookups: u64) -> FsResult<Attr> {
        let name = check_name(name)?;
        if is_reserved(parent, name) {
            return Err(FsError::ENOENT);
        }
        for _ in 0..MOVED_TRIES {
            if let Some(a) = self.resolve_at(parent, name, lookups).await? {
                return Ok(a);
            }
        }
        Err(FsError::ESTALE)
    }

    /// [`Self::resolve`] at the parent's path now; `None`: it moved before the answer came,
    /// or the name changed here and nothing holds it now (the answer may predate that).
    async fn resolve_at(&self, parent: Ino, name: &str, lookups: u64) -> FsResult<Option<Attr>> {
        let parent_path = self.dir_path(parent)?;
        {
            let mut t = self.table.lock();
            if let Some(ino) = t.child(parent, name) {
                let i = t.get_mut(ino).expect("child in table");
                if self.fresh(i.fetched) || i.writing {
                    i.lookups += lookups;
                    inc(&self.metrics.attr_hits);
                    return Ok(Some(i.attr.clone()));
                }
            }
        }
        inc(&self.metrics.attr_misses);
        let path = parent_path.join(name);
        let mut cached = self.lookups.cached_complete(&path);
        let mut says = self.listing_says(parent, name);
        if matches!(says, ListingSays::Unknown) && !self.lookups.known(&path) {
            let detail = match self.listing_lacks(parent, name) {
                true => ListDetail::Plain,
                false => ListDetail::UserMeta,
            };
            if self.list_for_lookups(parent, &parent_path, detail).await {
                cached = self.lookups.cached_complete(&path);
                says = self.listing_says(parent, name);
            }
        }
        match says {
            ListingSays::Absent if !cached => {
                // A fresh complete listing of the parent does not have it. An inode the kernel
                // still holds under the name leaves it, as when the store says so (else the
                // name could not be made again).
                inc(&self.metrics.attr_hits);
                if !self.remove_missing(parent, name, &path) {
                    return Ok(None);
                }
                return Err(FsError::ENOENT);
            }
            ListingSays::Present { window, far_end } => {
                // Keep the window full: refill on a miss, or when its far end is not
                // fetched yet, so the reader never catches up with the statahead. Only then
                // are the window's names copied out of the listing.
                let far_behind =
                    far_end.is_some_and(|n| !self.lookups.known(&parent_path.join(&n)));
                if !cached || far_behind {
                    let ahead = self.listing_names(parent, window, &parent_path);
                    // Pages fetched ahead could lack a directory whose marker is on its way.
                    self.lookups.statahead(ahead, self.markers.len() == 0);
                }
            }
            _ => {}
        }
        // A directory made here whose marker is not up yet would look absent.
        let dir_key = self.dir_key(&path);
        self.markers.wait(&dir_key).await?;
        // The kernel's lookup of a directory usually comes before its listing: let a LIST of
        // it fetch the first page too. Not while a directory made here below is not in the
        // bucket yet (the page would lack it); the epoch is read first, so one made after
        // the check invalidates the page.
        let epoch = self.lookups.epoch();
        let (stat, current) = if lookups > 0 && !self.markers.any_below(&dir_key) {
            self.lookups.stat_before_listing(&path, epoch).await
        } else {
            self.lookups.stat(&path).await
        };
        if !current {
            // This mount changed the name while the store was asked (a truncate, a chmod, a
            // rename over it, an unlink, a create): the answer may predate that. The inode the
            // change left has what the change made; with none there, ask again.
            let mut t = self.table.lock();
            if !t.names_at(parent, name, &path) {
                return Ok(None);
            }
            let Some(ino) = t.child(parent, name) else {
                return Ok(None);
            };
            let i = t.get_mut(ino).expect("child in table");
            i.lookups += lookups;
            return Ok(Some(i.attr.clone()));
        }
        match stat.map(|(f, _)| f) {
            Ok(f) => {
                // Believed for the TTL from when the store said it (a listing's time), not
                // from this lookup.
                let at = self.lookups.learned_at(&path).unwrap_or_else(Instant::now);
                Ok(self.remember(parent, name, path, f, lookups, at))
            }
            Err(e) => {
                if e == FsError::ENOENT && !self.remove_missing(parent, name, &path) {
                    return Ok(None);
                }
                Err(e)
            }
        }
    }

    /// Resolves an existing entry for a call that changes it; returns its inode number.
    pub async fn existing(&self, parent: Ino, name: &OsStr) -> FsResult<Ino> {
        self.resolve(parent, name, 0).await?;
        let name = check_name(name)?;
        self.table.lock().child(parent, name).ok_or(FsError::ENOENT)
    }

    /// The kernel dropped `nlookup` references to `ino`.
    pub fn forget(&self, ino: Ino, nlookup: u64) {
        self.table.lock().forget(ino, nlookup);
    }

    /// Adds one lookup reference (for entries returned by readdirplus).
    pub fn add_lookup(&self, ino: Ino) {
        if let Some(i) = self.table.lock().get_mut(ino) {
            i.lookups += 1;
        }
    }

    // ---- entries made and removed here ----

    /// The checked name and the parent's path, for calls that add an entry.
    pub fn prepare_new(&self, parent: Ino, name: &OsStr) -> FsResult<(String, MountPath)> {
        let name = check_name(name)?.to_string();
        if is_reserved(parent, &name) {
            return Err(FsError::EPERM);
        }
        let parent_path = self.dir_path(parent)?;
        if self.table.lock().child(parent, &name).is_some() {
            return Err(FsError::EEXIST);
        }
        self.check_key_len(&parent_path.join(&name))?;
        Ok((name, parent_path))
    }

    /// Adds a new inode that was just created in the store (or locally, `local_only`).
    #[allow(clippy::too_many_arguments)]
    pub fn add_new(
        &self,
        parent: Ino,
        name: &str,
        path: MountPath,
        kind: FileKind,
        pm: &PosixMeta,
        size: u64,
        etag: Option<String>,
        local_only: bool,
    ) -> (Ino, Attr) {
        self.lookups.forget(&path);
        self.note_added(parent, name);
        self.dir_changed(parent);
        let mut t = self.table.lock();
        let ino = t.ino_for(&path);
        let attr = self
            .policy
            .attr(ino, kind, size, pm, Some(SystemTime::now()));
        let mut i = Inode::new(ino, parent, name.to_string(), path, kind, attr.clone());
        if local_only {
            i.fetched = None;
        }
        i.etag = etag;
        i.user = pm.to_user();
        i.has_marker = kind == FileKind::Dir;
        i.lookups = 1;
        t.insert(i);
        (ino, attr)
    }

    /// An entry of directory `dir` was added or removed here: its mtime and ctime are now.
    /// Kept in memory only (storing them would cost a request per entry); [`Self::remember`]
    /// never moves them back.
    pub fn dir_changed(&self, dir: Ino) {
        self.lookups.changing();
        if let Some(i) = self.table.lock().get_mut(dir) {
            let t = SystemTime::now();
            i.attr.mtime = t;
            i.attr.ctime = t;
        }
    }

    /// `ino` at `path` was deleted from directory `parent` (a directory: and all below it).
    pub fn removed(&self, parent: Ino, ino: Ino, path: &MountPath) {
        self.note_removed(parent, path);
        self.lookups.forget(path);
        self.lookups.forget_below(path);
        self.table.lock().removed(ino);
        self.dir_changed(parent);
    }

    /// The name `path` in `parent` of a file still open here is gone; the inode stays (its
    /// path now names the hidden copy its descriptors read).
    pub fn hidden(&self, parent: Ino, path: &MountPath) {
        self.note_removed(parent, path);
        self.lookups.forget(path);
        self.dir_changed(parent);
    }

    /// `path` is about to change here (chmod, truncate...), or just did: what the stat cache
    /// says of it goes, and the saved pages' disk learns of the change.
    pub fn changing(&self, path: &MountPath) {
        self.lookups.forget(path);
        self.lookups.changing();
    }

    /// `ino`, at `from` (parent and path), now is `to` (parent, the parent's path, and name)
    /// in the store, where the rename left `objects`. Returns the files below a directory
    /// whose version it copied as they knew it: (inode, old ETag, the copy's).
    pub fn renamed(
        &self,
        ino: Ino,
        from: (Ino, &MountPath),
        to: (Ino, &MountPath, &str),
        objects: RenamedObjects,
    ) -> Vec<(Ino, String, String)> {
        let ((parent, path), (new_parent, new_parent_path, new_name)) = (from, to);
        let new_path = new_parent_path.join(new_name);
        self.lookups.forget(path);
        self.lookups.forget(&new_path);
        // And what was found absent below a directory the rename replaced.
        self.lookups.forget_below_either(path, &new_path);
        self.note_removed(parent, path);
        self.note_added(new_parent, new_name);
        self.dir_changed(parent);
        self.dir_changed(new_parent);
        let mut t = self.table.lock();
        t.rename(ino, new_parent, new_name, new_parent_path);
        let mut retagged = Vec::new();
        let Some(i) = t.get_mut(ino) else {
            return retagged;
        };
        i.attr.ctime = SystemTime::now();
        match objects {
            RenamedObjects::File {
                copied,
                learned,
                etag,
            } => {
                // A copy pinned to the version it knew, if the inode still knows that one
                // (not another client's learnt meanwhile): the same bytes.
                let same = copied.is_some() && i.etag == copied;
                if let (true, Some(old), Some(new)) = (same, copied, etag.as_deref()) {
                    i.pages.retag(&old, new);
                    retagged.push((ino, old, new.to_string()));
                } else if i.learned_changes != learned && etag.is_some() {
                    // Another client's version was learnt while the one before was copied
                    // (not a version this mount stored meanwhile): the name holds that
                    // one's copy now. A descriptor that read the other stops there, and
                    // the size (the other's) is asked again.
                    i.learned_changes += 1;
                    i.fetched = self.stale_instant().or(i.fetched);
                }
                if etag.is_some() && i.fetched.is_none() {
                    // Never stored under its old name (a background upload that landed
                    // while the rename waited for it): in the bucket now, so an unlink
                    // deletes it once its state is gone.
                    i.fetched = Some(Instant::now());
                }
                i.etag = etag;
            }
            RenamedObjects::Below(copies) => {
                // Its objects moved with a marker (one was made where it had none).
                i.has_marker = true;
                // A listing read from the old keys may have seen them half moved (one made
                // for lookups takes no part in the rename's exclusion): listed again.
                i.listing = None;
                // Every object below was copied: each inode names its copy now, whose
                // ETag the rename knows. The copy's time is asked again (an object with
                // no mtime of its own shows the copy's).
                let stale = self.stale_instant();
                for d in t.descendants(&new_path) {
                    let Some(i) = t.get_mut(d) else { continue };
                    i.listing = None;
                    if i.writing {
                        continue;
                    }
                    let copy = copies.get(self.key(&i.path).as_str());
                    i.fetched = stale.or(i.fetched);
                    match copy {
                        // The version it knew: the same bytes under another ETag, pages
                        // of it included.
                        Some(c) if i.etag.is_some() && c.from == i.etag => {
                            let old = i.etag.replace(c.etag.clone()).unwrap_or_default();
                            i.pages.retag(&old, &c.etag);
                            retagged.push((d, old, c.etag.clone()));
                        }
                        // Another client's, copied: a descriptor that read the version
                        // before stops there (see `Inode::learned_changes`).
                        Some(c) if c.from.is_some() => {
                            if i.etag.is_some() {
                                i.learned_changes += 1;
                            }
                            // Its size goes with its ETag (a truncate or a reader builds on
                            // the pair); the rest is asked again.
                            i.etag = Some(c.etag.clone());
                            i.attr.size = c.size;
                        }
                        _ => i.etag = None,
                    }
                }
            }
        }
        t.maybe_drop(ino);
        retagged
    }

    /// The path of object `key` of this mount, if it is one (not hidden, below the prefix).
    pub fn path_of_key(&self, key: &str) -> Option<MountPath> {
        let rel = key.strip_prefix(self.keys.prefix())?;
        let bad = rel.is_empty() || rel.ends_with('/') || rel.split('/').any(|n| n.is_empty());
        let hidden = rel.split('/').next() == Some(UNLINKED_DIR);
        (!bad && !hidden).then(|| MountPath::new(rel))
    }

    /// A file committed here by a daemon that died, not uploaded yet (`size` bytes, `user`
    /// metadata; `etag`: the object it replaces, `in_store`: an object may be at its key):
    /// an inode, as a file written and closed here has, before anything looks it up. Its
    /// directory may not be known yet: it is numbered as a lookup will number it.
    pub fn add_recovered(
        &self,
        path: &MountPath,
        size: u64,
        user: UserMeta,
        etag: Option<String>,
        in_store: bool,
    ) -> Ino {
        self.lookups.forget(path);
        let (parent_path, name) = match path.as_str().rsplit_once('/') {
            Some((d, n)) => (MountPath::new(d), n.to_string()),
            None => (MountPath::root(), path.as_str().to_string()),
        };
        let mut t = self.table.lock();
        let parent = if parent_path.is_root() {
            ROOT_INO
        } else {
            t.ino_for(&parent_path)
        };
        let ino = t.ino_for(path);
        let pm = PosixMeta::from_user(&user);
        let attr = self
            .policy
            .attr(ino, FileKind::File, size, &pm, Some(SystemTime::now()));
        let mut i = Inode::new(ino, parent, name, path.clone(), FileKind::File, attr);
        i.fetched = in_store.then(Instant::now);
        i.etag = etag;
        i.user = user;
        i.writing = true;
        t.insert(i);
        ino
    }

    /// File `ino` now has `size` bytes and `user` metadata as committed here, not yet in the
    /// store (background upload): what it says of the object stays.
    pub fn changed_here(&self, ino: Ino, size: u64, user: UserMeta) {
        self.lookups.changing();
        let mut t = self.table.lock();
        if let Some(i) = t.get_mut(ino) {
            self.lookups.forget(&i.path);
            let pm = PosixMeta::from_user(&user);
            i.attr = self
                .policy
                .attr(ino, i.kind, size, &pm, Some(SystemTime::now()));
            i.user = user;
        }
    }

    /// The object of file `ino` is now in the store with `size` bytes, ETag `etag` and `user`
    /// metadata, as this mount stored it.
    pub fn stored(&self, ino: Ino, size: u64, etag: Option<String>, user: UserMeta) {
        self.lookups.changing();
        let place = {
            let mut t = self.table.lock();
            let Some(i) = t.get_mut(ino) else { return };
            self.lookups.forget(&i.path);
            let pm = PosixMeta::from_user(&user);
            // The ctime of the change made here that this stores (a write, a truncate, a
            // chmod: each set it when made), not when the store took it: the kernel may
            // have been told it already (a truncate's reply), and tar takes a ctime that
            // moves while it reads a file for a change.
            let ctime = i.attr.ctime;
            i.attr = self
                .policy
                .attr(ino, i.kind, size, &pm, Some(SystemTime::now()));
            i.attr.ctime = ctime;
            i.etag = etag;
            i.user = user;
            i.fetched = Some(Instant::now());
            (i.parent, i.name.clone())
        };
        // Noted again now that it is in the store: a listing whose LIST was sent since its
        // create, and answered without it, must not be taken to say it is not there (the
        // note of the create predates that LIST, and the file is no longer being written).
        self.note_added(place.0, &place.1);
    }

    /// The object at `key` of open file `ino` is `obj` now (a read found it changed).
    /// Recorded unless the file is being written here or moved; returns whether it is larger
    /// than stat showed.
    pub fn learned(&self, ino: Ino, key: &ObjectKey, obj: &ObjectMeta) -> bool {
        let mut t = self.table.lock();
        let Some(i) = t.get_mut(ino) else {
            return false;
        };
        if i.writing || self.key(&i.path) != *key {
            return false;
        }
        self.lookups.forget(&i.path);
        let grew = obj.size > i.attr.size;
        if another_version(&i.etag, &obj.etag) {
            i.learned_version(obj.size, &obj.etag, self.ttl);
            self.version_learnt(ino, None);
        }
        let mut a = self.policy.attr_of_object(ino, i.kind, obj);
        i.keep_ctime(&obj.etag, &obj.user, &mut a);
        i.attr = a;
        i.etag = obj.etag.clone();
        i.user = obj.user.clone();
        i.fetched = Some(Instant::now());
        grew
    }

    /// Whether a directory holds anything (in the store or created here and not yet uploaded).
    /// A marker `dir/` holding bytes counts as something: rmdir would delete them.
    pub async fn dir_is_empty(&self, ino: Ino, path: &MountPath) -> FsResult<bool> {
        if !self
            .table
            .lock()
            .children_of(ino)
            .iter()
            .all(|c| c.fetched.is_some())
        {
            return Ok(false);
        }
        let dir_key = self.dir_key(path);
        if self.markers.any_below(&dir_key) {
            // A subdirectory made here whose marker is not in the bucket (yet).
            return Ok(false);
        }
        self.bucket_dir_is_empty(&dir_key).await
    }

    /// Whether the bucket holds nothing under `dir_key` but an empty marker (one LIST of 2
    /// keys).
    pub async fn bucket_dir_is_empty(&self, dir_key: &ObjectKey) -> FsResult<bool> {
        let page = self
            .store
            .list(dir_key, None, ListFrom::Start, 2, ListDetail::Plain)
            .await
            .map_err(|e| log_store_err(&format!("list {dir_key}"), e))?;
        Ok(page
            .objects
            .iter()
            .all(|o| *dir_key == *o.key && o.size == 0)
            && page.common_prefixes.is_empty())
    }

    // ---- what this mount knows going stale ----

    /// Another client replaced or deleted the object of `ino`: what this mount knows of it
    /// is stale, so the next lookup asks the store again.
    pub fn changed_elsewhere(&self, ino: Ino) {
        self.ask_store_again(&mut self.table.lock(), ino);
    }

    /// The next lookup of `ino` asks the store (under the table's lock `t`): what this mount
    /// knows of it may not be what the store has (another client's change, or a change of
    /// this mount's that was never stored).
    pub fn ask_store_again(&self, t: &mut InodeTable, ino: Ino) {
        if let Some(i) = t.get_mut(ino) {
            self.lookups.forget(&i.path);
            i.fetched = self.stale_instant().or(i.fetched);
        }
    }

    /// Forgets what this mount cached about `ino` (and, for a directory, its listing), so the
    /// next access asks the store: how a user forces another client's change to show now.
    pub fn refresh(&self, ino: Ino) -> FsResult<()> {
        let mut t = self.table.lock();
        let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
        let (path, parent, kind) = (i.path.clone(), i.parent, i.kind);
        if !i.writing && ino != ROOT_INO {
            let stale = self.stale_instant();
            i.fetched = stale.or(i.fetched);
        }
        i.listing = None;
        if let Some(p) = t.get_mut(parent) {
            p.listing = None;
        }
        drop(t);
        self.lookups.forget(&path);
        if kind == FileKind::Dir {
            // Including names cached as missing.
            self.lookups.forget_below(&path);
        }
        Ok(())
    }
}

/// What a rename left in the store of what it moved.
pub enum RenamedObjects {
    /// A file: the ETag of the version the rename copied, the inode's `learned_changes`
    /// when it was read, and its object's ETag now (`None`: not stored yet, or not known).
    File {
        copied: Option<String>,
        learned: u64,
        etag: Option<String>,
    },
    /// A directory: the copies of the objects below it, by their new keys.
    Below(Copies),
}

/// An object a directory rename copied, pinned to the version it listed.
#[derive(Clone)]
pub struct Copied {
    /// The ETag of the version copied, as listed.
    pub from: Option<String>,
    /// Its size, as listed.
    pub size: u64,
    /// The copy's.
    pub etag: String,
}

/// The copies a directory rename made, by key.
pub type Copies = HashMap<String, Copied>;

/// Whether ETag `new`, learnt from the store, says another version than `old`, known before
/// (unknown on either side says nothing: a file whose directory a rename copied without
/// knowing its version has none).
fn another_version(old: &Option<String>, new: &Option<String>) -> bool {
    matches!((old, new), (Some(o), Some(n)) if o != n)
}
