//! Directories: listings streamed page by page to readdir, the listing each complete pass
//! leaves for negative lookups and statahead, and what a cached listing says about a name.

use super::inode::{DirListing, InodeTable};
use super::lookup::{dir_shadow_to_come, page_end, page_entries, Found, LIST_PAGE};
use super::Namespace;
use crate::error::{log_store_err, FsError, FsResult};
use crate::meta::{Attr, FileKind, Ino, PosixMeta};
use crate::paths::{MountPath, ObjectKey};
use bucketfs_store::{ListDetail, ListFrom, ObjectMeta};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// One directory entry as `readdir` returns it.
#[derive(Debug, Clone)]
pub struct DirEntry {
    pub ino: Ino,
    /// Cookie of the entry after this one: pass it back to continue the listing.
    pub next_offset: i64,
    pub kind: FileKind,
    pub name: String,
}

impl DirEntry {
    /// `.` or `..`: not a lookup of anything when handed to the kernel.
    pub fn is_dot(&self) -> bool {
        self.name == "." || self.name == ".."
    }
}

/// Names after a looked-up one that statahead stats in the background.
const STATAHEAD_WINDOW: usize = 256;

pub enum ListingSays {
    Unknown,
    Absent,
    /// Present; `window` indexes the names that follow it (the statahead window, empty at
    /// the listing's first lookup) and `far_end` is the last of them.
    Present {
        window: std::ops::Range<usize>,
        far_end: Option<String>,
    },
}

/// Lookups that must miss in one directory, within a stat TTL, before it is listed for them.
const LIST_AFTER_MISSES: u32 = 3;
/// Entries of a directory per lookup that must miss in it, within a stat TTL, before it is
/// listed again for them when a page does not hold it all. A plain page entry costs the
/// server a small part of a HEAD (MinIO: 35 us each, a HEAD 0.5-0.7 ms), so a directory of
/// 1,000 files read 4 files per TTL (100,000 files read over 100 directories) costs 4 HEADs,
/// not a page of 1,000 entries each TTL: at that size the pages took most of the server's
/// time.
const ENTRIES_PER_MISS: usize = 32;
/// The same for a listing with user metadata, which MinIO reads for every entry (about 90 us
/// each: a page of 1,000 costs it as much as 150 HEADs). Where a store lists no metadata,
/// such a listing saves the HEADs of the names it shows nothing anyway.
const META_ENTRIES_PER_MISS: usize = 6;
/// Directories whose misses are counted at once, at most (older counts are dropped beyond).
const MAX_TRACKED_DIRS: usize = 4096;

/// Lookups that missed in one directory lacking a listing, and the listing made for them.
pub struct DirMisses {
    since: Instant,
    count: u32,
    listing: Option<Arc<tokio::sync::OnceCell<()>>>,
    /// Entries the last listing made for lookups found, and whether that was all of them
    /// (kept from one stat TTL to the next).
    found: Option<(usize, bool)>,
}

impl DirMisses {
    fn new(found: Option<(usize, bool)>) -> Self {
        Self {
            since: Instant::now(),
            count: 0,
            listing: None,
            found,
        }
    }
}

/// Entries returned by one readdir call at most (the kernel takes what fits its buffer).
const READDIR_BATCH: usize = 512;

/// A directory being listed: the entries so far and where the LIST continues.
pub struct DirStream {
    ino: Ino,
    path: MountPath,
    /// Key prefix of its entries.
    prefix: ObjectKey,
    /// Where the next LIST page starts.
    from: ListFrom,
    /// Whether its LIST pages ask for user metadata (decided at opendir).
    detail: ListDetail,
    done: bool,
    entries: Vec<DirEntry>,
    /// Name to position in `entries`, while the listing is incomplete.
    index: HashMap<String, usize>,
    /// When its first page was asked for: names added here since may be missing from it.
    started: Option<Instant>,
    /// When the LIST of its first page was sent (earlier than `started` for a page a lookup
    /// kept).
    listed_at: Option<Instant>,
    /// The entries that are not directories as far as the pages read say, but that a later
    /// page may show to be (see [`DirStream::settled`]).
    unsettled: Vec<Unsettled>,
    /// The last key the pages read so far (less the prefix), where the listing goes on
    /// should the directory move (see [`DirStream::moved`]).
    last_read: String,
    /// A readdir was answered: one from offset 0 again is a `rewinddir`.
    served: bool,
}

/// Most names a listing of a directory notes as made or removed here since it was read.
const MAX_NOTED: usize = 10_000;

/// The listing of directory `dir`, fresh or stale, to note a change made here in (both
/// [`Namespace::listing_lacks`] reads). One with [`MAX_NOTED`] names noted is dropped
/// instead: a directory listed once and written to for days (temporary names made and
/// renamed) grew them for ever; a lookup lists it again when it needs a listing.
fn noting_listing(t: &mut InodeTable, dir: Ino) -> Option<&mut DirListing> {
    let i = t.get_mut(dir)?;
    if i.listing
        .as_ref()
        .is_some_and(|l| l.added.len() + l.removed.len() >= MAX_NOTED)
    {
        i.listing = None;
    }
    i.listing.as_mut()
}

/// A file of a listing that a later page may show to be a directory.
struct Unsettled {
    /// Its position in [`DirStream::entries`].
    pos: usize,
    name: String,
    /// What its page showed, with that page's epoch and time.
    found: Found,
    epoch: u64,
    at: Instant,
}

impl DirStream {
    fn new(
        ino: Ino,
        path: MountPath,
        prefix: ObjectKey,
        detail: ListDetail,
        entries: Vec<DirEntry>,
    ) -> Self {
        Self {
            ino,
            path,
            // After the directory's own marker `dir/`, which is no entry: with it a directory
            // of 1,000 entries would take a second page.
            from: match prefix.is_empty() {
                true => ListFrom::Start,
                false => ListFrom::After(prefix.to_string()),
            },
            prefix,
            detail,
            done: false,
            entries,
            index: HashMap::new(),
            started: None,
            listed_at: None,
            unsettled: Vec::new(),
            last_read: String::new(),
            served: false,
        }
    }

    /// The directory was renamed (here) since the last page: the pages still to read come
    /// from its new place, after the last key read (a continuation token is good for the
    /// old prefix only, where the rename deleted everything).
    fn moved(&mut self, path: MountPath, prefix: ObjectKey) {
        self.from = match self.from {
            ListFrom::Token(_) => ListFrom::After(format!("{prefix}{}", self.last_read)),
            _ => ListFrom::After(prefix.to_string()),
        };
        self.path = path;
        self.prefix = prefix;
    }

    /// How many entries may be handed out. A file whose directory would sort after the last
    /// key read ([`dir_shadow_to_come`]) waits for the next page, and so does what follows it
    /// (offsets are positions).
    fn settled(&self) -> usize {
        self.unsettled
            .iter()
            .map(|u| u.pos)
            .min()
            .unwrap_or(self.entries.len())
    }

    /// Adds an entry; `ino` is what a lookup of it gives (see [`InodeTable::entry_ino`]).
    fn push(&mut self, name: &str, kind: FileKind, ino: Ino) {
        let n = self.entries.len();
        self.index.insert(name.to_string(), n);
        self.entries.push(DirEntry {
            ino,
            next_offset: n as i64 + 1,
            kind,
            name: name.to_string(),
        });
    }
}

impl Namespace {
    /// What the parent's cached listing says about `name`. The first lookup of a name it
    /// shows gets an empty statahead window: one stat in a listed directory (`ls -l dir`
    /// after a listing of its parent, `cd`) is no sign that its neighbours come next, and
    /// stat'ing them would cost a request each. From the second on, it is.
    pub fn listing_says(&self, parent: Ino, name: &str) -> ListingSays {
        let mut t = self.table.lock();
        let Some(l) = t.get_mut(parent).and_then(|p| p.listing.as_mut()) else {
            return ListingSays::Unknown;
        };
        if l.at.elapsed() >= self.ttl {
            return ListingSays::Unknown;
        }
        match l.names.binary_search_by(|n| n.as_str().cmp(name)) {
            Ok(i) => {
                l.hits = l.hits.saturating_add(1);
                let end = match l.hits {
                    1 => i + 1,
                    _ => (i + 1 + STATAHEAD_WINDOW).min(l.names.len()),
                };
                let window = i + 1..end;
                ListingSays::Present {
                    far_end: l.names.get(window.clone()).and_then(|w| w.last()).cloned(),
                    window,
                }
            }
            Err(_) if l.added.contains(name) => ListingSays::Unknown,
            Err(_) => ListingSays::Absent,
        }
    }

    /// Paths of the names at `window` in the cached listing of `parent`.
    pub fn listing_names(
        &self,
        parent: Ino,
        window: std::ops::Range<usize>,
        dir: &MountPath,
    ) -> Vec<MountPath> {
        let t = self.table.lock();
        t.get(parent)
            .and_then(|p| p.listing.as_ref())
            .and_then(|l| l.names.get(window))
            .map(|names| names.iter().map(|n| dir.join(n)).collect())
            .unwrap_or_default()
    }

    /// Notes that `name` now exists in directory `parent` (its cached listing lacks it, and
    /// so does a listing whose LIST was sent before now: see [`Self::added_since`]).
    pub fn note_added(&self, parent: Ino, name: &str) {
        self.note_change(parent, name, true);
        if let Some(l) = noting_listing(&mut self.table.lock(), parent) {
            l.removed.remove(name);
            l.added.insert(name.to_string());
        }
    }

    /// Notes that the entry at `path` left directory `parent` here (see
    /// [`DirListing::holds_entries`]).
    pub fn note_removed(&self, parent: Ino, path: &MountPath) {
        let name = path.as_str().rsplit('/').next().unwrap_or_default();
        self.note_change(parent, name, false);
        if let Some(l) = noting_listing(&mut self.table.lock(), parent) {
            l.added.remove(name);
            l.removed.insert(name.to_string());
        }
    }

    /// Whether directory `dir` has an entry left, as its listing (while fresh) and the
    /// changes made here since say; `None`: no fresh listing.
    pub fn listing_holds_entries(&self, dir: Ino) -> Option<bool> {
        let t = self.table.lock();
        let l = t.get(dir)?.listing.as_ref()?;
        (l.at.elapsed() < self.ttl).then(|| l.holds_entries())
    }

    /// Records that `name` was made (`added`) or removed in `dir` now, for the stat TTL.
    fn note_change(&self, dir: Ino, name: &str, added: bool) {
        let mut all = self.recent_changes.lock();
        if all.len() >= MAX_TRACKED_DIRS {
            let ttl = self.ttl;
            all.retain(|_, q| q.back().is_some_and(|(t, ..)| t.elapsed() < ttl));
        }
        let q = all.entry(dir).or_default();
        while q.front().is_some_and(|(t, ..)| t.elapsed() >= self.ttl) {
            q.pop_front();
        }
        q.push_back((Instant::now(), name.to_string(), added));
    }

    /// Names noted as added to `dir` at or after `since` (a listing begun then may lack
    /// them), and those removed since (it may show them), each as its last change says.
    fn changed_since(&self, dir: Ino, since: Instant) -> (HashSet<String>, HashSet<String>) {
        let (mut added, mut removed) = (HashSet::new(), HashSet::new());
        if let Some(q) = self.recent_changes.lock().get(&dir) {
            for (_, name, made) in q.iter().filter(|(t, ..)| *t >= since) {
                let (to, from) = match made {
                    true => (&mut added, &mut removed),
                    false => (&mut removed, &mut added),
                };
                from.remove(name);
                to.insert(name.clone());
            }
        }
        (added, removed)
    }

    /// Whether `parent`'s listing, fresh or stale, lacks `name` (nor was it made here since):
    /// its lookup is most likely the one before a create.
    pub fn listing_lacks(&self, parent: Ino, name: &str) -> bool {
        let t = self.table.lock();
        t.get(parent)
            .and_then(|p| p.listing.as_ref())
            .is_some_and(|l| {
                l.names.binary_search_by(|n| n.as_str().cmp(name)).is_err()
                    && !l.added.contains(name)
            })
    }

    /// Lists `parent` once for the lookups of its names when enough of them miss within a
    /// stat TTL (an application opening the files of a directory one by one): one LIST page,
    /// then answers them all from the cache, instead of a HEAD and a LIST per name. With
    /// `detail` (user metadata where the store has it) when the lookups are of names it
    /// shows; a writer creating names it lacks needs their absence only, and a page of
    /// metadata costs the server a read of every entry's (on MinIO 5-10x a plain page),
    /// each stat TTL, for as long as the directory grows. Returns whether such a listing was
    /// made (or awaited, when another lookup started it); false leaves the lookup to probe
    /// its name.
    pub async fn list_for_lookups(
        &self,
        parent: Ino,
        parent_path: &MountPath,
        detail: ListDetail,
    ) -> bool {
        // A directory listed (or made) here before, whose listing went stale: its names are
        // being looked up again (a writer creating files for longer than the stat TTL, a
        // reader going through it), so one LIST now answers them all instead of a HEAD and
        // a LIST per name until enough of them missed.
        let listed = self
            .table
            .lock()
            .get(parent)
            .and_then(|p| p.listing.as_ref().map(|l| l.names.len()));
        let gate = {
            let ttl = self.ttl;
            let mut all = self.dir_misses.lock();
            if all.len() >= MAX_TRACKED_DIRS {
                all.retain(|_, m| m.since.elapsed() < ttl);
            }
            let m = all.entry(parent).or_insert_with(|| DirMisses::new(None));
            if m.since.elapsed() >= ttl {
                *m = DirMisses::new(m.found);
            }
            m.count += 1;
            // A big directory's page costs more than probing the few names looked up in it:
            // only as many misses as it has entries per ENTRIES_PER_MISS (with metadata,
            // META_ENTRIES_PER_MISS) list it again. Not for a writer's plain page of a
            // directory it holds whole (cheap, and it answers every name the writer makes
            // next).
            let (entries, whole) = m.found.unwrap_or((listed.unwrap_or(0), true));
            let base = match listed {
                Some(_) => 1,
                None => LIST_AFTER_MISSES,
            };
            let need = match (detail, whole) {
                (ListDetail::Plain, true) => base,
                (ListDetail::Plain, false) => base.max((entries / ENTRIES_PER_MISS) as u32),
                (ListDetail::UserMeta, _) => base.max((entries / META_ENTRIES_PER_MISS) as u32),
            };
            if m.listing.is_none() && m.count >= need {
                m.listing = Some(Arc::default());
            }
            m.listing.clone()
        };
        let Some(gate) = gate else {
            return false;
        };
        gate.get_or_init(|| async {
            let mut st = DirStream::new(
                parent,
                parent_path.clone(),
                self.dir_key(parent_path),
                detail,
                Vec::new(),
            );
            // One page: a bigger directory keeps probing the names beyond it.
            match self.next_page(&mut st).await {
                Ok(()) => {
                    if let Some(m) = self.dir_misses.lock().get_mut(&parent) {
                        m.found = Some((st.entries.len(), st.done));
                    }
                }
                Err(e) => tracing::debug!("listing {parent_path:?} for lookups: {e:?}"),
            }
        })
        .await;
        true
    }

    // ---- the operations ----

    /// Opens a directory for listing and returns its handle. The listing is read from the
    /// store page by page as `readdir` asks for entries.
    pub async fn opendir(&self, ino: Ino) -> FsResult<u64> {
        let (path, parent) = {
            let t = self.table.lock();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            if i.kind != FileKind::Dir {
                return Err(FsError::ENOTDIR);
            }
            (i.path.clone(), i.parent)
        };
        let dots = [(ino, "."), (parent, "..")];
        let entries = dots
            .iter()
            .enumerate()
            .map(|(n, (ino, name))| DirEntry {
                ino: *ino,
                next_offset: n as i64 + 1,
                kind: FileKind::Dir,
                name: name.to_string(),
            })
            .collect();
        let prefix = self.dir_key(&path);
        let stream = DirStream::new(ino, path, prefix, self.lookups.list_detail(), entries);
        let fh = self.next_dir_fh.fetch_add(1, Ordering::Relaxed);
        let stream = Arc::new(tokio::sync::Mutex::new(stream));
        self.dirs.lock().insert(fh, stream);
        Ok(fh)
    }

    /// Entries after cookie `offset` (0 = from the start, including `.` and `..`), of the
    /// directory now at `path` (none: where it was, as it is gone). The caller holds off
    /// renames of it meanwhile.
    pub async fn readdir(
        &self,
        fh: u64,
        offset: i64,
        path: Option<&MountPath>,
    ) -> FsResult<Vec<DirEntry>> {
        let stream = self.dirs.lock().get(&fh).cloned().ok_or(FsError::EBADF)?;
        let mut st = stream.lock().await;
        if offset <= 0 && st.served {
            // rewinddir: the directory as it is now (POSIX), not the listing read before,
            // which may hold names removed since (readdirplus would register them again).
            let dots = st.entries[..2].to_vec();
            *st = DirStream::new(st.ino, st.path.clone(), st.prefix.clone(), st.detail, dots);
        }
        st.served = true;
        if let Some(path) = path.filter(|p| **p != st.path && !st.done) {
            st.moved(path.clone(), self.dir_key(path));
        }
        let from = offset.max(0) as usize;
        // Past the dots at least, so the first answer carries a page of names.
        while !st.done && st.settled() <= from.max(2) {
            self.next_page(&mut st).await?;
        }
        Ok(st
            .entries
            .iter()
            .take(st.settled())
            .skip(from)
            .take(READDIR_BATCH)
            .cloned()
            .collect())
    }

    /// Reads one LIST page into the stream; after the last, adds entries that exist only here
    /// and records the listing for negative lookups and statahead.
    async fn next_page(&self, st: &mut DirStream) -> FsResult<()> {
        // The page from the start (not one going on after a move, see `DirStream::moved`:
        // that is no first page to take from a lookup or to save).
        let first = st.listed_at.is_none();
        let fresh_prefix = !matches!(st.from, ListFrom::Token(_));
        // Before the page is taken or asked for: a kept page is dropped by any change made
        // here, so one still kept predates none.
        st.started.get_or_insert_with(Instant::now);
        if fresh_prefix {
            // Subdirectories made here must be in the bucket for the listing to show them.
            self.markers.wait_below(&st.prefix).await?;
        }
        // The first page may come from the lookup of the directory. It starts at the marker
        // itself, not after it: the marker's empty name is skipped below like any unlistable
        // one, and its continuation token goes on from its last key.
        let kept = match first {
            true => self.lookups.take_page(&st.prefix, st.detail),
            false => None,
        };
        tracing::trace!(
            "list {} ({:?}): {}",
            st.prefix,
            st.detail,
            if kept.is_some() {
                "the lookup's page"
            } else {
                "LIST"
            }
        );
        let (page, epoch, at) = match kept {
            Some(kept) => kept,
            None => {
                let epoch = self.lookups.epoch();
                let at = Instant::now();
                let sent = std::time::SystemTime::now();
                let page = self
                    .store
                    .list(&st.prefix, Some("/"), st.from.clone(), LIST_PAGE, st.detail)
                    .await
                    .map_err(|e| log_store_err(&format!("list {}", st.prefix), e))?;
                // Only a page from the directory's start: one from after its marker (every
                // directory but a root) would tell a later mount it has none (its mode and
                // owner lost, its marker written again empty).
                if first && matches!(st.from, ListFrom::Start) {
                    self.lookups.save_page(&st.prefix, &page, sent, st.detail);
                }
                (page, epoch, at)
            }
        };
        st.listed_at.get_or_insert(at);
        let at_root = st.path.is_root();
        // The last key this page read: a directory sorting after it is still to come. A page
        // with none that more follow (a store may send fewer keys than asked, even none)
        // settles nothing.
        let last = page_end(&page).map(str::to_string);
        let empty_page_of_more = last.is_none() && page.next_continuation.is_some();
        let prefix = st.prefix.to_string();
        let to_come = |name: &str| {
            empty_page_of_more
                || last
                    .as_deref()
                    .is_some_and(|l| dir_shadow_to_come(&prefix, name, l))
        };
        if let Some(l) = last
            .as_deref()
            .and_then(|l| l.strip_prefix(prefix.as_str()))
        {
            st.last_read = l.to_string();
        }
        for (name, found) in page_entries(&page, st.prefix.len(), at_root) {
            let path = st.path.join(name);
            if found.kind == FileKind::Dir {
                match st.index.get(name) {
                    Some(&i) => {
                        st.entries[i].kind = FileKind::Dir; // a directory wins
                        st.unsettled.retain(|u| u.name != name);
                    }
                    None => {
                        let ino = self.table.lock().entry_ino(st.ino, name, &path);
                        st.push(name, FileKind::Dir, ino)
                    }
                }
            } else if st.index.contains_key(name) {
                continue;
            } else {
                // With user metadata the mode tells symlinks from files; without, a file,
                // unless known here as a symlink.
                let (ino, kind) = {
                    let mut t = self.table.lock();
                    let ino = t.entry_ino(st.ino, name, &path);
                    match t.get(ino) {
                        Some(i)
                            if !found.obj.user_complete && listed_as_file(i.kind, found.kind) =>
                        {
                            (ino, i.kind)
                        }
                        _ => (ino, found.kind),
                    }
                };
                st.push(name, kind, ino);
                if to_come(name) {
                    // Not believed either until the page that may hold `name/` is read.
                    st.unsettled.push(Unsettled {
                        pos: st.entries.len() - 1,
                        name: name.to_string(),
                        found,
                        epoch,
                        at,
                    });
                    continue;
                }
            }
            self.lookups.listed(&path, found, epoch, at);
        }
        // Files no directory of their name came for on the pages read: believed now, as of
        // the page that showed them.
        let (waiting, settled) = std::mem::take(&mut st.unsettled)
            .into_iter()
            .partition(|u| to_come(&u.name));
        st.unsettled = waiting;
        for u in settled {
            self.lookups
                .listed(&st.path.join(&u.name), u.found, u.epoch, u.at);
        }
        if let Some(t) = page.next_continuation {
            st.from = ListFrom::Token(t);
            return Ok(());
        }
        st.done = true;
        let t = self.table.lock();
        for c in t.children_of(st.ino) {
            // Created here and not uploaded yet: show it anyway.
            if (c.fetched.is_none() || c.writing) && !st.index.contains_key(&c.name) {
                let (name, kind, ino) = (c.name.clone(), c.kind, c.ino);
                st.push(&name, kind, ino);
            }
        }
        let mut names: Vec<String> = std::mem::take(&mut st.index).into_keys().collect();
        names.sort_unstable();
        for e in st.entries.iter_mut().skip(2) {
            if let Some(ino) = t.child(st.ino, &e.name) {
                e.ino = ino;
            }
        }
        // A name created or renamed here while the pages were fetched may be missing from
        // them: not taken for absent (a lookup of it, seeing it missing, said ENOENT).
        let since = st.started.unwrap_or_else(Instant::now);
        drop(t);
        let (added, removed) = self.changed_since(st.ino, since);
        let mut t = self.table.lock();
        // Not on a directory renamed since (its path is the stream's until it is done, but
        // for one made for lookups): its pages may have seen the old keys half moved.
        if let Some(i) = t.get_mut(st.ino).filter(|i| i.path == st.path) {
            // As of its first LIST (a page a lookup kept, or the first asked for): a name
            // another client added to a page read long ago is missing from it, however slowly
            // the rest was read, so the names it lacks are believed no longer than that page.
            let at = st.listed_at.unwrap_or_else(Instant::now);
            let mut l = DirListing::new(names, at);
            l.added = added;
            l.removed = removed;
            i.listing = Some(l);
        }
        Ok(())
    }

    /// Attributes for readdirplus entry `e` of directory `dir`, from what is known without a
    /// request, and whether they are complete (the kernel may keep them for the stat TTL).
    /// Every entry but `.` and `..` becomes one lookup of its inode. An entry the listing gave
    /// without user metadata is registered with stale attributes that the kernel must not
    /// keep (TTL zero): its first stat asks the store, as after a plain readdir, and a symlink
    /// the listing showed as a file is looked up again before anything relies on its type.
    pub fn plus_entry(&self, dir: Ino, e: &DirEntry) -> Option<(Attr, bool)> {
        // The directory renamed between reading its path and registering the entry there.
        for _ in 0..super::MOVED_TRIES {
            if let Some(r) = self.plus_entry_at(dir, e)? {
                return Some(r);
            }
        }
        None
    }

    /// [`Self::plus_entry`] at the directory's path now: `Some(None)`: it moved meanwhile.
    fn plus_entry_at(&self, dir: Ino, e: &DirEntry) -> Option<Option<(Attr, bool)>> {
        if e.is_dot() {
            let t = self.table.lock();
            let attr = t.get(e.ino).map(|i| i.attr.clone()).unwrap_or_else(|| {
                self.policy
                    .attr(e.ino, FileKind::Dir, 0, &PosixMeta::default(), None)
            });
            return Some(Some((attr, true)));
        }
        let path = {
            let mut t = self.table.lock();
            if let Some(i) = t.child(dir, &e.name).and_then(|c| t.get_mut(c)) {
                if self.fresh(i.fetched) || i.writing {
                    i.lookups += 1;
                    return Some(Some((i.attr.clone(), true)));
                }
            }
            t.get(dir)?.path.join(&e.name)
        };
        let Some((found, complete, at)) = self.lookups.peek(&path) else {
            let stale = self.stale_instant();
            let mut t = self.table.lock();
            if let Some(i) = t.child(dir, &e.name).and_then(|c| t.get_mut(c)) {
                if i.kind == e.kind
                    || listed_as_file(i.kind, e.kind)
                    || listed_as_file(e.kind, i.kind)
                {
                    // Known, its attributes out of date: kept (its ETag too), and asked for
                    // at its next stat.
                    i.lookups += 1;
                    i.fetched = stale.or(i.fetched);
                    return Some(Some((i.attr.clone(), false)));
                }
            }
            drop(t);
            let found = Found {
                kind: e.kind,
                obj: ObjectMeta::default(),
                has_marker: false,
            };
            let Some(attr) = self.remember(dir, &e.name, path, found, 1, Instant::now()) else {
                return Some(None);
            };
            if let Some(i) = self.table.lock().get_mut(attr.ino) {
                i.fetched = stale.or(i.fetched);
            }
            return Some(Some((attr, false)));
        };
        if !complete && matches!(found.kind, FileKind::Dir | FileKind::File) {
            // A common prefix says nothing of a directory's attributes: a known one keeps its
            // marker's (stat answers a directory from memory), and its next lookup asks. Nor
            // does a listing without metadata tell a symlink from a file: a known one keeps
            // its inode (and number) until its next lookup asks.
            let stale = self.stale_instant();
            let mut t = self.table.lock();
            if let Some(i) = t.child(dir, &e.name).and_then(|c| t.get_mut(c)) {
                if i.kind == FileKind::Dir && found.kind == FileKind::Dir
                    || listed_as_file(i.kind, found.kind)
                {
                    i.lookups += 1;
                    i.fetched = stale.or(i.fetched);
                    return Some(Some((i.attr.clone(), false)));
                }
            }
        }
        // Fresh for the TTL from when the store said it, not from now.
        let Some(attr) = self.remember(dir, &e.name, path, found, 1, at) else {
            return Some(None);
        };
        if !complete {
            // Not fresh: the next stat or lookup of it asks the store.
            let stale = self.stale_instant();
            if let Some(i) = self.table.lock().get_mut(attr.ino) {
                i.fetched = stale.or(i.fetched);
            }
        }
        Some(Some((attr, complete)))
    }

    pub fn releasedir(&self, fh: u64) {
        self.dirs.lock().remove(&fh);
    }
}

/// Whether a listing without user metadata may have shown `known`, a symlink, as `listed`:
/// it tells symlinks from files by their mode only.
pub(super) fn listed_as_file(known: FileKind, listed: FileKind) -> bool {
    known == FileKind::Symlink && listed == FileKind::File
}
