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

use crate::error::{log_store_err, FsError, FsResult};
use crate::meta::{FileKind, PosixMeta};
use bucketfs_store::{ListDetail, ListFrom, ListPage, ObjectMeta, ObjectStore, StoreError};
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the store says exists at a path.
#[derive(Clone, Debug)]
pub struct Found {
    pub kind: FileKind,
    pub obj: ObjectMeta,
    pub has_marker: bool,
}

#[derive(Clone)]
struct Cached {
    /// `None`: the store has nothing at this path (a negative entry).
    found: Option<Found>,
    /// User metadata is known (a HEAD, or a listing that carried it).
    complete: bool,
    /// Learned from a directory listing (not yet stat'ed since).
    from_listing: bool,
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

pub struct Lookups {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    limits: CacheLimits,
    cache: Mutex<HashMap<String, Cached>>,
    /// Probes in flight, with the epoch each started at.
    inflight: Mutex<HashMap<String, (Probe, u64)>>,
    /// Files (and symlinks) listed since the listing detail was last decided.
    listed_files: AtomicU64,
    /// Stats of listed files since then.
    listed_used: AtomicU64,
    /// Whether directory listings ask for user metadata.
    list_user_meta: AtomicBool,
    /// Bumped by every `forget`: a listing that was in flight meanwhile may predate a change
    /// made here, so its entries are not trusted as complete.
    changes: AtomicU64,
}

impl Lookups {
    pub fn new(store: Arc<dyn ObjectStore>, prefix: String, limits: CacheLimits) -> Arc<Self> {
        Arc::new(Self {
            store,
            prefix,
            limits,
            cache: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            listed_files: AtomicU64::new(0),
            listed_used: AtomicU64::new(0),
            list_user_meta: AtomicBool::new(true),
            changes: AtomicU64::new(0),
        })
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
        if self.list_user_meta.load(Ordering::Relaxed) {
            ListDetail::UserMeta
        } else {
            ListDetail::Plain
        }
    }

    fn alive(&self, c: &Cached) -> bool {
        let ttl = match c.found {
            Some(_) => self.limits.ttl,
            None => self.limits.negative_ttl,
        };
        c.at.elapsed() < ttl
    }

    fn fresh(&self, path: &str) -> Option<Cached> {
        let mut cache = self.cache.lock();
        match cache.get(path) {
            Some(c) if self.alive(c) => Some(c.clone()),
            Some(_) => {
                cache.remove(path);
                None
            }
            None => None,
        }
    }

    /// What is cached for `path` and whether it is complete, without a request and without
    /// counting as a stat of a listed entry.
    pub fn peek(&self, path: &str) -> Option<(Found, bool)> {
        self.fresh(path).and_then(|c| Some((c.found?, c.complete)))
    }

    fn put(&self, path: &str, found: Option<Found>, complete: bool) {
        self.put_from(path, found, complete, false);
    }

    fn put_from(&self, path: &str, found: Option<Found>, complete: bool, from_listing: bool) {
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
            path.to_string(),
            Cached {
                found,
                complete,
                from_listing,
                at: Instant::now(),
            },
        );
    }

    /// Whether a fresh, complete answer for `path` is cached (no request needed); "nothing
    /// there" is one.
    pub fn cached_complete(&self, path: &str) -> bool {
        self.fresh(path).is_some_and(|c| c.complete)
    }

    /// Whether `path` is cached complete or being probed right now.
    pub fn known(&self, path: &str) -> bool {
        self.cached_complete(path) || self.inflight.lock().contains_key(path)
    }

    /// Records what a LIST sent at `epoch` showed. An entry that came with its user metadata
    /// is as good as a HEAD (complete, newer than what is cached), unless this mount changed
    /// something since the LIST was sent (the answer may predate the change); one without it
    /// is partial and does not replace a complete entry of the same kind.
    pub fn listed(&self, path: &str, found: Found, epoch: u64) {
        let complete = found.obj.user_complete && epoch == self.epoch();
        if !complete
            && self.fresh(path).is_some_and(|c| {
                c.complete && c.found.as_ref().is_some_and(|f| f.kind == found.kind)
            })
        {
            return;
        }
        if found.kind != FileKind::Dir {
            self.listed_files.fetch_add(1, Ordering::Relaxed);
        }
        self.put_from(path, Some(found), complete, true);
    }

    /// Forgets `path` (it changed here).
    pub fn forget(&self, path: &str) {
        self.changes.fetch_add(1, Ordering::SeqCst);
        self.cache.lock().remove(path);
    }

    /// Forgets everything below directory `dir`.
    pub fn forget_below(&self, dir: &str) {
        self.changes.fetch_add(1, Ordering::SeqCst);
        let below = format!("{dir}/");
        self.cache
            .lock()
            .retain(|p, _| p != dir && !p.starts_with(&below));
    }

    /// What `path` is: from the cache when fresh and complete, else from the store.
    pub async fn stat(&self, path: &str) -> FsResult<(Found, bool)> {
        let cached = self.fresh(path);
        if cached.as_ref().is_some_and(|c| {
            c.from_listing && c.found.as_ref().is_some_and(|f| f.kind != FileKind::Dir)
        }) {
            self.listed_used.fetch_add(1, Ordering::Relaxed);
        }
        let hint = match cached.map(|c| (c.found, c.complete)) {
            Some((None, _)) => return Err(FsError::ENOENT),
            Some((Some(f), true)) => return Ok((f, true)),
            Some((Some(f), false)) => Some(f.kind),
            None => None,
        };
        let (probe, started) = {
            let mut inflight = self.inflight.lock();
            match inflight.get(path) {
                Some(p) => p.clone(),
                None => {
                    let p = probe(self.store.clone(), format!("{}{path}", self.prefix), hint)
                        .boxed()
                        .shared();
                    let entry = (p, self.epoch());
                    inflight.insert(path.to_string(), entry.clone());
                    entry
                }
            }
        };
        let result = probe.await;
        self.inflight.lock().remove(path);
        match &result {
            Ok(f) => self.put(path, Some(f.clone()), true),
            // Unless this mount changed something meanwhile (a create the probe may predate).
            Err(FsError::ENOENT) if started == self.epoch() => self.put(path, None, true),
            Err(_) => self.forget(path),
        }
        result.map(|f| (f, false))
    }

    /// Stats `paths` in the background (those not cached yet), a bounded number at a time.
    pub fn statahead(self: &Arc<Self>, paths: Vec<String>) {
        let todo: Vec<String> = paths
            .into_iter()
            .filter(|p| !self.known(p))
            .take(STATAHEAD_COUNT)
            .collect();
        if todo.is_empty() {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            futures::stream::iter(todo)
                .for_each_concurrent(STATAHEAD_CONCURRENCY, |p| {
                    let this = this.clone();
                    async move {
                        let _ = this.stat(&p).await;
                    }
                })
                .await;
        });
    }
}

/// HEAD `key` and LIST `key/` together; with a hint from a listing, the one it names first
/// (a file: only the HEAD; a directory: only the LIST), and the other only if that finds
/// nothing. So `find` and `ls -l` stat listed subdirectories with one LIST each.
async fn probe(
    store: Arc<dyn ObjectStore>,
    key: String,
    hint: Option<FileKind>,
) -> Result<Found, FsError> {
    let dir_key = format!("{key}/");
    match hint {
        Some(FileKind::Dir) => {
            let page = store
                .list(
                    &dir_key,
                    Some("/"),
                    ListFrom::Start,
                    1,
                    ListDetail::UserMeta,
                )
                .await
                .map_err(|e| log_store_err(&format!("list {dir_key}"), e))?;
            if let Some(dir) = dir_from_page(&*store, &dir_key, page).await? {
                return Ok(dir);
            }
            // Not a directory any more: perhaps a file now.
            return match store.head(&key).await {
                Ok(obj) => Ok(found_object(obj)),
                Err(e) => Err(log_store_err(&format!("stat {key}"), e)),
            };
        }
        Some(_) => match store.head(&key).await {
            Ok(obj) => return Ok(found_object(obj)),
            Err(StoreError::NotFound(_)) => {}
            Err(e) => return Err(log_store_err(&format!("stat {key}"), e)),
        },
        None => {}
    }
    let (head, list) = tokio::join!(
        store.head(&key),
        store.list(
            &dir_key,
            Some("/"),
            ListFrom::Start,
            1,
            ListDetail::UserMeta
        )
    );
    let page = list.map_err(|e| log_store_err(&format!("list {dir_key}"), e))?;
    if let Some(dir) = dir_from_page(&*store, &dir_key, page).await? {
        return Ok(dir);
    }
    match head {
        Ok(obj) => Ok(found_object(obj)),
        Err(e) => Err(log_store_err(&format!("stat {key}"), e)),
    }
}

/// The directory that a LIST of `dir_key` (max-keys 1) shows, if any: anything below it makes
/// it one (and a directory wins over a file of the same name). Its attributes come from its
/// marker `dir_key`, from the listing when that carried the metadata, else from a HEAD.
async fn dir_from_page(
    store: &dyn ObjectStore,
    dir_key: &str,
    page: ListPage,
) -> Result<Option<Found>, FsError> {
    if page.objects.is_empty() && page.common_prefixes.is_empty() {
        return Ok(None);
    }
    let marker = page.objects.into_iter().next().filter(|o| o.key == dir_key);
    let has_marker = marker.is_some();
    let obj = match marker {
        Some(m) if m.user_complete => m,
        Some(_) => match store.head(dir_key).await {
            Ok(o) => o,
            Err(StoreError::NotFound(_)) => ObjectMeta::default(),
            Err(e) => return Err(log_store_err(&format!("stat {dir_key}"), e)),
        },
        None => ObjectMeta::default(),
    };
    Ok(Some(Found {
        kind: FileKind::Dir,
        obj,
        has_marker,
    }))
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
        let l = Lookups::new(Arc::new(MemoryStore::new()), String::new(), limits());
        let listed = || {
            found_object(ObjectMeta {
                key: "a".into(),
                user_complete: true,
                ..Default::default()
            })
        };
        let epoch = l.epoch();
        l.listed("a", listed(), epoch);
        assert!(l.cached_complete("a"));
        // A LIST sent before `a` was changed here answers after the change.
        let epoch = l.epoch();
        l.forget("a");
        l.listed("a", listed(), epoch);
        assert!(!l.cached_complete("a"));
        l.listed("a", listed(), l.epoch());
        assert!(l.cached_complete("a"));
    }

    #[tokio::test]
    async fn concurrent_stats_of_one_path_share_one_probe() {
        let mem = Arc::new(MemoryStore::new());
        mem.put("a", bytes::Bytes::from_static(b"x"), &UserMeta::new())
            .await
            .unwrap();
        let metered = MeteredStore::new(mem as Arc<dyn ObjectStore>);
        let m = metered.metrics();
        let l = Lookups::new(Arc::new(metered), String::new(), limits());
        let all = futures::future::join_all((0..32).map(|_| l.stat("a"))).await;
        assert!(all
            .iter()
            .all(|r| r.as_ref().unwrap().0.kind == FileKind::File));
        assert_eq!(m.requests(Op::Head), 1);
        assert_eq!(m.requests(Op::List), 1);
        // Cached now.
        l.stat("a").await.unwrap();
        assert_eq!(m.total_requests(), 2);
    }

    #[tokio::test]
    async fn missing_names_are_cached_for_the_negative_ttl_only() {
        let mem = Arc::new(MemoryStore::new());
        let metered = MeteredStore::new(mem.clone() as Arc<dyn ObjectStore>);
        let m = metered.metrics();
        let store: Arc<dyn ObjectStore> = Arc::new(metered);
        let l = Lookups::new(store.clone(), String::new(), limits());
        assert_eq!(l.stat("nope").await.unwrap_err(), FsError::ENOENT);
        assert_eq!(l.stat("nope").await.unwrap_err(), FsError::ENOENT);
        assert_eq!(
            m.total_requests(),
            2,
            "one HEAD and one LIST, then the cache"
        );
        // A change made here forgets it.
        mem.put("nope", bytes::Bytes::new(), &UserMeta::new())
            .await
            .unwrap();
        l.forget("nope");
        assert!(l.stat("nope").await.is_ok());

        let off = CacheLimits {
            negative_ttl: Duration::ZERO,
            ..limits()
        };
        let l = Lookups::new(store, String::new(), off);
        let before = m.total_requests();
        for _ in 0..3 {
            assert_eq!(l.stat("other").await.unwrap_err(), FsError::ENOENT);
        }
        assert_eq!(
            m.total_requests() - before,
            6,
            "--negative-ttl 0 asks every time"
        );
    }

    #[tokio::test]
    async fn the_cache_stays_within_its_size() {
        let l = Lookups::new(Arc::new(MemoryStore::new()), String::new(), limits());
        let f = || found_object(ObjectMeta::default());
        for i in 0..5000 {
            l.listed(&format!("f{i}"), f(), l.epoch());
            assert!(l.cache.lock().len() <= 1000);
        }
        assert!(
            l.cache.lock().len() >= 750,
            "evicts a quarter, not everything"
        );
        assert!(l.peek("f4999").is_some(), "the newest entry is kept");
    }
}
