use super::*;

/// Times (20 ms apart) an open waits for the passthrough handles of its inode to close.
const THROUGH_WAITS: u32 = 50;

/// What [`Fs::open_registered`] makes of an open.
enum Registered {
    Opened(OpenedInode),
    /// The inode is open for passthrough and this open cannot share it (see
    /// [`OpenFiles::choose_through`]).
    Busy,
    /// An unlink of it or a rename over it is under way (see `Inode::removing`).
    Removing,
}

/// What an open of an inode takes from it.
struct OpenedInode {
    write: Option<Arc<OpenWrite>>,
    /// The kernel keeps its pages.
    keep_cache: bool,
    /// The kernel reads this descriptor through the daemon, not its pages.
    uncached: bool,
    /// The local copy read through.
    local: Option<Arc<std::fs::File>>,
    /// The inode's `learned_changes` and `page_drops`.
    learned_changes: u64,
    page_drops: u64,
}

impl Fs {
    /// `flags` are the open(2) flags.
    pub async fn open(&self, ino: Ino, flags: i32) -> FsResult<OpenReply> {
        self.open_as(ino, flags, true).await
    }

    /// [`Fs::open`] after the kernel's own try again of one that got `ESTALE` (the file an
    /// unlink or a rename over it removed): if its second file is removed too (two renames
    /// over one name back to back), a read-only open no longer fails but reads what its name
    /// holds now, as one that came just before the removal would (the kernel tries once
    /// more only; the program would see the error).
    pub async fn open_retried(&self, ino: Ino, flags: i32) -> FsResult<OpenReply> {
        self.open_handle(ino, flags, true, false).await
    }

    /// [`Fs::open`]; `through`: the reply may hand the kernel a local copy (not for `create`,
    /// whose reply cannot).
    async fn open_as(&self, ino: Ino, flags: i32, through: bool) -> FsResult<OpenReply> {
        let r = self.open_handle(ino, flags, through, true).await?;
        if flags & libc::O_TRUNC != 0 && flags & libc::O_ACCMODE == libc::O_RDONLY {
            // Linux truncates for O_RDONLY|O_TRUNC too; with atomic O_TRUNC the kernel leaves
            // that to the open (a writable one truncates through its own state).
            let set = SetAttr {
                size: Some(0),
                ..SetAttr::default()
            };
            if let Err(e) = self.setattr(ino, None, set).await {
                let _ = self.release(ino, r.fh).await;
                return Err(e);
            }
        }
        Ok(r)
    }

    /// [`Fs::open_as`] without the truncation an `O_RDONLY|O_TRUNC` open makes. `removed_stale`:
    /// `ESTALE` for a read-only open of a file an unlink or a rename over it removed with no
    /// copy kept (see [`Fs::open_retried`]).
    async fn open_handle(
        &self,
        ino: Ino,
        flags: i32,
        through: bool,
        removed_stale: bool,
    ) -> FsResult<OpenReply> {
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        if writable || flags & libc::O_TRUNC != 0 {
            self.check_writable()?;
        }
        // Close-to-open: attributes older than the TTL are checked again.
        self.getattr(ino).await?;
        // A read-only open may share the kernel's local copy of the file, even after passthrough
        // went off for the mount (the kernel still holds that copy and refuses other opens);
        // a new one is looked for only when nothing else has the inode open (the kernel cannot
        // mix the two). O_DIRECT would reach the cache disk with the caller's alignment: not
        // started for it.
        let shareable = through && !writable && flags & libc::O_TRUNC == 0;
        let mut local = None;
        if shareable && flags & libc::O_DIRECT == 0 && self.files.passthrough_on() {
            let wanted = {
                let t = self.ns.table();
                t.get(ino).and_then(|i| {
                    let idle = i.kind == FileKind::File && !i.writing && i.open_handles == 0;
                    let etag = i.etag.clone().filter(|_| idle && i.attr.size > 0)?;
                    Some((self.ns.key(&i.path), etag, i.attr.size))
                })
            };
            if let Some((key, etag, size)) = wanted {
                local = self
                    .files
                    .local_copy(key, etag.clone(), size)
                    .await
                    .map(|(f, seal)| (etag, f, seal));
            }
        }
        // A writer's state is made, and an O_TRUNC applied, where no rename of the file or
        // above it moves it meanwhile (see `subtrees`): its close would store under the old
        // key once the rename copied it. One that starts later finds the state. In background
        // mode a rename of a directory above moves the write states below it, and their
        // entries in the write-back directory, whenever they come: only a rename of the file
        // itself is waited for (it moves the states there are when it starts).
        let writer = writable || flags & libc::O_TRUNC != 0;
        // Not while a setattr changes the metadata its state starts from (see meta_changes).
        let _meta = match writer {
            true => Some(self.meta_changes.lock(ino).await),
            false => None,
        };
        let path = || self.path_of(ino);
        let _changing = match (writer, self.files.writeback().is_some()) {
            (false, _) => None,
            (true, false) => Some(self.subtrees.store(path).await?.1),
            (true, true) => Some(self.subtrees.store_of_file(path).await?.1),
        };
        // While the inode is open for passthrough, an open that cannot share it waits for
        // those handles to close (the kernel tells us a little after the close itself).
        let mut waits = 0;
        let mut checked = None;
        let OpenedInode {
            write,
            keep_cache,
            uncached,
            local,
            learned_changes,
            page_drops,
        } = loop {
            let stale = writer || removed_stale;
            let share = (shareable, checked.as_ref());
            match self.open_registered(ino, (writable, stale), share, &mut local)? {
                Registered::Opened(r) => break r,
                // Whether it keeps this file for its descriptors depends on when the open
                // counts: after it, the file is gone (ESTALE) or still there.
                Registered::Removing => tokio::time::sleep(Duration::from_millis(5)).await,
                Registered::Busy if shareable && checked.is_none() => {
                    // Open for passthrough: shared if its copy is still sound, else waited for.
                    checked = self.files.sound_shared_copy(ino).await;
                    if checked.is_none() {
                        self.wait_through(ino, &mut waits).await?;
                    }
                }
                Registered::Busy => {
                    checked = None;
                    self.wait_through(ino, &mut waits).await?
                }
            }
        };
        let trunc = write.clone().filter(|_| flags & libc::O_TRUNC != 0);
        let fh = self.files.add_handle(FileHandle {
            ino,
            flags,
            reader: Arc::new(tokio::sync::Mutex::new(None)),
            learned_changes: Arc::new(learned_changes.into()),
            page_drops,
            write,
            through: local.is_some(),
            uncached,
            changed: Arc::default(),
        });
        if let Some(w) = trunc {
            let set = SetAttr {
                size: Some(0),
                ..SetAttr::default()
            };
            let r = {
                let mut st = w.state.lock().await;
                if let Ok(h) = self.files.handle(ino, fh) {
                    h.changes();
                }
                self.setattr_state(ino, FileKind::File, &mut st, &set, false)
                    .await
            };
            if let Err(e) = r {
                // Registered as a writer and an open handle, which no release would undo
                // (the kernel sends none for a failed open): the inode stayed `writing`.
                let _ = self.release(ino, fh).await;
                return Err(e);
            }
        }
        Ok(OpenReply {
            fh,
            keep_cache,
            uncached,
            local,
        })
    }

    /// One wait of an open (or truncate) that the inode's passthrough readers keep out: 20 ms,
    /// then `ETXTBSY` after [`THROUGH_WAITS`] of them.
    async fn wait_through(&self, ino: Ino, waits: &mut u32) -> FsResult<()> {
        if *waits >= THROUGH_WAITS {
            tracing::debug!("inode {ino}: open for passthrough elsewhere");
            return Err(FsError(libc::ETXTBSY));
        }
        *waits += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok(())
    }

    /// A size change must wait as an open for writing does while the kernel reads the inode
    /// from a local copy (it would keep serving the old bytes).
    pub(crate) async fn wait_not_through(&self, ino: Ino) -> FsResult<()> {
        let mut waits = 0;
        while self.files.is_through(ino) {
            self.wait_through(ino, &mut waits).await?;
        }
        Ok(())
    }

    /// The inode's side of an open, under the table's lock: its write state, whether the
    /// kernel keeps its pages, the local copy it reads through, and what a reader checks
    /// (see [`FileHandle`]).
    fn open_registered(
        &self,
        ino: Ino,
        (writable, removed_stale): (bool, bool),
        (shareable, checked): (bool, Option<&Arc<std::fs::File>>),
        local: &mut Option<LocalCopy>,
    ) -> FsResult<Registered> {
        let mut t = self.ns.table();
        let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
        match i.kind {
            FileKind::Dir => return Err(FsError::EISDIR),
            FileKind::Symlink => return Err(FsError::ELOOP),
            FileKind::File => {}
        }
        if i.removing > 0 {
            return Ok(Registered::Removing);
        }
        if removed_stale && i.unlinked && !i.hidden && self.files.write_of(ino).is_none() {
            // Looked up before an unlink or a rename over it: its name's object is gone or
            // another file's (a reader would read that one, a writer's state publish over
            // it). The kernel looks the name up again (the file renamed there is opened, or
            // ENOENT). One kept as a hidden copy for its descriptors has that copy's name,
            // and one kept in a write state has its bytes: a reopen through /proc works.
            return Err(FsError::ESTALE);
        }
        let shareable = shareable && !i.writing;
        let Ok(through) = self.files.choose_through(
            ino,
            i.etag.as_deref(),
            i.open_handles,
            (shareable, checked),
            local,
        ) else {
            return Ok(Registered::Busy);
        };
        let write = writable.then(|| {
            // Under the table's lock: a last writer's release retires the state under it.
            i.writing = true;
            self.files.add_writer(ino, || {
                let base = i.etag.clone().map(|etag| Base {
                    etag,
                    size: i.attr.size,
                });
                self.files
                    .new_write(self.ns.key(&i.path), base, i.user.clone())
            })
        });
        i.open_handles += 1;
        // The kernel may keep its cached pages if they are of the object as it is now, and no
        // other client's change was learnt since they were last dropped.
        let keep = write.is_none()
            && i.etag.is_some()
            && i.pages.only_of(i.etag.as_deref())
            && i.pages_learned == i.learned_changes;
        // Not while a descriptor reading an older version may be handed the pages this one
        // fills (see `reads_older_pages`); the pages it was handed are dropped below.
        let uncached = through.is_none()
            && i.open_handles > 1
            && i.learned_changes > 0
            && self.files.reads_older_pages(ino, i.learned_changes);
        // A passthrough open fills no page of this inode: what the kernel holds is unchanged.
        // Any other open but a kept one drops the kernel's pages; a writer's fill them with
        // what it writes.
        if through.is_none() && !keep {
            // Dropping none takes nothing from what a descriptor may have been handed.
            if i.pages != KernelPages::Dropped {
                i.page_drops += 1;
            }
            i.pages = match write {
                None => KernelPages::Dropped,
                Some(_) => KernelPages::Unknown,
            };
            i.pages_learned = i.learned_changes;
        }
        Ok(Registered::Opened(OpenedInode {
            write,
            keep_cache: keep,
            uncached,
            local: through,
            learned_changes: i.learned_changes,
            page_drops: i.page_drops,
        }))
    }

    /// Creates and opens a regular file; the lookup count of the new inode goes up by one.
    pub async fn create(
        &self,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        caller: Caller,
    ) -> FsResult<(Attr, OpenReply)> {
        // As an open for writing (see `open_as`); in background mode a rename of the
        // directory moves the new file's state along.
        let changing = match self.files.writeback() {
            None => Some(self.changing_in(parent).await?),
            Some(_) => None,
        };
        let (name, parent_path) = match self.prepare_new(parent, name) {
            Err(e) if e == FsError::EEXIST && flags & libc::O_EXCL == 0 => {
                // Made meanwhile (by another process on this mount): open(2) opens it, and
                // truncates it only when asked to (holding off renames itself).
                drop(changing);
                let ino = self.ns.existing(parent, name).await?;
                let reply = self.open_as(ino, flags, false).await?;
                self.add_lookup(ino);
                return Ok((self.getattr(ino).await?, reply));
            }
            other => other?,
        };
        crate::testpoint::reached("create.prepared").await;
        let path = parent_path.join(&name);
        let pm = self.new_meta(parent, FileKind::File, mode, umask, caller);
        let w = self.files.new_write(self.ns.key(&path), None, pm.to_user());
        w.state.lock().await.mark_changed(); // an empty file is still a file
        let (ino, attr) = self.ns.add_new(
            parent,
            &name,
            path.clone(),
            FileKind::File,
            &pm,
            0,
            None,
            true,
        );
        let (learned_changes, page_drops) = {
            let mut t = self.ns.table();
            match t.get_mut(ino) {
                Some(i) => {
                    i.writing = true;
                    i.open_handles = 1;
                    self.files.forget_write(ino);
                    self.files.add_writer(ino, || w.clone());
                    (i.learned_changes, i.page_drops)
                }
                None => (0, 0),
            }
        };
        if changing.is_none() {
            self.follow_parent(ino, parent, &name, &path, &w).await;
        }
        let fh = self.files.add_handle(FileHandle {
            ino,
            flags,
            reader: Arc::new(tokio::sync::Mutex::new(None)),
            learned_changes: Arc::new(learned_changes.into()),
            page_drops,
            write: Some(w),
            through: false,
            uncached: false,
            // An empty file is still a file: its close stores it.
            changed: Arc::new(AtomicBool::new(true)),
        });
        Ok((
            attr,
            OpenReply {
                fh,
                keep_cache: false,
                uncached: false,
                local: None,
            },
        ))
    }

    /// Background mode: a file just created at `path`, in `parent`, whose create did not
    /// hold off renames of the directory. One that ran between the read of the directory's
    /// path and the file's registration left the file (or its write state) at the old place,
    /// where its upload would bring the old directory back: both go where the directory is
    /// now.
    async fn follow_parent(
        &self,
        ino: Ino,
        parent: Ino,
        name: &str,
        path: &MountPath,
        w: &Arc<OpenWrite>,
    ) {
        // The state lock first and held to the end: a second rename in between would
        // otherwise move the inode again after this read and leave the state behind.
        let mut st = w.state.lock().await;
        let now = {
            let mut t = self.ns.table();
            let Some(parent_path) = t.get(parent).map(|p| p.path.clone()) else {
                return;
            };
            let now = parent_path.join(name);
            if now == *path {
                return;
            }
            if t.get(ino)
                .is_some_and(|i| i.path != now && i.parent == parent && i.name == name)
            {
                t.rename(ino, parent, name, &parent_path);
            }
            // Where the file is now (renamed itself meanwhile: its rename moved the state).
            let Some(i) = t.get(ino) else { return };
            i.path.clone()
        };
        let key = self.ns.key(&now);
        if st.key != key {
            st.move_to(key, None).await;
        }
    }
}
