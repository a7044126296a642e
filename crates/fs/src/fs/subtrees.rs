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
    /// A rename or a store ended, or a rename stopped waiting.
    ended: Notify,
}

#[derive(Default)]
struct Busy {
    /// Renames under way.
    renaming: Vec<(u64, Move)>,
    /// Paths being changed (their metadata, or what is in them), and whether only a rename
    /// of the path itself waits for the change (see [`Subtrees::store_of_file`]).
    storing: Vec<(u64, MountPath, bool)>,
    /// Renames waiting to start, as they last read their paths: a later rename they
    /// conflict with waits behind them, so a stream of renames below one cannot hold it off
    /// for good.
    waiting: Vec<(u64, Move)>,
    next: u64,
}

/// What a rename moves: `src` to `dst`, in directory `dst_dir`.
#[derive(Clone)]
pub(super) struct Move {
    pub src: MountPath,
    pub dst: MountPath,
    pub dst_dir: MountPath,
}

impl Move {
    /// Whether `path` is at or below what this moves (its old place or its new one): a
    /// change there waits for it.
    fn covers(&self, path: &MountPath) -> bool {
        at_or_below(path, &self.src) || at_or_below(path, &self.dst)
    }

    /// Whether a store at `path` and this rename wait for each other: when the path is
    /// covered, or, for a store of a file only (`exact`, see [`Subtrees::store_of_file`]),
    /// when it is the rename's source or destination itself.
    fn holds_off(&self, path: &MountPath, exact: bool) -> bool {
        match exact {
            true => *path == self.src || *path == self.dst,
            false => self.covers(path),
        }
    }

    /// Whether this and `other` must not run at once: one moves what the other moves, or
    /// moves something into it.
    fn conflicts(&self, other: &Move) -> bool {
        let either =
            |a: &Move, b: &Move| a.covers(&b.src) || a.covers(&b.dst) || a.covers(&b.dst_dir);
        either(self, other) || either(other, self)
    }
}

/// A rename's place among [`Busy::waiting`], given up when dropped (started, failed, or its
/// request dropped).
struct Waiting<'a> {
    subtrees: &'a Subtrees,
    id: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.subtrees
            .inner
            .lock()
            .waiting
            .retain(|(id, _)| *id != self.id);
        self.subtrees.ended.notify_waiters();
    }
}

/// Held for a rename, or a change below what renames move; ends it when dropped.
pub(super) struct Held<'a> {
    subtrees: &'a Subtrees,
    id: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut b = self.subtrees.inner.lock();
        b.renaming.retain(|(id, _)| *id != self.id);
        b.storing.retain(|(id, ..)| *id != self.id);
        drop(b);
        self.subtrees.ended.notify_waiters();
    }
}

fn at_or_below(path: &MountPath, dir: &MountPath) -> bool {
    path == dir || path.is_below(dir)
}

impl Subtrees {
    /// `ready`'s answer once it has one: it runs under the lock, again after each rename or
    /// store ends (a wake-up between its check and the wait is not lost).
    async fn once<T>(
        &self,
        mut ready: impl FnMut(&mut Busy) -> FsResult<Option<T>>,
    ) -> FsResult<T> {
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if let Some(t) = ready(&mut self.inner.lock())? {
                return Ok(t);
            }
            ended.await;
        }
    }

    /// A rename (`what()`, read again after each wait, as a rename above moves its paths):
    /// waits while a rename it conflicts with is under way or has waited longer; then holds
    /// off changes at or below its source and its destination until it ends, and waits for
    /// those begun there. `what` must not wait for these subtrees (it runs under their
    /// lock).
    pub async fn rename(&self, what: impl Fn() -> FsResult<Move>) -> FsResult<Held<'_>> {
        let waiting = {
            let mut b = self.inner.lock();
            b.next += 1;
            Waiting {
                subtrees: self,
                id: b.next,
            }
        };
        let id = waiting.id;
        let m = self
            .once(|b| {
                let m = what()?;
                let busy = b.renaming.iter().any(|(_, r)| r.conflicts(&m))
                    || b.waiting.iter().any(|(i, w)| *i < id && w.conflicts(&m));
                if !busy {
                    b.renaming.push((id, m.clone()));
                    return Ok(Some(m));
                }
                match b.waiting.iter_mut().find(|(i, _)| *i == id) {
                    Some(w) => w.1 = m,
                    None => b.waiting.push((id, m)),
                }
                Ok(None)
            })
            .await?;
        let held = Held { subtrees: self, id };
        drop(waiting);
        self.once(|b| {
            let busy = b.storing.iter().any(|(_, p, exact)| m.holds_off(p, *exact));
            Ok((!busy).then_some(()))
        })
        .await?;
        Ok(held)
    }

    /// A store at or below `path()` (asked again after each wait, as a rename moves it): a
    /// change of its metadata, or of what is in it when it is a directory. Waits while a
    /// rename at or above it is under way (at its old place or its new one). Returns the
    /// path with the hold. `path` must not wait for these subtrees (it runs under their
    /// lock): a rename that moves it and ends between the read and the check would leave
    /// it the old one.
    pub async fn store(
        &self,
        path: impl Fn() -> FsResult<MountPath>,
    ) -> FsResult<(MountPath, Held<'_>)> {
        self.store_when(path, false).await
    }

    /// [`Self::store`] of a file that waits only for a rename of the file itself (or onto
    /// it), not for one of a directory above, nor does such a rename wait for it:
    /// background mode, where that rename moves the write states below it along, and the
    /// files' entries in the write-back directory.
    pub async fn store_of_file(
        &self,
        path: impl Fn() -> FsResult<MountPath>,
    ) -> FsResult<(MountPath, Held<'_>)> {
        self.store_when(path, true).await
    }

    /// A store at `path()`, once no rename under way covers it (`exact`: moves it).
    async fn store_when(
        &self,
        path: impl Fn() -> FsResult<MountPath>,
        exact: bool,
    ) -> FsResult<(MountPath, Held<'_>)> {
        let (p, id) = self
            .once(|b| {
                let p = path()?;
                if b.renaming.iter().any(|(_, r)| r.holds_off(&p, exact)) {
                    return Ok(None);
                }
                b.next += 1;
                b.storing.push((b.next, p.clone(), exact));
                Ok(Some((p, b.next)))
            })
            .await?;
        Ok((p, Held { subtrees: self, id }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    /// A rename waiting behind one below it is not held off by more renames below it that
    /// come after it: they wait behind it.
    #[tokio::test]
    async fn a_waiting_rename_goes_before_later_renames_below_it() {
        let s = Arc::new(Subtrees::default());
        let first = s
            .rename(|| {
                Ok(Move {
                    src: MountPath::new("p/d/a.tmp"),
                    dst: MountPath::new("p/d/a"),
                    dst_dir: MountPath::new("p/d"),
                })
            })
            .await
            .unwrap();
        let outer = tokio::spawn({
            let s = s.clone();
            async move {
                drop(
                    s.rename(|| {
                        Ok(Move {
                            src: MountPath::new("p/d"),
                            dst: MountPath::new("q/d"),
                            dst_dir: MountPath::new("q"),
                        })
                    })
                    .await,
                );
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let later = tokio::spawn({
            let s = s.clone();
            async move {
                drop(
                    s.rename(|| {
                        Ok(Move {
                            src: MountPath::new("p/d/b.tmp"),
                            dst: MountPath::new("p/d/b"),
                            dst_dir: MountPath::new("p/d"),
                        })
                    })
                    .await,
                );
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!outer.is_finished() && !later.is_finished());
        drop(first);
        outer.await.unwrap();
        later.await.unwrap();
    }

    /// A rename that moves the path and ends while a store reads it: the store goes on at
    /// the new path, never the old one (an earlier build read the path before the check).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_never_goes_on_at_a_path_a_rename_moved() {
        let s = Arc::new(Subtrees::default());
        let place = Arc::new(Mutex::new(MountPath::new("a/d")));
        let held = s
            .rename(|| {
                Ok(Move {
                    src: MountPath::new("a"),
                    dst: MountPath::new("b"),
                    dst_dir: MountPath::new(""),
                })
            })
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
        let held = s
            .rename(|| {
                Ok(Move {
                    src: MountPath::new("a"),
                    dst: MountPath::new("c"),
                    dst_dir: MountPath::new(""),
                })
            })
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
                    s.rename(|| {
                        Ok(Move {
                            src: MountPath::new("a"),
                            dst: MountPath::new("c"),
                            dst_dir: MountPath::new(""),
                        })
                    })
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

    /// A store of a file in background mode (`store_of_file`) below a directory holds off
    /// neither a rename of the directory nor is held off by it (a steady stream of them
    /// starved the rename), but waits for a rename of the file itself, and that one for it.
    #[tokio::test]
    async fn a_file_store_waits_only_for_a_rename_of_the_file() {
        let s = Arc::new(Subtrees::default());
        let mv = |src: &'static str, dst: &'static str| {
            move || {
                Ok(Move {
                    src: MountPath::new(src),
                    dst: MountPath::new(dst),
                    dst_dir: MountPath::new(""),
                })
            }
        };
        let (_, file) = s.store_of_file(|| Ok(MountPath::new("a/x"))).await.unwrap();
        let dir = tokio::time::timeout(Duration::from_secs(1), s.rename(mv("a", "c")))
            .await
            .expect("a directory rename waited for a file's store below it")
            .unwrap();
        let (_, below) = tokio::time::timeout(
            Duration::from_secs(1),
            s.store_of_file(|| Ok(MountPath::new("a/y"))),
        )
        .await
        .expect("a file's store waited for a rename of its directory")
        .unwrap();
        drop((dir, below));
        let rename = tokio::spawn({
            let s = s.clone();
            async move { drop(s.rename(mv("a/x", "a/z")).await) }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!rename.is_finished(), "a rename of the file did not wait");
        drop(file);
        rename.await.unwrap();
    }
}
