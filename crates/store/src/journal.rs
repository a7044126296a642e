//! A journal of the multipart uploads a mount has in progress, so that the uploads of a daemon
//! that died (kill -9, OOM, power loss) are aborted by the next mount of the same bucket
//! instead of holding their parts (and their storage bill) forever.
//!
//! An [`crate::Upload`] records itself in the journal of its store
//! ([`crate::ObjectStore::upload_journal`]: the one a [`JournalStore`] layer carries): once
//! created, as `+ <upload id> <key>` (hex-encoded, so any key fits on a line, then
//! `fdatasync`, before its first part), and once completed or aborted as `- <upload id>`. The
//! journal is the file
//! `<dir>/<tag>.<pid>.journal` (mode 0600, in a 0700 directory); `tag` names the bucket, so
//! only mounts of the same bucket recover each other's uploads. Its first line (`s <store>`,
//! [`UploadJournal::open_for_store`]) records which store the bucket is on, as the mount
//! spelled it. The daemon holds an exclusive `flock` on its journal while it lives: a journal
//! whose lock can be taken belongs to a dead daemon.
//!
//! [`recover`] runs at startup, before the mount: for every dead journal of this bucket it
//! aborts the uploads that were started and never finished, then removes the journal. If the
//! journal is of this very store (the caller decides, whatever the spelling), an abort that
//! answers `NoSuchUpload` (the upload did complete) counts as done. Otherwise (the same bucket
//! name on another store, or a journal that cannot say) only uploads this store lists under
//! their key with their exact id are aborted, and the rest is kept for a mount of that store.
//! A journal whose aborts fail (the store is down) is kept for the next mount.
//!
//! Only uploads this program started are touched; other clients' uploads under the same prefix
//! are never aborted.
//!
//! **Temporary objects.** A store made [`JournalStore::with_temporaries`] also journals every
//! object it writes under that prefix (the hidden copies of files unlinked while open) as
//! `t <key>` before writing it, and `d <key>` once it is deleted. Such objects must not
//! outlive their daemon, so [`recover`] deletes the ones a dead daemon left behind.

use crate::*;
use async_trait::async_trait;
use bytes::Bytes;
use md5::Digest;
use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const SUFFIX: &str = ".journal";
/// The journal is rewritten (compacted) when it grows past this while nothing is open.
const COMPACT_AT: u64 = 1 << 20;

/// A file name fragment for the bucket a journal belongs to: readable, no `/` or `.`.
pub fn journal_tag(store_identity: &str) -> String {
    let mut out: String = store_identity
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(60)
        .collect();
    // Distinct identities that sanitize alike still get distinct tags.
    let h = md5::Md5::digest(store_identity.as_bytes());
    out.push('-');
    out.push_str(&hex::encode(&h[..6]));
    out
}

fn lock(f: &File, block: bool) -> io::Result<bool> {
    let op = libc::LOCK_EX | if block { 0 } else { libc::LOCK_NB };
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// One open journal (the live daemon's).
pub struct UploadJournal {
    path: PathBuf,
    inner: Mutex<JournalInner>,
}

struct JournalInner {
    file: File,
    /// The `s <store>` line every version of the file starts with (empty: none).
    header: String,
    /// upload id -> key of uploads started and not finished.
    live: BTreeMap<String, String>,
    /// Temporary objects written and not yet deleted.
    temporaries: BTreeSet<String>,
    len: u64,
}

impl JournalInner {
    fn append(&mut self, line: &str, durable: bool) -> io::Result<()> {
        let r = self
            .file
            .write_all(line.as_bytes())
            .and_then(|()| match durable {
                true => self.file.sync_data(),
                false => Ok(()),
            });
        if let Err(e) = r {
            // Not recorded: a part of the line left (a full disk cuts it) would glue the
            // next line to it, and that record would not parse after a crash.
            let _ = self.file.set_len(self.len);
            let _ = self.file.seek(SeekFrom::Start(self.len));
            return Err(e);
        }
        self.len += line.len() as u64;
        Ok(())
    }

    /// Starts the file over when it has grown and records nothing live.
    fn compact(&mut self) -> io::Result<bool> {
        if self.live.is_empty() && self.temporaries.is_empty() && self.len > COMPACT_AT {
            self.file.set_len(0)?;
            // Or the next line would land after a hole of zeros and not parse.
            self.file.seek(SeekFrom::Start(0))?;
            self.len = 0;
            let header = std::mem::take(&mut self.header);
            let r = self.append(&header, true);
            self.header = header;
            r?;
            return Ok(true);
        }
        Ok(false)
    }
}

impl std::fmt::Debug for UploadJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UploadJournal")
            .field("path", &self.path)
            .finish()
    }
}

/// Runs `f`, which writes (and syncs) the journal under its lock, off the runtime's worker
/// threads: a slow or hung state disk then holds only the calls waiting for it, never the
/// workers that drive every other request's I/O and timers (their deadlines included).
fn off_workers<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

fn create_dir(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

impl UploadJournal {
    /// Creates the journal of this process for `tag` in `dir` and locks it.
    pub fn open(dir: &Path, tag: &str) -> io::Result<Self> {
        Self::open_for_store(dir, tag, "")
    }

    /// [`UploadJournal::open`], recording `store` (the endpoint, as the mount spells it) so that
    /// recovery can tell this store from another one holding a bucket of the same name.
    pub fn open_for_store(dir: &Path, tag: &str, store: &str) -> io::Result<Self> {
        create_dir(dir)?;
        // A new file: one by this name is a dead daemon's that had this pid, whose
        // leftovers its recovery kept (see `MountJournal::open`) for the next mount.
        let pid = std::process::id();
        let mut n = 0u32;
        let (path, file) = loop {
            let path = match n {
                0 => dir.join(format!("{tag}.{pid}{SUFFIX}")),
                n => dir.join(format!("{tag}.{pid}-{n}{SUFFIX}")),
            };
            match OpenOptions::new()
                .create_new(true)
                .write(true)
                .mode(0o600)
                .open(&path)
            {
                Ok(f) => break (path, f),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(e),
            }
        };
        lock(&file, true)?;
        // Its name survives a power loss with the lines it will hold. Locked first: another
        // mount's recovery takes an unlocked journal for a dead daemon's.
        if let Err(e) = std::fs::File::open(dir).and_then(|d| d.sync_all()) {
            tracing::debug!("sync of {}: {e}", dir.display());
        }
        let mut inner = JournalInner {
            file,
            header: String::new(),
            live: BTreeMap::new(),
            temporaries: BTreeSet::new(),
            len: 0,
        };
        if !store.is_empty() {
            inner.header = store_line(store);
            let header = inner.header.clone();
            inner.append(&header, true)?;
        }
        Ok(Self {
            path,
            inner: Mutex::new(inner),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Uploads started and not yet completed or aborted: `(key, upload id)`.
    pub fn live(&self) -> Vec<(String, String)> {
        self.inner
            .lock()
            .live
            .iter()
            .map(|(id, k)| (k.clone(), id.clone()))
            .collect()
    }

    /// Temporary objects written and not yet deleted.
    pub fn temporaries(&self) -> Vec<String> {
        self.inner.lock().temporaries.iter().cloned().collect()
    }

    /// Records a started upload; durable when this returns.
    pub fn started(&self, key: &str, upload_id: &str) -> io::Result<()> {
        off_workers(|| {
            let mut g = self.inner.lock();
            g.append(
                &format!("+ {} {}\n", hex::encode(upload_id), hex::encode(key)),
                true,
            )?;
            g.live.insert(upload_id.to_string(), key.to_string());
            Ok(())
        })
    }

    /// Records a completed or aborted upload.
    pub fn finished(&self, upload_id: &str) -> io::Result<()> {
        off_workers(|| {
            let mut g = self.inner.lock();
            if g.live.remove(upload_id).is_none() || g.compact()? {
                return Ok(());
            }
            g.append(&format!("- {}\n", hex::encode(upload_id)), false)
        })
    }

    /// [`Self::finished`] of the upload of `key`, the error logged: the upload is over
    /// whatever the journal says, and a line left over only costs the next mount an abort
    /// that finds nothing.
    pub fn end(&self, key: &str, upload_id: &str) {
        if let Err(e) = self.finished(upload_id) {
            tracing::warn!(
                "upload journal {}: cannot record the end of the upload of {key}: {e}",
                self.path.display()
            );
        }
    }

    /// The error of a store write refused because this journal could not record it.
    pub fn failed(&self, e: io::Error) -> StoreError {
        let what = format!("upload journal {}: {e}", self.path.display());
        // The state directory's disk is full: ENOSPC, not EIO, for the call that failed.
        match e.kind() == io::ErrorKind::StorageFull || e.raw_os_error() == Some(libc::EDQUOT) {
            true => StoreError::NoSpace(what),
            false => StoreError::Other(what),
        }
    }

    /// Records a temporary object about to be written; durable when this returns, so the
    /// object can never exist unrecorded.
    pub fn keeping(&self, key: &str) -> io::Result<()> {
        off_workers(|| {
            let mut g = self.inner.lock();
            if g.temporaries.contains(key) {
                return Ok(());
            }
            g.append(&format!("t {}\n", hex::encode(key)), true)?;
            g.temporaries.insert(key.to_string());
            Ok(())
        })
    }

    /// Records a temporary object deleted.
    pub fn dropped(&self, key: &str) -> io::Result<()> {
        off_workers(|| {
            let mut g = self.inner.lock();
            if !g.temporaries.remove(key) || g.compact()? {
                return Ok(());
            }
            g.append(&format!("d {}\n", hex::encode(key)), false)
        })
    }

    /// Its lock, as a write stuck on a hung disk holds it.
    #[cfg(test)]
    pub(crate) fn hold(&self) -> parking_lot::MutexGuard<'_, impl Sized> {
        self.inner.lock()
    }

    /// Removes the journal (a clean exit with nothing in progress and no temporary object
    /// left).
    pub fn remove(&self) -> io::Result<()> {
        let g = self.inner.lock();
        if !g.live.is_empty() || !g.temporaries.is_empty() {
            return Err(io::Error::other(format!(
                "{} uploads still in progress, {} temporary objects left",
                g.live.len(),
                g.temporaries.len()
            )));
        }
        std::fs::remove_file(&self.path)
    }
}

/// What a journal says is left: uploads still open and temporary objects not deleted.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// `(key, upload id)`.
    pub uploads: Vec<(String, String)>,
    pub temporaries: Vec<String>,
}

/// Parses journal text. Damaged lines are skipped, and a last line without its newline (torn
/// by a crash) too: cut at an even number of hex digits, it would name a prefix of its key,
/// another object, which recovery would delete.
pub fn parse_journal(text: &str) -> Leftovers {
    let mut live: BTreeMap<String, String> = BTreeMap::new();
    let mut temporaries = BTreeSet::new();
    let whole_lines = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    for line in whole_lines.lines() {
        let mut f = line.split(' ');
        let decode = |s: Option<&str>| {
            s.and_then(|s| hex::decode(s).ok())
                .and_then(|b| String::from_utf8(b).ok())
        };
        match f.next() {
            Some("+") => {
                if let (Some(id), Some(key)) = (decode(f.next()), decode(f.next())) {
                    live.insert(id, key);
                }
            }
            Some("-") => {
                if let Some(id) = decode(f.next()) {
                    live.remove(&id);
                }
            }
            Some("t") => {
                if let Some(key) = decode(f.next()) {
                    temporaries.insert(key);
                }
            }
            Some("d") => {
                if let Some(key) = decode(f.next()) {
                    temporaries.remove(&key);
                }
            }
            _ => {}
        }
    }
    Leftovers {
        uploads: live.into_iter().map(|(id, k)| (k, id)).collect(),
        temporaries: temporaries.into_iter().collect(),
    }
}

fn store_line(store: &str) -> String {
    format!("s {}\n", hex::encode(store))
}

/// The store a journal's text records (its `s` line), if any.
pub fn journal_store(text: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let h = l.strip_prefix("s ")?;
        String::from_utf8(hex::decode(h).ok()?).ok()
    })
}

/// Journal text holding `left` (and the store line), for a dead journal that keeps part of
/// what it recorded.
fn journal_text(store: Option<&str>, left: &Leftovers) -> String {
    let mut t = store.map(store_line).unwrap_or_default();
    for (key, id) in &left.uploads {
        t += &format!("+ {} {}\n", hex::encode(id), hex::encode(key));
    }
    for key in &left.temporaries {
        t += &format!("t {}\n", hex::encode(key));
    }
    t
}

/// Which dead journals a mount recovers (see [`recover_in`]).
pub struct Scope<'a> {
    pub dir: &'a Path,
    /// Journals whose file name starts with this are of this mount's bucket name.
    pub name_prefix: String,
    /// Whether the journal with this file name and recorded store (its `s` line) was written
    /// by a mount of this very store. Then whatever the store no longer holds is done;
    /// otherwise it is kept (it may be on the other store).
    pub this_store: &'a (dyn Fn(&str, Option<&str>) -> bool + Sync),
}

/// What [`recover`] did.
#[derive(Debug, Default)]
pub struct Recovery {
    /// Journals of dead daemons that were read.
    pub journals: usize,
    /// Uploads aborted: `(key, upload id)`.
    pub aborted: Vec<(String, String)>,
    /// Uploads whose abort failed (kept for the next mount): `(key, upload id, error)`.
    pub failed: Vec<(String, String, String)>,
    /// Temporary objects deleted.
    pub deleted: Vec<String>,
    /// Temporary objects whose delete failed (kept for the next mount): `(key, error)`.
    pub failed_deletes: Vec<(String, String)>,
}

/// Aborts the uploads and deletes the temporary objects left by dead daemons of `tag` in
/// `dir`, all of this store (see the module docs). Call it before [`UploadJournal::open`]: a
/// dead daemon may have had this process's pid.
pub async fn recover(store: &dyn ObjectStore, dir: &Path, tag: &str) -> io::Result<Recovery> {
    let scope = Scope {
        dir,
        name_prefix: format!("{tag}."),
        this_store: &|_, _| true,
    };
    recover_in(store, &[scope]).await
}

/// [`recover`] for the dead journals of each scope (see the module docs). A directory that
/// does not exist has none.
pub async fn recover_in(store: &dyn ObjectStore, scopes: &[Scope<'_>]) -> io::Result<Recovery> {
    let mut rec = Recovery::default();
    for scope in scopes {
        let entries = match std::fs::read_dir(scope.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with(&scope.name_prefix) || !name.ends_with(SUFFIX) {
                continue;
            }
            recover_journal(store, &entry.path(), &name, scope, &mut rec).await?;
        }
    }
    Ok(rec)
}

/// Recovers one journal file if its daemon is dead.
async fn recover_journal(
    store: &dyn ObjectStore,
    path: &Path,
    name: &str,
    scope: &Scope<'_>,
    rec: &mut Recovery,
) -> io::Result<()> {
    let Ok(mut file) = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
    else {
        return Ok(());
    };
    if !lock(&file, false)? {
        return Ok(()); // its daemon is alive
    }
    rec.journals += 1;
    let mut bytes = Vec::new();
    (&file).read_to_end(&mut bytes)?;
    // Damaged bytes spoil their line only (see `parse_journal`).
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let recorded = journal_store(&text);
    let this_store = (scope.this_store)(name, recorded.as_deref());
    let mut kept = Leftovers::default();
    let left = parse_journal(&text);
    for (key, id) in left.uploads {
        if !this_store {
            // Abort only what this store shows is that upload; the rest may be another store's.
            match store.list_multipart_uploads(&key).await {
                Ok(ups) if ups.iter().any(|u| u.key == key && u.upload_id == id) => {}
                Ok(_) => {
                    kept.uploads.push((key, id));
                    continue;
                }
                Err(e) => {
                    rec.failed.push((key.clone(), id.clone(), e.to_string()));
                    kept.uploads.push((key, id));
                    continue;
                }
            }
        }
        match store.abort_multipart(&key, &id).await {
            Ok(()) => rec.aborted.push((key, id)),
            Err(e) if e.is_not_found() => rec.aborted.push((key, id)),
            Err(e) => {
                rec.failed.push((key.clone(), id.clone(), e.to_string()));
                kept.uploads.push((key, id));
            }
        }
    }
    for key in left.temporaries {
        if !this_store {
            // Hidden copies are named after their daemon: one this store holds is that one.
            match store.head(&key).await {
                Ok(_) => {}
                Err(e) => {
                    if !e.is_not_found() {
                        rec.failed_deletes.push((key.clone(), e.to_string()));
                    }
                    kept.temporaries.push(key);
                    continue;
                }
            }
        }
        match store.delete(&key).await {
            Ok(()) => rec.deleted.push(key),
            Err(e) => {
                rec.failed_deletes.push((key.clone(), e.to_string()));
                kept.temporaries.push(key);
            }
        }
    }
    if kept == Leftovers::default() {
        std::fs::remove_file(path)?;
    } else {
        file.set_len(0)?;
        file.seek(SeekFrom::Start(0))?;
        file.write_all(journal_text(recorded.as_deref(), &kept).as_bytes())?;
        file.sync_data()?;
    }
    Ok(()) // dropping the file unlocks it
}

/// A store that journals the multipart uploads going through it, and the temporary objects
/// it writes.
pub struct JournalStore {
    inner: Arc<dyn ObjectStore>,
    journal: Arc<UploadJournal>,
    /// Objects written under this prefix are temporary (see the module docs).
    temporaries: Option<String>,
}

impl JournalStore {
    pub fn new(inner: Arc<dyn ObjectStore>, journal: Arc<UploadJournal>) -> Self {
        Self {
            inner,
            journal,
            temporaries: None,
        }
    }

    /// Journals the objects written under `prefix` as temporary.
    pub fn with_temporaries(mut self, prefix: String) -> Self {
        self.temporaries = Some(prefix);
        self
    }

    fn is_temporary(&self, key: &str) -> bool {
        self.temporaries
            .as_deref()
            .is_some_and(|p| key.starts_with(p))
    }

    /// Records `key` before it is written, if it is temporary; the write must not happen
    /// unrecorded.
    fn keeping(&self, key: &str) -> StoreResult<()> {
        if !self.is_temporary(key) {
            return Ok(());
        }
        self.journal
            .keeping(key)
            .map_err(|e| self.journal.failed(e))
    }

    pub fn journal(&self) -> Arc<UploadJournal> {
        self.journal.clone()
    }
}

#[async_trait]
impl crate::layer::StoreLayer for JournalStore {
    type Inner = dyn ObjectStore;
    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }
    async fn put_if(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
        if_match: Option<&str>,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        self.keeping(key)?;
        self.inner
            .put_if(key, body, meta, if_match, headers_from)
            .await
    }
    fn upload_journal(&self) -> Option<Arc<UploadJournal>> {
        Some(self.journal.clone())
    }
    async fn create_multipart(
        &self,
        key: &str,
        meta: &UserMeta,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        // A large file copied to a temporary key (its upload itself is journaled by Upload).
        self.keeping(key)?;
        self.inner.create_multipart(key, meta, headers_from).await
    }
    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        self.keeping(dst_key)?;
        self.inner.copy(src_key, dst_key, meta, src_if_match).await
    }
    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.inner.delete(key).await?;
        if self.is_temporary(key) {
            if let Err(e) = self.journal.dropped(key) {
                tracing::warn!(
                    "upload journal {}: cannot record the delete of {key}: {e}",
                    self.journal.path.display()
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full state disk is said as such (ENOSPC for the call), not as any store error.
    #[test]
    fn a_full_disk_is_no_space() {
        let dir = tempfile::tempdir().unwrap();
        let j = UploadJournal::open(dir.path(), "s").unwrap();
        let full = io::Error::from_raw_os_error(libc::ENOSPC);
        assert!(matches!(j.failed(full), StoreError::NoSpace(_)));
        let other = io::Error::from_raw_os_error(libc::EIO);
        assert!(matches!(j.failed(other), StoreError::Other(_)));
    }
    use crate::memory::MemoryStore;

    #[test]
    fn journal_lines_round_trip_any_key() {
        let keys = ["a/b", "sp ace\nnew+line%#?", "ü/é", ""];
        let mut text = String::new();
        for (i, k) in keys.iter().enumerate() {
            text.push_str(&format!(
                "+ {} {}\n",
                hex::encode(format!("id{i}")),
                hex::encode(k)
            ));
        }
        text.push_str(&format!("- {}\n", hex::encode("id1")));
        text.push_str("+ 6964 zz\n- \ngarbage\n+ 69"); // damaged lines
        let live = parse_journal(&text).uploads;
        assert_eq!(
            live,
            vec![
                ("a/b".to_string(), "id0".to_string()),
                ("ü/é".to_string(), "id2".to_string()),
                ("".to_string(), "id3".to_string()),
            ]
        );
    }

    #[test]
    fn tags_are_file_names() {
        let t = journal_tag("s3://bucket/pre fix @ http://127.0.0.1:9000");
        assert!(!t.contains('/') && !t.contains('.') && !t.contains(' '));
        assert_ne!(journal_tag("a/b"), journal_tag("a_b"));
    }

    /// A last line torn by a crash is not read: cut at an even number of hex digits, it
    /// named a prefix of its key, which recovery deleted.
    #[test]
    fn a_torn_last_line_is_not_read() {
        let line = |op: &str, key: &str| format!("{op} {}", hex::encode(key));
        let text = format!(
            "{}\n{}",
            line("t", ".bucketfs-unlinked/a"),
            &line("t", "data/file.bucketfs-unlinked")[..2 + 8]
        );
        assert_eq!(
            parse_journal(&text).temporaries,
            vec![".bucketfs-unlinked/a".to_string()]
        );
    }

    /// A dead daemon's journal that its recovery kept (an abort failed) under the name this
    /// process's would have (the dead one had this pid: a restart in a container) stays
    /// for the next recovery: opening this one's truncated it, and its uploads were never
    /// aborted.
    #[test]
    fn a_kept_journal_under_this_processs_name_stays() {
        let dir = tempfile::tempdir().unwrap();
        let kept = dir.path().join(format!("t.{}{SUFFIX}", std::process::id()));
        let lines = format!("+ {} {}\n", hex::encode("id"), hex::encode("k"));
        std::fs::write(&kept, &lines).unwrap();
        let journal = UploadJournal::open(dir.path(), "t").unwrap();
        assert_ne!(journal.path(), kept);
        assert_eq!(std::fs::read_to_string(&kept).unwrap(), lines);
        let again = UploadJournal::open(dir.path(), "t").unwrap();
        assert_ne!(again.path(), journal.path());
    }

    /// A journal written by a "dead daemon" (a journal file nobody holds a lock on).
    fn dead_journal(dir: &Path, tag: &str, lines: &str) {
        std::fs::write(dir.join(format!("{tag}.999999999{SUFFIX}")), lines).unwrap();
    }

    #[tokio::test]
    async fn uploads_of_a_dead_daemon_are_aborted_and_others_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(MemoryStore::new());
        let journal = Arc::new(UploadJournal::open(dir.path(), "t").unwrap());
        let js = Uploads::new(Arc::new(JournalStore::new(mem.clone(), journal.clone())));
        // Our upload, then the daemon "dies" (its journal is left, unlocked).
        let upload = js.create("k1", &UserMeta::new(), None).await.unwrap();
        let ours = upload.id().to_string();
        std::mem::forget(upload);
        let done = js.create("k2", &UserMeta::new(), None).await.unwrap();
        done.abort().await.unwrap();
        assert_eq!(journal.live(), vec![("k1".to_string(), ours.clone())]);
        let text = std::fs::read_to_string(journal.path()).unwrap();
        let own = journal.path().to_path_buf();
        drop(js);
        drop(journal);
        std::fs::remove_file(own).unwrap();
        dead_journal(dir.path(), "t", &text);
        // Someone else's upload, and a dead journal of another bucket.
        let theirs = mem
            .create_multipart("k3", &UserMeta::new(), None)
            .await
            .unwrap();
        let other_bucket = mem
            .create_multipart("k4", &UserMeta::new(), None)
            .await
            .unwrap();
        dead_journal(
            dir.path(),
            "other",
            &format!("+ {} {}\n", hex::encode(&other_bucket), hex::encode("k4")),
        );
        // A live daemon's journal (locked) is not touched either.
        let busy = mem
            .create_multipart("k5", &UserMeta::new(), None)
            .await
            .unwrap();
        let live_path = dir.path().join(format!("t.888888888{SUFFIX}"));
        std::fs::write(
            &live_path,
            format!("+ {} {}\n", hex::encode(&busy), hex::encode("k5")),
        )
        .unwrap();
        let live = File::open(&live_path).unwrap();
        assert!(lock(&live, false).unwrap());
        assert_eq!(mem.pending_uploads(), 4);

        let rec = recover(&*mem, dir.path(), "t").await.unwrap();
        assert_eq!(rec.aborted, vec![("k1".to_string(), ours)]);
        assert!(rec.failed.is_empty());
        assert_eq!(rec.journals, 1);
        assert_eq!(mem.pending_uploads(), 3);
        let left: Vec<_> = mem
            .list_multipart_uploads("")
            .await
            .unwrap()
            .into_iter()
            .map(|u| u.upload_id)
            .collect();
        assert!(left.contains(&theirs) && left.contains(&other_bucket) && left.contains(&busy));
        assert!(live_path.exists());
        drop(live);
        assert!(!dir.path().join(format!("t.999999999{SUFFIX}")).exists());
        assert!(dir.path().join(format!("other.999999999{SUFFIX}")).exists());
    }

    #[tokio::test]
    async fn temporary_objects_of_a_dead_daemon_are_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(MemoryStore::new());
        let journal = Arc::new(UploadJournal::open(dir.path(), "t").unwrap());
        let js = JournalStore::new(mem.clone(), journal.clone()).with_temporaries("p/.tmp/".into());
        let meta = UserMeta::new();
        js.put("p/f", Bytes::from_static(b"data"), &meta)
            .await
            .unwrap();
        // Copied away (an unlink of an open file), one copy deleted again (its last close).
        js.copy("p/f", "p/.tmp/1", None, None).await.unwrap();
        js.copy("p/f", "p/.tmp/2", None, None).await.unwrap();
        js.put("p/.tmp/3", Bytes::from_static(b"x"), &meta)
            .await
            .unwrap();
        js.delete("p/.tmp/2").await.unwrap();
        js.delete("p/f").await.unwrap();
        assert_eq!(journal.temporaries(), vec!["p/.tmp/1", "p/.tmp/3"]);
        assert!(journal.remove().is_err(), "objects left: the journal stays");
        // The daemon dies: the next mount deletes what it left, and only that.
        let text = std::fs::read_to_string(journal.path()).unwrap();
        assert_eq!(
            parse_journal(&text).temporaries,
            vec!["p/.tmp/1".to_string(), "p/.tmp/3".to_string()]
        );
        let own = journal.path().to_path_buf();
        drop(js);
        drop(journal);
        std::fs::remove_file(own).unwrap();
        dead_journal(dir.path(), "t", &text);
        mem.put("p/.tmp/other-mount", Bytes::from_static(b"y"), &meta)
            .await
            .unwrap();
        let rec = recover(&*mem, dir.path(), "t").await.unwrap();
        assert_eq!(rec.deleted, vec!["p/.tmp/1", "p/.tmp/3"]);
        let left: Vec<String> = mem
            .list("p/", None, ListFrom::Start, 100, ListDetail::Plain)
            .await
            .unwrap()
            .objects
            .into_iter()
            .map(|o| o.key)
            .collect();
        assert_eq!(left, vec!["p/.tmp/other-mount"]);
        assert!(!dir.path().join(format!("t.999999999{SUFFIX}")).exists());
    }

    #[test]
    fn a_compacted_journal_stays_readable() {
        let dir = tempfile::tempdir().unwrap();
        let journal = UploadJournal::open(dir.path(), "t").unwrap();
        let long = "k".repeat(1000);
        // Each pair of lines is ~4 KB; once past COMPACT_AT with nothing live, the journal
        // starts over.
        for i in 0..COMPACT_AT / 4000 + 8 {
            journal.keeping(&format!("{long}{i}")).unwrap();
            journal.dropped(&format!("{long}{i}")).unwrap();
        }
        journal.started("last-key", "last-id").unwrap();
        journal.keeping("last-tmp").unwrap();
        let len = std::fs::metadata(journal.path()).unwrap().len();
        assert!(len < COMPACT_AT / 2, "not compacted: {len} bytes");
        let text = std::fs::read_to_string(journal.path()).unwrap();
        assert_eq!(
            parse_journal(&text),
            Leftovers {
                uploads: vec![("last-key".to_string(), "last-id".to_string())],
                temporaries: vec!["last-tmp".to_string()],
            }
        );
    }

    #[tokio::test]
    async fn a_journal_whose_aborts_fail_is_kept() {
        use crate::fault::{Fault, FaultStore};
        use crate::metrics::Op;
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(MemoryStore::new());
        let id = mem
            .create_multipart("k", &UserMeta::new(), None)
            .await
            .unwrap();
        dead_journal(
            dir.path(),
            "t",
            &format!("+ {} {}\n", hex::encode(&id), hex::encode("k")),
        );
        let fault = FaultStore::new(mem.clone());
        fault.inject(
            Op::AbortMultipart,
            0,
            Some(1),
            Fault::Error(StoreError::Transient("down".into())),
        );
        let rec = recover(&fault, dir.path(), "t").await.unwrap();
        assert_eq!(rec.failed.len(), 1);
        assert!(dir.path().join(format!("t.999999999{SUFFIX}")).exists());
        let rec = recover(&fault, dir.path(), "t").await.unwrap();
        assert_eq!(rec.aborted.len(), 1);
        assert_eq!(mem.pending_uploads(), 0);
        assert!(!dir.path().join(format!("t.999999999{SUFFIX}")).exists());
    }

    #[tokio::test]
    async fn a_journal_of_another_store_keeps_what_this_store_does_not_hold() {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(MemoryStore::new());
        let meta = UserMeta::new();
        let here = mem.create_multipart("k1", &meta, None).await.unwrap();
        mem.put("t1", Bytes::from_static(b"x"), &meta)
            .await
            .unwrap();
        let theirs = mem.create_multipart("k1", &meta, None).await.unwrap();
        let lines = format!(
            "s {}\n+ {} {}\n+ {} {}\nt {}\nt {}\n",
            hex::encode("http://a:9000"),
            hex::encode(&here),
            hex::encode("k1"),
            hex::encode("elsewhere"),
            hex::encode("k2"),
            hex::encode("t1"),
            hex::encode("t2"),
        );
        dead_journal(dir.path(), "t", &lines);
        let other = |_: &str, s: Option<&str>| s == Some("http://b:9000");
        let scope = Scope {
            dir: dir.path(),
            name_prefix: "t.".into(),
            this_store: &other,
        };
        let rec = recover_in(&*mem, &[scope]).await.unwrap();
        // What this store holds under the journal's ids goes; nobody else's upload is touched.
        assert_eq!(rec.aborted, vec![("k1".to_string(), here)]);
        assert_eq!(rec.deleted, vec!["t1".to_string()]);
        assert!(
            rec.failed.is_empty() && rec.failed_deletes.is_empty(),
            "{rec:?}"
        );
        let left: Vec<_> = mem
            .list_multipart_uploads("")
            .await
            .unwrap()
            .into_iter()
            .map(|u| u.upload_id)
            .collect();
        assert_eq!(left, vec![theirs]);
        // The rest stays for a mount of the journal's own store.
        let path = dir.path().join(format!("t.999999999{SUFFIX}"));
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(journal_store(&text).as_deref(), Some("http://a:9000"));
        assert_eq!(
            parse_journal(&text),
            Leftovers {
                uploads: vec![("k2".to_string(), "elsewhere".to_string())],
                temporaries: vec!["t2".to_string()],
            }
        );
        let rec = recover(&*mem, dir.path(), "t").await.unwrap();
        assert_eq!(rec.aborted.len(), 1);
        assert!(!path.exists());
    }

    #[test]
    fn the_store_line_survives_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let j = UploadJournal::open_for_store(dir.path(), "t", "http://h:1").unwrap();
        let long = "k".repeat(1000);
        for i in 0..COMPACT_AT / 4000 + 8 {
            j.keeping(&format!("{long}{i}")).unwrap();
            j.dropped(&format!("{long}{i}")).unwrap();
        }
        j.started("k", "id").unwrap();
        let text = std::fs::read_to_string(j.path()).unwrap();
        assert!(
            (text.len() as u64) < COMPACT_AT / 2,
            "not compacted: {} bytes",
            text.len()
        );
        assert_eq!(journal_store(&text).as_deref(), Some("http://h:1"));
        assert_eq!(parse_journal(&text).uploads.len(), 1);
    }

    #[tokio::test]
    async fn completed_uploads_leave_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(MemoryStore::new());
        let journal = Arc::new(UploadJournal::open(dir.path(), "t").unwrap());
        let js = Uploads::new(Arc::new(JournalStore::new(mem.clone(), journal.clone())));
        let mut upload = js.create("k", &UserMeta::new(), None).await.unwrap();
        assert_eq!(journal.live().len(), 1);
        let e = upload.part(1, Bytes::from_static(b"x")).await.unwrap();
        let parts = [CompletedPart {
            part_number: 1,
            etag: e,
        }];
        upload.complete(&parts, None).await.unwrap();
        assert!(journal.live().is_empty());
        let text = std::fs::read_to_string(journal.path()).unwrap();
        assert_eq!(parse_journal(&text), Leftovers::default());
        journal.remove().unwrap();
        assert!(!journal.path().exists());
        // Mode 0600.
        use std::os::unix::fs::PermissionsExt;
        let j2 = UploadJournal::open(dir.path(), "t").unwrap();
        let mode = std::fs::metadata(j2.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
