//! Counters of the fs core: cache hits and misses, prefetch behaviour, buffers and uploads in
//! flight. Read by `--metrics-addr` and `bucketfs stats`; never on a hot path beyond one
//! relaxed atomic add.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default, Debug)]
pub struct FsMetrics {
    /// Lookups and getattrs answered from the inode table.
    pub attr_hits: AtomicU64,
    /// Lookups and getattrs that asked the store.
    pub attr_misses: AtomicU64,
    /// Reads answered from a handle's fetched window or its prefetch.
    pub read_hits: AtomicU64,
    /// Reads that had to wait for a new GET.
    pub read_misses: AtomicU64,
    /// Sequential streams broken by a random read (the prefetch window starts over).
    pub prefetch_resets: AtomicU64,
    /// Copies of write requests made outside the budget: its area and the overdraft stayed
    /// taken for [`crate::budget::COPY_WAIT`].
    pub write_copies_unbudgeted: AtomicU64,
    /// Bytes held in read windows, prefetches and part buffers right now.
    pub buffer_bytes: AtomicU64,
    /// The memory budget those buffers must stay within.
    pub budget_bytes: AtomicU64,
    /// Parts uploading in the background right now.
    pub uploads_in_flight: AtomicU64,
    /// Files published (PUT or completed multipart upload).
    pub files_published: AtomicU64,
    /// Publishes that failed and were reported to close/fsync.
    pub publish_errors: AtomicU64,
    /// Reads or rewrites refused (`EIO`) because only an uploaded part held the bytes (their
    /// local copy failed).
    pub unreadable_streamed: AtomicU64,
    /// Bytes written to local staging files (what a write costs the local disk).
    pub staged_bytes: AtomicU64,
    /// Data cache (`--data-cache`): blocks read from it, blocks looked for and not there
    /// (or not sound), and the bytes it served.
    pub data_cache_hits: AtomicU64,
    pub data_cache_misses: AtomicU64,
    pub data_cache_bytes_served: AtomicU64,
    /// Blocks evicted to stay within `--data-cache-size`.
    pub data_cache_evictions: AtomicU64,
    /// Block files found corrupt or truncated (removed and fetched again).
    pub data_cache_corrupt: AtomicU64,
    /// I/O errors of the cache disk (the read went to the bucket).
    pub data_cache_errors: AtomicU64,
    /// Fetched blocks not cached because the writer was behind.
    pub data_cache_skipped: AtomicU64,
    /// Blocks handed to the writer and not written yet (`bucketfs warmup` waits for none).
    pub data_cache_queued: AtomicU64,
    /// Bytes of block files in the cache directory (as this mount knows them).
    pub data_cache_bytes: AtomicU64,
    /// `--data-cache-size`; 0 without a data cache.
    pub data_cache_limit_bytes: AtomicU64,
    /// Background upload (`--upload background`): entries committed to the write-back
    /// directory, uploaded, replaced by a later version before upload, removed before upload
    /// (unlink, rename over), failed upload tries, conflicts with another client, commits
    /// that waited for room; commits that stored only what changed since the last one.
    pub writeback_committed: AtomicU64,
    pub writeback_deltas: AtomicU64,
    /// Commits of other files' changes an fsync took along (one sync for all of them).
    pub writeback_along: AtomicU64,
    /// Syncs of the write-back directory's files (one covers the commits waiting at the time).
    pub writeback_syncs: AtomicU64,
    pub writeback_uploaded: AtomicU64,
    pub writeback_replaced: AtomicU64,
    pub writeback_cancelled: AtomicU64,
    pub writeback_upload_errors: AtomicU64,
    pub writeback_conflicts: AtomicU64,
    pub writeback_space_waits: AtomicU64,
    /// Closes and fsyncs that uploaded to the bucket directly: the write-back directory had
    /// no room (its bound, or its disk, full).
    pub writeback_direct: AtomicU64,
    /// Parts an upload did not send, as they went up while the file was written.
    pub writeback_early_parts: AtomicU64,
    /// Commits that took the writer's staging file as their entry's file (no copy).
    pub writeback_adopted: AtomicU64,
    /// Files and bytes waiting for upload now, and how many of them failed.
    pub writeback_pending: AtomicU64,
    pub writeback_pending_bytes: AtomicU64,
    pub writeback_failed: AtomicU64,
    /// Opens handed to the kernel with the data cache's copy of the file (FUSE passthrough:
    /// its reads never reach the daemon), and the bytes of those files.
    pub passthrough_opens: AtomicU64,
    pub passthrough_bytes: AtomicU64,
}

pub(crate) fn inc(c: &AtomicU64) {
    inc_by(c, 1);
}

pub(crate) fn inc_by(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl FsMetrics {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    /// Prometheus text exposition.
    pub fn prometheus(&self) -> String {
        let counters: [(&str, &str, &AtomicU64); 36] = [
            ("bucketfs_attr_cache_hits_total", "counter", &self.attr_hits),
            (
                "bucketfs_attr_cache_misses_total",
                "counter",
                &self.attr_misses,
            ),
            ("bucketfs_read_hits_total", "counter", &self.read_hits),
            ("bucketfs_read_misses_total", "counter", &self.read_misses),
            (
                "bucketfs_prefetch_resets_total",
                "counter",
                &self.prefetch_resets,
            ),
            (
                "bucketfs_files_published_total",
                "counter",
                &self.files_published,
            ),
            (
                "bucketfs_publish_errors_total",
                "counter",
                &self.publish_errors,
            ),
            (
                "bucketfs_unreadable_streamed_total",
                "counter",
                &self.unreadable_streamed,
            ),
            ("bucketfs_staged_bytes_total", "counter", &self.staged_bytes),
            (
                "bucketfs_data_cache_hits_total",
                "counter",
                &self.data_cache_hits,
            ),
            (
                "bucketfs_data_cache_misses_total",
                "counter",
                &self.data_cache_misses,
            ),
            (
                "bucketfs_data_cache_bytes_served_total",
                "counter",
                &self.data_cache_bytes_served,
            ),
            (
                "bucketfs_data_cache_evictions_total",
                "counter",
                &self.data_cache_evictions,
            ),
            (
                "bucketfs_data_cache_corrupt_total",
                "counter",
                &self.data_cache_corrupt,
            ),
            (
                "bucketfs_data_cache_errors_total",
                "counter",
                &self.data_cache_errors,
            ),
            (
                "bucketfs_data_cache_skipped_total",
                "counter",
                &self.data_cache_skipped,
            ),
            (
                "bucketfs_writeback_committed_total",
                "counter",
                &self.writeback_committed,
            ),
            (
                "bucketfs_writeback_deltas_total",
                "counter",
                &self.writeback_deltas,
            ),
            (
                "bucketfs_writeback_along_total",
                "counter",
                &self.writeback_along,
            ),
            (
                "bucketfs_writeback_syncs_total",
                "counter",
                &self.writeback_syncs,
            ),
            (
                "bucketfs_writeback_early_parts_total",
                "counter",
                &self.writeback_early_parts,
            ),
            (
                "bucketfs_writeback_adopted_total",
                "counter",
                &self.writeback_adopted,
            ),
            (
                "bucketfs_writeback_uploaded_total",
                "counter",
                &self.writeback_uploaded,
            ),
            (
                "bucketfs_writeback_replaced_total",
                "counter",
                &self.writeback_replaced,
            ),
            (
                "bucketfs_writeback_cancelled_total",
                "counter",
                &self.writeback_cancelled,
            ),
            (
                "bucketfs_writeback_upload_errors_total",
                "counter",
                &self.writeback_upload_errors,
            ),
            (
                "bucketfs_writeback_conflicts_total",
                "counter",
                &self.writeback_conflicts,
            ),
            (
                "bucketfs_writeback_space_waits_total",
                "counter",
                &self.writeback_space_waits,
            ),
            (
                "bucketfs_writeback_direct_uploads_total",
                "counter",
                &self.writeback_direct,
            ),
            (
                "bucketfs_writeback_pending_files",
                "gauge",
                &self.writeback_pending,
            ),
            (
                "bucketfs_writeback_pending_bytes",
                "gauge",
                &self.writeback_pending_bytes,
            ),
            (
                "bucketfs_writeback_failed_files",
                "gauge",
                &self.writeback_failed,
            ),
            (
                "bucketfs_data_cache_queued_blocks",
                "gauge",
                &self.data_cache_queued,
            ),
            (
                "bucketfs_passthrough_opens_total",
                "counter",
                &self.passthrough_opens,
            ),
            (
                "bucketfs_passthrough_bytes_total",
                "counter",
                &self.passthrough_bytes,
            ),
            (
                "bucketfs_write_copies_unbudgeted_total",
                "counter",
                &self.write_copies_unbudgeted,
            ),
        ];
        let mut s = String::new();
        for (name, kind, c) in counters {
            s += &format!("# TYPE {name} {kind}\n{name} {}\n", Self::get(c));
        }
        s += &format!(
            "# TYPE bucketfs_buffer_bytes gauge\nbucketfs_buffer_bytes {}\n",
            Self::get(&self.buffer_bytes)
        );
        s += &format!(
            "# TYPE bucketfs_memory_budget_bytes gauge\nbucketfs_memory_budget_bytes {}\n",
            Self::get(&self.budget_bytes)
        );
        s += &format!(
            "# TYPE bucketfs_data_cache_bytes gauge\nbucketfs_data_cache_bytes {}\n",
            Self::get(&self.data_cache_bytes)
        );
        s += &format!(
            "# TYPE bucketfs_data_cache_limit_bytes gauge\nbucketfs_data_cache_limit_bytes {}\n",
            Self::get(&self.data_cache_limit_bytes)
        );
        s += &format!(
            "# TYPE bucketfs_uploads_in_flight gauge\nbucketfs_uploads_in_flight {}\n",
            Self::get(&self.uploads_in_flight)
        );
        s
    }
}
