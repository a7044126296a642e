use super::*;

impl Fs {
    /// chmod/chown/utimens/truncate. `fh` is set for ftruncate/futimens on an open file.
    ///
    /// The change is stored, or queued in the file's live write state, before this returns. A
    /// state whose last close is retiring it is never used: its publish is over and nothing
    /// would publish the change (see [`WriteState::retire`]).
    pub async fn setattr(&self, ino: Ino, fh: Option<u64>, set: SetAttr) -> FsResult<Attr> {
        self.check_writable()?;
        // No writer opens meanwhile with the metadata from before the change.
        let _changing_meta = self.meta_changes.lock(ino).await;
        let (kind, path) = {
            let t = self.ns.table();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            (i.kind, i.path.clone())
        };
        let mut write = self.files.write_of(ino);
        if set.size.is_some() {
            match kind {
                FileKind::Dir => return Err(FsError::EISDIR),
                FileKind::Symlink => return Err(FsError::EINVAL),
                FileKind::File => {}
            }
            if write.is_none() {
                return self.truncate_closed(ino, &set).await;
            }
            self.wait_not_through(ino).await?;
        }
        self.ns.changing(&path);
        while let Some(w) = write.take() {
            let mut st = w.state.lock().await;
            if st.is_retired() {
                drop(st);
                self.ns.attr(ino)?;
                write = self.files.write_of(ino);
                if write.is_none() && set.size.is_some() {
                    return self.truncate_closed(ino, &set).await;
                }
                continue;
            }
            // A metadata change to a file whose writers' changes are all stored (its close
            // came, its release not yet: a forked child holds the descriptor; or nothing was
            // written through it) is stored now, as for a closed file: queued in the state,
            // it waited for the release, which stores it as a whole upload whose failure can
            // only be logged, and in background mode a crash before then lost it.
            if set.size.is_none() && !st.has_changes_to_publish() && !st.is_unlinked() {
                let background = self.files.writeback().is_some();
                if background && st.committed().is_some() {
                    // Background mode, every write committed (an fsync): the change is
                    // committed now over that content, as an fsync would (queued in the
                    // state, a crash before the writer's close lost it). A closed file's
                    // state, kept for its upload, is committed below, unparked.
                    if self.files.writers(ino) > 0 {
                        let a = self.setattr_state(ino, kind, &mut st, &set, false).await?;
                        self.persist(ino, &mut st, true).await?;
                        return Ok(a);
                    }
                } else if st.base_etag().is_some() {
                    break;
                }
            }
            if let Some(h) = fh.and_then(|fh| self.files.handle(ino, fh).ok()) {
                h.changes();
            }
            // With no writer open (truncate(2) of a path, or of a closed file's state kept
            // for its upload while only readers have it open): no writer's close will
            // publish it, so it is published now.
            let no_writer = self.files.writers(ino) == 0;
            let a = self
                .setattr_state(ino, kind, &mut st, &set, no_writer)
                .await?;
            // A closed file's state kept for its upload goes once nothing is left to upload
            // (its version went to the bucket directly: no upload's news will retire it).
            self.drop_if_uploaded(ino, &w, &mut st);
            return Ok(a);
        }
        let Some(change) = Self::meta_change(kind, &set) else {
            return self.getattr(ino).await;
        };
        // Not while a directory at or above it is being renamed (see `subtrees`), and at the
        // path it has after that.
        let (path, _storing) = self.subtrees.store(|| self.path_of(ino)).await?;
        // The state of a writer whose changes were all stored (seen above) is held across the
        // copy: its publish, pinned to the version copied, landing between the copy and the
        // restamp below was refused (ESTALE, no other client involved), and a whole rewrite
        // published meanwhile carried the old metadata over the copy.
        let writer = self.files.write_of(ino);
        let mut held = match &writer {
            Some(w) => Some(w.state.lock().await),
            None => None,
        };
        if held.as_ref().is_some_and(|st| st.is_retired()) {
            held = None;
        }
        // The change goes onto the object's own metadata, as the store says it now when the
        // inode's is out of date: it may be a listing's defaults (listed without metadata) or
        // of a version before the one its ETag names (another client's, copied by a
        // directory rename), and would be stored over the object's owner, mtime and keys.
        let marker = if kind == FileKind::Dir {
            self.marker_meta_now(ino, &path).await?
        } else {
            self.getattr(ino).await?;
            None
        };
        let (etag, size, user) = {
            let t = self.ns.table();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            match &marker {
                // A marker holding bytes is copied onto itself, as a file is.
                Some(m) if m.size > 0 => (m.etag.clone(), m.size, i.user.clone()),
                _ => (i.etag.clone(), i.attr.size, i.user.clone()),
            }
        };
        let mut new_user = user;
        self.filled_meta(ino, kind, &new_user)?
            .write_into(&mut new_user);
        change.write_into(&mut new_user);
        self.store_meta(ino, kind, &path, size, &new_user, etag.as_deref())
            .await?;
        // A write state made meanwhile took the old metadata: its publish must carry the
        // change too, and build on the object as it is now. (Opens for writing wait for
        // the change, see `meta_changes`; this holds for a state made any other way.)
        let new_etag = self
            .ns
            .table()
            .get(ino)
            .ok_or(FsError::ENOENT)?
            .etag
            .clone();
        let relocked;
        let st = match held {
            Some(st) => Some(st),
            None => match self.files.write_of(ino) {
                Some(w) => {
                    relocked = w;
                    Some(relocked.state.lock().await)
                }
                None => None,
            },
        };
        if let Some(mut st) = st {
            if !st.is_retired() {
                change.write_into(&mut st.meta);
                if let Some(t) = change.mtime {
                    // Stored already; the close must not put the last write's back.
                    st.set_mtime(t);
                }
                if let (Some(old), Some(new)) = (etag.as_deref(), new_etag) {
                    st.restamp_base(old, new);
                }
            }
        }
        let mut t = self.ns.table();
        let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
        let pm = PosixMeta::from_user(&new_user);
        i.attr = self
            .ns
            .policy
            .attr(ino, kind, i.attr.size, &pm, Some(now()));
        i.user = new_user;
        Ok(self.current_attr(i))
    }

    /// Where `ino` is now.
    pub(super) fn path_of(&self, ino: Ino) -> FsResult<MountPath> {
        let t = self.ns.table();
        t.get(ino).map(|i| i.path.clone()).ok_or(FsError::ENOENT)
    }

    /// Takes directory `ino`'s metadata from its marker as the store has it now: what this
    /// mount knows of a directory may be a listing's common prefix, which carries none. No
    /// marker: what the mount knows stands (the defaults, or its own mkdir's). Returns what
    /// the store says of the marker, if there is one.
    async fn marker_meta_now(&self, ino: Ino, path: &MountPath) -> FsResult<Option<ObjectMeta>> {
        if self.ns.is_bucket_root(path) {
            return Ok(None);
        }
        if ino == crate::ROOT_INO {
            // Its first read is over before this one: it never lands after it.
            self.read_root_marker().await;
        }
        let key = self.ns.dir_key(path);
        // mkdir's marker first (one whose upload failed stays for the next sync).
        self.ns.markers.landed(&key).await;
        let obj = match self.store.head(&key).await {
            Ok(obj) => obj,
            // No marker: a directory implied by what is below it, or made here with its
            // marker still to be stored, or one another client removed, which a chmod must
            // not bring back.
            Err(StoreError::NotFound(_)) => {
                let gone = ino != crate::ROOT_INO
                    && !self.ns.markers.pending(&key)
                    && self.ns.dir_is_empty(ino, path).await?;
                if gone {
                    self.ns.changed_elsewhere(ino);
                    return Err(FsError::ENOENT);
                }
                return Ok(None);
            }
            Err(e) => return Err(log_store_err(&format!("stat {key}"), e)),
        };
        let mut t = self.ns.table();
        let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
        let mut a = self.ns.policy.attr_of_object(ino, FileKind::Dir, &obj);
        // Changed here since its marker was stored (as a lookup keeps it).
        (a.mtime, a.ctime) = (a.mtime.max(i.attr.mtime), a.ctime.max(i.attr.ctime));
        i.attr = a;
        i.user = obj.user.clone();
        i.has_marker = true;
        Ok(Some(obj))
    }

    /// The root of a mount of a prefix has a marker (`prefix/`), where a chmod, chown or
    /// utimens of the root stores its attributes; they are read from it at the first stat of
    /// the root (the kernel's, at mount). One HEAD; no marker: the defaults. A failed HEAD
    /// leaves the defaults for that stat rather than fail it (the next stat tries again, at
    /// the cost of the store's refusal, which an outage makes immediate).
    pub(super) async fn read_root_marker(&self) {
        let root = MountPath::root();
        if self.ns.is_bucket_root(&root) {
            return;
        }
        let read = self.root_read.get_or_try_init(|| async {
            let key = self.ns.dir_key(&root);
            let obj = match self.store.head(&key).await {
                Ok(obj) => obj,
                Err(StoreError::NotFound(_)) => return Ok(()),
                Err(e) => return Err(e),
            };
            let mut t = self.ns.table();
            // A chmod of the root read or stored the marker since this HEAD was answered:
            // what it left is newer.
            if let Some(i) = t.get_mut(crate::ROOT_INO).filter(|i| !i.has_marker) {
                let mut a = self.ns.policy.attr_of_object(i.ino, FileKind::Dir, &obj);
                // Changed here meanwhile (an entry made in it).
                if i.attr.ctime > self.root_made {
                    (a.mtime, a.ctime) = (a.mtime.max(i.attr.mtime), a.ctime.max(i.attr.ctime));
                }
                i.attr = a;
                i.user = obj.user;
                i.has_marker = true;
            }
            Ok(())
        });
        if let Err(e) = read.await {
            tracing::debug!("the mount root's marker could not be read ({e}); defaults shown");
        }
    }

    /// truncate(2) of file `ino` (at `path`) that no write state holds: through a state of
    /// its own, published now (unless a writer opened it meanwhile). The state is registered as a writer's from before the wait
    /// for passthrough readers until it is published, so an open meanwhile shares it: a
    /// writer builds on the new size (its close never puts the old bytes back), a reader
    /// reads the new content, never a local copy of the old one; and the last of them
    /// publishes what is left.
    async fn truncate_closed(&self, ino: Ino, set: &SetAttr) -> FsResult<Attr> {
        // Its publish is a store below any directory being renamed (see `subtrees`).
        let (path, _storing) = self.subtrees.store(|| self.path_of(ino)).await?;
        let path = &path;
        let w = {
            let mut t = self.ns.table();
            let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
            if i.unlinked && !i.hidden {
                // Unlinked or renamed over since the kernel's lookup (see `open_registered`).
                return Err(FsError::ESTALE);
            }
            i.writing = true;
            // The kernel's pages are of the old size.
            i.pages = KernelPages::Unknown;
            let base = i.etag.clone().map(|etag| Base {
                etag,
                size: i.attr.size,
            });
            let key = self.ns.key(&i.path);
            self.files
                .add_writer(ino, || self.files.new_write(key, base, i.user.clone()))
        };
        let set_now = async {
            self.wait_not_through(ino).await?;
            self.ns.changing(path);
            let mut st = w.state.lock().await;
            // A writer that opened meanwhile publishes it with what it writes, at its close.
            let alone = self.files.writers(ino) == 1;
            self.setattr_state(ino, FileKind::File, &mut st, set, alone)
                .await
        };
        let a = set_now.await;
        let last = {
            let _t = self.ns.table();
            self.files.drop_writer(ino) == 0
        };
        if last {
            self.last_writer_done(ino, &w, false).await;
        }
        a
    }

    /// Applies `set` to file `ino` through its write state `st` (held locked), and publishes
    /// at once when `publish` says so.
    pub(super) async fn setattr_state(
        &self,
        ino: Ino,
        kind: FileKind,
        st: &mut WriteState,
        set: &SetAttr,
        publish: bool,
    ) -> FsResult<Attr> {
        let old_size = st.size();
        if let Some(n) = set.size {
            st.truncate(n).await?;
        }
        let resized = st.size() != old_size;
        let change = Self::meta_change(kind, set);
        if let Some(c) = &change {
            let filled = self.filled_meta(ino, kind, &st.meta)?;
            filled.write_into(&mut st.meta);
            c.write_into(&mut st.meta);
            if let Some(t) = c.mtime {
                st.set_mtime(t);
            }
            st.mark_changed();
        }
        if change.is_some() || resized {
            // The time of the change, which its store keeps (see `Namespace::stored`).
            self.ns.with(ino, |i| i.attr.ctime = now());
        }
        if publish && st.has_changes_to_publish() {
            self.persist(ino, st, false).await?;
        } else if change.is_some() || resized {
            // What stat shows now is what the close will store.
            let mut pm = PosixMeta::from_user(&st.meta);
            if st.mtime.is_some() {
                pm.mtime = st.mtime;
            }
            let mut t = self.ns.table();
            let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
            i.attr = self.ns.policy.attr(ino, kind, st.size(), &pm, Some(now()));
            i.user = st.meta.clone();
        }
        let t = self.ns.table();
        let i = t.get(ino).ok_or(FsError::ENOENT)?;
        let mut a = self.current_attr(i);
        a.size = st.size();
        Ok(a)
    }

    /// The metadata fields `set` changes (`None`: only the size, or nothing).
    pub(super) fn meta_change(kind: FileKind, set: &SetAttr) -> Option<PosixMeta> {
        let c = PosixMeta {
            mode: set.mode.map(|m| kind.mode_bits() | (m & 0o7777)),
            uid: set.uid,
            gid: set.gid,
            mtime: set.mtime,
            atime: set.atime,
        };
        (c != PosixMeta::default()).then_some(c)
    }

    /// The metadata `user` describes, with what it lacks taken from what stat shows for
    /// `ino`, so that it is stored whole.
    pub(super) fn filled_meta(
        &self,
        ino: Ino,
        kind: FileKind,
        user: &UserMeta,
    ) -> FsResult<PosixMeta> {
        let mut pm = PosixMeta::from_user(user);
        let t = self.ns.table();
        let i = t.get(ino).ok_or(FsError::ENOENT)?;
        // The default as stored, not as `--umask` shows it.
        let perm = self.ns.policy.stored_perm(kind, &PosixMeta::default());
        pm.mode.get_or_insert(kind.mode_bits() | perm as u32);
        pm.uid.get_or_insert(i.attr.uid);
        pm.gid.get_or_insert(i.attr.gid);
        pm.mtime.get_or_insert(i.attr.mtime);
        if kind == FileKind::Dir {
            // Entries made or removed here since its marker was stored moved it on.
            pm.mtime = pm.mtime.max(Some(i.attr.mtime));
        }
        Ok(pm)
    }

    /// The S_ISUID/S_ISGID bits a write by an unprivileged caller clears from file `ino`, as
    /// the kernel does for local files (S_ISGID only with group execute); 0 when none.
    pub fn suid_bits(&self, ino: Ino) -> u32 {
        let t = self.ns.table();
        let Some(i) = t.get(ino).filter(|i| i.kind == FileKind::File) else {
            return 0;
        };
        // As stored, not as `--umask` shows it.
        let perm = self
            .ns
            .policy
            .stored_perm(i.kind, &PosixMeta::from_user(&i.user)) as u32;
        let mut kill = perm & libc::S_ISUID;
        if perm & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
            kill |= libc::S_ISGID;
        }
        kill
    }

    /// Clears the bits [`Fs::suid_bits`] names (the kernel asks this with a write by a caller
    /// without CAP_FSETID, `FUSE_WRITE_KILL_SUIDGID`); stored like a chmod.
    pub async fn kill_suid(&self, ino: Ino) -> FsResult<()> {
        let kill = self.suid_bits(ino);
        if kill == 0 {
            return Ok(());
        }
        let perm = self.ns.table().get(ino).map_or(0, |i| {
            let stored = PosixMeta::from_user(&i.user);
            self.ns.policy.stored_perm(i.kind, &stored) as u32
        });
        let set = SetAttr {
            mode: Some(perm & !kill),
            ..SetAttr::default()
        };
        self.setattr(ino, None, set).await.map(|_| ())
    }

    /// Replaces the user metadata of a stored object (CopyObject onto itself), pinned to
    /// `etag`, the version this mount knows: never over another client's newer one. A
    /// directory's marker is PUT again (its ETag is that of no bytes whatever its metadata),
    /// unless it holds `size` bytes, which another client may store there.
    pub(super) async fn store_meta(
        &self,
        ino: Ino,
        kind: FileKind,
        path: &MountPath,
        size: u64,
        user: &UserMeta,
        etag: Option<&str>,
    ) -> FsResult<()> {
        if kind == FileKind::Dir {
            if self.ns.is_bucket_root(path) {
                return Ok(()); // the bucket root has no object to carry metadata
            }
            let key = self.ns.dir_key(path);
            // mkdir's marker must not land after this one.
            let unstored = self.ns.markers.settle(&key).await;
            if size > 0 {
                // Another client's bytes in the marker object: kept, and never written over
                // a newer version of it.
                self.copy_object(&key, &key, size, Some(user), etag).await?;
            } else {
                self.store
                    .put(&key, Bytes::new(), user)
                    .await
                    .map_err(|e| log_store_err(&format!("set metadata of {key}"), e))?;
            }
            unstored.replaced();
            if let Some(i) = self.ns.table().get_mut(ino) {
                i.has_marker = true;
            }
            return Ok(());
        }
        let key = self.ns.key(path);
        let copied = self.copy_object(&key, &key, size, Some(user), etag).await;
        if copied == Err(FsError::ESTALE) {
            // Another client's version is there now: the next lookup (the kernel retries a
            // chmod once after ESTALE) sees it, and the change applies to it.
            let _ = self.ns.refresh(ino);
        }
        // The copy's own answer: a HEAD now could name a version another client wrote since.
        let new = copied?;
        // Done (a copy can take a while): a page saved meanwhile predates it.
        self.ns.changing(path);
        let mut retagged = Vec::new();
        if let Some(i) = self.ns.table().get_mut(ino) {
            // A copy pinned to the version it knew: the same bytes.
            if let Some(old) = etag.filter(|&e| i.etag.as_deref() == Some(e)) {
                i.pages.retag(old, &new);
                retagged.push((ino, old.to_string(), new.clone()));
            }
            i.etag = Some(new);
        }
        self.retagged(retagged);
        Ok(())
    }
}
