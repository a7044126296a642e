//! Renames and the changes below what they move, kept apart. A directory rename lists,
//! copies and deletes every object below it; a chmod, a truncate, a write, a create, an
//! unlink or another rename there landing in between would go to a key already copied (and
//! be deleted with it, or bring the old directory back), while the change reports success.
//! The kernel does not order them: it locks the renamed directory's parent, not what is in
//! it. Cross-directory renames the kernel runs one at a time; renames within one directory
//! are ordered here too when one is at, above or below the other.

use crate::error::FsResult;
use crate::paths::MountPath;
use parking_lot::Mutex;
use tokio::sync::Notify;

#[derive(Default)]
pub(super) struct Subtrees {
    inner: Mutex<Busy>,
    /// A rename or a store ended.
    ended: Notify,
}

#[derive(Default)]
struct Busy {
    /// Directories being renamed (their old paths).
    renaming: Vec<(u64, MountPath)>,
    /// Paths whose metadata is being stored.
    storing: Vec<(u64, MountPath)>,
    next: u64,
}

/// Held for a rename of a directory, or a store of metadata; ends it when dropped.
pub(super) struct Held<'a> {
    subtrees: &'a Subtrees,
    id: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut b = self.subtrees.inner.lock();
        b.renaming.retain(|(id, _)| *id != self.id);
        b.storing.retain(|(id, _)| *id != self.id);
        drop(b);
        self.subtrees.ended.notify_waiters();
    }
}

fn at_or_below(path: &MountPath, dir: &MountPath) -> bool {
    path == dir || path.is_below(dir)
}

impl Subtrees {
    /// A rename of what is at `src` into directory `dst_dir` (`paths()`, read again after
    /// each wait, as a rename above moves them): waits while a rename is under way at, above
    /// or below `src`, or at or above `dst_dir`; then holds off stores at or below `src` and
    /// renames into it, and waits for the stores begun there to end. `dst_dir` counts as a
    /// store (a rename above it waits). `paths` must not wait for these subtrees (it runs
    /// under their lock).
    pub async fn rename(
        &self,
        paths: impl Fn() -> FsResult<(MountPath, MountPath)>,
    ) -> FsResult<Held<'_>> {
        let (held, src) = loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            {
                let mut b = self.inner.lock();
                let (src, dst_dir) = paths()?;
                let busy = b.renaming.iter().any(|(_, r)| {
                    at_or_below(&src, r) || r.is_below(&src) || at_or_below(&dst_dir, r)
                });
                if !busy {
                    b.next += 1;
                    let id = b.next;
                    b.renaming.push((id, src.clone()));
                    b.storing.push((id, dst_dir));
                    break (Held { subtrees: self, id }, src);
                }
            }
            ended.await;
        };
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let busy = self
                .inner
                .lock()
                .storing
                .iter()
                .any(|(id, p)| *id != held.id && at_or_below(p, &src));
            if !busy {
                return Ok(held);
            }
            ended.await;
        }
    }

    /// A store at or below `path()` (asked again after each wait, as a rename moves it): a
    /// change of its metadata, or of what is in it when it is a directory. Waits while a
    /// directory at or above it is being renamed. Returns the path with the hold. `path`
    /// must not wait for these subtrees (it runs under their lock).
    pub async fn store(
        &self,
        path: impl Fn() -> FsResult<MountPath>,
    ) -> FsResult<(MountPath, Held<'_>)> {
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            {
                // The path read under the lock: a rename that moves it and ends between the
                // read and the check would leave it the old one.
                let mut b = self.inner.lock();
                let p = path()?;
                if !b.renaming.iter().any(|(_, r)| at_or_below(&p, r)) {
                    b.next += 1;
                    let id = b.next;
                    b.storing.push((id, p.clone()));
                    return Ok((p, Held { subtrees: self, id }));
                }
            }
            ended.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    /// A rename that moves the path and ends while a store reads it: the store goes on at
    /// the new path, never the old one (an earlier build read the path before the check).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_never_goes_on_at_a_path_a_rename_moved() {
        let s = Arc::new(Subtrees::default());
        let place = Arc::new(Mutex::new(MountPath::new("a/d")));
        let held = s
            .rename(|| Ok((MountPath::new("a"), MountPath::root())))
            .await
            .unwrap();
        let (read_tx, read) = std::sync::mpsc::channel();
        let store = tokio::spawn({
            let (s, place) = (s.clone(), place.clone());
            async move {
                let first = std::sync::atomic::AtomicBool::new(true);
                s.store(|| {
                    let p = place.lock().clone();
                    if first.swap(false, std::sync::atomic::Ordering::SeqCst) {
                        let _ = read_tx.send(());
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    Ok(p)
                })
                .await
                .map(|(p, _)| p)
            }
        });
        // The first read of the path is in progress: the rename moves it and ends.
        tokio::task::spawn_blocking(move || read.recv().unwrap())
            .await
            .unwrap();
        *place.lock() = MountPath::new("b/d");
        drop(held);
        assert_eq!(store.await.unwrap().unwrap(), MountPath::new("b/d"));
    }

    #[tokio::test]
    async fn a_store_below_waits_for_a_rename_and_a_rename_for_a_store_below() {
        let s = Arc::new(Subtrees::default());
        let a = MountPath::new("a");
        let held = s
            .rename(|| Ok((a.clone(), MountPath::root())))
            .await
            .unwrap();
        // Elsewhere: at once.
        let other = s.store(|| Ok(MountPath::new("ab/x"))).await.unwrap();
        let below = tokio::spawn({
            let s = s.clone();
            async move { s.store(|| Ok(MountPath::new("a/x"))).await.map(|(p, _)| p) }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!below.is_finished(), "a store below a rename did not wait");
        drop(held);
        assert_eq!(below.await.unwrap().unwrap(), MountPath::new("a/x"));
        drop(other);
        let (_, store) = s.store(|| Ok(MountPath::new("a/y"))).await.unwrap();
        let rename = tokio::spawn({
            let s = s.clone();
            async move {
                drop(
                    s.rename(|| Ok((MountPath::new("a"), MountPath::root())))
                        .await,
                );
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !rename.is_finished(),
            "a rename did not wait for a store below"
        );
        drop(store);
        rename.await.unwrap();
    }
}
