use super::*;
use crate::files::writeback::{Cond, Holding, WriteBack};

/// How one try of an unlink ended.
enum Unlinked {
    Done,
    /// Background mode: a directory rename above is moving the file's version waiting for
    /// upload (the state's key): tried again once it is done.
    Moving(String),
    /// The name is another inode's now: tried again on that one.
    Replaced,
}

/// The hidden copy of an open file whose name went (see [`Fs::copy_for_descriptors`]).
pub(super) struct KeptCopy {
    /// Under [`UNLINKED_DIR`].
    pub path: MountPath,
    /// The copy's own ETag, which its readers pin.
    pub etag: String,
    /// The ETag of the version copied.
    pub source: Option<String>,
}

impl Fs {
    pub async fn unlink(&self, parent: Ino, name: &OsStr) -> FsResult<()> {
        self.check_writable()?;
        loop {
            // No open for writing of the file between the unlink's look at it and its end
            // (see `meta_changes`): one would make a state on the old key, which its close
            // would publish, bringing the file back.
            let ino = self.ns.existing(parent, name).await?;
            let _opens = self.meta_changes.lock(ino).await;
            let _changing = self.changing_in(parent).await?;
            match self.unlink_once(parent, name, ino).await? {
                Unlinked::Done => {
                    self.keep_emptied_dir(parent).await;
                    return Ok(());
                }
                Unlinked::Moving(key) => match self.files.writeback() {
                    Some(wb) => wb.wait_unmoved(&key).await,
                    None => return Err(FsError::EIO),
                },
                Unlinked::Replaced => {}
            }
        }
    }

    /// One try of [`Self::unlink`] of `name`, if it is still inode `expected`.
    async fn unlink_once(&self, parent: Ino, name: &OsStr, expected: Ino) -> FsResult<Unlinked> {
        let ino = self.ns.existing(parent, name).await?;
        if ino != expected {
            return Ok(Unlinked::Replaced);
        }
        // The descriptors counted are those it keeps the file for: later opens wait.
        let (kind, path, in_store, open, _removing) = {
            let mut t = self.ns.table();
            let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
            (
                i.kind,
                i.path.clone(),
                i.fetched.is_some(),
                i.open_handles > 0,
                Removing::hold(&self.ns, i),
            )
        };
        let write = self.files.write_of(ino);
        if kind == FileKind::Dir {
            return Err(FsError::EISDIR);
        }
        // One hold of the write state's lock for the whole unlink, so no write or publish
        // changes what it decides (keep a copy or not, delete or not) before it acts. The
        // object goes before the state is marked unlinked: a failed delete leaves the file as
        // it was, to be published at close.
        let mut guard = match &write {
            Some(w) => Some(w.state.lock().await),
            None => None,
        };
        // Published since the table was read: the object exists.
        let mut in_store = in_store || guard.as_ref().is_some_and(|st| st.base_etag().is_some());
        // Background mode: a version still to upload is held (never uploaded from now on)
        // and removed only once the unlink has succeeded in the bucket: a failed unlink
        // leaves the file, and its version to upload, as they were.
        let committed = guard.as_ref().and_then(|st| st.committed());
        let mut held = None;
        if let (Some(wb), Some(seq), Some(st)) = (self.files.writeback(), committed, &guard) {
            match wb.hold_unless_moved(seq, Some(st.key.as_str())).await {
                Some(Holding::Held { cond, .. }) => held = Some((wb.clone(), seq, cond)),
                Some(Holding::Uploaded(_)) => in_store = true,
                Some(Holding::Gone) => {}
                None => return Ok(Unlinked::Moving(st.key.as_str().to_string())),
            }
        }
        let done = self
            .unlink_object(ino, &path, guard.as_deref_mut(), in_store, open, &held)
            .await;
        let hidden = match done {
            Ok(hidden) => hidden,
            Err(e) => {
                if let Some((wb, seq, _)) = &held {
                    wb.release(*seq);
                }
                return Err(e);
            }
        };
        if let Some((wb, seq, _)) = &held {
            wb.discard(*seq).await?;
        }
        if hidden {
            drop(guard);
            self.ns.hidden(parent, &path);
            return Ok(Unlinked::Done);
        }
        if let Some(st) = guard.as_deref_mut() {
            st.unlink();
            st.abort_stream().await;
        }
        if let (Some(w), Some(st)) = (&write, guard.as_deref_mut()) {
            self.drop_closed_state(ino, w, st);
        }
        drop(guard);
        self.ns.removed(parent, ino, &path);
        Ok(Unlinked::Done)
    }

    /// The bucket side of unlinking file `ino` at `path` (write state `st`, locked): its
    /// object goes, or, open here, moves to a hidden key for its descriptors (true). With a
    /// version waiting for upload (`held`: its condition), the object goes only if it is
    /// the one that version was based on: another client's newer object is not this
    /// mount's to delete (it stays, logged), a deleted one is not deleted again.
    async fn unlink_object(
        &self,
        ino: Ino,
        path: &MountPath,
        st: Option<&mut WriteState>,
        mut in_store: bool,
        open: bool,
        held: &Option<(Arc<WriteBack>, u64, Cond)>,
    ) -> FsResult<bool> {
        let key = self.ns.key(path);
        if let Some((_, _, Cond::Any)) = held {
            // Written here again after a conflict: this mount's file is the one at the key.
            in_store = true;
        }
        let kept = || {
            tracing::warn!(
                "unlink {key}: another client wrote it since this mount's version (not \
                 uploaded yet, now removed); its object is kept"
            );
            Ok(false)
        };
        // The object goes only if it is the version the held one replaces, or the held one
        // itself (an upload of it whose answer was lost): the DELETE is pinned to it
        // (`If-Match`), and checked by a HEAD first for stores that ignore that (MinIO):
        // there, another client's write between the two is deleted.
        let tried = match held {
            Some((wb, seq, _)) => wb.tried_size(*seq),
            None => None,
        };
        // Versions it replaced whose upload failed and may have landed.
        let landed = match held {
            Some((wb, seq, _)) => wb.landed(*seq),
            None => Vec::new(),
        };
        let mut pin = None;
        let base = match held {
            Some((_, _, Cond::Match(base))) => Some(base.as_str()),
            _ => None,
        };
        if base.is_some() || tried.is_some() || !landed.is_empty() {
            match self.store.head(&key).await {
                Ok(o) => {
                    let mut ours = o.etag.is_some()
                        && (o.etag.as_deref() == base
                            || o.etag.as_ref().is_some_and(|e| landed.contains(e)));
                    if let (false, Some((wb, seq, _)), Some(_)) = (ours, held, &o.etag) {
                        // The entry's bytes are read for their ETag only when sizes match.
                        ours = tried == Some(o.size) && wb.etag_if_tried(*seq).await == o.etag;
                    }
                    if ours {
                        in_store = true;
                        pin = o.etag;
                    } else if base.is_some() {
                        return kept();
                    }
                    // Else another client's file where this one was new: not this mount's.
                }
                Err(StoreError::NotFound(_)) => return Ok(false),
                Err(e) => return Err(log_store_err(&format!("unlink {key}"), e)),
            }
        }
        if open && self.hide_open_file(ino, path, st, in_store).await? {
            return Ok(true);
        }
        if in_store {
            let r = match pin.as_deref() {
                Some(etag) => self.store.delete_if(&key, etag).await,
                None => self.store.delete(&key).await,
            };
            match r {
                Ok(()) => {}
                Err(StoreError::PreconditionFailed(_)) if pin.is_some() => return kept(),
                Err(e) => return Err(log_store_err(&format!("unlink {key}"), e)),
            }
        }
        Ok(false)
    }

    /// Unlinks file `ino`, still open here, without losing what its descriptors may read
    /// (POSIX keeps an unlinked file until its last close). Bytes that only the store holds
    /// move to a hidden key (see [`Self::copy_for_descriptors`]; copy, then delete), which
    /// the last close deletes. Returns false, having done nothing, when all its bytes are
    /// local anyway. `st` is its write state, locked by the caller.
    pub(super) async fn hide_open_file(
        &self,
        ino: Ino,
        path: &MountPath,
        mut st: Option<&mut WriteState>,
        in_store: bool,
    ) -> FsResult<bool> {
        let Some(kept) = self
            .copy_for_descriptors(ino, path, st.as_deref_mut(), in_store)
            .await?
        else {
            return Ok(false);
        };
        let src = self.ns.key(path);
        if let Err(e) = self.delete_copied(&src, kept.source.as_deref()).await {
            self.delete_hidden(kept.path).await;
            return Err(log_store_err(&format!("unlink {src}"), e));
        }
        self.retire_open_file(ino, st, Some(kept)).await;
        Ok(true)
    }

    /// Copies what the store holds of open file `ino` at `path` (its object; streamed parts
    /// have local copies, and publishing them would put half-written content under the
    /// name) server-side to a new hidden key under [`UNLINKED_DIR`], for its descriptors to
    /// read once the name is gone or taken.
    /// Returns that path and the copy's ETag, or None, having copied nothing, when all its
    /// bytes are local anyway. The object stays where it is.
    pub(super) async fn copy_for_descriptors(
        &self,
        ino: Ino,
        path: &MountPath,
        st: Option<&mut WriteState>,
        in_store: bool,
    ) -> FsResult<Option<KeptCopy>> {
        // A file truncated or rewritten since it was opened needs nothing from its object.
        let reads_object = in_store && st.as_ref().is_none_or(|st| st.reads_base());
        if !reads_object {
            return Ok(None);
        }
        // The version its descriptors read: not another client's that took the name since.
        let read = match &st {
            Some(st) => st.base_etag().map(str::to_string),
            None => self.ns.with(ino, |i| i.etag.clone()).flatten(),
        };
        // Unique across mounts sharing the bucket: inode numbers repeat, clocks and pids less so.
        let stamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let hidden = MountPath::new(format!(
            "{UNLINKED_DIR}/{ino}-{}-{stamp:x}",
            std::process::id()
        ));
        self.ns.check_key_len(&hidden)?;
        let (src, dst) = (self.ns.key(path), self.ns.key(&hidden));
        let what = format!("keeping {src} as {dst} for its open descriptors");
        let (size, source) = match self.store.head(&src).await {
            Ok(o) if read.is_none() || o.etag == read => (o.size, o.etag),
            // Deleted or replaced behind our back: nothing left to keep (the descriptors'
            // reads pinned to their version fail).
            Ok(_) | Err(StoreError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(log_store_err(&what, e)),
        };
        // Pinned: another client's version put since the HEAD is not copied either.
        let etag = match self
            .copy_object(&src, &dst, size, None, source.as_deref())
            .await
        {
            Ok(etag) => etag,
            Err(FsError::ESTALE) => return Ok(None),
            Err(e) => return Err(e),
        };
        // Readers pin the copy's own ETag with If-Match.
        Ok(Some(KeptCopy {
            path: hidden,
            etag,
            source,
        }))
    }

    /// The last step of unlinking open file `ino`, or of renaming another file over it: its
    /// name is gone, its state never publishes again, and with `kept` (the hidden copy of
    /// [`Self::copy_for_descriptors`]) its descriptors read that copy until the last close.
    pub(super) async fn retire_open_file(
        &self,
        ino: Ino,
        st: Option<&mut WriteState>,
        kept: Option<KeptCopy>,
    ) {
        if let Some(st) = st {
            st.unlink();
            st.abort_stream().await;
            if let Some(k) = &kept {
                st.move_base(self.ns.key(&k.path), k.etag.clone());
            }
        }
        let closed = {
            let mut t = self.ns.table();
            t.removed(ino);
            match (kept, t.get_mut(ino)) {
                (
                    Some(KeptCopy {
                        path: hidden, etag, ..
                    }),
                    Some(i),
                ) => {
                    i.path = hidden.clone();
                    i.etag = Some(etag);
                    // The last close came while the object was moving: it could not delete it.
                    i.hidden = i.open_handles > 0;
                    (!i.hidden).then_some(hidden)
                }
                (Some(k), None) => Some(k.path),
                (None, _) => None,
            }
        };
        if let Some(hidden) = closed {
            self.delete_hidden(hidden).await;
        }
    }

    /// Background mode: the write state `w` (`st`, locked) of `ino`, kept after its last close
    /// for an upload that will not happen now (unlinked, renamed over), goes.
    pub(super) fn drop_closed_state(&self, ino: Ino, w: &Arc<OpenWrite>, st: &mut WriteState) {
        if self.files.writeback().is_none() {
            return;
        }
        let mut t = self.ns.table();
        let open = t.get(ino).is_some_and(|i| i.open_handles > 0);
        if !open && self.files.is_sole(ino, w) {
            self.files.forget_write(ino);
            st.retire();
            if let Some(i) = t.get_mut(ino) {
                i.writing = false;
            }
        }
    }

    /// Deletes the hidden object of a file unlinked while open (see [`Self::hide_open_file`]),
    /// once nothing has it open any more.
    pub(super) async fn delete_hidden(&self, path: MountPath) {
        let key = self.ns.key(&path);
        if let Err(e) = self.store.delete(&key).await {
            tracing::warn!("{key}: object of a file unlinked while open not deleted: {e}");
        }
    }

    pub async fn rmdir(&self, parent: Ino, name: &OsStr) -> FsResult<()> {
        let _changing = self.changing_in(parent).await?;
        self.check_writable()?;
        let ino = self.ns.existing(parent, name).await?;
        let (kind, path) = {
            let t = self.ns.table();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            (i.kind, i.path.clone())
        };
        if kind != FileKind::Dir {
            return Err(FsError::ENOTDIR);
        }
        if !self.ns.dir_is_empty(ino, &path).await? {
            return Err(FsError::ENOTEMPTY);
        }
        let key = self.ns.dir_key(&path);
        let unstored = self.ns.markers.settle(&key).await;
        self.store
            .delete(&key)
            .await
            .map_err(|e| log_store_err(&format!("rmdir {key}"), e))?;
        unstored.replaced();
        self.ns.removed(parent, ino, &path);
        self.keep_emptied_dir(parent).await;
        Ok(())
    }

    /// Directory `dir` lost an entry in the bucket (the caller holds off a removal of `dir`
    /// itself). One with no marker is there only through the keys below it: emptied, it
    /// would be gone, for other clients at once and for this mount after the stat TTL,
    /// though nobody removed it. It gets a marker (with no metadata, as it showed), in the
    /// background as mkdir's. Costs a LIST of 2 keys unless its fresh listing (with what
    /// was made and removed here since) still shows an entry: in `rm -rf`, once per
    /// directory.
    pub(super) async fn keep_emptied_dir(&self, dir: Ino) {
        if dir == crate::ROOT_INO {
            return;
        }
        let only_here;
        let path = {
            let t = self.ns.table();
            let Some(i) = t.get(dir) else { return };
            if i.kind != FileKind::Dir || i.has_marker || i.unlinked {
                return;
            }
            let children = t.children_of(dir);
            if children.iter().any(|c| c.fetched.is_some()) {
                // Entries of the bucket known here: not empty (as far as the mount can
                // tell cheaply).
                return;
            }
            // Entries made here only (files waiting for a background upload) do not keep
            // it in the bucket meanwhile: it gets a marker if the bucket holds nothing else.
            only_here = !children.is_empty();
            i.path.clone()
        };
        if !only_here && self.ns.listing_holds_entries(dir) == Some(true) {
            return;
        }
        let key = self.ns.dir_key(&path);
        if self.ns.markers.pending(&key)
            || !matches!(self.ns.bucket_dir_is_empty(&key).await, Ok(true))
        {
            return;
        }
        let mut t = self.ns.table();
        if let Some(i) = t.get_mut(dir).filter(|i| !i.unlinked && !i.has_marker) {
            i.has_marker = true;
            self.ns.markers.start(key, UserMeta::new());
        }
    }
}

/// Opens of a file wait while it is held (see `Inode::removing`): an unlink of it or a rename
/// over it counted its open descriptors.
pub(super) struct Removing<'a> {
    ns: &'a Namespace,
    ino: Ino,
}

impl<'a> Removing<'a> {
    /// Holds `i` (locked in `ns`'s table, where its open descriptors were just counted).
    pub(super) fn hold(ns: &'a Namespace, i: &mut Inode) -> Self {
        i.removing += 1;
        Removing { ns, ino: i.ino }
    }
}

impl Drop for Removing<'_> {
    fn drop(&mut self) {
        self.ns
            .with(self.ino, |i| i.removing = i.removing.saturating_sub(1));
    }
}
