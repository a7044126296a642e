use super::remove::Removing;
use super::*;
use crate::files::writeback::{Cond, Holding, Moved, WriteBack};
use crate::namespace::{Copied, Copies, RenamedObjects};
use crate::testpoint;

/// A file still open here whose name a rename takes (see [`Fs::rename_file`]).
pub(super) struct Replaced {
    ino: Ino,
    write: Option<Arc<OpenWrite>>,
    in_store: bool,
}

/// Background mode: a file of a rename is below a directory being renamed, which may move
/// its version waiting for upload to a new entry its state learns of only at the end; the
/// rename waits for it and starts again (see [`WriteBack::hold_unless_moved`]). Never
/// returned to the kernel.
const MOVING: FsError = FsError(libc::EAGAIN);

type StateGuard<'a> = tokio::sync::MutexGuard<'a, WriteState>;

/// Locks the write states of two files in inode order, so that two renames crossing each
/// other cannot deadlock.
async fn lock_in_order<'a>(
    a: (Ino, Option<&'a OpenWrite>),
    b: Option<(Ino, Option<&'a OpenWrite>)>,
) -> (Option<StateGuard<'a>>, Option<StateGuard<'a>>) {
    async fn lock(w: Option<&OpenWrite>) -> Option<StateGuard<'_>> {
        match w {
            Some(w) => Some(w.state.lock().await),
            None => None,
        }
    }
    let Some((b_ino, b)) = b else {
        return (lock(a.1).await, None);
    };
    if a.0 <= b_ino {
        let ga = lock(a.1).await;
        (ga, lock(b).await)
    } else {
        let gb = lock(b).await;
        (lock(a.1).await, gb)
    }
}

/// Write-back entries a directory rename keeps from uploading; those it did not move are let
/// go when it ends.
#[derive(Default)]
struct Held(Vec<(Arc<WriteBack>, u64)>);

impl Drop for Held {
    fn drop(&mut self) {
        for (wb, seq) in self.0.drain(..) {
            wb.release(seq);
        }
    }
}

impl Held {
    /// Removes the held versions for good: a rename's copy replaced them at `dst`.
    async fn discard(&mut self, dst: &ObjectKey) {
        for (wb, seq) in std::mem::take(&mut self.0) {
            if let Err(e) = wb.discard(seq).await {
                tracing::warn!(
                    "rename over {dst}: removing the replaced file's version waiting for \
                     upload: {e}"
                );
            }
        }
    }
}

impl Fs {
    /// `flags` are renameat2 flags (`RENAME_NOREPLACE` is honoured, `RENAME_EXCHANGE` is not
    /// supported).
    pub async fn rename(
        &self,
        parent: Ino,
        name: &OsStr,
        new_parent: Ino,
        new_name: &OsStr,
        flags: u32,
    ) -> FsResult<()> {
        loop {
            match self
                .rename_once(parent, name, new_parent, new_name, flags)
                .await
            {
                Err(MOVING) => {}
                r => return r,
            }
        }
    }

    /// [`Self::rename`], or `MOVING` (having waited for it) when a directory rename above
    /// moved a version waiting for upload of one of the files: tried again.
    async fn rename_once(
        &self,
        parent: Ino,
        name: &OsStr,
        new_parent: Ino,
        new_name: &OsStr,
        flags: u32,
    ) -> FsResult<()> {
        self.check_writable()?;
        // Neither an exchange nor a whiteout (overlayfs's) can be made of copies and deletes.
        if flags & (libc::RENAME_EXCHANGE | libc::RENAME_WHITEOUT) != 0 {
            return Err(FsError::EINVAL);
        }
        let name_s = check_name(name)?;
        let new_name_s = check_name(new_name)?.to_string();
        // Not while a rename it conflicts with runs (see `subtrees`).
        let _renaming = self
            .subtrees
            .rename(|| {
                let dst_dir = self.ns.dir_path(new_parent)?;
                Ok(subtrees::Move {
                    src: self.ns.dir_path(parent)?.join(name_s),
                    dst: dst_dir.join(&new_name_s),
                    dst_dir,
                })
            })
            .await?;
        if is_reserved(new_parent, &new_name_s) {
            return Err(FsError::EPERM);
        }
        let new_parent_path = self.ns.dir_path(new_parent)?;
        let src = self.ns.existing(parent, name).await?;
        let target = match self.ns.existing(new_parent, new_name).await {
            Ok(t) => Some(t),
            Err(e) if e == FsError::ENOENT => None,
            Err(e) => return Err(e),
        };
        if target == Some(src) {
            return Ok(());
        }
        if target.is_some() && flags & libc::RENAME_NOREPLACE != 0 {
            return Err(FsError::EEXIST);
        }
        let (kind, path, size, etag, learned) = {
            let t = self.ns.table();
            let i = t.get(src).ok_or(FsError::ENOENT)?;
            let learned = i.learned_changes;
            (i.kind, i.path.clone(), i.attr.size, i.etag.clone(), learned)
        };
        let write = self.files.write_of(src);
        let new_path = new_parent_path.join(&new_name_s);
        self.ns.check_key_len(&new_path)?;
        let mut replaced = None;
        // The descriptors of a file replaced counted are those it keeps the file for.
        let mut _removing = None;
        if let Some(t) = target {
            let (tkind, tpath, open, in_store) = {
                let mut tb = self.ns.table();
                let i = tb.get_mut(t).ok_or(FsError::ENOENT)?;
                if i.kind == FileKind::File {
                    _removing = Some(Removing::hold(&self.ns, i));
                }
                (
                    i.kind,
                    i.path.clone(),
                    i.open_handles > 0,
                    i.fetched.is_some(),
                )
            };
            let twrite = self.files.write_of(t);
            match (kind == FileKind::Dir, tkind == FileKind::Dir) {
                (true, false) => return Err(FsError::ENOTDIR),
                (false, true) => return Err(FsError::EISDIR),
                (true, true) => {
                    if !self.ns.dir_is_empty(t, &tpath).await? {
                        return Err(FsError::ENOTEMPTY);
                    }
                }
                (false, false) => {
                    // A closed file may have its state too: its last release still publishing,
                    // or in background mode a version still to upload. That publish must not
                    // land over the renamed file. A copy for descriptors only if it has some.
                    if open || twrite.is_some() {
                        replaced = Some(Replaced {
                            ino: t,
                            write: twrite,
                            in_store: in_store && open,
                        });
                    }
                }
            }
        }
        let to = (new_parent, &new_parent_path, new_name_s.as_str());
        if kind == FileKind::Dir {
            // The namespace moves as soon as the objects did, before the files being written
            // below are re-pointed: a file opened below from then on has its new key.
            let renamed = |copies| {
                let below = RenamedObjects::Below(copies);
                let retagged = self.ns.renamed(src, (parent, &path), to, below);
                self.retagged(retagged);
            };
            self.rename_dir(&path, &new_path, target.is_some(), renamed)
                .await?;
            if parent != new_parent {
                self.keep_emptied_dir(parent).await;
            }
            return Ok(());
        }
        let copied = etag.clone();
        let new_etag = {
            let moved = self
                .rename_file(&path, &new_path, (size, etag), (src, write), replaced)
                .await;
            if let (Err(MOVING), Some(wb)) = (&moved, self.files.writeback()) {
                wb.wait_unmoved(self.ns.key(&path).as_str()).await;
                wb.wait_unmoved(self.ns.key(&new_path).as_str()).await;
            }
            if moved == Err(FsError::ESTALE) {
                // Another client's version is there now: the next lookup (the kernel retries
                // the rename once after ESTALE) sees it.
                let _ = self.ns.refresh(src);
            }
            moved?
        };
        let file = RenamedObjects::File {
            copied,
            learned,
            etag: new_etag,
        };
        let retagged = self.ns.renamed(src, (parent, &path), to, file);
        self.retagged(retagged);
        if parent != new_parent {
            self.keep_emptied_dir(parent).await;
        }
        Ok(())
    }

    /// Versions this mount's own copies gave new ETags (inode, old, new): their passthrough
    /// opens go on sharing the local copy.
    pub(super) fn retagged(&self, retagged: Vec<(Ino, String, String)>) {
        for (ino, old, new) in retagged {
            self.files.retag_through(ino, &old, &new);
        }
    }

    /// Moves file `src` (its inode and write state) from `path` to `new_path`. The file whose
    /// name it takes, if still open here (`replaced`), keeps its bytes for its descriptors, as
    /// an unlinked one does (see [`Self::hide_open_file`]), and never publishes over the new
    /// object.
    pub(super) async fn rename_file(
        &self,
        path: &MountPath,
        new_path: &MountPath,
        version: (u64, Option<String>),
        src: (Ino, Option<Arc<OpenWrite>>),
        replaced: Option<Replaced>,
    ) -> FsResult<Option<String>> {
        let (mut guard, mut replaced_guard) = lock_in_order(
            (src.0, src.1.as_deref()),
            replaced.as_ref().map(|r| (r.ino, r.write.as_deref())),
        )
        .await;
        // The replaced file's version waiting for upload never goes up from now on; it is
        // removed once the copy replaced it, before the source's delete (a failure before
        // the copy leaves it as it was). Removed later, a crash or a failed delete between
        // would let it go up over the copy, the moved file then under neither name.
        let mut replaced_held = Held::default();
        if let (Some(wb), Some(st)) = (self.files.writeback(), replaced_guard.as_deref()) {
            if let Some(seq) = st.committed() {
                match wb.hold_unless_moved(seq, Some(st.key.as_str())).await {
                    Some(Holding::Held { .. }) => replaced_held.0.push((wb.clone(), seq)),
                    Some(_) => {}
                    None => return Err(MOVING),
                }
            }
        }
        let kept = match &replaced {
            Some(r) => {
                self.copy_for_descriptors(
                    r.ino,
                    new_path,
                    replaced_guard.as_deref_mut(),
                    r.in_store,
                )
                .await?
            }
            None => None,
        };
        let user = self.ns.with(src.0, |i| i.user.clone());
        let moved = self
            .move_object(
                path,
                new_path,
                version,
                user.as_ref(),
                guard.as_deref_mut(),
                &mut replaced_held,
            )
            .await;
        if let (Ok(_), Some(w), Some(st)) = (&moved, &src.1, guard.as_deref_mut()) {
            self.drop_if_uploaded(src.0, w, st);
        }
        match (moved, &replaced) {
            (Err(e), _) => {
                if let Some(k) = kept {
                    self.delete_hidden(k.path).await;
                }
                Err(e)
            }
            (Ok(etag), Some(r)) => {
                self.retire_open_file(r.ino, replaced_guard.as_deref_mut(), kept)
                    .await;
                if let (Some(w), Some(st)) = (&r.write, replaced_guard.as_deref_mut()) {
                    self.drop_closed_state(r.ino, w, st);
                }
                Ok(etag)
            }
            (Ok(etag), None) => Ok(etag),
        }
    }

    /// Background mode: the state of a file just moved, kept only for an upload that is done
    /// (it landed before the rename moved its object, so the upload's news, about the old
    /// name, does not retire it), goes as it would have then.
    pub(super) fn drop_if_uploaded(&self, ino: Ino, w: &Arc<OpenWrite>, st: &mut WriteState) {
        let Some(wb) = self.files.writeback() else {
            return;
        };
        // Its version's entry, or the one a directory rename moved it to meanwhile (which
        // the state learns of only at the rename's end).
        let pending = st
            .committed()
            .is_some_and(|s| wb.awaits_upload(wb.latest(s)));
        if !st.has_changes_to_publish() && !pending {
            self.drop_closed_state(ino, w, st);
        }
    }

    /// Moves the object of a file from `path` to `new_path`; returns the new object's ETag.
    /// A file being written (state `st`) is not published here: what it holds is half
    /// written, and its upload belongs to the old key. The upload is aborted and the state
    /// goes on under the new key (close sends the streamed parts again, from their local
    /// copies); the file's previous complete object, if any, moves with the name, else the
    /// new name has no object until close. Either way each key holds a complete object or
    /// none, whenever the daemon dies. The copy is pinned to the version the file was looked
    /// up on (`version`: size and ETag), or its state is based on. `replaced`: the replaced
    /// file's version waiting for upload, removed once `new_path`'s object is replaced.
    async fn move_object(
        &self,
        path: &MountPath,
        new_path: &MountPath,
        version: (u64, Option<String>),
        user: Option<&UserMeta>,
        st: Option<&mut WriteState>,
        replaced: &mut Held,
    ) -> FsResult<Option<String>> {
        let (src, dst) = (self.ns.key(path), self.ns.key(new_path));
        let Some(st) = st else {
            let (size, etag) = version;
            // The copy has an ETag of its own (a multipart source's never carries over):
            // readers pin it with If-Match.
            let copied = self
                .copy_moving(&src, &dst, size, etag.as_deref(), user)
                .await?;
            replaced.discard(&dst).await;
            testpoint::reached("rename.copied").await;
            self.delete_copied(&src, etag.as_deref())
                .await
                .map_err(|e| log_store_err(&format!("delete {src} after copy"), e))?;
            return Ok(Some(copied));
        };
        st.leave_key(&src).await?;
        // Background mode: a version still to upload waits (no upload under either name)
        // and moves to the new name with the file. The object moved with it must be the one
        // that version was based on (or the one its upload made).
        let (held, expect) = match (self.files.writeback(), st.committed()) {
            (Some(wb), Some(seq)) => match wb.hold_unless_moved(seq, Some(st.key.as_str())).await {
                Some(Holding::Held { cond, .. }) => {
                    (Some((wb.clone(), seq, cond.clone())), Some(cond))
                }
                // Its upload's ETag, or, once the write-back directory forgot it, the one
                // the state learnt when it landed.
                Some(Holding::Uploaded(etag)) => {
                    let known = || st.known_etag().map(str::to_string);
                    (None, etag.or_else(known).map(Cond::Match))
                }
                Some(Holding::Gone) => (None, st.known_etag().map(|e| Cond::Match(e.into()))),
                None => return Err(MOVING),
            },
            _ => (None, None),
        };
        let uploaded = held.is_none() && st.committed().is_some();
        let moved = self
            .move_state_object(&src, &dst, st, expect, held, replaced)
            .await?;
        if let (Some(wb), true) = (self.files.writeback(), uploaded) {
            // Its upload landed under the old name and moved with it: the next version
            // replaces the copy.
            st.set_committed(moved.clone().map(|e| wb.remember(e)));
        }
        Ok(moved)
    }

    /// [`Self::move_object`] of a file being written: its previous complete object, if any,
    /// moves to `dst`, then the state goes on under `dst`. `expect`: what the object at
    /// `src` must be (background mode: what the file's version waiting for upload may
    /// replace); another client's object there is neither moved nor deleted (`ESTALE`).
    /// `held`: that version, held (with its condition): it moves to `dst` durably before
    /// the bucket changes (a crash in between: see [`WriteBack::rekey`]), back on failure.
    /// `replaced`: as [`Self::move_object`] says.
    async fn move_state_object(
        &self,
        src: &ObjectKey,
        dst: &ObjectKey,
        st: &mut WriteState,
        expect: Option<Cond>,
        held: Option<(Arc<WriteBack>, u64, Cond)>,
        replaced: &mut Held,
    ) -> FsResult<Option<String>> {
        let what = format!("rename {src} to {dst}");
        let old = match self.store.head(src).await {
            Ok(o) => Some(o),
            Err(StoreError::NotFound(_)) => None,
            Err(e) => {
                if let Some((wb, seq, _)) = &held {
                    wb.release(*seq);
                }
                return Err(log_store_err(&what, e));
            }
        };
        let mut expect = expect;
        if unexpected(old.as_ref(), expect.as_ref()) {
            let ours = match &held {
                Some((wb, seq, _)) => landed_ours(wb, *seq, old.as_ref()).await,
                None => false,
            };
            if !ours {
                if let Some((wb, seq, _)) = &held {
                    wb.release(*seq);
                }
                return Err(theirs(src));
            }
            // This mount's own version: the copy is pinned to it.
            expect = old.as_ref().and_then(|o| o.etag.clone()).map(Cond::Match);
        }
        let rekeyed = match &held {
            Some((wb, seq, cond)) => {
                let (etag, modified) = old
                    .as_ref()
                    .map_or((None, None), |o| (o.etag.clone(), o.last_modified));
                let from = Moved::of(src, etag, modified);
                match wb.rekey(*seq, dst, Cond::Any, Some(from), None).await {
                    Ok(new) => Some((wb, new, cond)),
                    Err(e) => {
                        tracing::error!(
                            "{what}: its version waiting for upload could not move ({e})"
                        );
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        let moved = self
            .move_base_object(src, dst, st, old, expect, replaced)
            .await;
        match (moved, rekeyed) {
            (Ok(etag), Some((wb, new, _))) => {
                wb.moved(new, etag.clone().map_or(Cond::Absent, Cond::Match));
                st.set_committed(Some(new));
                st.move_to(dst.clone(), etag.clone()).await;
                Ok(etag)
            }
            (Ok(etag), None) => {
                st.move_to(dst.clone(), etag.clone()).await;
                Ok(etag)
            }
            (Err(e), Some((wb, new, cond))) => {
                // The object is still at `src` (each step before the delete leaves it).
                match wb.rekey(new, src, cond.clone(), None, None).await {
                    Ok(back) => st.set_committed(Some(back)),
                    Err(e) => tracing::error!(
                        "{what} failed: its version waiting for upload could not move back \
                         ({e}); it goes up under the new name"
                    ),
                }
                Err(e)
            }
            (Err(e), None) => Err(e),
        }
    }

    /// The bucket's part of [`Self::move_state_object`]: `old` (the object at `src`, checked
    /// against `expect`) copied to `dst` and deleted, or, with none, `dst` deleted.
    /// `replaced`: as [`Self::move_object`] says.
    async fn move_base_object(
        &self,
        src: &ObjectKey,
        dst: &ObjectKey,
        st: &WriteState,
        old: Option<ObjectMeta>,
        expect: Option<Cond>,
        replaced: &mut Held,
    ) -> FsResult<Option<String>> {
        let what = format!("rename {src} to {dst}");
        // The state reads its base from the copy: it must be that base, whole.
        let pin = match &expect {
            Some(Cond::Match(e)) => Some(e.clone()),
            _ => st.base_etag().map(str::to_string),
        };
        let etag = match &old {
            Some(o) => {
                // The state reads its base from the copy, pinned to the copy's own ETag. With
                // no base (rewritten from empty), the version the HEAD saw.
                let from = pin.as_deref().or(o.etag.as_deref());
                let listed = o.user_complete.then_some(&o.user);
                Some(self.copy_moving(src, dst, o.size, from, listed).await?)
            }
            None => {
                // The name's old object (a file replaced) is gone; this one comes at close.
                self.store
                    .delete(dst)
                    .await
                    .map_err(|e| log_store_err(&what, e))?;
                None
            }
        };
        replaced.discard(dst).await;
        if let Some(o) = &old {
            testpoint::reached("rename.copied").await;
            self.delete_copied(src, pin.as_deref().or(o.etag.as_deref()))
                .await
                .map_err(|e| log_store_err(&format!("delete {src} after copy"), e))?;
        }
        Ok(etag)
    }

    /// Moves every object under the directory: copies all, then deletes the sources.
    ///
    /// Background mode: no lock is held across an upload or a copy: the write states of the
    /// files being written below are locked one at a time once the objects moved, each only
    /// to point it at its new key. Nothing below goes up meanwhile; the versions below
    /// waiting for upload move to their new keys durably before the bucket changes (so that
    /// a crash at any step leaves each under the name it is to have, see
    /// [`WriteBack::rekey`]), and so do those committed while the rename runs.
    pub(super) async fn rename_dir(
        &self,
        path: &MountPath,
        new_path: &MountPath,
        replace: bool,
        renamed: impl FnOnce(Copies),
    ) -> FsResult<()> {
        let (src, dst) = (self.ns.dir_key(path), self.ns.dir_key(new_path));
        let wb = self.files.writeback().cloned();
        let _paused = match &wb {
            Some(wb) => Some(wb.pause_below(src.as_str()).await),
            None => None,
        };
        // Directories made below must be in the bucket to be listed and moved.
        self.ns.markers.wait_below(&src).await?;
        // The directory replaced keeps a marker still to be stored if the rename fails.
        let replaced = match replace {
            true => Some(self.ns.markers.settle(&dst).await),
            false => None,
        };
        // Sync mode: a close below would publish under the old key while the objects move
        // (and the delete would take its version): the files being written are locked for
        // the whole rename, in inode order as a file rename does, as before.
        let mut writes: Vec<(Ino, Arc<OpenWrite>)> = Vec::new();
        if wb.is_none() {
            let t = self.ns.table();
            writes = t
                .descendants(path)
                .into_iter()
                .filter_map(|d| Some((d, self.files.write_of(d)?)))
                .collect();
        }
        writes.sort_by_key(|(ino, _)| *ino);
        let mut locked = Vec::with_capacity(writes.len());
        for (ino, w) in &writes {
            let mut st = w.state.lock().await;
            let key = st.key.clone();
            st.leave_key(&key).await?;
            locked.push((*ino, st));
        }
        let objects = self.list_for_rename(&src).await?;
        // Every key below must fit at the new name, checked before anything moves: a copy
        // refused halfway would leave part of the tree at each name.
        let longest = objects
            .iter()
            .map(|o| o.key.len())
            .chain(locked.iter().map(|(_, st)| st.key.as_str().len()))
            .max()
            .unwrap_or(0);
        if longest.saturating_sub(src.len()) + dst.len() > crate::namespace::MAX_KEY_LEN {
            return Err(FsError::ENAMETOOLONG);
        }
        let mut moving = Vec::new();
        if let Some(wb) = &wb {
            let r = self
                .rekey_below(wb, (&src, &dst), &objects, true, &mut moving)
                .await;
            if let Err(e) = r {
                undo_rekeys(wb, moving).await;
                return Err(e);
            }
        }
        let copies = match self.move_objects(&src, &dst, &objects, replaced).await {
            Ok(c) => c,
            Err(e) => {
                if let Some(wb) = &wb {
                    undo_rekeys(wb, moving).await;
                }
                return Err(e);
            }
        };
        // Files being written below, one at a time; a version one of them committed since
        // moves first. Each is pointed at the copy this rename made of its version, never at
        // what a HEAD finds under its new key (another client's version, copied or put since).
        renamed(copies.clone());
        let mut done: Vec<Ino> = Vec::new();
        for (ino, mut st) in locked {
            let p = {
                let t = self.ns.table();
                t.get(ino).map(|i| i.path.clone())
            };
            let Some(p) = p else { continue };
            let key = self.ns.key(&p);
            let etag = copy_of_version(&copies, &key, &st);
            st.move_to(key, etag).await;
            done.push(ino);
        }
        let mut sweep = wb.is_some();
        loop {
            if let (Some(wb), true) = (&wb, sweep) {
                let r = self
                    .rekey_below(wb, (&src, &dst), &objects, false, &mut moving)
                    .await;
                if let Err(e) = r {
                    // The objects moved: the rename is done. Only a local error gets here.
                    tracing::error!(
                        "rename of {src}: a version waiting for upload below could not move \
                         ({e}); it goes up under its old name"
                    );
                    sweep = false;
                }
            }
            let next = {
                let t = self.ns.table();
                t.descendants(new_path)
                    .into_iter()
                    .filter(|d| !done.contains(d))
                    .find_map(|d| Some((d, t.get(d)?.path.clone(), self.files.write_of(d)?)))
            };
            let Some((ino, p, w)) = next else { break };
            if !w.state.lock().await.key.as_str().starts_with(src.as_str()) {
                // Opened since the namespace moved: its key is the new one already.
                done.push(ino);
                continue;
            }
            let key = self.ns.key(&p);
            testpoint::reached("rename_dir.repointing").await;
            let mut st = w.state.lock().await;
            if !st.key.as_str().starts_with(src.as_str()) {
                // Moved in between (a create that followed its directory).
                done.push(ino);
                continue;
            }
            let mut etag = copy_of_version(&copies, &key, &st);
            if let (Some(wb), Some(seq)) = (&wb, st.committed()) {
                let mut seq = wb.latest(seq);
                let late = wb.below(src.as_str()).into_iter().find(|(s, _)| *s == seq);
                if let (Some(late), true) = (late, sweep) {
                    // Committed under its old key since the sweep: moved now, under the
                    // file's lock (sweeping again could go on as long as a writer closes).
                    let r = self
                        .rekey_one(wb, (&src, &dst), late, &objects, false, &mut moving)
                        .await;
                    if let Err(e) = r {
                        tracing::error!(
                            "rename of {src}: a version waiting for upload below could not \
                             move ({e}); it goes up under its old name"
                        );
                    }
                    seq = wb.latest(seq);
                }
                let copy = copies.get(key.as_str());
                if !copied_commit(wb, seq, &moving, &st, copy).await {
                    etag = None;
                }
                st.set_committed(if wb.awaits_upload(seq) {
                    Some(seq)
                } else {
                    // Uploaded before the rename: that object moved with the rest.
                    etag.clone().map(|e| wb.remember(e))
                });
            }
            st.move_to(key, etag.clone()).await;
            if let Some(wb) = &wb {
                // Its version goes up now (a close after this one waits for it otherwise).
                let i = st
                    .committed()
                    .and_then(|s| moving.iter().position(|m| m.seq == s));
                if let Some(i) = i {
                    let m = moving.swap_remove(i);
                    wb.moved(m.seq, etag.map_or(Cond::Absent, Cond::Match));
                }
            }
            self.drop_if_uploaded(ino, &w, &mut st);
            done.push(ino);
        }
        testpoint::reached("rename_dir.repointed").await;
        if let Some(wb) = &wb {
            // Versions without a write state here (found at start).
            // Each replaces the copy of what its old key held, or nothing.
            for m in moving {
                let cond = copies
                    .get(m.key.as_str())
                    .map_or(Cond::Absent, |c| Cond::Match(c.etag.clone()));
                wb.moved(m.seq, cond);
            }
        }
        Ok(())
    }

    /// The objects below `src` (a directory to rename), or `EXDEV` past
    /// `--max-dir-rename-objects`.
    async fn list_for_rename(&self, src: &ObjectKey) -> FsResult<Vec<ObjectMeta>> {
        let mut objects = Vec::new();
        let mut from = ListFrom::Start;
        loop {
            let page = self
                .store
                .list(src, None, from, 1000, ListDetail::Plain)
                .await
                .map_err(|e| log_store_err(&format!("list {src}"), e))?;
            objects.extend(page.objects);
            if objects.len() > self.cfg.max_dir_rename_objects {
                tracing::info!(
                    "rename of {src}: more than {} objects, returning EXDEV",
                    self.cfg.max_dir_rename_objects
                );
                return Err(FsError::EXDEV);
            }
            match page.next_continuation {
                Some(t) => from = ListFrom::Token(t),
                None => break,
            }
        }
        Ok(objects)
    }

    /// Background mode: moves every entry below `src` to its key below `dst` (held, until
    /// [`WriteBack::moved`]), recording each in `moving`. `check`: the objects they replace
    /// must be those `objects` lists (a version committed during the rename was checked
    /// with the file's first). One pass: an entry committed meanwhile belongs to a file
    /// being written, re-pointed under its lock later (another pass for it could go on as
    /// long as a writer keeps closing).
    async fn rekey_below(
        &self,
        wb: &Arc<WriteBack>,
        (src, dst): (&ObjectKey, &ObjectKey),
        objects: &[ObjectMeta],
        check: bool,
        moving: &mut Vec<Rekeyed>,
    ) -> FsResult<()> {
        for (seq, key) in wb.below(src.as_str()) {
            self.rekey_one(wb, (src, dst), (seq, key), objects, check, moving)
                .await?;
        }
        Ok(())
    }

    /// [`Self::rekey_below`] of entry `seq` (at `key`), unless it went up or away.
    async fn rekey_one(
        &self,
        wb: &Arc<WriteBack>,
        (src, dst): (&ObjectKey, &ObjectKey),
        (seq, key): (u64, String),
        objects: &[ObjectMeta],
        check: bool,
        moving: &mut Vec<Rekeyed>,
    ) -> FsResult<()> {
        let Holding::Held { cond, .. } = wb.hold(seq).await else {
            return Ok(());
        };
        let listed = objects.iter().find(|o| o.key == key);
        if check && unexpected(listed, Some(&cond)) && !landed_ours(wb, seq, listed).await {
            wb.release(seq);
            return Err(theirs(&key));
        }
        let new_key = format!("{dst}{}", &key[src.len()..]);
        if new_key.len() > crate::namespace::MAX_KEY_LEN {
            // Its upload would be refused for good: the rename is, before anything moves.
            wb.release(seq);
            return Err(FsError::ENAMETOOLONG);
        }
        let modified = listed.and_then(|o| o.last_modified);
        let listed = listed.and_then(|o| o.etag.clone());
        let checked = listed.clone().filter(|_| check);
        let from = Moved::of(&key, listed.clone(), modified);
        let prior = moving.iter().position(|m| m.key == new_key);
        let also = prior.map(|i| moving[i].seq);
        let new = wb.rekey(seq, &new_key, Cond::Any, Some(from), also).await?;
        match prior {
            Some(i) => {
                moving[i].seq = new;
                if check {
                    moving[i].checked = checked;
                }
            }
            None => moving.push(Rekeyed {
                seq: new,
                key: new_key,
                old_key: key,
                cond,
                checked,
            }),
        }
        Ok(())
    }

    /// The bucket's part of a directory rename: copies every object of `objects` (below
    /// `src`) to `dst`, then deletes them. `replaced`: the empty directory at `dst` it
    /// replaces, whose marker, if not stored yet, stays to be stored unless the copies are
    /// made (they are the directory at `dst` then, even if a delete fails after them).
    async fn move_objects(
        &self,
        src: &ObjectKey,
        dst: &ObjectKey,
        objects: &[ObjectMeta],
        replaced: Option<crate::namespace::markers::Unstored<'_>>,
    ) -> FsResult<Copies> {
        // The marker of a directory replaced is overwritten by the moved one's (its copy,
        // or a new one) after the other copies, never deleted first: a rename failing before
        // that leaves the directory replaced as it was, its attributes included. With none
        // replaced, the new marker goes first: a store may refuse it for its new name alone
        // (MinIO's limit on a marker's name), and refused after the other copies it would
        // leave part of the tree at each name.
        let (top, below): (Vec<&ObjectMeta>, Vec<&ObjectMeta>) =
            objects.iter().partition(|o| *src == *o.key);
        let mut moved = Vec::with_capacity(objects.len());
        if replaced.is_none() {
            moved.extend(self.move_marker(top.first().copied(), dst).await?);
        }
        let copies: Vec<BoxFuture<'_, FsResult<(String, Copied)>>> = below
            .into_iter()
            .map(|o| {
                let to = format!("{dst}{}", &o.key[src.len()..]);
                // Each object as listed: its size and version go together.
                async move {
                    let listed = o.user_complete.then_some(&o.user);
                    let etag = self
                        .copy_moving(&o.key, &to, o.size, o.etag.as_deref(), listed)
                        .await?;
                    let (from, size) = (o.etag.clone(), o.size);
                    Ok((to, Copied { from, size, etag }))
                }
                .boxed()
            })
            .collect();
        // A failed copy lets the others finish: one over 5 GiB is multipart, and dropping it
        // would skip its abort.
        moved.extend(run_bounded(copies, RENAME_CONCURRENCY).await?);
        if let Some(r) = replaced {
            moved.extend(self.move_marker(top.first().copied(), dst).await?);
            r.replaced();
        }
        testpoint::reached("rename_dir.copied").await;
        // Objects first, then directory markers deepest first, so that a store where a
        // marker is a real directory (the local one) can remove it once it is empty.
        let (mut markers, files): (Vec<&ObjectMeta>, Vec<&ObjectMeta>) =
            objects.iter().partition(|o| o.key.ends_with('/'));
        let deletes: Vec<BoxFuture<'_, FsResult<()>>> = files
            .into_iter()
            .map(|o| {
                async move {
                    // Only the version copied: one another client put since stays (where
                    // the store checks the condition; MinIO deletes whatever is there).
                    let r = match &o.etag {
                        Some(etag) => self.store.delete_if(&o.key, etag).await,
                        None => self.store.delete(&o.key).await,
                    };
                    match r {
                        Err(StoreError::PreconditionFailed(_)) => {
                            tracing::warn!(
                                "{}: replaced by another client while its directory was \
                                 renamed; that version stays under the old name",
                                o.key
                            );
                            Ok(())
                        }
                        r => r.map_err(|e| log_store_err(&format!("delete {}", o.key), e)),
                    }
                }
                .boxed()
            })
            .collect();
        stream::iter(deletes)
            .buffer_unordered(RENAME_CONCURRENCY)
            .try_collect::<Vec<()>>()
            .await?;
        markers.sort_by(|a, b| b.key.cmp(&a.key));
        for m in markers {
            self.store
                .delete(&m.key)
                .await
                .map_err(|e| log_store_err(&format!("delete {}", m.key), e))?;
        }
        Ok(moved.into_iter().collect())
    }

    /// The marker `dst` of a directory rename: a copy of `top`, the source's marker, or a
    /// new one for an implied directory, so that it exists even if empty.
    async fn move_marker(
        &self,
        top: Option<&ObjectMeta>,
        dst: &ObjectKey,
    ) -> FsResult<Option<(String, Copied)>> {
        let Some(o) = top else {
            self.store
                .put(dst, Bytes::new(), &UserMeta::new())
                .await
                .map_err(|e| log_store_err(&format!("mkdir {dst}"), e))?;
            return Ok(None);
        };
        let listed = o.user_complete.then_some(&o.user);
        let etag = self
            .copy_moving(&o.key, dst, o.size, o.etag.as_deref(), listed)
            .await?;
        let (from, size) = (o.etag.clone(), o.size);
        Ok(Some((dst.to_string(), Copied { from, size, etag })))
    }

    /// The copy a rename makes of `src` (version `etag`) at `dst`: the object's mtime goes
    /// with it. One another tool wrote has no `mtime` of its own (its mtime is its
    /// Last-Modified, which the copy's replaces): the copy gets it, beside the object's
    /// other metadata, so `mv` keeps the file's mtime as on a local disk (before: the time
    /// of the rename). `user`: the object's user metadata where known whole; else a `HEAD`
    /// asks, unless it names an `mtime`.
    async fn copy_moving(
        &self,
        src: &str,
        dst: &str,
        size: u64,
        etag: Option<&str>,
        user: Option<&UserMeta>,
    ) -> FsResult<String> {
        let has_mtime = |u: &UserMeta| u.contains_key(crate::meta::META_MTIME);
        let meta = match user {
            Some(u) if has_mtime(u) => None,
            _ => match self.store.head(src).await {
                // Another version than the one to move: the pinned copy refuses it.
                Ok(h) if etag.is_some() && h.etag.as_deref() != etag => None,
                Ok(h) if has_mtime(&h.user) => None,
                Ok(h) => h.last_modified.map(|t| {
                    let mut u = h.user;
                    crate::meta::PosixMeta {
                        mtime: Some(crate::meta::whole_seconds(t)),
                        ..Default::default()
                    }
                    .write_into(&mut u);
                    u
                }),
                Err(StoreError::NotFound(_)) if etag.is_some() => return Err(FsError::ESTALE),
                Err(e) => return Err(log_store_err(&format!("stat {src}"), e)),
            },
        };
        self.copy_object(src, dst, size, meta.as_ref(), etag).await
    }
}

/// An entry a directory rename moved: now `seq` at `key`, from `old_key` where it was to
/// replace what `cond` says.
struct Rekeyed {
    seq: u64,
    key: String,
    old_key: String,
    cond: Cond,
    /// The ETag of the object at its old key that the rename checked it may replace (the
    /// version it was based on, or one its own upload made): that object's copy is its own.
    checked: Option<String>,
}

/// A directory rename failed before its objects all moved: its entries go back to their
/// keys (the objects they replace are still there) and up from there.
async fn undo_rekeys(wb: &WriteBack, moving: Vec<Rekeyed>) {
    for m in moving {
        if let Err(e) = wb.rekey(m.seq, &m.old_key, m.cond, None, None).await {
            tracing::error!(
                "{}: a failed rename's version waiting for upload could not move back from \
                 {} ({e}); it goes up there",
                m.old_key,
                m.key
            );
            wb.release(m.seq);
        }
    }
}

/// Whether `found`'s ETag is that of a version of this mount's that entry `seq` replaced or
/// is, whose upload failed after it may have landed (its answer lost): see `Entry::landed`.
/// The entry's own ETag (an MD5 of its whole content) is worked out only for an object of its
/// size.
async fn landed_ours(wb: &WriteBack, seq: u64, found: Option<&ObjectMeta>) -> bool {
    let Some((etag, size)) = found.and_then(|o| Some((o.etag.as_ref()?, o.size))) else {
        return false;
    };
    if wb.landed(seq).contains(etag) {
        return true;
    }
    wb.tried_size(seq) == Some(size) && wb.etag_if_tried(seq).await.as_ref() == Some(etag)
}

/// The ETag under `key` (its new key, after a directory rename) of the version write state
/// `st` builds on: that of the copy the rename made, when it copied that very version, or
/// (background mode) when the state committed, whose copy [`copied_commit`] checks (see
/// [`WriteBack::rekey`] for how those versions move). Otherwise `None`: the state keeps what it knew, which the new key
/// does not hold, so its publish is refused (`ESTALE`, or a conflict of its upload) instead
/// of built on, or stored over, another client's version. A state that knows no version
/// (a new file) replaces nothing, so a copy there is another client's.
fn copy_of_version(copies: &Copies, key: &ObjectKey, st: &WriteState) -> Option<String> {
    let c = copies.get(key.as_str())?;
    match (st.committed(), st.known_etag()) {
        (None, None) => None,
        (None, Some(own)) if c.from.as_deref() != Some(own) => None,
        _ => Some(c.etag.clone()),
    }
}

/// Background mode: whether `copy` (of a file with write state `st` whose last commit is
/// entry `seq` now) copied a version of that commit's: the one its entry, moved by this
/// rename (`moving`), was to replace, or the one its upload made. Another client's version
/// met at the old key is not: the file's next version must be a conflict against its copy.
async fn copied_commit(
    wb: &WriteBack,
    seq: u64,
    moving: &[Rekeyed],
    st: &WriteState,
    copy: Option<&Copied>,
) -> bool {
    let Some((from, size)) = copy.and_then(|c| Some((c.from.as_deref()?, c.size))) else {
        return false;
    };
    let mut ours = wb.landed(seq);
    if wb.tried_size(seq) == Some(size) {
        // A try of it may have landed with its answer lost (see `landed_ours`).
        ours.extend(wb.etag_if_tried(seq).await);
    }
    match moving.iter().find(|m| m.seq == seq) {
        Some(m) if m.checked.as_deref() == Some(from) => return true,
        Some(m) => match &m.cond {
            Cond::Any => return true,
            Cond::Match(e) => ours.push(e.clone()),
            Cond::Absent => {}
        },
        None => ours.extend(wb.result(seq)),
    }
    ours.extend(st.known_etag().map(str::to_string));
    ours.iter().any(|e| e == from)
}

/// Whether `found`, the object at a key, is not what `expect` says a version waiting for
/// upload may replace: a version moves only with the object it was based on, never with one
/// another client wrote since. An object another client deleted is no conflict: the version
/// goes on as a new file (as its upload would).
fn unexpected(found: Option<&ObjectMeta>, expect: Option<&Cond>) -> bool {
    match (expect, found) {
        (Some(Cond::Absent), Some(_)) => true,
        (Some(Cond::Match(e)), Some(o)) => o.etag.as_deref() != Some(e.as_str()),
        _ => false,
    }
}

/// The rename of `key` refused: another client wrote it (see [`unexpected`]).
fn theirs(key: &str) -> FsError {
    tracing::warn!(
        "rename of {key}: another client wrote it since this mount's version (waiting for \
         upload); not moved"
    );
    FsError::ESTALE
}
