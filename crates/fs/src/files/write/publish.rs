//! Storing a write state's content: publish (one PUT, or the multipart upload completed from
//! streamed, sent and copied parts, pinned to the base) and, in background mode, commit to
//! the write-back directory.

use super::*;
use crate::files::writeback::{EarlyParts, Slot};
use crate::meta::META_MTIME;
use bucketfs_store::IF_ABSENT;

/// Commits of at most this many bytes are written in the blocking call that syncs them
/// (one thread hand-off for a small file's close or a small fsync's delta).
const SMALL_COMMIT: u64 = 1 << 20;

/// Where [`WriteState::commit`] stored the content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// In the write-back directory: it uploads in the background.
    Committed,
    /// In the bucket (the write-back directory had no room).
    Uploaded,
}

/// Where bytes a commit writes are now.
enum Fill {
    Mem(Bytes),
    /// `len` bytes of the staging file at `at`.
    Staged(Arc<File>, u64, u64),
    Zeros(u64),
}

impl WriteState {
    /// Background mode's publish: makes the current content, with its metadata, durable as
    /// an entry of the write-back directory (see [`crate::files::writeback`]) that uploads
    /// in the background. The entry's file then serves as this state's content (read as is,
    /// copied before any change), so nothing of the base object is needed any more: base
    /// bytes not at hand are fetched first. `ino` names the file to the upload's callback.
    ///
    /// While the last commit's entry still waits for upload, only what changed since may be
    /// stored, as a delta over it (see [`WriteBack::begin`]); the state keeps its own
    /// staging file then. `park`: an fsync of a file that stays open (its entry waits for
    /// the close, see `writeback::PARK`).
    ///
    /// With no room for it there (the bound stays full, or the local disk is), the content
    /// goes to the bucket before this returns instead ([`Stored::Uploaded`]): never `ENOSPC`
    /// while the bucket takes it.
    pub async fn commit(&mut self, ino: Ino, park: bool) -> FsResult<Stored> {
        // Written since the last try failed (or since the last commit).
        let changed = self.phase == Phase::Changed;
        match self.commit_as(ino, park, false).await {
            Ok(()) => Ok(Stored::Committed),
            Err(e) if no_room(e) => {
                self.publish_direct(e, changed).await?;
                Ok(Stored::Uploaded)
            }
            Err(e) => Err(e),
        }
    }

    /// [`Self::commit`] found no room in the write-back directory (`e`): the content goes to
    /// the bucket now, as in sync mode, once no earlier version of its key is left to
    /// upload, and under the condition its entry would have had (another client's change
    /// since is never overwritten; an object deleted since is stored as a new one, as the
    /// entry's upload would). `e` stands when that cannot be (a conflict of the key waits to
    /// be resolved, a directory above is being renamed).
    /// `changed`: written since the last try failed; after a conflict (`ESTALE`), only
    /// such a version goes over the other client's, as in the write-back directory.
    async fn publish_direct(&mut self, e: FsError, changed: bool) -> FsResult<()> {
        let wb = self.cfg.writeback.clone().expect("background mode");
        let origin = self.origin();
        let Some((mut cond, _direct)) = wb.direct_cond(&self.key, self.committed, origin).await
        else {
            inc(&self.cfg.metrics.publish_errors);
            tracing::warn!(
                "{}: no room in the write-back directory ({e}) and no upload of it now (a \
                 version of it in conflict, or a directory above being renamed)",
                self.key
            );
            return Err(e);
        };
        if self.conflict && changed {
            // Refused before (ESTALE) and written again: this version goes over the other
            // client's, as the write-back directory does with a rewrite of a conflict. Not
            // written again, it is refused again.
            cond = Cond::Any;
            self.conflict = false;
        }
        wb.log_direct(&self.key, e);
        let mut r = self
            .publish_pinned(cond.if_match().map(str::to_string))
            .await;
        if r == Err(FsError::ESTALE) && matches!(cond, Cond::Match(_)) {
            if let Err(StoreError::NotFound(_)) = self.store.head(&self.key).await {
                tracing::warn!(
                    "{}: deleted by another client since this mount knew it; this mount's \
                     version is stored as a new file",
                    self.key
                );
                self.conflict = false;
                r = self.publish_pinned(Some(IF_ABSENT.to_string())).await;
            }
        }
        r?;
        inc(&self.cfg.metrics.writeback_direct);
        // The object is this content now: the next commit builds on it, not on an entry.
        self.committed = None;
        self.since_commit = None;
        self.bytes_changed = false;
        Ok(())
    }

    /// Another file's fsync commits this one's changes along (group commit: see
    /// `Fs::commit_along`): as a delta of at most `max` bytes over the last commit, taken
    /// now (never a whole file, never a wait for room or an upload), else nothing (false).
    /// A failure is left to the file's own next fsync or close, which commit again and
    /// report it.
    pub async fn commit_along(&mut self, ino: Ino, max: u64) -> bool {
        if self.along_len().is_none_or(|n| n > max) {
            return false;
        }
        match self.commit_as(ino, true, true).await {
            Ok(()) => true,
            Err(e) => {
                if e != FsError::EAGAIN {
                    tracing::debug!("{}: commit along another fsync: {e}", self.key);
                }
                self.untold_failure();
                false
            }
        }
    }

    /// [`Self::commit`]; `delta_only`: [`Self::commit_along`]'s (`EAGAIN` when it is not).
    async fn commit_as(&mut self, ino: Ino, park: bool, delta_only: bool) -> FsResult<()> {
        let wb = self.cfg.writeback.clone().expect("background mode");
        if !self.has_changes_to_publish() {
            return Ok(());
        }
        let size = self.size();
        if let Some(t) = self.mtime {
            mtime_into(&mut self.meta, t);
        }
        self.settle_spills().await;
        // An fsync's whole commit takes them too (fio's end_fsync, `dd conv=fsync`: the
        // close after it has nothing to commit). Parts written after it do not go up
        // early: its later fsyncs store deltas. A commit that may be a delta drops them.
        self.early_off |= park;
        let early = match park && self.since_commit.is_some() {
            true => {
                self.abort_stream().await;
                None
            }
            false => self.early_parts(size),
        };
        let r = self
            .commit_into(&wb, ino, size, park, early, delta_only)
            .await;
        if delta_only && r.as_ref().is_err_and(|e| *e == FsError::EAGAIN) {
            return Err(FsError::EAGAIN);
        }
        if let Err(e) = &r {
            if !delta_only && no_room(*e) {
                // Not a failure yet: the content goes to the bucket instead (`commit`).
                self.phase = Phase::Failed;
                return Err(*e);
            }
        }
        inc(if r.is_ok() {
            &self.cfg.metrics.files_published
        } else {
            &self.cfg.metrics.publish_errors
        });
        match r {
            // A file that stays open keeps its own copy (the next write would copy the
            // entry's back); a closed one is read from its entry until it is uploaded.
            Ok((seq, Some(_))) if park && !self.staging_shared => self.own_content(seq, size),
            Ok((seq, Some(file))) => self.serve_entry(seq, file, size),
            Ok((seq, None)) => self.committed_as(seq),
            Err(e) => {
                self.phase = Phase::Failed;
                return Err(e);
            }
        }
        self.since_commit = Some(SinceCommit::new(size));
        self.bytes_changed = false;
        // Every byte is committed: an error deferred from shipping one part is over.
        self.deferred_err = None;
        Ok(())
    }

    /// Background mode: write-back entry `seq` (`size` bytes of `file` from `offset`) is this
    /// state's content from now on, as its commit; `meta` its metadata. How a file
    /// committed by a daemon that died comes back (see [`WriteBack::adopt`]).
    pub fn adopt(&mut self, seq: u64, (file, offset): (Arc<File>, u64), size: u64, meta: UserMeta) {
        self.meta = meta;
        self.size.store(size, Ordering::Relaxed);
        self.serve_entry(seq, (file, offset), size);
    }

    /// What the next version replaces in the bucket, as far as this state knows: its base
    /// object, else the last commit's version once its upload landed, else nothing. (The
    /// write-back directory knows better while it remembers the last commit's upload.)
    fn origin(&self) -> Cond {
        match self.known_etag() {
            Some(e) => Cond::Match(e.to_string()),
            None => Cond::Absent,
        }
    }

    /// The upload of the last commit landed as `etag` (see `Fs::uploaded`).
    pub fn commit_landed(&mut self, etag: String) {
        self.committed_etag = Some(etag);
    }

    /// Entry `seq` holds the whole content now, which stays where it is (the staging file
    /// and the tail): nothing of the base object is needed any more.
    fn own_content(&mut self, seq: u64, size: u64) {
        self.dirty = Extents::default();
        if size > 0 {
            self.dirty.insert(0..size);
        }
        self.base = None;
        self.base_len = 0;
        self.generations.clear();
        self.uploaded_only.clear();
        self.committed_as(seq);
    }

    /// Entry `seq` stores the content as it is now.
    fn committed_as(&mut self, seq: u64) {
        self.committed = Some(seq);
        self.phase = Phase::Clean;
        self.conflict = false;
    }

    /// The state's content is entry `seq` now, read from `file` at `offset`.
    fn serve_entry(&mut self, seq: u64, (file, offset): (Arc<File>, u64), size: u64) {
        self.tail = None;
        let old = [self.staging.replace(file), self.staging_direct.take()];
        super::close_away(old);
        self.staging_offset = offset;
        self.staging_shared = true;
        self.local = Extents::default();
        if size > 0 {
            self.local.insert(0..size);
        }
        self.since_commit = None;
        self.own_content(seq, size);
    }

    /// The commit's entry, and where its record holds the whole content (None: it is a
    /// delta, whose bytes are only the changes).
    pub(super) async fn commit_into(
        &mut self,
        wb: &Arc<WriteBack>,
        ino: Ino,
        size: u64,
        park: bool,
        early: Option<EarlyParts>,
        delta_only: bool,
    ) -> FsResult<(u64, Option<(Arc<File>, u64)>)> {
        self.localize().await?;
        let origin = self.origin();
        // Deltas for fsyncs of a file that stays open; a close stores it whole, which lets
        // the state give back its tail and staging file while the upload waits.
        let changes = self
            .since_commit
            .as_ref()
            .filter(|_| park)
            .map(|since| Changes {
                keep: since.keep.min(size),
                ranges: since
                    .written
                    .segments(0..size)
                    .filter(|(_, w)| *w)
                    .map(|(r, _)| r)
                    .collect(),
            });
        let mut slot = match (delta_only, changes.clone()) {
            (true, Some(c)) => wb
                .try_delta(&self.key, size, &self.meta, self.committed, c)
                .await?
                .ok_or(FsError::EAGAIN)?,
            (true, None) => return Err(FsError::EAGAIN),
            (false, changes) => {
                // Not when only the metadata changed (a chmod, a utimens).
                let rewrite = self.bytes_changed;
                wb.begin(
                    &self.key,
                    size,
                    &self.meta,
                    self.committed,
                    origin,
                    changes,
                    rewrite,
                )
                .await?
            }
        };
        if let Some(e) = early.filter(|_| !slot.is_delta()) {
            slot.attach_early(e);
        }
        if slot.may_adopt() && self.staging_holds(size).await {
            let staging = self.staging.clone().expect("staging_holds");
            if slot.adopt(&staging) {
                // The staging file is the entry's now: read as is, copied before a change.
                // After a failed commit too: its sync may have failed (the kernel reports
                // that once), so it is never taken as an entry again; the next commit
                // writes a copy.
                let file = slot.file();
                self.staging_shared = true;
                let seq = wb.commit(slot, ino, park).await?;
                inc(&self.cfg.metrics.writeback_adopted);
                return Ok((seq, Some(file)));
            }
        }
        let ranges: Vec<Range<u64>> = match (&changes, slot.is_delta()) {
            (Some(c), true) => c.ranges.clone(),
            _ => std::iter::once(0..size).collect(),
        };
        let file = (!slot.is_delta()).then(|| slot.file());
        let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        if let Some(fills) = self.fills(&ranges).filter(|_| total <= SMALL_COMMIT) {
            let largest = fills.iter().map(|f| match f {
                Fill::Staged(_, _, n) | Fill::Zeros(n) => *n,
                Fill::Mem(_) => 0,
            });
            let buf = match largest.max().unwrap_or(0) {
                0 => None,
                n => Some(self.cfg.budget.buffer(n).await),
            };
            let fill = move |slot: &mut Slot| write_fills(slot, fills, buf);
            let seq = wb.commit_filled(slot, ino, park, fill).await?;
            return Ok((seq, file));
        }
        for r in ranges {
            let mut at = r.start;
            while at < r.end {
                let n = (r.end - at).min(COMMIT_CHUNK);
                // A buffer of the budget, held until its bytes are written.
                let (buf, _mem) = self.cfg.budget.buffer(n).await.split_mem();
                let w = match self.assemble_into(at..at + n, buf).await {
                    Ok(b) => slot.write(b.freeze(n as usize)).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = w {
                    // This descriptor of the entry's file may be its last (it frees the
                    // blocks): closed off the runtime, as the slot's is.
                    super::close_away([file.map(|(f, _)| f), None]);
                    wb.abandon(slot).await;
                    return Err(e);
                }
                at += n;
            }
        }
        match wb.commit(slot, ino, park).await {
            Ok(seq) => Ok((seq, file)),
            Err(e) => {
                super::close_away([file.map(|(f, _)| f), None]);
                Err(e)
            }
        }
    }

    /// Whether the staging file holds the whole content, `size` bytes from 0 (the tail moved
    /// there first), so that a commit can take it as its entry's file.
    async fn staging_holds(&mut self, size: u64) -> bool {
        if self.staging.is_none() || self.staging_shared || self.staging_offset != 0 {
            return false;
        }
        if self.spill_tail().await.is_err() {
            return false;
        }
        // Holes (zeros) too would read right; they are rare enough to copy.
        self.sources(0..size)
            .iter()
            .all(|(_, src)| *src == Source::Staging)
    }

    /// Where the current bytes of `ranges` are, for [`write_fills`]; None when some are not
    /// at hand (only in the base object, or in a failed upload).
    fn fills(&self, ranges: &[Range<u64>]) -> Option<Vec<Fill>> {
        let mut out = Vec::new();
        for r in ranges {
            for (seg, src) in self.sources(r.clone()) {
                let n = seg.end - seg.start;
                out.push(match src {
                    Source::Staging => {
                        let at = seg.start + self.staging_offset;
                        Fill::Staged(self.staging.clone()?, at, n)
                    }
                    Source::Tail => {
                        let t = self.tail.as_ref()?;
                        let from = (seg.start - t.start) as usize;
                        let bytes = &t.buf.as_slice()[from..from + n as usize];
                        Fill::Mem(Bytes::copy_from_slice(bytes))
                    }
                    Source::Zeros => Fill::Zeros(n),
                    Source::Base | Source::Uploaded => return None,
                });
            }
        }
        Some(out)
    }

    /// Fetches every byte still only in the base object into the staging file.
    pub(super) async fn localize(&mut self) -> FsResult<()> {
        let end = self.base_len.min(self.size());
        let missing: Vec<Range<u64>> = self
            .sources(0..end)
            .into_iter()
            .filter(|(_, src)| *src == Source::Base)
            .map(|(r, _)| r)
            .collect();
        for r in missing {
            let mut at = r.start;
            while at < r.end {
                let n = (r.end - at).min(COMMIT_CHUNK);
                let data = self.get_base(at..at + n).await?;
                self.stage(at, data).await?;
                self.local.insert(at..at + n);
                at += n;
            }
        }
        Ok(())
    }

    /// Uploads the current content as the object, if anything changed. On success the file is
    /// clean and the new object is the base; on failure the content stays staged (a later
    /// flush tries again) and any multipart upload is aborted.
    pub async fn publish(&mut self) -> FsResult<()> {
        let pin = self.publish_condition().map(str::to_string);
        let refused_before = self.conflict;
        let r = self.publish_pinned(pin.clone()).await;
        let new_file = pin.as_deref() == Some(IF_ABSENT);
        if r != Err(FsError::ESTALE) || pin.is_none() || refused_before {
            return r;
        }
        // A rewrite's earlier try is taken for the base only while every byte the new content
        // keeps of the base is one it kept too: not when bytes only a lost upload held are
        // part of it.
        if !new_file && (self.unanswered_tries.is_empty() || !self.uploaded_only.is_empty()) {
            return r;
        }
        // The object is not the one pinned to: an earlier publish of this file whose answer
        // was lost (its close failed with EIO) made it, and this one replaces it, or another
        // client did.
        match self.own_earlier_try().await {
            NameTaken::ByUs(etag) => {
                self.conflict = false;
                if let Some(b) = self.base.as_mut() {
                    // That try kept the base's bytes wherever this content keeps them: it is
                    // the base now, read and copied from where this content keeps bytes.
                    b.etag.clone_from(&etag);
                }
                self.publish_pinned(Some(etag)).await
            }
            NameTaken::NoLonger if new_file => {
                self.conflict = false;
                self.publish_pinned(Some(IF_ABSENT.to_string())).await
            }
            NameTaken::NoLonger => r,
            NameTaken::Unknown(e) => {
                // Not known to be another client's: no conflict, the next close tries again.
                self.conflict = false;
                Err(e)
            }
            NameTaken::ByAnother => r,
        }
    }

    /// Who has the object at this file's key (see `unanswered_tries`).
    async fn own_earlier_try(&self) -> NameTaken {
        match self.store.head(&self.key).await {
            Ok(o) => {
                let etag = o.etag.as_deref().map(norm_etag);
                let ours = etag.is_some_and(|e| self.unanswered_tries.contains(&(e, o.size)));
                match (ours, o.etag) {
                    (true, Some(etag)) => NameTaken::ByUs(etag),
                    _ => NameTaken::ByAnother,
                }
            }
            Err(StoreError::NotFound(_)) => NameTaken::NoLonger,
            Err(e) => NameTaken::Unknown(log_store_err(&format!("stat {}", self.key), e)),
        }
    }

    /// A publish of this file pinned to `pin` ended in `r`; `etag` gives the ETag its object
    /// would have. One that failed without a definite answer is remembered.
    fn note_try<T>(
        &mut self,
        pin: Option<&str>,
        r: &FsResult<T>,
        etag: impl FnOnce() -> Option<String>,
        size: u64,
    ) {
        if pin.is_none() || matches!(r, Ok(_) | Err(FsError::ESTALE)) {
            return;
        }
        if let Some(e) = etag() {
            if self.unanswered_tries.len() >= 16 {
                self.unanswered_tries.remove(0);
            }
            self.unanswered_tries.push((norm_etag(&e), size));
        }
    }

    /// [`Self::publish`] under `pin` (`If-Match`, or [`bucketfs_store::IF_ABSENT`]) instead of the base's.
    async fn publish_pinned(&mut self, pin: Option<String>) -> FsResult<()> {
        if !self.has_changes_to_publish() {
            return Ok(());
        }
        if self.conflict && pin.is_some() {
            // Said already, with the log line; nothing to ask the store.
            return Err(FsError::ESTALE);
        }
        let size = self.size();
        if let Some(t) = self.mtime {
            mtime_into(&mut self.meta, t);
        }
        self.settle_spills().await;
        // Bytes only the open upload holds can only be published by completing it.
        let result = if size <= self.cfg.layout.part_size && self.uploaded_only.is_empty() {
            self.abort_stream().await;
            self.publish_small(size, pin.as_deref()).await
        } else {
            self.publish_multipart(size, pin.as_deref()).await
        };
        self.phase = if result.is_ok() {
            Phase::Clean
        } else {
            Phase::Failed
        };
        self.conflict = result == Err(FsError::ESTALE);
        inc(if result.is_ok() {
            &self.cfg.metrics.files_published
        } else {
            &self.cfg.metrics.publish_errors
        });
        match result {
            Ok(etag) => {
                self.base = Some(Base { etag, size });
                self.unanswered_tries.clear();
                // Every byte is stored: an error deferred from shipping one part is over.
                self.deferred_err = None;
                self.base_len = size;
                self.dirty.clear();
                self.generations.clear();
                // Bytes only an uploaded part held are in the new object now.
                self.uploaded_only.clear();
                // What is on disk (`local`) and in the tail equals the new object: keep it for
                // later reads.
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// One PUT of the whole file. Its body is a budget buffer (many small files published at
    /// once must not each hold a copy outside the budget), held for the request.
    pub(super) async fn publish_small(&mut self, size: u64, pin: Option<&str>) -> FsResult<String> {
        if size == 0 {
            let r = self.put_whole(Bytes::new(), pin).await;
            self.note_try(pin, &r, || Some(crate::files::writeback::put_etag(&[])), 0);
            return r;
        }
        let len = size as usize;
        let (mut buf, _mem) = self.cfg.budget.buffer(size).await.split_mem();
        let in_tail = self
            .tail
            .as_ref()
            .is_some_and(|t| t.start == 0 && t.end() == size);
        if in_tail {
            // Written in one go and still in memory: no disk. The tail stays, for reads and
            // appends after this publish (fsync).
            let tail = self.tail.as_ref().expect("checked").buf.as_slice();
            buf.as_mut_slice()[..len].copy_from_slice(tail);
            let body = buf.freeze(len);
            let r = self.put_whole(body.clone(), pin).await;
            self.note_try(
                pin,
                &r,
                || Some(crate::files::writeback::put_etag(&body)),
                size,
            );
            return r;
        }
        let body = self.assemble_into(0..size, buf).await?.freeze(len);
        let r = self.put_whole(body.clone(), pin).await;
        self.note_try(
            pin,
            &r,
            || Some(crate::files::writeback::put_etag(&body)),
            size,
        );
        // The whole small file is at hand: keep it, so the next rewrite of a few bytes needs
        // no GET.
        if r.is_ok() && self.stage(0, body).await.is_ok() {
            self.local.insert(0..size);
            self.tail = None;
        }
        r
    }

    pub(super) async fn put_whole(&self, body: Bytes, pin: Option<&str>) -> FsResult<String> {
        self.store
            .put_if(&self.key, body, &self.meta, pin, self.headers_from(pin))
            .await
            .map_err(|e| self.publish_err(&format!("upload {}", self.key), e, pin))
    }

    /// The ETag the published object must replace (`If-Match`): the base's, when the new
    /// content keeps any of its bytes (a partial rewrite: append, pwrite, truncate/extend).
    /// A whole rewrite keeps nothing of it and replaces whatever is there (last writer wins).
    /// A new file (no base, nothing committed) replaces nothing ([`IF_ABSENT`]): an object
    /// another client made at its name since the mount found none is never overwritten.
    pub(super) fn publish_condition(&self) -> Option<&str> {
        if self.base.is_none() && self.committed.is_none() && self.committed_etag.is_none() {
            return Some(IF_ABSENT);
        }
        let keeps_base = self
            .dirty
            .segments(0..self.base_len)
            .any(|(_, dirty)| !dirty);
        self.base_etag().filter(|_| keeps_base)
    }

    /// A publish step failed. Under a pin (`If-Match`: an ETag; or [`IF_ABSENT`]), a failed
    /// precondition means another client replaced, deleted or made the object since this
    /// file's base was read, and so does a missing object under an ETag: the publish is
    /// refused (ESTALE), and the other version stays.
    pub(super) fn publish_err(&self, what: &str, e: StoreError, pin: Option<&str>) -> FsError {
        let conflict = match &e {
            StoreError::PreconditionFailed(_) => pin.is_some(),
            StoreError::NotFound(_) => pin.is_some_and(|p| p != IF_ABSENT),
            _ => false,
        };
        match e {
            e if conflict => {
                let since = match pin {
                    Some(IF_ABSENT) => {
                        "made by another client since this mount found the name free"
                    }
                    _ => "changed by another client since this file was opened",
                };
                tracing::warn!(
                    "{}: {since}; not published (ESTALE), the other client's version is kept \
                     ({what}: {e})",
                    self.key
                );
                FsError::ESTALE
            }
            e => log_store_err(what, e),
        }
    }

    pub(super) async fn publish_multipart(
        &mut self,
        size: u64,
        pin: Option<&str>,
    ) -> FsResult<String> {
        self.publish_multipart_into(size, pin, true).await
    }

    /// [`Self::publish_multipart`]; `again`: an upload the parts went into early that the
    /// store no longer has (aborted by a lifecycle rule, or MinIO's stale-upload expiry,
    /// while the file stayed open) is not taken for a deleted object: when every byte is
    /// still here (none only in that upload), the parts go again into a new upload, once.
    fn publish_multipart_into<'a>(
        &'a mut self,
        size: u64,
        pin: Option<&'a str>,
        again: bool,
    ) -> BoxFuture<'a, FsResult<String>> {
        async move {
            let early = self.stream.as_ref().is_some_and(|s| !s.slots.is_empty());
            let r = self.publish_multipart_once(size, pin, early && again).await;
            match r {
                Err(UploadGone) => {
                    if let Some(stream) = self.stream.take() {
                        let _ = stream.upload.abort().await;
                    }
                    self.publish_multipart_into(size, pin, false).await
                }
                Ok(r) => r,
            }
        }
        .boxed()
    }

    /// One try of [`Self::publish_multipart`]; with `gone_is_retried`, a "not found" or
    /// "changed" with the object still as pinned is the early upload's: [`UploadGone`] (the
    /// stream left).
    async fn publish_multipart_once(
        &mut self,
        size: u64,
        pin: Option<&str>,
        gone_is_retried: bool,
    ) -> Result<FsResult<String>, UploadGone> {
        let key = self.key.clone();
        let parts = self.cfg.layout.parts(size);
        if parts.len() > self.cfg.limits.max_parts as usize {
            return Ok(Err(FsError::EFBIG));
        }
        if let Err(e) = self.start_stream(pin).await {
            return Ok(Err(e));
        }
        Ok(match self.send_parts(&parts).await {
            Ok(completed) => {
                let stream = self.stream.as_mut().expect("stream");
                let done = stream.upload.complete(&completed, pin).await;
                let outcome = match &done {
                    Ok(_) => Ok(()),
                    Err(StoreError::PreconditionFailed(_)) => Err(FsError::ESTALE),
                    Err(_) => Err(FsError::EIO),
                };
                self.note_try(
                    pin,
                    &outcome,
                    || bucketfs_store::retry::multipart_etag(&completed),
                    size,
                );
                match done {
                    Ok(etag) => {
                        let stored = self.stream.take().expect("stream").meta;
                        self.settle_meta(stored, etag, size).await
                    }
                    Err(StoreError::NotFound(e)) if gone_is_retried => {
                        match self.as_pinned(pin).await {
                            Ok(true) => return self.upload_gone(&e.to_string()).await,
                            Ok(false) => {
                                let what = format!("complete upload of {key}");
                                let e = self.publish_err(&what, StoreError::NotFound(e), pin);
                                self.drop_failed_stream(e).await;
                                Err(e)
                            }
                            // Not known to be another client's: no conflict.
                            Err(e) => {
                                self.drop_failed_stream(e).await;
                                Err(e)
                            }
                        }
                    }
                    Err(e) => {
                        let what = format!("complete upload of {key}");
                        let e = self.publish_err(&what, e, pin);
                        self.drop_failed_stream(e).await;
                        Err(e)
                    }
                }
            }
            // A part copied from the base into a gone upload says ESTALE (see `send_part`).
            Err(e @ (FsError::ENOENT | FsError::ESTALE)) if gone_is_retried => {
                let e = match self.as_pinned(pin).await {
                    Ok(true) => return self.upload_gone("a part was refused").await,
                    Ok(false) => e,
                    // Not known to be another client's: no conflict.
                    Err(unknown) => unknown,
                };
                self.drop_failed_stream(e).await;
                Err(e)
            }
            Err(e) => {
                self.drop_failed_stream(e).await;
                Err(e)
            }
        })
    }

    /// The multipart upload just completed as `etag` carries `stored`, the metadata it was
    /// created with. A chmod, chown or utimens through the file since then is stored now,
    /// by a copy of the object onto itself pinned to `etag`; returns the object's ETag. A
    /// write's mtime after the upload began is not such a change: the object keeps the
    /// mtime it was created with (a copy per streamed file would double its cost), and so
    /// does this state, so that stat shows what a later mount will.
    ///
    /// If the copy fails, the content stays published as `etag` (the base from now on) and
    /// the metadata left to store: the next publish builds on it server-side.
    pub(super) async fn settle_meta(
        &mut self,
        stored: UserMeta,
        etag: String,
        size: u64,
    ) -> FsResult<String> {
        if !self.mtime_set {
            match stored.get(META_MTIME) {
                Some(m) => self.meta.insert(META_MTIME.into(), m.clone()),
                None => self.meta.remove(META_MTIME),
            };
            self.mtime = None;
        }
        if self.meta == stored {
            return Ok(etag);
        }
        self.base = Some(Base {
            etag: etag.clone(),
            size,
        });
        self.base_len = size;
        self.dirty.clear();
        self.generations.clear();
        self.uploaded_only.clear();
        if size > self.cfg.limits.max_copy_object {
            // Too big for one copy: a new upload of parts copied from the object.
            let pin = self.publish_condition().map(str::to_string);
            return Box::pin(self.publish_multipart(size, pin.as_deref())).await;
        }
        let what = format!("set metadata of {}", self.key);
        // The copy's own answer names the version it made: a HEAD after it could name a
        // version another client wrote since, which this file would then take for its own.
        self.store
            .copy(&self.key, &self.key, Some(&self.meta), Some(&etag))
            .await
            .map_err(|e| self.publish_err(&what, e, Some(&etag)))
    }

    /// After a publish failed with `e`: the upload is aborted, unless it holds bytes found
    /// nowhere else and a later try may work; then it stays for that try (and is aborted
    /// when the file is dropped). After a conflict (ESTALE) no try can work.
    pub(super) async fn drop_failed_stream(&mut self, e: FsError) {
        if self.uploaded_only.is_empty() || e == FsError::ESTALE {
            self.abort_stream().await;
        }
    }

    /// Makes sure every part of the object is uploaded; returns them in order.
    pub(super) async fn send_parts(
        &mut self,
        parts: &[Range<u64>],
    ) -> FsResult<Vec<CompletedPart>> {
        let indexes: Vec<u64> = self
            .stream
            .as_ref()
            .map(|s| s.slots.keys().copied().collect())
            .unwrap_or_default();
        for i in indexes {
            self.settle_part(i).await;
        }
        let stream = self.stream.as_ref().expect("stream");
        let upload = &stream.upload;
        // Parts uploaded early and unchanged since are kept; failed ones whose bytes are
        // nowhere else are sent from memory.
        let mut reuse: BTreeMap<u64, String> = BTreeMap::new();
        let mut resend: BTreeMap<u64, Bytes> = BTreeMap::new();
        for (i, slot) in &stream.slots {
            let current = self.generations.get(i).copied().unwrap_or(0);
            let full = parts
                .get(*i as usize)
                .is_some_and(|r| *r == self.cfg.layout.bounds(*i));
            match slot {
                PartSlot::Done { generation, etag } if *generation == current && full => {
                    reuse.insert(*i, etag.clone());
                }
                PartSlot::Failed {
                    generation,
                    kept: Some((body, _)),
                } if *generation == current && full => {
                    resend.insert(*i, body.clone());
                }
                _ => {}
            }
        }
        let this = &*self;
        // Collected and boxed so the caller's future stays provably Send
        // (rust-lang/rust#102211).
        let jobs: Vec<BoxFuture<'_, FsResult<CompletedPart>>> = parts
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let reused = reuse.get(&(i as u64)).cloned();
                let kept = resend.get(&(i as u64)).cloned();
                async move {
                    let number = i as u32 + 1;
                    let etag = match reused {
                        Some(etag) => etag,
                        None => this.send_part(upload, number, r.clone(), kept).await?,
                    };
                    Ok::<_, FsError>(CompletedPart {
                        part_number: number,
                        etag,
                    })
                }
                .boxed()
            })
            .collect();
        run_bounded(jobs, self.cfg.upload_concurrency).await
    }

    /// One part at publish: `kept` (the bytes of a failed early upload) if given, else copied
    /// from the base when untouched, else sent.
    pub(super) async fn send_part(
        &self,
        upload: &Upload,
        number: u32,
        r: Range<u64>,
        kept: Option<Bytes>,
    ) -> FsResult<String> {
        let what = format!("upload part {number} of {}", self.key);
        if kept.is_none() && r.end <= self.base_len && !self.dirty.intersects(&r) {
            // Untouched since the base was uploaded: copy it server-side, from the base only.
            let pin = self.base_etag();
            return upload
                .copy_part(number, &self.key, r, pin)
                .await
                .map_err(|e| self.publish_err(&what, e, pin));
        }
        let (body, _mem) = match kept {
            // Its budget is held by the slot that kept it.
            Some(body) => (body, None),
            None => {
                let len = (r.end - r.start) as usize;
                let (buf, mem) = self.cfg.budget.buffer(len as u64).await.split_mem();
                (self.assemble_into(r, buf).await?.freeze(len), Some(mem))
            }
        };
        upload
            .part(number, body)
            .await
            .map_err(|e| log_store_err(&what, e))
    }

    /// Aborts the multipart upload in progress, if any, once its running part uploads are
    /// done (see `bucketfs_store::upload`).
    pub async fn abort_stream(&mut self) {
        // One being created aborts itself once made (see `Upload`'s drop).
        self.opening = None;
        if self.cfg.writeback.is_some() {
            // Dropped, it aborts in the background once its parts end: an unlink or a
            // commit in background mode never waits for the store.
            self.stream = None;
            return;
        }
        if let Some(stream) = self.stream.take() {
            if let Err(e) = stream.upload.abort().await {
                tracing::warn!("abort upload of {}: {e}; will retry", self.key);
            }
        }
    }
}

/// A commit's error that says the write-back directory has no room for it (its bound, or
/// its disk).
fn no_room(e: FsError) -> bool {
    matches!(e.0, libc::ENOSPC | libc::EDQUOT)
}

/// Writes `fills` into `slot` in order (blocking), staged bytes through `buf` (large enough
/// for the largest).
fn write_fills(slot: &mut Slot, fills: Vec<Fill>, mut buf: Option<PoolBuf>) -> std::io::Result<()> {
    for f in fills {
        match f {
            Fill::Mem(b) => slot.write_blocking(&b)?,
            Fill::Staged(file, at, n) => {
                let b = &mut buf.as_mut().expect("a buffer").as_mut()[..n as usize];
                file.read_exact_at(b, at)?;
                slot.write_blocking(b)?;
            }
            Fill::Zeros(n) => {
                let b = &mut buf.as_mut().expect("a buffer").as_mut()[..n as usize];
                b.fill(0);
                slot.write_blocking(b)?;
            }
        }
    }
    Ok(())
}

impl WriteState {
    /// The upload the parts went into early is gone (`why`): sent again when every byte is
    /// here, else `EIO`, the bytes only it held lost (no other client is involved: not
    /// `ESTALE`).
    async fn upload_gone(&mut self, why: &str) -> Result<FsResult<String>, UploadGone> {
        // Read now: settling the parts may have staged what the upload gave back.
        if self.uploaded_only.is_empty() {
            tracing::info!(
                "{}: the upload its parts went into early is gone ({why}); sending them again",
                self.key
            );
            return Err(UploadGone);
        }
        tracing::error!(
            "{}: the upload its parts went into early is gone ({why}), with bytes only it held \
             (no staging copy); the file cannot be stored (EIO)",
            self.key
        );
        self.abort_stream().await;
        Ok(Err(FsError::EIO))
    }

    /// Whether the object is still as `pin` says (the ETag pinned to, or none for a new
    /// file): then a "not found" is the upload's, not the object's. Unpinned, only the
    /// upload can be missing. An error: not known (the HEAD failed).
    async fn as_pinned(&self, pin: Option<&str>) -> FsResult<bool> {
        let Some(pin) = pin else { return Ok(true) };
        match self.store.head(&self.key).await {
            Ok(o) => {
                Ok(pin != IF_ABSENT && o.etag.as_deref().map(norm_etag) == Some(norm_etag(pin)))
            }
            Err(StoreError::NotFound(_)) => Ok(pin == IF_ABSENT),
            Err(e) => Err(log_store_err(&format!("stat {}", self.key), e)),
        }
    }
}

/// A publish's multipart upload the store no longer has (see
/// `WriteState::publish_multipart_into`).
struct UploadGone;

/// Who has the object a pinned publish was refused at (see `WriteState::own_earlier_try`).
enum NameTaken {
    /// An earlier publish of this file, whose answer was lost: its ETag.
    ByUs(String),
    ByAnother,
    /// Nobody now (deleted since the refusal).
    NoLonger,
    /// Not known (the HEAD failed): its error.
    Unknown(FsError),
}

/// An ETag as compared: no quotes, lower case.
fn norm_etag(e: &str) -> String {
    e.trim_matches('"').to_ascii_lowercase()
}
