//! Directory renames and the metadata changes below them kept apart. A directory rename
//! lists, copies and deletes every object below it; a chmod, chown or utimens there storing
//! in between would land on a key already copied (and be deleted with it, or bring the old
//! directory back), while the change reports success. The kernel does not order them: it
//! locks the renamed directory's parent, not the inodes below.

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
    /// A rename of directory `src`: stores below it that have begun end first, and new ones
    /// wait for the rename.
    pub async fn rename(&self, src: &MountPath) -> Held<'_> {
        let held = {
            let mut b = self.inner.lock();
            b.next += 1;
            let id = b.next;
            b.renaming.push((id, src.clone()));
            Held { subtrees: self, id }
        };
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if !self
                .inner
                .lock()
                .storing
                .iter()
                .any(|(_, p)| at_or_below(p, src))
            {
                return held;
            }
            ended.await;
        }
    }

    /// A store of the metadata of what is at `path()` (asked again after each wait, as a
    /// rename moves it): waits while a directory at or above it is being renamed. Returns
    /// the path with the hold. `path` must not wait for these subtrees (it runs under their
    /// lock).
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
        let held = s.rename(&MountPath::new("a")).await;
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
        let held = s.rename(&a).await;
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
                drop(s.rename(&MountPath::new("a")).await);
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
