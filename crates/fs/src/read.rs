//! The read path of one open handle: ranged GETs pinned to the ETag seen at open, with a
//! sequential prefetch that grows while the reader keeps streaming.
//!
//! A handle keeps one fetched window and at most one prefetch of the range after it. A read
//! that continues where the last one ended (allowing the kernel's small reorderings) counts as
//! sequential and doubles the request size up to the part size; any other read fetches just
//! what it asks for plus a small readahead. Files no larger than one part come in one GET.

use crate::error::{log_store_err, FsError, FsResult};
use crate::metrics::{inc, FsMetrics, Held};
use bucketfs_store::ObjectStore;
use bytes::{Bytes, BytesMut};
use std::ops::Range;
use std::sync::Arc;
use tokio::task::JoinHandle;

/// First request size of a sequential stream and the readahead of a random read.
const MIN_FETCH: u64 = 1024 * 1024;
/// Reads within this distance of the last one still count as sequential.
const SEQ_SLACK: u64 = 4 * 1024 * 1024;

struct Prefetch {
    range: Range<u64>,
    task: JoinHandle<FsResult<Bytes>>,
    _held: Held,
}

pub struct Reader {
    store: Arc<dyn ObjectStore>,
    key: String,
    etag: Option<String>,
    size: u64,
    max_fetch: u64,
    window_start: u64,
    window: Bytes,
    window_held: Option<Held>,
    metrics: Arc<FsMetrics>,
    prefetch: Option<Prefetch>,
    last_end: Option<u64>,
    fetch_size: u64,
}

impl Reader {
    pub fn new(
        store: Arc<dyn ObjectStore>,
        key: String,
        etag: Option<String>,
        size: u64,
        part_size: u64,
        metrics: Arc<FsMetrics>,
    ) -> Self {
        Self {
            store,
            key,
            etag,
            size,
            max_fetch: part_size.max(MIN_FETCH),
            window_start: 0,
            window: Bytes::new(),
            window_held: None,
            metrics,
            prefetch: None,
            last_end: None,
            fetch_size: MIN_FETCH,
        }
    }

    fn window_range(&self) -> Range<u64> {
        self.window_start..self.window_start + self.window.len() as u64
    }

    fn spawn_fetch(&self, range: Range<u64>) -> JoinHandle<FsResult<Bytes>> {
        let (store, key, etag) = (self.store.clone(), self.key.clone(), self.etag.clone());
        tokio::spawn(async move { fetch(&*store, &key, range, etag.as_deref()).await })
    }

    pub async fn read(&mut self, offset: u64, len: u32) -> FsResult<Bytes> {
        let end = (offset + len as u64).min(self.size);
        if offset >= end {
            return Ok(Bytes::new());
        }
        let sequential = self
            .last_end
            .is_some_and(|l| offset + SEQ_SLACK >= l && offset <= l + SEQ_SLACK);
        if sequential {
            self.fetch_size = (self.fetch_size * 2).min(self.max_fetch);
        } else if self.last_end.is_some() {
            if self.fetch_size > MIN_FETCH {
                inc(&self.metrics.prefetch_resets);
            }
            self.fetch_size = MIN_FETCH;
        }
        let hit = self.window_range().contains(&offset)
            || self
                .prefetch
                .as_ref()
                .is_some_and(|p| p.range.contains(&offset));
        inc(if hit {
            &self.metrics.read_hits
        } else {
            &self.metrics.read_misses
        });
        self.last_end = Some(end);

        let mut out = BytesMut::new();
        let mut pos = offset;
        while pos < end {
            if !self.window_range().contains(&pos) {
                self.load_window(pos, end).await?;
            }
            let w = self.window_range();
            let from = (pos - w.start) as usize;
            let to = (end.min(w.end) - w.start) as usize;
            if pos == offset && end <= w.end {
                // Common case: the whole answer is in the window, no copy.
                self.maybe_prefetch(sequential);
                return Ok(self.window.slice(from..to));
            }
            out.extend_from_slice(&self.window[from..to]);
            pos = w.start + to as u64;
        }
        self.maybe_prefetch(sequential);
        Ok(out.freeze())
    }

    /// Makes the window hold `pos`: from the prefetch if it has it, else a new GET.
    async fn load_window(&mut self, pos: u64, want_end: u64) -> FsResult<()> {
        if let Some(p) = self.prefetch.take() {
            if p.range.contains(&pos) {
                let start = p.range.start;
                let data = p.task.await.map_err(|_| FsError::EIO)??;
                self.window_start = start;
                self.window_held = Some(Held::new(self.metrics.clone(), data.len() as u64));
                self.window = data;
                if self.window_range().contains(&pos) {
                    return Ok(());
                }
            } else {
                p.task.abort();
            }
        }
        let len = if self.size <= self.max_fetch {
            self.size // a small file comes whole
        } else {
            self.fetch_size.max(want_end - pos)
        };
        let start = if self.size <= self.max_fetch { 0 } else { pos };
        let range = start..(start + len).min(self.size);
        let data = fetch(&*self.store, &self.key, range.clone(), self.etag.as_deref()).await?;
        if (data.len() as u64) < (want_end.min(range.end) - range.start) {
            tracing::warn!("{}: object shorter than its size at open", self.key);
            return Err(FsError::EIO);
        }
        self.window_start = range.start;
        self.window_held = Some(Held::new(self.metrics.clone(), data.len() as u64));
        self.window = data;
        Ok(())
    }

    fn maybe_prefetch(&mut self, sequential: bool) {
        let next = self.window_range().end;
        if !sequential || self.prefetch.is_some() || next >= self.size {
            return;
        }
        let range = next..(next + self.fetch_size).min(self.size);
        self.prefetch = Some(Prefetch {
            task: self.spawn_fetch(range.clone()),
            _held: Held::new(self.metrics.clone(), range.end - range.start),
            range,
        });
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if let Some(p) = self.prefetch.take() {
            p.task.abort();
        }
    }
}

/// Attempts of one ranged GET. The SDK retries failed requests, but not a body that breaks
/// off mid-transfer; those are retried here, from the same offset.
const FETCH_ATTEMPTS: u32 = 4;

async fn fetch(
    store: &dyn ObjectStore,
    key: &str,
    range: Range<u64>,
    etag: Option<&str>,
) -> FsResult<Bytes> {
    let mut attempt = 1;
    loop {
        match store.get_range(key, range.clone(), etag).await {
            Ok(b) => return Ok(b),
            Err(e) if e.is_transient() && attempt < FETCH_ATTEMPTS => {
                tracing::debug!("read {key} attempt {attempt}: {e}; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(100 << attempt)).await;
                attempt += 1;
            }
            Err(e) => return Err(log_store_err(&format!("read {key}"), e)),
        }
    }
}
