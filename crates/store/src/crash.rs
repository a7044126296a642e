//! A mount's crash cleanup, as one policy: at startup, what dead daemons of the same bucket
//! left (open uploads, temporary objects) is cleaned up from their journals; then this
//! daemon's own journal is opened and the store wrapped so that the uploads started through
//! it ([`crate::Upload`]) and the temporary objects it writes are recorded
//! ([`MountJournal::open`]). At shutdown, uploads still open can be aborted
//! ([`MountJournal::abort_open_uploads`]) and the journal is removed if nothing is left
//! ([`MountJournal::close`]); what is left is cleaned up by the next mount.
//!
//! Journals are named after the bucket alone (however the endpoint is spelled); the store a
//! journal was written on is the line inside it, compared by [`same_endpoint`]. Journals of
//! older versions (named after bucket and endpoint, in other directories) are recovered too.
//! The caller chooses the directories and prints what happened.

use crate::journal::{self, JournalStore, Recovery, Scope, UploadJournal};
use crate::{ObjectStore, StoreError};
use futures::StreamExt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How long the aborts at shutdown may take before the daemon gives up on those left (the
/// next mount aborts them).
const ABORT_TIMEOUT: Duration = Duration::from_secs(15);
/// Aborts sent at once at shutdown: a store that stopped answering held each for
/// [`ABORT_TIMEOUT`] in turn (40 open files, 10 minutes).
const ABORTS_AT_ONCE: usize = 32;

/// How long shutdown waits for the journal: a write stuck on a hung state disk holds its
/// lock for good, and the daemon must still exit (the journal then stays for the next mount).
pub const JOURNAL_WAIT: Duration = Duration::from_secs(10);

/// Runs `f`, journal work that may wait for the state disk, on a thread of its own, waiting
/// at most `wait`. `None`: no answer in time (the thread stays blocked until the
/// disk answers or the process exits).
async fn within_journal_wait<T: Send + 'static>(
    wait: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("journal".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .ok()?;
    tokio::time::timeout(wait, rx).await.ok()?.ok()
}

/// The bucket a mount is of, and the store it is on.
#[derive(Debug, Clone)]
pub enum Bucket {
    /// `endpoint`: the endpoint URL as the mount spells it; `None` is AWS.
    S3 {
        bucket: String,
        endpoint: Option<String>,
    },
    /// A local directory used as a bucket.
    Local { dir: PathBuf },
}

impl Bucket {
    /// The journal file name fragment: the bucket without the endpoint, so the journals of a
    /// bucket are found however the endpoint was spelled (the store line inside tells stores
    /// apart).
    fn tag(&self) -> String {
        match self {
            Bucket::S3 { bucket, .. } => journal::journal_tag(&format!("s3://{bucket}")),
            Bucket::Local { dir } => journal::journal_tag(&dir.display().to_string()),
        }
    }

    /// The store the bucket is on, as this mount spells it (recorded in the journal).
    fn store(&self) -> String {
        match self {
            Bucket::S3 { endpoint, .. } => endpoint.clone().unwrap_or_else(|| "aws".into()),
            Bucket::Local { .. } => "local".into(),
        }
    }
}

/// Where the journals are: this version's directory, and those older versions used.
#[derive(Debug, Clone)]
pub struct JournalDirs {
    pub dir: PathBuf,
    pub legacy: Vec<PathBuf>,
}

/// What became of one upload aborted at shutdown.
#[derive(Debug)]
pub enum ShutdownAbort {
    Aborted,
    Failed(StoreError),
    TimedOut,
}

/// What a mount leaves for the next one at [`MountJournal::close`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Left {
    pub uploads: usize,
    pub temporaries: usize,
}

/// The live daemon's journal and the store that records into it.
pub struct MountJournal {
    journal: Arc<UploadJournal>,
    store: Arc<dyn ObjectStore>,
    /// [`JOURNAL_WAIT`] (shorter in tests).
    wait: Duration,
}

impl MountJournal {
    /// Cleans up after the dead daemons of `bucket` (see the module docs), then opens this
    /// daemon's journal in `dirs.dir` and wraps `store` to record into it; objects written
    /// under `temporaries` are journaled as temporary. Returns the journal and the recovery
    /// (an error there does not stop the mount: what could not be read is kept for the next
    /// one). An error opening the journal does.
    pub async fn open(
        store: Arc<dyn ObjectStore>,
        bucket: &Bucket,
        dirs: &JournalDirs,
        temporaries: String,
    ) -> Result<(Self, io::Result<Recovery>), String> {
        // Before our own journal exists: a dead daemon may have had this process's pid.
        let recovery = recover(&*store, bucket, dirs).await;
        let journal = UploadJournal::open_for_store(&dirs.dir, &bucket.tag(), &bucket.store())
            .map_err(|e| format!("upload journal in {}: {e}", dirs.dir.display()))?;
        let journal = Arc::new(journal);
        let store: Arc<dyn ObjectStore> =
            Arc::new(JournalStore::new(store, journal.clone()).with_temporaries(temporaries));
        Ok((
            Self {
                journal,
                store,
                wait: JOURNAL_WAIT,
            },
            recovery,
        ))
    }

    /// The store to use: everything it starts is journaled.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    pub fn path(&self) -> &Path {
        self.journal.path()
    }

    /// Aborts every upload still open (a shutdown that does not wait for open files), each
    /// within a time bound; returns each key and what became of its upload. `None`: the
    /// journal did not answer within [`JOURNAL_WAIT`] (its disk hung), so nothing was aborted;
    /// the next mount aborts what it holds.
    pub async fn abort_open_uploads(&self) -> Option<Vec<(String, ShutdownAbort)>> {
        let journal = self.journal.clone();
        let live = within_journal_wait(self.wait, move || journal.live()).await?;
        let deadline = tokio::time::Instant::now() + ABORT_TIMEOUT;
        let aborts: Vec<_> = futures::stream::iter(live)
            .map(|(key, id)| async move {
                let abort = self.store.abort_multipart(&key, &id);
                let r = tokio::time::timeout_at(deadline, abort).await;
                (key, id, r)
            })
            .buffer_unordered(ABORTS_AT_ONCE)
            .collect()
            .await;
        let mut out = Vec::new();
        // Once the journal does not answer, the other ends are not recorded either.
        let mut answers = true;
        for (key, id, r) in aborts {
            if let (Ok(Ok(()) | Err(StoreError::NotFound(_))), true) = (&r, answers) {
                // Not recorded in time: the next mount's abort finds nothing.
                let (journal, k) = (self.journal.clone(), key.clone());
                answers = within_journal_wait(self.wait, move || journal.end(&k, &id))
                    .await
                    .is_some();
            }
            let what = match r {
                Ok(Ok(())) => ShutdownAbort::Aborted,
                Ok(Err(e)) => ShutdownAbort::Failed(e),
                Err(_) => ShutdownAbort::TimedOut,
            };
            out.push((key, what));
        }
        Some(out)
    }

    /// The end of the mount: the journal is removed if nothing is left in it; otherwise it
    /// stays for the next mount, and what it holds is returned. `None`: the journal did not
    /// answer within [`JOURNAL_WAIT`] (its disk hung); it stays.
    pub async fn close(&self) -> Option<Left> {
        let journal = self.journal.clone();
        within_journal_wait(self.wait, move || {
            let left = Left {
                uploads: journal.live().len(),
                temporaries: journal.temporaries().len(),
            };
            if left == Left::default() {
                let _ = journal.remove();
            }
            left
        })
        .await
    }
}

/// Recovers the dead journals of `bucket`: in `dirs.dir` by the store line inside them, in
/// the legacy directories by their name.
async fn recover(
    store: &dyn ObjectStore,
    bucket: &Bucket,
    dirs: &JournalDirs,
) -> io::Result<Recovery> {
    let ours = bucket.store();
    // Journals say which store they are of; the old ones only in their name.
    let this_store = |_: &str, recorded: Option<&str>| {
        recorded.is_some_and(|r| r == ours || same_endpoint(r, &ours))
    };
    let (legacy_start, legacy_exact) = match bucket {
        Bucket::S3 { bucket, .. } => {
            let exact = journal::journal_tag(&format!("s3://{bucket} at {ours}"));
            (legacy_tag_start(&format!("s3://{bucket} at ")), exact)
        }
        Bucket::Local { .. } => {
            let t = bucket.tag();
            (format!("{t}."), t)
        }
    };
    let legacy_this_store =
        |name: &str, _: Option<&str>| name.starts_with(&format!("{legacy_exact}."));
    let mut scopes = vec![Scope {
        dir: &dirs.dir,
        name_prefix: format!("{}.", bucket.tag()),
        this_store: &this_store,
    }];
    for d in &dirs.legacy {
        scopes.push(Scope {
            dir: d,
            name_prefix: legacy_start.clone(),
            this_store: &legacy_this_store,
        });
    }
    journal::recover_in(store, &scopes).await
}

/// The first 60 characters of the old tag (`s3://BUCKET at ENDPOINT` made a file name), which
/// every endpoint spelling shares.
fn legacy_tag_start(id: &str) -> String {
    id.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(60)
        .collect()
}

/// Whether two endpoint URLs name the same server without asking DNS: same scheme, port and
/// path, and the same host name, or `localhost` and its usual addresses (`127.0.0.1`, `::1`).
/// Stricter than [`same_endpoint`], where two names sharing an address (an anycast front, one
/// ingress for two tenants) count as one: for moving files acknowledged for one store to
/// another spelling of it, where being wrong would upload them to another store.
pub fn same_endpoint_spelt(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    let (Some(pa), Some(pb)) = (split_endpoint(a), split_endpoint(b)) else {
        return false;
    };
    // `localhost` and its usual addresses; not all of 127/8 (a tunnel to another store may
    // listen on 127.0.0.2).
    let loopback = |h: &str| matches!(h, "localhost" | "127.0.0.1" | "::1");
    (pa.0, pa.2, &pa.3) == (pb.0, pb.2, &pb.3)
        && (pa.1 == pb.1 || loopback(&pa.1) && loopback(&pb.1))
}

/// Whether two endpoint URLs reach the same server: same scheme, port and path, and the same
/// host name or a host address in common (`localhost` and `127.0.0.1` are one store).
pub fn same_endpoint(a: &str, b: &str) -> bool {
    use std::collections::HashSet;
    use std::net::{IpAddr, ToSocketAddrs};
    if a == b {
        return true;
    }
    let (Some(pa), Some(pb)) = (split_endpoint(a), split_endpoint(b)) else {
        return false;
    };
    if (pa.0, pa.2, &pa.3) != (pb.0, pb.2, &pb.3) {
        return false;
    }
    if pa.1 == pb.1 {
        return true;
    }
    let addrs = |host: &str, port: u16| -> HashSet<IpAddr> {
        (host, port)
            .to_socket_addrs()
            .map(|it| it.map(|sa| sa.ip()).collect())
            .unwrap_or_default()
    };
    !addrs(&pa.1, pa.2).is_disjoint(&addrs(&pb.1, pb.2))
}

/// `(scheme, host, port, path)` of an endpoint URL, lower-cased, default port filled in.
fn split_endpoint(url: &str) -> Option<(&'static str, String, u16, String)> {
    let (scheme, rest) = url.split_once("://")?;
    let (scheme, default_port) = match scheme.to_ascii_lowercase().as_str() {
        "http" => ("http", 80),
        "https" => ("https", 443),
        _ => return None,
    };
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let authority = authority.rsplit('@').next()?;
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => {
            let (h, after) = v6.split_once(']')?;
            (h, after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default_port,
    };
    Some((
        scheme,
        host.to_ascii_lowercase(),
        port,
        path.trim_end_matches('/').to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryStore;
    use crate::{Uploads, UserMeta};

    #[test]
    fn endpoint_spellings_without_dns() {
        assert!(same_endpoint_spelt(
            "http://127.0.0.1:9000",
            "http://localhost:9000/"
        ));
        assert!(same_endpoint_spelt(
            "https://S3.example.com",
            "https://s3.example.com:443"
        ));
        // Two names of one address are not taken for one store.
        assert!(!same_endpoint_spelt(
            "https://a.r2.example.com",
            "https://b.r2.example.com"
        ));
        assert!(!same_endpoint_spelt(
            "http://localhost:9000",
            "http://localhost:9001"
        ));
        assert!(!same_endpoint_spelt(
            "http://127.0.0.2:9000",
            "http://127.0.0.1:9000"
        ));
    }

    #[test]
    fn endpoint_spellings() {
        assert!(same_endpoint(
            "http://127.0.0.1:9000",
            "http://localhost:9000"
        ));
        assert!(same_endpoint(
            "http://LocalHost:9000/",
            "http://localhost:9000"
        ));
        assert!(same_endpoint(
            "https://s3.example.com",
            "https://s3.example.com:443"
        ));
        assert!(!same_endpoint(
            "http://127.0.0.1:9000",
            "http://127.0.0.1:9001"
        ));
        assert!(!same_endpoint(
            "http://127.0.0.1:9000",
            "https://127.0.0.1:9000"
        ));
        assert!(!same_endpoint("http://127.0.0.1:9000", "aws"));
        assert_eq!(
            split_endpoint("http://[::1]:9000/x/"),
            Some(("http", "::1".to_string(), 9000, "x".to_string()))
        );
    }

    /// A daemon dies with an upload open; the next mount of the bucket (the endpoint spelled
    /// another way) aborts it, and a clean shutdown leaves no journal.
    #[tokio::test]
    async fn the_next_mount_cleans_up_and_a_clean_one_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dirs = JournalDirs {
            dir: dir.path().join("journal"),
            legacy: vec![],
        };
        let mem = Arc::new(MemoryStore::new());
        let bucket = |endpoint: &str| Bucket::S3 {
            bucket: "b".into(),
            endpoint: Some(endpoint.into()),
        };
        let (first, rec) = MountJournal::open(
            mem.clone(),
            &bucket("http://127.0.0.1:9"),
            &dirs,
            "t/".into(),
        )
        .await
        .unwrap();
        assert_eq!(rec.unwrap().journals, 0);
        // The daemon dies with an upload open: in its journal, never finished.
        let id = mem
            .create_multipart("k", &UserMeta::new(), None)
            .await
            .unwrap();
        let journal = first.store().upload_journal().unwrap();
        journal.started("k", &id).unwrap();
        drop(journal);
        assert_eq!(
            first.close().await.unwrap(),
            Left {
                uploads: 1,
                temporaries: 0
            }
        );
        // Dead: its journal stays, unlocked.
        let path = first.path().to_path_buf();
        drop(first);
        assert!(path.exists());
        let (second, rec) = MountJournal::open(
            mem.clone(),
            &bucket("http://localhost:9"),
            &dirs,
            "t/".into(),
        )
        .await
        .unwrap();
        assert_eq!(rec.unwrap().aborted, vec![("k".to_string(), id)]);
        assert_eq!(mem.pending_uploads(), 0);
        // An upload open at shutdown is aborted through the journal, which then goes.
        let _open = Uploads::new(second.store().clone())
            .create("k2", &UserMeta::new(), None)
            .await
            .unwrap();
        let aborted = second.abort_open_uploads().await.unwrap();
        assert!(matches!(&aborted[..], [(k, ShutdownAbort::Aborted)] if k == "k2"));
        assert_eq!(second.close().await, Some(Left::default()));
        assert!(!second.path().exists());
    }

    /// A mount's journal (in a temp dir) over a fault store, with `n` uploads open, `k0`...
    async fn with_open_uploads(
        n: usize,
    ) -> (
        tempfile::TempDir,
        Arc<MemoryStore>,
        Arc<crate::fault::FaultStore>,
        MountJournal,
        Vec<crate::Upload>,
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = JournalDirs {
            dir: tmp.path().join("journal"),
            legacy: vec![],
        };
        let mem = Arc::new(MemoryStore::new());
        let fault = Arc::new(crate::fault::FaultStore::new(mem.clone()));
        let bucket = Bucket::S3 {
            bucket: "b".into(),
            endpoint: Some("http://127.0.0.1:9".into()),
        };
        let (mount, _) = MountJournal::open(fault.clone(), &bucket, &dirs, "t/".into())
            .await
            .unwrap();
        let uploads = Uploads::new(mount.store().clone());
        let mut open = Vec::new();
        for i in 0..n {
            let key = format!("k{i}");
            open.push(uploads.create(&key, &UserMeta::new(), None).await.unwrap());
        }
        (tmp, mem, fault, mount, open)
    }

    /// A journal that stops answering after the first abort of many: the other uploads
    /// are aborted without waiting for it again, so shutdown waits for it once, not once
    /// per upload.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_journal_that_stops_answering_is_waited_for_once() {
        use crate::fault::Fault;
        use crate::metrics::Op;
        let (_tmp, mem, fault, mut mount, _open) = with_open_uploads(5).await;
        mount.wait = Duration::from_millis(300);
        // The first abort takes a while; meanwhile the journal's disk stops answering.
        let slow = Fault::Delay(Duration::from_millis(200));
        fault.inject(Op::AbortMultipart, 0, Some(1), slow);
        let journal = mount.store().upload_journal().unwrap();
        let (release, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let _hung = journal.hold();
            let _ = release_rx.recv();
        });
        let t = std::time::Instant::now();
        let aborted = mount.abort_open_uploads().await.unwrap();
        let took = t.elapsed();
        release.send(()).unwrap();
        holder.join().unwrap();
        assert_eq!(aborted.len(), 5);
        assert!(aborted
            .iter()
            .all(|(_, a)| matches!(a, ShutdownAbort::Aborted)));
        assert!(took < Duration::from_millis(900), "took {took:?}");
        assert_eq!(mem.pending_uploads(), 0);
    }

    /// The aborts at shutdown go at once: against a store taking 400 ms per abort, 20 open
    /// uploads took 8 s one after another (a stalled one, 15 s each).
    #[tokio::test]
    async fn shutdown_aborts_open_uploads_at_once() {
        use crate::fault::Fault;
        use crate::metrics::Op;
        let (_tmp, mem, fault, mount, _open) = with_open_uploads(20).await;
        let slow = Fault::Delay(Duration::from_millis(400));
        fault.inject(Op::AbortMultipart, 0, None, slow);
        let t = std::time::Instant::now();
        let aborted = mount.abort_open_uploads().await.unwrap();
        let took = t.elapsed();
        assert_eq!(aborted.len(), 20);
        assert!(aborted
            .iter()
            .all(|(_, a)| matches!(a, ShutdownAbort::Aborted)));
        assert!(took < Duration::from_secs(3), "took {took:?}");
        assert_eq!(mem.pending_uploads(), 0);
    }

    /// A journal whose lock a write on a hung state disk holds does not hold up shutdown:
    /// aborting the open uploads and closing each give up after the wait, and the journal
    /// stays for the next mount. An earlier build waited for the lock for good.
    #[tokio::test]
    async fn shutdown_gives_up_on_a_journal_held_by_a_hung_disk() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = JournalDirs {
            dir: tmp.path().join("journal"),
            legacy: vec![],
        };
        let mem = Arc::new(MemoryStore::new());
        let bucket = Bucket::S3 {
            bucket: "b".into(),
            endpoint: Some("http://127.0.0.1:9".into()),
        };
        let (mut mount, _) = MountJournal::open(mem.clone(), &bucket, &dirs, "t/".into())
            .await
            .unwrap();
        mount.wait = Duration::from_millis(300);
        let _open = Uploads::new(mount.store().clone())
            .create("k", &UserMeta::new(), None)
            .await
            .unwrap();
        let journal = mount.store().upload_journal().unwrap();
        let (held_tx, held) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _hung = journal.hold();
            held_tx.send(()).unwrap();
            let _ = release_rx.recv();
        });
        held.recv().unwrap();
        assert!(mount.abort_open_uploads().await.is_none());
        assert!(mount.close().await.is_none());
        assert!(
            mount.path().exists(),
            "the journal went while it could not be read"
        );
        release.send(()).unwrap();
        holder.join().unwrap();
        // The disk answers again: the same calls do their work.
        let aborted = mount.abort_open_uploads().await.unwrap();
        assert!(matches!(&aborted[..], [(k, ShutdownAbort::Aborted)] if k == "k"));
        assert_eq!(mount.close().await, Some(Left::default()));
        assert_eq!(mem.pending_uploads(), 0);
    }
}
