//! Finding out what a path is: the stat cache, single-flight requests and statahead.
//!
//! A path is probed with HEAD `key` and LIST `key/` at once (a directory wins over a file of
//! the same name). Results are cached for the stat TTL. Entries learned from a LIST are
//! *partial* when the listing had no user metadata (plain S3), so their first stat costs one
//! HEAD instead of two requests; when it had it (MinIO's `metadata=true`, the local store) they
//! are complete and their stat costs nothing. Metadata in a listing costs the server a little
//! per entry, so directories are listed with it only while listed files get stat'ed (`ls -l`,
//! `du`), not while they do not (`find`): see [`Lookups::list_detail`].
//! Concurrent stats of one path share one probe. When a directory was just listed and its
//! entries start being stat'ed one by one (`ls -l`, `du`), the next entries in listing order
//! are stat'ed ahead in the background with bounded concurrency, the way Lustre's statahead
//! does, so the kernel's serial lookups find them cached.
//!
//! A lookup by the kernel of a directory is usually followed by its listing (`ls -l dir`,
//! `find`): its LIST then asks for a whole first page instead of one key, and that page is
//! kept for a short while so the listing starts without a request ([`Lookups::take_page`]).

use crate::error::{log_store_err, FsError, FsResult};
use crate::meta::{FileKind, PosixMeta};
use crate::namespace::names::{listable, UNLINKED_DIR};
use crate::namespace::saved::{self, ListingDisk};
use crate::paths::{Keys, MountPath, ObjectKey};
use bucketfs_store::{
    ListDetail, ListFrom, ListPage, ObjectMeta, ObjectStore, StoreError, StoreResult,
};
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What the store says exists at a path.
#[derive(Clone, Debug)]
pub struct Found {
    pub kind: FileKind,
    pub obj: ObjectMeta,
    pub has_marker: bool,
}

impl Found {
    /// A directory a listing shows as a common prefix: nothing is known of its marker.
    pub fn listed_dir() -> Self {
        Found {
            kind: FileKind::Dir,
            obj: ObjectMeta::default(),
            has_marker: false,
        }
    }
}

#[derive(Clone)]
struct Cached {
    /// `None`: the store has nothing at this path (a negative entry).
    found: Option<Found>,
    /// User metadata is known (a HEAD, or a listing that carried it).
    complete: bool,
    /// Learned from a directory listing (not yet stat'ed since).
    from_listing: bool,
    /// A directory stat'ed ahead without its first page: its lookup fetches it.
    page_due: bool,
    at: Instant,
}

type Probe = Shared<BoxFuture<'static, Result<Found, FsError>>>;

/// How long and how much the stat cache remembers.
#[derive(Debug, Clone, Copy)]
pub struct CacheLimits {
    /// Attributes and types learned from the store.
    pub ttl: Duration,
    /// "Nothing there" answers (0: never cached).
    pub negative_ttl: Duration,
    /// Entries kept at most. When full, expired entries go first, then a random quarter.
    pub max_entries: usize,
}
/// Entries stat'ed ahead per trigger, and requests in flight for them.
const STATAHEAD_COUNT: usize = 256;
const STATAHEAD_CONCURRENCY: usize = 64;
/// Listed files never stat'ed after which directories are listed without user metadata.
const UNUSED_LISTED_FILES: u64 = 64;
/// Keys asked for per LIST page of a directory listing (the most S3 returns in one).
pub const LIST_PAGE: usize = 1000;
/// First pages of looked-up directories kept for their listing once their entries are in
/// the stat cache (oldest dropped first).
const KEPT_PAGES: usize = 16;
/// Directories one statahead fetches a first page for: few enough that the kept pages of
/// the directories a walk reaches first are not pushed out by those after.
const STATAHEAD_PAGES: usize = KEPT_PAGES / 2;

/// The first LIST page of a directory (from its start: its marker first), fetched by its
/// lookup and kept for the readdir that usually follows.
struct KeptPage {
    dir_key: String,
    page: ListPage,
    /// The epoch the LIST was sent at.
    epoch: u64,
    at: Instant,
    /// Its entries went into the stat cache.
    fed: bool,
    detail: ListDetail,
    /// Saved by an earlier mount: its entries do not replace what this mount knows.
    saved: bool,
}

type KeptPages = Arc<Mutex<VecDeque<KeptPage>>>;

/// Directories (keys, `dir/`) whose first page a lookup fetched was not all of them.
type BigDirs = Arc<Mutex<HashSet<String>>>;

/// Big directories remembered at most (forgotten all at once beyond).
const BIG_DIRS: usize = 4096;

/// How long a probe's failure (`EIO`: the store did not answer, 2T on a hung connection)
/// stands for its path: the kernel, whose revalidation of a cached entry failed, drops the
/// entry and looks the name up again at once, which waited for the store as long again (4T
/// for one stat(2)). As `FAILED_STANDS` of the read path (`files::read`).
const FAILED_STANDS: Duration = Duration::from_secs(1);
/// Failed paths remembered at most (the expired ones dropped beyond, then all at once).
const FAILED_KEPT: usize = 1024;

/// Where a probe keeps the full first page its LIST fetched.
struct Keep {
    pages: KeptPages,
    big: BigDirs,
    epoch: u64,
    ttl: Duration,
    /// What the page's entries carry (see [`Lookups::list_detail`]).
    detail: ListDetail,
    /// Where the page is saved for later mounts, with the time its LIST is sent.
    disk: Option<(Arc<dyn ListingDisk>, SystemTime)>,
    /// When its LIST is sent.
    sent: Instant,
}

impl Keep {
    fn put(self, dir_key: &str, page: ListPage) {
        if page.next_continuation.is_some() {
            let mut big = self.big.lock();
            if big.len() >= BIG_DIRS {
                big.clear();
            }
            big.insert(dir_key.to_string());
        }
        // Only with user metadata (see `Lookups::save_page`).
        if let Some((disk, sent)) = self
            .disk
            .as_ref()
            .filter(|_| self.detail == ListDetail::UserMeta)
        {
            disk.save(dir_key, saved::encode(&page, *sent, self.detail));
        }
        let mut pages = self.pages.lock();
        pages.retain(|k| k.at.elapsed() < self.ttl && k.dir_key != dir_key);
        // A page not fed yet belongs to a lookup still finishing, which feeds the stat cache
        // from it: older fed pages go first, so many directories looked up at once (a job
        // opening files across a tree) do not each lose theirs and probe every file alone.
        // Unfed pages are as many as such lookups in flight, and expire with the TTL.
        while pages.len() >= KEPT_PAGES {
            match pages.iter().position(|k| k.fed) {
                Some(i) => drop(pages.remove(i)),
                None => break,
            }
        }
        pages.push_back(KeptPage {
            dir_key: dir_key.to_string(),
            page,
            epoch: self.epoch,
            at: self.sent,
            fed: false,
            detail: self.detail,
            saved: false,
        });
    }
}

/// A probe in flight (see `Lookups::inflight`).
type Inflight = (Probe, u64, bool, Arc<AtomicBool>);

pub struct Lookups {
    store: Arc<dyn ObjectStore>,
    keys: Keys,
    limits: CacheLimits,
    cache: Mutex<HashMap<MountPath, Cached>>,
    /// Probes in flight, with the epoch each started at, whether it keeps the page it
    /// fetches, and whether this mount forgot the name since it began (see [`Self::stat`]).
    inflight: Mutex<HashMap<MountPath, Inflight>>,
    /// Files (and symlinks) listed since the listing detail was last decided.
    listed_files: AtomicU64,
    /// Stats of listed files since then.
    listed_used: AtomicU64,
    /// Whether directory listings ask for user metadata.
    list_user_meta: AtomicBool,
    /// Bumped by every `forget`: a listing that was in flight meanwhile may predate a change
    /// made here, so its entries are not trusted as complete.
    changes: AtomicU64,
    /// First pages fetched by lookups of directories, for their listings.
    kept: KeptPages,
    /// Directories bigger than a page: the kernel's lookup of one (each stat TTL, while a job
    /// works in it) fetches no page, see [`Self::stat_before_listing`].
    big: BigDirs,
    /// Page fetches in flight ([`Self::fetch_page`]), by directory: the lookups of one
    /// directory that all find its page missing (many files opened in it at once) share one.
    page_fetches: Mutex<HashMap<MountPath, Shared<BoxFuture<'static, ()>>>>,
    /// Where first pages are saved for later mounts (`--data-cache`), see [`saved`].
    disk: OnceLock<Arc<dyn ListingDisk>>,
    /// Until when (Unix seconds) the disk was last told that this mount changes things.
    changing_until: AtomicU64,
    /// Paths whose probe failed with `EIO`, and when (see [`FAILED_STANDS`]).
    failed: Mutex<HashMap<MountPath, Instant>>,
}

impl Lookups {
    pub fn new(store: Arc<dyn ObjectStore>, keys: Keys, limits: CacheLimits) -> Arc<Self> {
        Arc::new(Self {
            store,
            keys,
            limits,
            cache: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            listed_files: AtomicU64::new(0),
            listed_used: AtomicU64::new(0),
            list_user_meta: AtomicBool::new(true),
            changes: AtomicU64::new(0),
            kept: KeptPages::default(),
            big: BigDirs::default(),
            page_fetches: Mutex::new(HashMap::new()),
            disk: OnceLock::new(),
            changing_until: AtomicU64::new(0),
            failed: Mutex::new(HashMap::new()),
        })
    }

    /// Saves the first pages directory lookups fetch on `disk`, and uses those saved by
    /// earlier mounts while younger than half the stat TTL (see [`saved`]).
    pub fn save_pages_on(&self, disk: Arc<dyn ListingDisk>) {
        let _ = self.disk.set(disk);
    }

    /// Pass to [`Lookups::listed`] for the entries of a LIST sent after this call.
    pub fn epoch(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
    }

    /// What a directory listing about to start should ask for. User metadata makes `ls -l`
    /// cost the LIST alone instead of a HEAD per file, but costs the server a little per entry
    /// (about 60 us on MinIO), which `find` and other walks that never stat files pay for
    /// nothing. So: with metadata at first and as long as listed files get stat'ed; without
    /// once many listed files went unstat'ed, until one is stat'ed again.
    pub fn list_detail(&self) -> ListDetail {
        if self.listed_used.swap(0, Ordering::Relaxed) > 0 {
            self.listed_files.store(0, Ordering::Relaxed);
            self.list_user_meta.store(true, Ordering::Relaxed);
        } else if self.listed_files.load(Ordering::Relaxed) >= UNUSED_LISTED_FILES {
            self.listed_files.store(0, Ordering::Relaxed);
            self.list_user_meta.store(false, Ordering::Relaxed);
        }
        self.detail_now()
    }

    /// The detail listings ask for as last decided by [`Self::list_detail`].
    fn detail_now(&self) -> ListDetail {
        if self.list_user_meta.load(Ordering::Relaxed) {
            ListDetail::UserMeta
        } else {
            ListDetail::Plain
        }
    }

    /// Where a probe of a directory keeps the first page it fetches, LISTed at `epoch` with
    /// the detail listings carry now; none without a stat TTL. With user metadata only while
    /// listings carry it: walks that stat no file (which turned it off) would pay the server
    /// for the metadata of a whole page.
    fn keep(&self, epoch: u64) -> Option<Keep> {
        (!self.limits.ttl.is_zero()).then(|| Keep {
            pages: self.kept.clone(),
            big: self.big.clone(),
            epoch,
            ttl: self.limits.ttl,
            detail: self.detail_now(),
            disk: self.disk.get().map(|d| (d.clone(), SystemTime::now())),
            sent: Instant::now(),
        })
    }

    fn alive(&self, c: &Cached) -> bool {
        let ttl = match c.found {
            Some(_) => self.limits.ttl,
            None => self.limits.negative_ttl,
        };
        c.at.elapsed() < ttl
    }

    fn fresh(&self, path: &MountPath) -> Option<Cached> {
        let cache = self.cache.lock();
        cache.get(path).filter(|c| self.alive(c)).cloned()
    }

    /// What kind of thing `path` was when last seen, however long ago: which request its
    /// probe sends first. Stale entries stay cached for this (see [`Self::put_from`]).
    fn last_kind(&self, path: &MountPath) -> Option<FileKind> {
        // `--stat-ttl 0` remembers nothing, not even this.
        if self.limits.ttl.is_zero() {
            return None;
        }
        let cache = self.cache.lock();
        cache.get(path)?.found.as_ref().map(|f| f.kind)
    }

    /// What is cached for `path` and whether it is complete, without a request and without
    /// counting as a stat of a listed entry.
    pub fn peek(&self, path: &MountPath) -> Option<(Found, bool, Instant)> {
        self.fresh(path)
            .and_then(|c| Some((c.found?, c.complete, c.at)))
    }

    fn put(&self, path: &MountPath, found: Option<Found>, complete: bool) {
        self.put_from(path, found, complete, false, Instant::now());
    }

    /// Caches what `path` is, as learned at `at`.
    fn put_from(
        &self,
        path: &MountPath,
        found: Option<Found>,
        complete: bool,
        from_listing: bool,
        at: Instant,
    ) {
        let mut cache = self.cache.lock();
        if self.limits.max_entries == 0 {
            return;
        }
        if cache.len() >= self.limits.max_entries {
            cache.retain(|_, c| self.alive(c));
            // HashMap order is random: this drops a random quarter.
            let mut extra = cache.len().saturating_sub(self.limits.max_entries * 3 / 4);
            cache.retain(|_, _| {
                let keep = extra == 0;
                extra = extra.saturating_sub(1);
                keep
            });
        }
        cache.insert(
            path.clone(),
            Cached {
                found,
                complete,
                from_listing,
                page_due: false,
                at,
            },
        );
    }

    /// When what is cached of `path` was learned, while fresh.
    pub fn learned_at(&self, path: &MountPath) -> Option<Instant> {
        self.fresh(path).map(|c| c.at)
    }

    /// Whether a fresh, complete answer for `path` is cached (no request needed); "nothing
    /// there" is one.
    pub fn cached_complete(&self, path: &MountPath) -> bool {
        self.fresh(path).is_some_and(|c| c.complete)
    }

    /// Whether `path` is cached complete or being probed right now.
    pub fn known(&self, path: &MountPath) -> bool {
        self.cached_complete(path) || self.inflight.lock().contains_key(path)
    }

    /// Records what a LIST sent at `epoch` showed. An entry that came with its user metadata
    /// is as good as a HEAD (complete, newer than what is cached), unless this mount changed
    /// something since the LIST was sent (the answer may predate the change); one without it
    /// is partial and does not replace a complete entry of the same kind.
    /// `at`: when the LIST was sent (what it says is believed until the TTL counted from then).
    pub fn listed(&self, path: &MountPath, found: Found, epoch: u64, at: Instant) {
        self.learned(path, found, epoch, true, at);
    }

    /// [`Self::listed`], as learned at `at`; `count`: as a listed file that a walk which
    /// stats nothing would not use (see [`Self::list_detail`]).
    fn learned(&self, path: &MountPath, found: Found, epoch: u64, count: bool, at: Instant) {
        let complete = found.obj.user_complete && epoch == self.epoch();
        if !complete
            && self.fresh(path).is_some_and(|c| {
                c.complete && c.found.as_ref().is_some_and(|f| f.kind == found.kind)
            })
        {
            return;
        }
        if count && found.kind != FileKind::Dir {
            self.listed_files.fetch_add(1, Ordering::Relaxed);
        }
        self.put_from(path, Some(found), complete, true, at);
    }

    /// Forgets `path` (it changed here).
    pub fn forget(&self, path: &MountPath) {
        self.changes.fetch_add(1, Ordering::SeqCst);
        self.cache.lock().remove(path);
        self.failed.lock().remove(path);
        // A probe under way may have been answered before the change: not cached, not joined.
        if let Some((.., forgotten)) = self.inflight.lock().remove(path) {
            forgotten.store(true, Ordering::SeqCst);
        }
    }

    /// Forgets everything below directory `dir`.
    pub fn forget_below(&self, dir: &MountPath) {
        self.changes.fetch_add(1, Ordering::SeqCst);
        let below = |p: &MountPath| p == dir || p.is_below(dir);
        self.cache.lock().retain(|p, _| !below(p));
        self.failed.lock().retain(|p, _| !below(p));
        self.inflight
            .lock()
            .retain(|p, e| forgotten_unless(!below(p), e));
    }

    /// [`Self::forget_below`] of `a` and `b`, in one pass.
    pub fn forget_below_either(&self, a: &MountPath, b: &MountPath) {
        self.changes.fetch_add(1, Ordering::SeqCst);
        let kept = |p: &MountPath| p != a && !p.is_below(a) && p != b && !p.is_below(b);
        self.cache.lock().retain(|p, _| kept(p));
        self.failed.lock().retain(|p, _| kept(p));
        self.inflight
            .lock()
            .retain(|p, e| forgotten_unless(kept(p), e));
    }

    /// This mount changes something in the store (before, and again once done, where the
    /// change takes a while): the saved pages' disk records it, in the background, until a
    /// second or two from now (so at most about once a second). Not for what it learns of
    /// other clients' changes: those show within T anyway.
    pub fn changing(&self) {
        let Some(disk) = self.disk.get() else { return };
        let now = SystemTime::now();
        let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if self.changing_until.load(Ordering::Relaxed) > secs {
            return;
        }
        self.changing_until.store(secs + 2, Ordering::Relaxed);
        disk.changing_until(UNIX_EPOCH + Duration::from_secs(secs + 2));
    }

    /// The mount goes: if it changed anything, the disk records that it did until now (an
    /// upload that landed since its last record, in background mode, changed the bucket).
    pub fn changes_end(&self) {
        let Some(disk) = self.disk.get() else { return };
        if self.changing_until.load(Ordering::Relaxed) > 0 {
            disk.changing_until(SystemTime::now());
        }
    }

    /// What `path` is: from the cache when fresh and complete, else from the store; and
    /// whether the answer is current: false when this mount changed the name (forgot it)
    /// while the store was asked, so the answer may predate the change.
    pub async fn stat(&self, path: &MountPath) -> (FsResult<(Found, bool)>, bool) {
        let (r, _, current) = self.stat_keeping(path, None).await;
        (r, current)
    }

    /// [`Self::stat`] of a path whose listing may well follow (the kernel's lookup of it):
    /// should it be a directory that must be listed to be found, its LIST asks for a full
    /// first page and keeps it for [`Self::take_page`]. `epoch` is [`Self::epoch`] from
    /// before the caller made sure that no directory made here below `path` is missing from
    /// the bucket (such a page would lack it).
    pub async fn stat_before_listing(
        &self,
        path: &MountPath,
        epoch: u64,
    ) -> (FsResult<(Found, bool)>, bool) {
        // A directory bigger than a page: its lookup comes back each stat TTL while a job
        // reads or writes in it (the kernel revalidates the dentry), and a page of up to
        // 1,000 entries each time, for a listing that rarely follows, cost the server more
        // than the job's own requests (100 directories of 1,000 files: 20,028 pages in a cold
        // read of them). Its lookups list it when they need to (see `list_for_lookups`), and
        // a readdir fetches its own first page.
        if self.big.lock().contains(self.keys.dir_key(path).as_str()) {
            return self.stat(path).await;
        }
        self.load_saved(path).await;
        let (r, paged, current) = self.stat_keeping(path, Some(epoch)).await;
        let page_missing = match &r {
            // A probe that kept its page: fed by whoever came first (and perhaps dropped
            // since, with the other fed pages, by the time a joiner gets here).
            Ok((_, false)) if paged => {
                self.feed_kept(path);
                false
            }
            Ok((f, false)) => f.kind == FileKind::Dir && !self.feed_kept(path),
            Ok((_, true)) => self.fresh(path).is_some_and(|c| c.page_due),
            Err(_) => false,
        };
        if page_missing {
            // Found by a probe that fetched no page (a statahead's one-key LIST, which this
            // lookup joined or found cached): the page now, so that the lookups of its
            // entries which usually follow (a job opening files across a tree) cost nothing
            // instead of a HEAD and a LIST each.
            self.fetch_page(path, epoch).await;
        }
        (r, current)
    }

    /// Saves the page a LIST of `dir_key` from its start (marker included: a lookup's, not
    /// a listing's from after the marker) gave, sent at `sent`, for later mounts. Only one with user metadata: a page without it
    /// (a walk that stats nothing) would replace the lookup's, which has it.
    pub fn save_page(&self, dir_key: &str, page: &ListPage, sent: SystemTime, detail: ListDetail) {
        if let Some(disk) = self.disk.get() {
            if !self.limits.ttl.is_zero() && detail == ListDetail::UserMeta {
                disk.save(dir_key, saved::encode(page, sent, detail));
            }
        }
    }

    /// Before a lookup of directory `path` that would LIST it: its page as an earlier mount
    /// saved it, if younger than half the stat TTL, as if this mount had fetched it then (it
    /// is believed until the TTL counted from then). Only while this mount has changed nothing
    /// (the page is older than any change made here), never over what this mount learned
    /// itself, and not when the page needs a HEAD (a marker without its metadata).
    async fn load_saved(&self, path: &MountPath) {
        let Some(disk) = self.disk.get().cloned() else {
            return;
        };
        let dir_key = self.keys.dir_key(path).into_string();
        let usable = || {
            let known = self.fresh(path);
            let other = known
                .as_ref()
                .is_some_and(|c| c.found.as_ref().is_none_or(|f| f.kind != FileKind::Dir));
            let page_known = known.as_ref().is_some_and(|c| c.complete && !c.page_due)
                || self.kept.lock().iter().any(|k| k.dir_key == dir_key);
            self.epoch() == 0 && !other && !page_known && !self.inflight.lock().contains_key(path)
        };
        if !usable() {
            return;
        }
        let Some((blob, changed)) = disk.load(&dir_key).await else {
            return;
        };
        // Not one without user metadata when a LIST now would carry it (a HEAD per file),
        // nor one that may predate a change a mount sharing the disk made.
        let Some(s) = saved::decode(&blob)
            .filter(|s| s.detail == ListDetail::UserMeta || self.detail_now() == ListDetail::Plain)
            .filter(|s| changed.is_none_or(|c| s.sent > c))
        else {
            return;
        };
        let Some(at) = s
            .age()
            // With half the TTL left at least: a page about to expire would leave the job
            // that follows probing its files one by one when it does.
            .filter(|age| *age < self.limits.ttl / 2)
            .and_then(|age| Instant::now().checked_sub(age))
        else {
            return;
        };
        let page = &s.page;
        if page.objects.is_empty() && page.common_prefixes.is_empty() {
            return;
        }
        let marker = page.objects.first().filter(|o| o.key == dir_key);
        if marker.is_some_and(|m| !m.user_complete) {
            return;
        }
        let found = Found {
            kind: FileKind::Dir,
            obj: marker.cloned().unwrap_or_default(),
            has_marker: marker.is_some(),
        };
        if !usable() {
            return;
        }
        // Known before its page is: a lookup of it meanwhile that sees the page kept (so
        // loads nothing) finds it known instead of probing it with a LIST.
        if !self.cached_complete(path) {
            self.put_from(path, Some(found), true, false, at);
        }
        {
            let mut kept = self.kept.lock();
            kept.retain(|k| k.dir_key != dir_key);
            while kept.len() >= KEPT_PAGES {
                match kept.iter().position(|k| k.fed) {
                    Some(i) => drop(kept.remove(i)),
                    None => break,
                }
            }
            kept.push_back(KeptPage {
                dir_key,
                page: s.page,
                epoch: 0,
                at,
                fed: false,
                detail: s.detail,
                saved: true,
            });
        }
        self.feed_kept(path);
    }

    /// Fetches the first page of directory `path` as its lookup would and feeds the stat
    /// cache from it; concurrent calls for one directory share one LIST. Errors are left to
    /// the lookups that follow.
    async fn fetch_page(&self, path: &MountPath, epoch: u64) {
        let fetch = {
            let mut fetches = self.page_fetches.lock();
            match fetches.get(path) {
                Some(f) => f.clone(),
                None => {
                    let Some(keep) = self.keep(epoch) else {
                        return;
                    };
                    let key = self.keys.key(path).into_string();
                    let store = self.store.clone();
                    let f = async move {
                        let _ = probe(store, key, Some(FileKind::Dir), Some(keep)).await;
                    }
                    .boxed()
                    .shared();
                    fetches.insert(path.clone(), f.clone());
                    f
                }
            }
        };
        fetch.await;
        self.page_fetches.lock().remove(path);
        // Whoever comes first feeds the stat cache; a failed fetch kept nothing.
        self.feed_kept(path);
    }

    /// Caches what the page kept by the lookup of directory `path` shows about its entries,
    /// so that looking them up (a path walk, a program opening files by name) needs no
    /// request either. False when no page of it is kept (fed already or not).
    fn feed_kept(&self, path: &MountPath) -> bool {
        let dir_key = self.keys.dir_key(path);
        let (entries, epoch, at, saved) = {
            let mut kept = self.kept.lock();
            let Some(k) = kept.iter_mut().find(|k| dir_key == *k.dir_key) else {
                return false;
            };
            if k.fed {
                return true;
            }
            k.fed = true;
            // A file whose `name/` sorts past the page's end may have a directory of its name
            // on a later page, which wins: left to its own lookup (or the listing's next page).
            let end = page_end(&k.page);
            let entries: Vec<(MountPath, Found)> =
                page_entries(&k.page, dir_key.len(), path.is_root())
                    .filter(|(name, found)| {
                        found.kind == FileKind::Dir
                            || !end.is_some_and(|end| dir_shadow_to_come(&dir_key, name, end))
                    })
                    .map(|(name, found)| (path.join(name), found))
                    .collect();
            (entries, k.epoch, k.at, k.saved)
        };
        // Not counted as listed files: the listing that usually follows counts them, and
        // counting them twice would look like a walk that stats nothing.
        for (p, found) in entries {
            // A saved page is older than anything this mount learned itself.
            if !(saved && self.fresh(&p).is_some()) {
                self.learned(&p, found, epoch, false, at);
            }
        }
        if let Some(c) = self.cache.lock().get_mut(path) {
            c.page_due = false;
        }
        true
    }

    /// The first LIST page of directory `dir_key` a lookup kept (marker first), with the epoch
    /// it was sent at. Each is given out once, while half the stat TTL is left (the kernel is
    /// told to keep the entries of a listing only as long as what is left: one about to
    /// expire would leave `ls -l` a lookup and a request per file), and only while this mount
    /// changed nothing since it was fetched (it may predate the change), and only if it
    /// carries what the listing wants (`detail`: a page without metadata would leave `ls -l`
    /// a HEAD per file).
    pub fn take_page(
        &self,
        dir_key: &ObjectKey,
        detail: ListDetail,
    ) -> Option<(ListPage, u64, Instant)> {
        let mut kept = self.kept.lock();
        if kept.is_empty() {
            return None;
        }
        let epoch = self.epoch();
        kept.retain(|k| k.at.elapsed() < self.limits.ttl && k.epoch == epoch);
        let young = self.limits.ttl / 2;
        let i = kept
            .iter()
            .position(|k| *dir_key == *k.dir_key && k.at.elapsed() < young)?;
        let k = kept.remove(i)?;
        let enough = k.detail == ListDetail::UserMeta || detail == ListDetail::Plain;
        enough.then_some((k.page, k.epoch, k.at))
    }

    /// [`Self::stat`]; with `keep_epoch`, a probe it starts keeps the page it fetches. Also
    /// says whether the probe it awaited (its own or another's) kept its page, and whether
    /// the answer is current (see [`Self::stat`]).
    async fn stat_keeping(
        &self,
        path: &MountPath,
        keep_epoch: Option<u64>,
    ) -> (FsResult<(Found, bool)>, bool, bool) {
        let cached = self.fresh(path);
        if cached.as_ref().is_some_and(|c| {
            c.from_listing && c.found.as_ref().is_some_and(|f| f.kind != FileKind::Dir)
        }) {
            self.listed_used.fetch_add(1, Ordering::Relaxed);
        }
        let hint = match cached.map(|c| (c.found, c.complete)) {
            Some((None, _)) => return (Err(FsError::ENOENT), false, true),
            Some((Some(f), true)) => return (Ok((f, true)), false, true),
            Some((Some(f), false)) => Some(f.kind),
            // A name seen before, stale now (a job reading a big directory for longer than
            // the TTL, the next epoch's open): a file costs a HEAD, not a HEAD and a LIST.
            None => self.last_kind(path),
        };
        // A probe of it failed just now: the kernel's lookup again after its revalidation
        // failed (or a getattr of it) fails at once instead of waiting for the store as long
        // again. Only a probe's own failure sets the time: asking again does not extend it.
        if self.failed_lately(path) {
            return (Err(FsError::EIO), false, true);
        }
        let (probe, started, paged, forgotten) = {
            let mut inflight = self.inflight.lock();
            match inflight.get(path) {
                Some(p) => p.clone(),
                None => {
                    let keep = keep_epoch.and_then(|epoch| self.keep(epoch));
                    let paged = keep.is_some();
                    let key = self.keys.key(path).into_string();
                    let p = probe(self.store.clone(), key, hint, keep).boxed().shared();
                    let entry = (p, self.epoch(), paged, Arc::new(AtomicBool::new(false)));
                    inflight.insert(path.clone(), entry.clone());
                    entry
                }
            }
        };
        let result = probe.clone().await;
        // Still this probe's: nothing forgot the name since it began.
        let current = {
            let mut inflight = self.inflight.lock();
            let current = inflight.get(path).is_some_and(|(p, ..)| p.ptr_eq(&probe));
            if current {
                inflight.remove(path);
            }
            current
        };
        match &result {
            Ok(f) if current => self.put(path, Some(f.clone()), true),
            // The answer may predate this mount's change of the name (an unlink, a rename):
            // the caller has it, the cache does not.
            Ok(_) => {}
            // Unless this mount changed something meanwhile (a create the probe may predate).
            Err(FsError::ENOENT) if started == self.epoch() => self.put(path, None, true),
            Err(e) if current => {
                self.forget(path);
                if *e == FsError::EIO {
                    self.failed_now(path);
                }
            }
            // A newer probe's, or its cache entry, stay.
            Err(_) => {}
        }
        // Not "not current": a joiner finds the entry gone because the first waiter took it.
        let unchanged = !forgotten.load(Ordering::SeqCst);
        (result.map(|f| (f, false)), paged, unchanged)
    }

    /// Whether a probe of `path` failed with `EIO` less than [`FAILED_STANDS`] ago.
    fn failed_lately(&self, path: &MountPath) -> bool {
        self.failed
            .lock()
            .get(path)
            .is_some_and(|at| at.elapsed() < FAILED_STANDS)
    }

    /// A probe of `path` failed with `EIO` now (see [`FAILED_STANDS`]).
    fn failed_now(&self, path: &MountPath) {
        let mut failed = self.failed.lock();
        if failed.len() >= FAILED_KEPT {
            failed.retain(|_, at| at.elapsed() < FAILED_STANDS);
            // A burst of failures (an outage, where calls fail at once anyway): forgetting
            // them only costs a wait, never a wrong answer.
            if failed.len() >= FAILED_KEPT {
                failed.clear();
            }
        }
        failed.insert(path.clone(), Instant::now());
    }

    /// Stats `paths` in the background (those not cached yet), a bounded number at a time.
    /// With `pages` allowed, the first few directories among them are stat'ed the way the
    /// kernel's lookup of a directory is: with its first page, kept for its listing and
    /// feeding the stat cache. A walk (`find`) then finds its next listings fetched, in
    /// parallel, and a program opening files by name below them finds them known. The
    /// directories after those are left to their own lookups, which fetch the page anyway: a
    /// one-key LIST ahead of that would be a second request for the same directory.
    pub fn statahead(self: &Arc<Self>, paths: Vec<MountPath>, pages: bool) {
        let pages = pages && !self.limits.ttl.is_zero();
        let mut with_page = if pages { STATAHEAD_PAGES } else { 0 };
        let todo: Vec<(MountPath, bool)> = paths
            .into_iter()
            .filter(|p| !self.known(p))
            .filter_map(|p| {
                let dir = self
                    .fresh(&p)
                    .is_some_and(|c| c.found.as_ref().is_some_and(|f| f.kind == FileKind::Dir));
                if !dir {
                    return Some((p, false));
                }
                if with_page > 0 {
                    with_page -= 1;
                    return Some((p, true));
                }
                (!pages).then_some((p, false))
            })
            .take(STATAHEAD_COUNT)
            .collect();
        if todo.is_empty() {
            return;
        }
        let this = self.clone();
        let epoch = self.epoch();
        tokio::spawn(async move {
            futures::stream::iter(todo)
                .for_each_concurrent(STATAHEAD_CONCURRENCY, |(p, dir)| {
                    let this = this.clone();
                    async move {
                        match dir {
                            true => drop(this.stat_before_listing(&p, epoch).await),
                            false => {
                                if matches!(this.stat(&p).await.0, Ok((f, _)) if f.kind == FileKind::Dir)
                                {
                                    if let Some(c) = this.cache.lock().get_mut(&p) {
                                        c.page_due = true;
                                    }
                                }
                            }
                        }
                    }
                })
                .await;
        });
    }
}

/// HEAD `key` and LIST `key/` together; with a hint (a listing's, or what the name was when
/// last seen), the one it names first (a file: only the HEAD; a directory: only the LIST),
/// and the other only if that finds nothing. So `find` and `ls -l` stat listed
/// subdirectories with one LIST each. The LIST asks for one key, or with `keep` for a full
/// page, kept if it shows a directory.
async fn probe(
    store: Arc<dyn ObjectStore>,
    key: String,
    hint: Option<FileKind>,
    keep: Option<Keep>,
) -> Result<Found, FsError> {
    let dir_key = format!("{key}/");
    let (max_keys, detail) = match &keep {
        Some(k) => (LIST_PAGE, k.detail),
        None => (1, ListDetail::UserMeta),
    };
    let list = || store.list(&dir_key, Some("/"), ListFrom::Start, max_keys, detail);
    // The directory a LIST of `key/` shows, if any (its page kept as `keep` says).
    let dir_of = |page: StoreResult<ListPage>, marker| async {
        let page = page.map_err(|e| log_store_err(&format!("list {dir_key}"), e))?;
        dir_from_page(&*store, &dir_key, page, keep, marker).await
    };
    let file_of = |head: StoreResult<ObjectMeta>| match head {
        Ok(obj) => Ok(found_object(obj)),
        Err(e) => Err(log_store_err(&format!("stat {key}"), e)),
    };
    tracing::trace!("probe {key} (hint {hint:?}): LIST {max_keys} keys, {detail:?}");
    match hint {
        Some(FileKind::Dir) => {
            // A page without metadata does not carry the marker's: HEAD it at the same time
            // (a `find`: one round trip per directory, and its listing needs none).
            let (page, marker) = if detail == ListDetail::Plain {
                let (page, marker) = tokio::join!(list(), store.head(&dir_key));
                (page, Some(marker))
            } else {
                (list().await, None)
            };
            match dir_of(page, marker).await? {
                Some(dir) => Ok(dir),
                // Not a directory any more: perhaps a file now.
                None => file_of(store.head(&key).await),
            }
        }
        Some(_) => match store.head(&key).await {
            // No file: a directory now, or nothing (not the HEAD again).
            Err(StoreError::NotFound(_)) => {
                dir_of(list().await, None).await?.ok_or(FsError::ENOENT)
            }
            head => file_of(head),
        },
        None => {
            let (head, page) = tokio::join!(store.head(&key), list());
            match dir_of(page, None).await? {
                Some(dir) => Ok(dir),
                None => file_of(head),
            }
        }
    }
}

/// The directory that a LIST of `dir_key` from its start shows, if any: anything below it
/// makes it one (and a directory wins over a file of the same name). Its attributes come
/// from its marker `dir_key` (the first key, if any), from the listing when that carried the
/// metadata, else from a HEAD (`marker`, when one was sent along with the LIST). A
/// directory's page goes to `keep`, if given.
async fn dir_from_page(
    store: &dyn ObjectStore,
    dir_key: &str,
    mut page: ListPage,
    mut keep: Option<Keep>,
    marker_head: Option<Result<ObjectMeta, StoreError>>,
) -> Result<Option<Found>, FsError> {
    // A store may cut a page short before any key: those of the directory, if any, come
    // on a later page (the first non-empty one, which is not kept: it is no first page).
    while page.objects.is_empty() && page.common_prefixes.is_empty() {
        let Some(token) = page.next_continuation.take() else {
            return Ok(None);
        };
        keep = None;
        page = store
            .list(
                dir_key,
                Some("/"),
                ListFrom::Token(token),
                1,
                ListDetail::UserMeta,
            )
            .await
            .map_err(|e| log_store_err(&format!("list {dir_key}"), e))?;
    }
    let marker = page.objects.first().filter(|o| o.key == dir_key).cloned();
    let has_marker = marker.is_some();
    let obj = match marker {
        Some(m) if m.user_complete => m,
        Some(_) => {
            let head = match marker_head {
                Some(h) => h,
                None => store.head(dir_key).await,
            };
            match head {
                Ok(o) => o,
                Err(StoreError::NotFound(_)) => ObjectMeta::default(),
                Err(e) => return Err(log_store_err(&format!("stat {dir_key}"), e)),
            }
        }
        None => ObjectMeta::default(),
    };
    if let Some(keep) = keep {
        keep.put(dir_key, page);
    }
    Ok(Some(Found {
        kind: FileKind::Dir,
        obj,
        has_marker,
    }))
}

/// What a LIST page of a directory whose key prefix is `plen` bytes long shows: its
/// subdirectories (common prefixes) first, then the objects whose names can be file names
/// (so not the directory's own marker, whose name is empty) and are not also a
/// subdirectory's (a directory wins over a file of the same name). A listing of the mount
/// root (`at_root`) leaves out [`UNLINKED_DIR`].
pub fn page_entries(
    page: &ListPage,
    plen: usize,
    at_root: bool,
) -> impl Iterator<Item = (&str, Found)> {
    let dirs: Vec<&str> = page
        .common_prefixes
        .iter()
        .filter_map(|cp| {
            let name = cp[plen..].trim_end_matches('/');
            // `a//` is no name: exactly one slash ends a subdirectory's prefix.
            (listable(name)
                && cp.len() == plen + name.len() + 1
                && !(at_root && name == UNLINKED_DIR))
                .then_some(name)
        })
        .collect();
    let shadowed: HashSet<&str> = dirs.iter().copied().collect();
    let files = page.objects.iter().filter_map(move |o| {
        let name = &o.key[plen..];
        // The hidden directory's name is no entry at the root, whatever another client put
        // there (a lookup of it says ENOENT).
        (listable(name) && !shadowed.contains(name) && !(at_root && name == UNLINKED_DIR))
            .then(|| (name, found_object(o.clone())))
    });
    dirs.into_iter()
        .map(|name| (name, Found::listed_dir()))
        .chain(files)
}

/// The last key a LIST page read, when more pages follow (see [`dir_shadow_to_come`]).
pub fn page_end(page: &ListPage) -> Option<&str> {
    page.next_continuation.as_ref()?;
    let last_object = page.objects.last().map(|o| o.key.as_str());
    let last_prefix = page.common_prefixes.last().map(String::as_str);
    last_object.max(last_prefix)
}

/// Whether a directory `name/` in the directory of key prefix `dir_key` would sort past
/// `end`, the last key read: an object `x` and keys below `x/` may both exist (not on MinIO;
/// on AWS S3), the directory wins, and keys such as `x-1` sort between them, so `x/` can
/// come a page after `x`.
pub fn dir_shadow_to_come(dir_key: &str, name: &str, end: &str) -> bool {
    let shadow = [dir_key, name, "/"];
    shadow.concat().as_str() > end
}

/// `keep` for a `retain` of the probes in flight; one not kept is marked forgotten.
fn forgotten_unless(keep: bool, e: &Inflight) -> bool {
    if !keep {
        e.3.store(true, Ordering::SeqCst);
    }
    keep
}

/// A plain object: a symlink if its mode says so, else a file.
pub fn found_object(obj: ObjectMeta) -> Found {
    let kind = match PosixMeta::from_user(&obj.user).kind() {
        Some(FileKind::Symlink) => FileKind::Symlink,
        _ => FileKind::File,
    };
    Found {
        kind,
        obj,
        has_marker: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bucketfs_store::memory::MemoryStore;
    use bucketfs_store::metrics::{MeteredStore, Op};
    use bucketfs_store::UserMeta;

    fn limits() -> CacheLimits {
        CacheLimits {
            ttl: Duration::from_secs(5),
            negative_ttl: Duration::from_secs(5),
            max_entries: 1000,
        }
    }

    #[tokio::test]
    async fn a_listing_older_than_a_change_here_is_not_trusted() {
        let l = Lookups::new(Arc::new(MemoryStore::new()), Keys::default(), limits());
        let listed = || {
            found_object(ObjectMeta {
                key: "a".into(),
                user_complete: true,
                ..Default::default()
            })
        };
        let epoch = l.epoch();
        l.listed(&"a".into(), listed(), epoch, Instant::now());
        assert!(l.cached_complete(&"a".into()));
        // A LIST sent before `a` was changed here answers after the change.
        let epoch = l.epoch();
        l.forget(&"a".into());
        l.listed(&"a".into(), listed(), epoch, Instant::now());
        assert!(!l.cached_complete(&"a".into()));
        l.listed(&"a".into(), listed(), l.epoch(), Instant::now());
        assert!(l.cached_complete(&"a".into()));
    }

    #[tokio::test]
    async fn concurrent_stats_of_one_path_share_one_probe() {
        let mem = Arc::new(MemoryStore::new());
        mem.put("a", bytes::Bytes::from_static(b"x"), &UserMeta::new())
            .await
            .unwrap();
        let metered = MeteredStore::new(mem as Arc<dyn ObjectStore>);
        let m = metered.metrics();
        let l = Lookups::new(Arc::new(metered), Keys::default(), limits());
        let a: MountPath = "a".into();
        let all = futures::future::join_all((0..32).map(|_| l.stat(&a))).await;
        assert!(all
            .iter()
            .all(|r| r.0.as_ref().unwrap().0.kind == FileKind::File));
        assert_eq!(m.requests(Op::Head), 1);
        assert_eq!(m.requests(Op::List), 1);
        // Cached now.
        l.stat(&"a".into()).await.0.unwrap();
        assert_eq!(m.total_requests(), 2);
    }

    #[tokio::test]
    async fn missing_names_are_cached_for_the_negative_ttl_only() {
        let mem = Arc::new(MemoryStore::new());
        let metered = MeteredStore::new(mem.clone() as Arc<dyn ObjectStore>);
        let m = metered.metrics();
        let store: Arc<dyn ObjectStore> = Arc::new(metered);
        let l = Lookups::new(store.clone(), Keys::default(), limits());
        assert_eq!(l.stat(&"nope".into()).await.0.unwrap_err(), FsError::ENOENT);
        assert_eq!(l.stat(&"nope".into()).await.0.unwrap_err(), FsError::ENOENT);
        assert_eq!(
            m.total_requests(),
            2,
            "one HEAD and one LIST, then the cache"
        );
        // A change made here forgets it.
        mem.put("nope", bytes::Bytes::new(), &UserMeta::new())
            .await
            .unwrap();
        l.forget(&"nope".into());
        assert!(l.stat(&"nope".into()).await.0.is_ok());

        let off = CacheLimits {
            negative_ttl: Duration::ZERO,
            ..limits()
        };
        let l = Lookups::new(store, Keys::default(), off);
        let before = m.total_requests();
        for _ in 0..3 {
            assert_eq!(
                l.stat(&"other".into()).await.0.unwrap_err(),
                FsError::ENOENT
            );
        }
        assert_eq!(
            m.total_requests() - before,
            6,
            "--negative-ttl 0 asks every time"
        );
    }

    #[tokio::test]
    async fn a_directory_lookup_caches_the_entries_its_page_shows() {
        let mem = Arc::new(MemoryStore::with_list_metadata());
        let mut meta = UserMeta::new();
        meta.insert("mode".into(), (libc::S_IFREG | 0o600).to_string());
        for key in ["d/", "d/a", "d/b", "d/sub/x", "d/twin", "d/twin/y"] {
            mem.put(key, bytes::Bytes::new(), &meta).await.unwrap();
        }
        let metered = MeteredStore::new(mem as Arc<dyn ObjectStore>);
        let m = metered.metrics();
        let l = Lookups::new(Arc::new(metered), Keys::default(), limits());
        let (d, _) = l
            .stat_before_listing(&"d".into(), l.epoch())
            .await
            .0
            .unwrap();
        assert_eq!(d.kind, FileKind::Dir);
        let after_dir = m.total_requests();
        // Files and subdirectories of the page are known now, with their metadata.
        let (a, cached) = l.stat(&"d/a".into()).await.0.unwrap();
        assert!(cached);
        assert_eq!(a.kind, FileKind::File);
        assert_eq!(a.obj.user["mode"], (libc::S_IFREG | 0o600).to_string());
        assert!(l.stat(&"d/b".into()).await.0.unwrap().1);
        assert!(l
            .fresh(&"d/sub".into())
            .is_some_and(|c| c.found.is_some_and(|f| f.kind == FileKind::Dir)));
        // A file and a directory of the same name: the directory.
        assert!(l
            .fresh(&"d/twin".into())
            .is_some_and(|c| c.found.is_some_and(|f| f.kind == FileKind::Dir)));
        assert_eq!(m.total_requests(), after_dir, "no request after the lookup");
        // The marker `d/` has no name in the directory.
        assert!(l.fresh(&"d/".into()).is_none());
        // The listing still gets the page.
        assert!(l.take_page(&"d/".into(), ListDetail::UserMeta).is_some());
    }

    #[tokio::test]
    async fn a_walk_keeps_plain_pages_and_heads_the_marker_alongside() {
        let mem = Arc::new(MemoryStore::with_list_metadata());
        let mut meta = UserMeta::new();
        meta.insert("mode".into(), (libc::S_IFDIR | 0o700).to_string());
        mem.put("d/", bytes::Bytes::new(), &meta).await.unwrap();
        mem.put("d/f", bytes::Bytes::new(), &UserMeta::new())
            .await
            .unwrap();
        let metered = MeteredStore::new(mem as Arc<dyn ObjectStore>);
        let m = metered.metrics();
        let l = Lookups::new(Arc::new(metered), Keys::default(), limits());
        // A walk that stats no file turned listing metadata off; the parent's listing
        // showed `d` as a directory.
        l.list_user_meta.store(false, Ordering::Relaxed);
        l.listed(&"d".into(), Found::listed_dir(), l.epoch(), Instant::now());
        let (d, _) = l
            .stat_before_listing(&"d".into(), l.epoch())
            .await
            .0
            .unwrap();
        assert_eq!(d.obj.user["mode"], (libc::S_IFDIR | 0o700).to_string());
        assert!(d.has_marker);
        assert_eq!((m.requests(Op::List), m.requests(Op::Head)), (1, 1));
        // A listing without metadata takes the page; one that wants metadata does not.
        assert!(l.take_page(&"d/".into(), ListDetail::Plain).is_some());
        l.forget(&"d".into());
        l.listed(&"d".into(), Found::listed_dir(), l.epoch(), Instant::now());
        l.stat_before_listing(&"d".into(), l.epoch())
            .await
            .0
            .unwrap();
        assert!(l.take_page(&"d/".into(), ListDetail::UserMeta).is_none());
    }

    #[tokio::test]
    async fn statahead_fetches_the_first_directories_pages() {
        let mem = Arc::new(MemoryStore::new());
        for d in 0..10 {
            mem.put(&format!("d{d}/f"), bytes::Bytes::new(), &UserMeta::new())
                .await
                .unwrap();
        }
        let dirs: Vec<MountPath> = (0..10).map(|d| MountPath::new(format!("d{d}"))).collect();
        let run = |pages: bool| {
            let mem = mem.clone();
            let dirs = dirs.clone();
            async move {
                let l = Lookups::new(mem, Keys::default(), limits());
                for d in &dirs {
                    l.listed(d, Found::listed_dir(), l.epoch(), Instant::now());
                }
                l.statahead(dirs.clone(), pages);
                // With pages, the directories past the first few are left to their lookups.
                let stated = if pages { STATAHEAD_PAGES } else { dirs.len() };
                while !dirs[..stated].iter().all(|d| l.cached_complete(d)) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                assert!(dirs[stated..].iter().all(|d| !l.known(d)));
                dirs.iter()
                    .filter(|d| {
                        l.take_page(&ObjectKey::new(format!("{d}/")), ListDetail::Plain)
                            .is_some()
                    })
                    .count()
            }
        };
        assert_eq!(run(true).await, STATAHEAD_PAGES);
        assert_eq!(run(false).await, 0, "not while a marker is on its way");
    }

    #[tokio::test]
    async fn kept_pages_are_few_used_once_and_expire() {
        let mem = Arc::new(MemoryStore::with_list_metadata());
        for d in 0..20 {
            mem.put(&format!("d{d:02}/f"), bytes::Bytes::new(), &UserMeta::new())
                .await
                .unwrap();
        }
        let l = Lookups::new(mem.clone(), Keys::default(), limits());
        for d in 0..20 {
            l.stat_before_listing(&MountPath::new(format!("d{d:02}")), l.epoch())
                .await
                .0
                .unwrap();
            assert!(l.kept.lock().len() <= KEPT_PAGES);
        }
        assert!(
            l.take_page(&"d00/".into(), ListDetail::UserMeta).is_none(),
            "the oldest were dropped"
        );
        let (page, _, _) = l.take_page(&"d19/".into(), ListDetail::UserMeta).unwrap();
        assert_eq!(page.objects[0].key, "d19/f");
        assert!(
            l.take_page(&"d19/".into(), ListDetail::UserMeta).is_none(),
            "given out once"
        );
        // A change here makes them all stale.
        l.forget(&"d00".into());
        assert!(l.take_page(&"d18/".into(), ListDetail::UserMeta).is_none());
        assert!(l.kept.lock().is_empty());
        // A plain stat keeps nothing.
        l.stat(&"d00".into()).await.0.unwrap();
        assert!(l.kept.lock().is_empty());

        let short = CacheLimits {
            ttl: Duration::from_millis(50),
            ..limits()
        };
        let l = Lookups::new(mem, Keys::default(), short);
        l.stat_before_listing(&"d01".into(), l.epoch())
            .await
            .0
            .unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(
            l.take_page(&"d01/".into(), ListDetail::UserMeta).is_none(),
            "expired with the stat TTL"
        );
    }

    #[tokio::test]
    async fn the_cache_stays_within_its_size() {
        let l = Lookups::new(Arc::new(MemoryStore::new()), Keys::default(), limits());
        let f = || found_object(ObjectMeta::default());
        for i in 0..5000 {
            l.listed(
                &MountPath::new(format!("f{i}")),
                f(),
                l.epoch(),
                Instant::now(),
            );
            assert!(l.cache.lock().len() <= 1000);
        }
        assert!(
            l.cache.lock().len() >= 750,
            "evicts a quarter, not everything"
        );
        assert!(
            l.peek(&"f4999".into()).is_some(),
            "the newest entry is kept"
        );
    }

    /// Lookups that share one probe, nothing changed here meanwhile: every one is told the
    /// answer is current (before: only the first woken; the others took it for one a change
    /// here made stale, and the caller answered with the inode's old attributes).
    #[tokio::test]
    async fn every_lookup_sharing_a_probe_gets_it_as_current() {
        use bucketfs_store::fault::{Fault, FaultStore};
        let mem = Arc::new(MemoryStore::new());
        mem.put("a", bytes::Bytes::from_static(b"x"), &UserMeta::new())
            .await
            .unwrap();
        let faulty = Arc::new(FaultStore::new(mem));
        faulty.inject(
            Op::Head,
            0,
            Some(1),
            Fault::DelayAfter(Duration::from_millis(200)),
        );
        let l = Lookups::new(faulty.clone(), Keys::default(), limits());
        let a: MountPath = "a".into();
        let all = futures::future::join_all((0..4).map(|_| l.stat(&a))).await;
        for (r, current) in all {
            assert_eq!(r.unwrap().0.obj.size, 1);
            assert!(current);
        }
        // A change here while the probe runs: no one is told it is current.
        faulty.inject(
            Op::Head,
            0,
            Some(1),
            Fault::DelayAfter(Duration::from_millis(200)),
        );
        l.forget(&a);
        let stats = futures::future::join_all((0..2).map(|_| l.stat(&a)));
        let forget = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            l.forget(&a);
        };
        let (all, ()) = futures::join!(stats, forget);
        assert!(all.iter().all(|(_, current)| !current));
    }
}
