//! The streaming upload of a write state: parts that become completely written upload in
//! the background (at most `--upload-concurrency` at once) into one [`bucketfs_store::Upload`],
//! and a failed one is kept to be sent again at publish.

use super::*;
use crate::files::writeback::EarlyParts;
use crate::meta::META_MTIME;

impl WriteState {
    /// Starts uploads of parts in `touched` that are now completely written. A part whose
    /// bytes are all new needs nothing from the base, so a rewrite of an existing file streams
    /// too; parts are laid out the same way whatever is copied or sent.
    pub(super) async fn stream_full_parts(&mut self, touched: Range<u64>) -> FsResult<()> {
        if self.phase == Phase::Unlinked || self.cfg.writeback.is_some() {
            return Ok(());
        }
        let layout = self.cfg.layout;
        let first = layout.index_of(touched.start);
        let last = layout.index_of(touched.end - 1);
        for i in first..=last {
            let r = layout.bounds(i);
            if i + 1 >= self.cfg.limits.max_parts as u64
                || !self.dirty.covers(&r)
                || !self.local.covers(&r)
            {
                continue;
            }
            let generation = self.generations.get(&i).copied().unwrap_or(0);
            if let Err(e) = self.start_stream(None).await {
                // The bytes are in the staging file: publish sends them, as for a tail that
                // cannot start its upload (see `ship_tail`: EIO may pass, a refusal not).
                return match e {
                    FsError::EIO => Ok(()),
                    e => Err(e),
                };
            }
            self.wait_for_upload_slot().await;
            // A pool buffer (not the allocator's, see pool.rs), its memory held by the upload.
            let (buf, mem) = self.cfg.budget.buffer(r.end - r.start).await.split_mem();
            let staging = self.staging().await?;
            let len = (r.end - r.start) as usize;
            let body = read_into(&staging, r, buf, 0).await?.freeze(len);
            // The staging file holds these bytes: a failed upload gives its memory back at once.
            self.spawn_part_upload(i, generation, body, Arc::new(vec![mem]), false)
                .await;
        }
        Ok(())
    }

    /// Background mode: the close commits the whole file locally (see `publish.rs`), so the
    /// tail goes to the staging file as in [`Self::spill_tail`]; while an upload slot is
    /// free, its part also goes up now from the same memory, into an upload the close hands
    /// to the file's write-back entry (see [`EarlyParts`]). A big file is then mostly in the
    /// bucket once its close returns, and the writer never waits for the store: a part with
    /// no free slot, or before the upload exists, is left to the entry's upload.
    pub(super) async fn ship_tail_early(&mut self) -> FsResult<()> {
        let Some((r, i)) = self
            .tail
            .as_ref()
            .map(|t| (t.range(), self.cfg.layout.index_of(t.start)))
        else {
            return Ok(());
        };
        let whole = r == self.cfg.layout.bounds(i);
        // A part written again while its earlier body is still going up waits for nothing
        // (spawn_part_upload would wait for that request).
        let sending = self.stream.as_ref().is_some_and(|s| {
            matches!(s.slots.get(&i), Some(PartSlot::Uploading { task, .. }) if !task.is_finished())
        });
        if !whole || sending || !self.early_part_ready() {
            return self.spill_tail().await;
        }
        self.settle_spills().await;
        let (body, mem) = self.stage_tail().await?;
        self.local.insert(r);
        let generation = self.generations.get(&i).copied().unwrap_or(0);
        // The staging file holds the bytes: a failed upload drops its copy.
        self.spawn_part_upload(i, generation, body, Arc::new(mem), false)
            .await;
        Ok(())
    }

    /// Background mode: whether a part may go up now. The file's upload is open (else its
    /// creation starts now, in the background) and fewer than `--upload-concurrency` of its
    /// parts are in flight.
    fn early_part_ready(&mut self) -> bool {
        if self.early_off {
            return false;
        }
        if self.stream.is_none() {
            match self.opening.take() {
                None => {
                    let mut meta = self.meta.clone();
                    if let Some(t) = self.mtime {
                        mtime_into(&mut meta, t);
                    }
                    let (uploads, key) = (self.cfg.uploads.clone(), self.key.to_string());
                    let headers_of = self.known_etag().map(str::to_string);
                    self.opening = Some(tokio::spawn(async move {
                        let from = headers_of.as_deref().map(|etag| HeadersFrom {
                            key: &key,
                            etag: Some(etag),
                        });
                        let upload = uploads.create(&key, &meta, from).await?;
                        Ok(Stream {
                            upload,
                            slots: BTreeMap::new(),
                            meta,
                            headers_of,
                        })
                    }));
                    return false;
                }
                Some(mut t) => match (&mut t).now_or_never() {
                    // Not made yet (or the task's poll budget is spent): the next part.
                    None => {
                        self.opening = Some(t);
                        return false;
                    }
                    Some(Ok(Ok(stream))) if stream.upload.key() == self.key.as_str() => {
                        self.stream = Some(stream);
                    }
                    _ => {
                        self.early_off = true;
                        return false;
                    }
                },
            }
        }
        let Some(stream) = &self.stream else {
            return false;
        };
        let running = stream
            .slots
            .values()
            .filter(|s| matches!(s, PartSlot::Uploading { task, .. } if !task.is_finished()))
            .count();
        running < self.cfg.upload_concurrency.max(1)
    }

    /// Background mode, at a commit of the whole file (`size` bytes): the parts sent early,
    /// for the entry (see [`EarlyParts`]), if the upload can become the object: its
    /// metadata is the file's but for the mtime of a write since it began. The state then
    /// takes the upload's mtime, as a publish does (see [`Self::settle_meta`]). Else
    /// (chmod, chown or utimens since) the upload is dropped, which aborts it.
    pub(super) fn early_parts(&mut self, size: u64) -> Option<EarlyParts> {
        self.opening = None;
        let stream = self.stream.take()?;
        let unmoved = |m: &UserMeta| {
            let mut m = m.clone();
            m.remove(META_MTIME);
            m
        };
        if self.mtime_set || unmoved(&stream.meta) != unmoved(&self.meta) {
            return None;
        }
        match stream.meta.get(META_MTIME) {
            Some(m) => self.meta.insert(META_MTIME.into(), m.clone()),
            None => self.meta.remove(META_MTIME),
        };
        self.mtime = None;
        let layout = self.cfg.layout;
        let parts = stream
            .slots
            .into_iter()
            .map(|(i, slot)| {
                let current = self.generations.get(&i).copied().unwrap_or(0);
                let (generation, request) = match slot {
                    PartSlot::Uploading { generation, task } => {
                        (generation, async move { task.await.ok()?.ok() }.boxed())
                    }
                    PartSlot::Done { generation, etag } => {
                        (generation, futures::future::ready(Some(etag)).boxed())
                    }
                    PartSlot::Failed { generation, .. } => {
                        (generation, futures::future::ready(None).boxed())
                    }
                };
                let valid = generation == current && layout.bounds(i).end <= size;
                (i as u32 + 1, (valid, request))
            })
            .collect();
        Some(EarlyParts {
            upload: stream.upload,
            meta: stream.meta,
            headers_of: stream.headers_of,
            parts,
        })
    }

    /// Opens the multipart upload parts stream into, if not open yet: for a version
    /// stored under `pin`, if known yet (see [`Self::headers_from`]).
    pub(super) async fn start_stream(&mut self, pin: Option<&str>) -> FsResult<()> {
        if self.stream.is_none() {
            // The object's mtime is the latest write's as of now; a later write's would cost
            // a copy of the object, so the publish keeps this one (and stat shows it).
            let mut meta = self.meta.clone();
            if let Some(t) = self.mtime {
                mtime_into(&mut meta, t);
            }
            let upload = self
                .cfg
                .uploads
                .create(&self.key, &meta, self.headers_from(pin))
                .await
                .map_err(|e| log_store_err(&format!("start upload of {}", self.key), e))?;
            let headers_of = self
                .headers_from(pin)
                .and_then(|f| f.etag)
                .map(str::to_string);
            self.stream = Some(Stream {
                upload,
                slots: BTreeMap::new(),
                meta,
                headers_of,
            });
        }
        Ok(())
    }

    /// Uploads `body` as part `i` in the background, holding `mem` until it is sent. An earlier
    /// upload of the same part still running is waited for first: aborting it could let its
    /// older body reach the store after this one, and the part kept would not be the one
    /// whose ETag completes the upload. With `return_on_failure`, a failed upload hands its
    /// bytes back to whoever settles the part; otherwise they are dropped when it fails, so
    /// that a writer waiting for budget memory never waits for memory that only its own
    /// settling (or another such writer's) would free.
    pub(super) async fn spawn_part_upload(
        &mut self,
        i: u64,
        generation: u64,
        body: Bytes,
        mem: Arc<Vec<Reservation>>,
        return_on_failure: bool,
    ) {
        self.settle_part(i).await;
        let stream = self.stream.as_mut().expect("stream started");
        let part = stream.upload.part_in_background(i as u32 + 1, body.clone());
        let metrics = self.cfg.metrics.clone();
        let task = tokio::spawn(async move {
            metrics.uploads_in_flight.fetch_add(1, Ordering::Relaxed);
            let r = part.await;
            metrics.uploads_in_flight.fetch_sub(1, Ordering::Relaxed);
            // On failure the bytes come back if they may be nowhere else.
            r.map_err(|e| (e, return_on_failure.then_some((body, mem))))
        });
        stream
            .slots
            .insert(i, PartSlot::Uploading { generation, task });
    }

    /// Back-pressure: at most `upload_concurrency` parts of this file in flight.
    pub(super) async fn wait_for_upload_slot(&mut self) {
        let limit = self.cfg.upload_concurrency.max(1);
        loop {
            let Some(stream) = self.stream.as_ref() else {
                return;
            };
            let mut inflight = stream
                .slots
                .iter()
                .filter(|(_, s)| matches!(s, PartSlot::Uploading { .. }))
                .map(|(&i, _)| i);
            let Some(oldest) = inflight.next() else {
                return;
            };
            if 1 + inflight.count() < limit {
                return;
            }
            self.settle_part(oldest).await;
        }
    }

    /// Waits for part `i`'s upload to finish and records the outcome. The bytes of a failed
    /// part that nothing else holds go to the staging file, which frees their memory; if that
    /// fails too, the slot keeps them for publish to send.
    pub(super) async fn settle_part(&mut self, i: u64) {
        let Some(stream) = self.stream.as_mut() else {
            return;
        };
        let Some(PartSlot::Uploading { .. }) = stream.slots.get(&i) else {
            return;
        };
        let Some(PartSlot::Uploading { generation, task }) = stream.slots.remove(&i) else {
            return;
        };
        let returned = match task.await {
            Ok(Ok(etag)) => {
                stream.slots.insert(i, PartSlot::Done { generation, etag });
                return;
            }
            Ok(Err((e, returned))) => {
                tracing::warn!("part {} upload failed, will resend at publish: {e}", i + 1);
                returned
            }
            Err(_) => None,
        };
        let kept = match returned {
            Some(body) => self.keep_failed_part(i, body).await,
            None => None,
        };
        if let Some(stream) = self.stream.as_mut() {
            stream
                .slots
                .insert(i, PartSlot::Failed { generation, kept });
        }
    }

    /// The bytes of failed part `i`: copied to the staging file where only the upload held
    /// them; returned if that copy fails.
    pub(super) async fn keep_failed_part(
        &mut self,
        i: u64,
        (body, mem): PartBody,
    ) -> Option<PartBody> {
        // A copy of the part still being made decides whether its bytes are elsewhere.
        self.settle_spills().await;
        let start = self.cfg.layout.bounds(i).start;
        let needed: Vec<Range<u64>> = self
            .uploaded_only
            .segments(start..start + body.len() as u64)
            .filter(|(_, only)| *only)
            .map(|(r, _)| r)
            .collect();
        if needed.is_empty() {
            return None;
        }
        for r in needed {
            let piece = body.slice((r.start - start) as usize..(r.end - start) as usize);
            if self.stage(r.start, piece).await.is_err() {
                return Some((body, mem));
            }
            self.local.insert(r.clone());
            self.uploaded_only.remove(r);
        }
        None
    }

    /// Bytes of the parts that `r` (not empty) touches.
    pub(super) fn parts_around(&self, r: Range<u64>) -> Range<u64> {
        let l = self.cfg.layout;
        l.bounds(l.index_of(r.start)).start..l.bounds(l.index_of(r.end - 1)).end
    }

    /// Checks that the bytes of `r` can be had. Those whose local copy failed are held only
    /// by an uploaded part, which S3 cannot read before the upload completes; publishing
    /// here would put half-written content under the file's key, so this is `EIO` until the
    /// writer's own close or fsync publishes them.
    pub(super) async fn recover(&mut self, r: Range<u64>) -> FsResult<()> {
        if r.is_empty() {
            return Ok(());
        }
        // A copy still being made decides whether its bytes are local.
        if self
            .spills
            .iter()
            .any(|(s, _)| s.start < r.end && r.start < s.end)
        {
            self.settle_spills().await;
        }
        if !self.uploaded_only.intersects(&r) {
            return Ok(());
        }
        tracing::warn!(
            "{}: bytes {r:?} are only in uploaded parts (their local copy failed): EIO until \
             the file is closed",
            self.key
        );
        inc(&self.cfg.metrics.unreadable_streamed);
        Err(FsError::EIO)
    }
}
