//! One lock per inode that a setattr is changing or an unlink removing: an open for writing of
//! that inode waits for it. A writer that opened while a chmod's copy was in flight took the
//! metadata from before it, and its upload, pinned to an ETag the copy of a one-part object
//! keeps, stored the old mode over the new one; one that opened while an unlink's DELETE was
//! in flight made a state the unlink never saw, whose close put the file back. Behind the
//! lock it takes the metadata as changed, or finds the file unlinked.

use crate::meta::Ino;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::{Mutex, OwnedMutexGuard};

#[derive(Default)]
pub(crate) struct MetaChanges {
    /// The inodes locked or waited for; an entry goes with its last guard.
    locks: parking_lot::Mutex<HashMap<Ino, Arc<Mutex<()>>>>,
}

/// Held while the metadata of `ino` changes, while it is unlinked, or while its writer's
/// state is made.
pub(crate) struct MetaChange<'a> {
    changes: &'a MetaChanges,
    ino: Ino,
    guard: Option<OwnedMutexGuard<()>>,
}

impl MetaChanges {
    /// Waits for the change of `ino`'s metadata under way, if any; holds off the next.
    pub(crate) async fn lock(&self, ino: Ino) -> MetaChange<'_> {
        let lock = self.locks.lock().entry(ino).or_default().clone();
        MetaChange {
            changes: self,
            ino,
            guard: Some(lock.lock_owned().await),
        }
    }
}

impl Drop for MetaChange<'_> {
    fn drop(&mut self) {
        self.guard.take();
        let mut locks = self.changes.locks.lock();
        // Only the map's own reference left: nobody holds or waits for it.
        if locks
            .get(&self.ino)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            locks.remove(&self.ino);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_lock_waits_for_the_one_held_and_nothing_stays_behind() {
        let changes = Arc::new(MetaChanges::default());
        let first = changes.lock(7).await;
        let waiter = tokio::spawn({
            let changes = changes.clone();
            async move {
                let _g = changes.lock(7).await;
            }
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            !waiter.is_finished(),
            "a second lock of the inode did not wait"
        );
        let _other = changes.lock(8).await; // another inode does not wait
        drop(first);
        waiter.await.unwrap();
        drop(_other);
        assert!(changes.locks.lock().is_empty());
    }
}
