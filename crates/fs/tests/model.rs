//! Model-based tests of the fs core: random sequences of file operations are applied to
//! `Fs` on the memory store and to a plain in-memory model of a POSIX tree, and after every
//! step the results (value or errno) and the whole tree (names, kinds, contents) must agree.
//! At the end of each sequence a fresh `Fs` on the same store (a remount with cold caches)
//! must see the same tree, so nothing lives only in a cache. A second model runs with
//! close-to-open caching (TTL 0), another S3 client putting and deleting objects between the
//! steps, and files that cross part boundaries (appends of a part and more).
//!
//! Also here: keys that cannot map to a file tree (`a//b`, `.`/`..` segments, a file and a
//! directory of the same name, names over 255 bytes) on the memory store, which accepts them
//! as AWS S3 does (MinIO refuses most), and the errno of each permanent store error.
//!
//! `PROPTEST_CASES` sets the number of sequences (default 48).

use bucketfs_fs::{Caller, FileKind, Fs, FsConfig, FsError, SetAttr, ROOT_INO};
use bucketfs_store::fault::{Fault, FaultStore};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::metrics::Op as StoreOp;
use bucketfs_store::{ObjectStore, StoreError, UserMeta};
use bytes::Bytes;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::sync::Arc;

const ME: Caller = Caller { uid: 0, gid: 0 };

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    File(Vec<u8>),
    Dir,
}

/// Paths (`a`, `d/b`) to nodes; the root is implicit.
#[derive(Debug, Clone, Default)]
struct Model(BTreeMap<String, Node>);

fn parent_of(p: &str) -> &str {
    p.rfind('/').map_or("", |i| &p[..i])
}

impl Model {
    fn children(&self, dir: &str) -> Vec<String> {
        self.0
            .keys()
            .filter(|k| parent_of(k) == dir)
            .map(|k| k.rsplit('/').next().unwrap().to_string())
            .collect()
    }
    /// Errno for a path whose parent must be an existing directory: resolution walks from
    /// the root, so a file on the way is ENOTDIR and a missing component ENOENT.
    fn check_parent(&self, p: &str) -> Result<(), i32> {
        let parts: Vec<&str> = p.split('/').collect();
        for i in 1..parts.len() {
            match self.0.get(&parts[..i].join("/")) {
                Some(Node::Dir) => {}
                Some(Node::File(_)) => return Err(libc::ENOTDIR),
                None => return Err(libc::ENOENT),
            }
        }
        Ok(())
    }
    fn file(&self, p: &str) -> Result<&Vec<u8>, i32> {
        self.check_parent(p)?;
        match self.0.get(p) {
            Some(Node::File(d)) => Ok(d),
            Some(Node::Dir) => Err(libc::EISDIR),
            None => Err(libc::ENOENT),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Create(String, Vec<u8>),
    Append(String, Vec<u8>),
    WriteAt(String, u16, Vec<u8>),
    Truncate(String, u16),
    Read(String),
    Mkdir(String),
    Rmdir(String),
    Unlink(String),
    Rename(String, String),
    /// Appends `PART + n` bytes, so the file crosses part boundaries (multipart, part copies).
    AppendBig(String, u16, u8),
    /// Another S3 client puts (creates or replaces) the object of a file whose directory exists.
    OtherPut(String, Vec<u8>),
    /// Another S3 client deletes the object of a file.
    OtherDelete(String),
}

/// The smallest part size the fs accepts.
const PART: usize = 5 << 20;

fn big(n: u16, seed: u8) -> Vec<u8> {
    (0..PART + n as usize)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

fn path() -> impl Strategy<Value = String> {
    // A tiny namespace so that operations collide: 3 names at the root, 2 directories deep.
    let name = prop::sample::select(vec!["a", "b", "d", "e"]);
    prop::collection::vec(name, 1..=3).prop_map(|v| v.join("/"))
}

fn data() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..48)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (path(), data()).prop_map(|(p, d)| Op::Create(p, d)),
        2 => (path(), data()).prop_map(|(p, d)| Op::Append(p, d)),
        2 => (path(), 0u16..80, data()).prop_map(|(p, o, d)| Op::WriteAt(p, o, d)),
        1 => (path(), 0u16..80).prop_map(|(p, n)| Op::Truncate(p, n)),
        2 => path().prop_map(Op::Read),
        2 => path().prop_map(Op::Mkdir),
        1 => path().prop_map(Op::Rmdir),
        1 => path().prop_map(Op::Unlink),
        2 => (path(), path()).prop_map(|(a, b)| Op::Rename(a, b)),
    ]
}

/// [`op`] plus another client's puts and deletes between the steps, and files that cross
/// part boundaries.
fn op_with_other_client() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => op(),
        1 => (path(), any::<u16>(), any::<u8>()).prop_map(|(p, n, s)| Op::AppendBig(p, n, s)),
        2 => (path(), data()).prop_map(|(p, d)| Op::OtherPut(p, d)),
        1 => path().prop_map(Op::OtherDelete),
    ]
}

/// The model's answer: `Ok(bytes read)` or an errno; the model is updated.
fn apply_model(m: &mut Model, op: &Op) -> Result<Vec<u8>, i32> {
    match op {
        Op::Create(p, d) => {
            m.check_parent(p)?;
            if m.0.contains_key(p) {
                return Err(libc::EEXIST);
            }
            m.0.insert(p.clone(), Node::File(d.clone()));
            Ok(vec![])
        }
        Op::Append(p, d) => {
            m.file(p)?;
            if let Some(Node::File(f)) = m.0.get_mut(p) {
                f.extend_from_slice(d);
            }
            Ok(vec![])
        }
        Op::WriteAt(p, off, d) => {
            m.file(p)?;
            // A write of no bytes changes nothing, not even the size (POSIX pwrite).
            if let Some(Node::File(f)) = m.0.get_mut(p).filter(|_| !d.is_empty()) {
                let off = *off as usize;
                if f.len() < off + d.len() {
                    f.resize(off + d.len(), 0);
                }
                f[off..off + d.len()].copy_from_slice(d);
            }
            Ok(vec![])
        }
        Op::Truncate(p, n) => {
            m.file(p)?;
            if let Some(Node::File(f)) = m.0.get_mut(p) {
                f.resize(*n as usize, 0);
            }
            Ok(vec![])
        }
        Op::Read(p) => m.file(p).cloned(),
        Op::AppendBig(p, n, seed) => {
            m.file(p)?;
            if let Some(Node::File(f)) = m.0.get_mut(p) {
                f.extend_from_slice(&big(*n, *seed));
            }
            Ok(vec![])
        }
        Op::OtherPut(p, d) => {
            m.0.insert(p.clone(), Node::File(d.clone()));
            Ok(vec![])
        }
        Op::OtherDelete(p) => {
            if let Some(Node::File(_)) = m.0.get(p) {
                m.0.remove(p);
            }
            Ok(vec![])
        }
        Op::Mkdir(p) => {
            m.check_parent(p)?;
            if m.0.contains_key(p) {
                return Err(libc::EEXIST);
            }
            m.0.insert(p.clone(), Node::Dir);
            Ok(vec![])
        }
        Op::Rmdir(p) => {
            m.check_parent(p)?;
            match m.0.get(p) {
                None => Err(libc::ENOENT),
                Some(Node::File(_)) => Err(libc::ENOTDIR),
                Some(Node::Dir) if !m.children(p).is_empty() => Err(libc::ENOTEMPTY),
                Some(Node::Dir) => {
                    m.0.remove(p);
                    Ok(vec![])
                }
            }
        }
        Op::Unlink(p) => {
            m.check_parent(p)?;
            match m.0.get(p) {
                None => Err(libc::ENOENT),
                Some(Node::Dir) => Err(libc::EISDIR),
                Some(Node::File(_)) => {
                    m.0.remove(p);
                    Ok(vec![])
                }
            }
        }
        Op::Rename(a, b) => {
            // Like renameat2: both parents are resolved first, then the source.
            m.check_parent(a)?;
            m.check_parent(b)?;
            let src = m.0.get(a).cloned().ok_or(libc::ENOENT)?;
            if a == b {
                return Ok(vec![]);
            }
            if src == Node::Dir && b.starts_with(&format!("{a}/")) {
                return Err(libc::EINVAL);
            }
            match (&src, m.0.get(b)) {
                (Node::Dir, Some(Node::File(_))) => return Err(libc::ENOTDIR),
                (Node::File(_), Some(Node::Dir)) => return Err(libc::EISDIR),
                (Node::Dir, Some(Node::Dir)) if !m.children(b).is_empty() => {
                    return Err(libc::ENOTEMPTY)
                }
                _ => {}
            }
            let moved: Vec<(String, Node)> =
                m.0.iter()
                    .filter(|(k, _)| *k == a || k.starts_with(&format!("{a}/")))
                    .map(|(k, v)| (format!("{b}{}", &k[a.len()..]), v.clone()))
                    .collect();
            m.0.retain(|k, _| k != a && !k.starts_with(&format!("{a}/")));
            m.0.remove(b);
            m.0.extend(moved);
            Ok(vec![])
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The same operations on the fs core
// ---------------------------------------------------------------------------------------------

fn e(r: FsError) -> i32 {
    r.0
}

/// Lookup references taken while resolving a path, given back with [`Refs::release`] once
/// the operation is done (as the kernel holds them while it uses the inodes).
#[derive(Default)]
struct Refs(Vec<u64>);

impl Refs {
    fn release(self, fs: &Fs) {
        for ino in self.0 {
            fs.forget(ino, 1);
        }
    }
}

/// Resolves a path to (parent inode, name).
async fn resolve_parent<'a>(fs: &Fs, p: &'a str, refs: &mut Refs) -> Result<(u64, &'a str), i32> {
    let mut ino = ROOT_INO;
    let mut parts: Vec<&str> = p.split('/').collect();
    let name = parts.pop().unwrap();
    for part in parts {
        let a = fs.lookup(ino, OsStr::new(part)).await.map_err(e)?;
        refs.0.push(a.ino);
        if a.kind != FileKind::Dir {
            return Err(libc::ENOTDIR);
        }
        ino = a.ino;
    }
    Ok((ino, name))
}

async fn lookup_path(fs: &Fs, p: &str, refs: &mut Refs) -> Result<bucketfs_fs::Attr, i32> {
    let (parent, name) = resolve_parent(fs, p, refs).await?;
    let a = fs.lookup(parent, OsStr::new(name)).await.map_err(e)?;
    refs.0.push(a.ino);
    Ok(a)
}

async fn open_file(fs: &Fs, p: &str, flags: i32, refs: &mut Refs) -> Result<(u64, u64), i32> {
    let a = lookup_path(fs, p, refs).await?;
    if a.kind == FileKind::Dir {
        return Err(libc::EISDIR);
    }
    let h = fs.open(a.ino, flags).await.map_err(e)?;
    Ok((a.ino, h.fh))
}

async fn close(fs: &Fs, ino: u64, fh: u64) -> Result<(), i32> {
    let r = fs.flush(ino, fh).await.map_err(e);
    fs.release(ino, fh).await.map_err(e)?;
    r
}

async fn read_file(fs: &Fs, p: &str) -> Result<Vec<u8>, i32> {
    let mut refs = Refs::default();
    let r = read_file_inner(fs, p, &mut refs).await;
    refs.release(fs);
    r
}

async fn read_file_inner(fs: &Fs, p: &str, refs: &mut Refs) -> Result<Vec<u8>, i32> {
    let (ino, fh) = open_file(fs, p, libc::O_RDONLY, refs).await?;
    let mut out = Vec::new();
    loop {
        let b = fs
            .read(ino, fh, out.len() as u64, 128 * 1024)
            .await
            .map_err(e)?;
        if b.is_empty() {
            break;
        }
        out.extend_from_slice(&b);
    }
    fs.release(ino, fh).await.map_err(e)?;
    Ok(out)
}

/// What the kernel does before create(O_EXCL) and mkdir: a lookup of the name, EEXIST if
/// it is there (the fs is only asked to create names the lookup did not find).
async fn exclusive(fs: &Fs, parent: u64, name: &str, refs: &mut Refs) -> Result<(), i32> {
    match fs.lookup(parent, OsStr::new(name)).await {
        Ok(a) => {
            refs.0.push(a.ino);
            Err(libc::EEXIST)
        }
        Err(FsError(libc::ENOENT)) => Ok(()),
        Err(err) => Err(err.0),
    }
}

async fn apply_fs(fs: &Fs, op: &Op) -> Result<Vec<u8>, i32> {
    let mut refs = Refs::default();
    let r = apply_fs_inner(fs, op, &mut refs).await;
    refs.release(fs);
    r
}

async fn apply_fs_inner(fs: &Fs, op: &Op, refs: &mut Refs) -> Result<Vec<u8>, i32> {
    match op {
        Op::Create(p, d) => {
            let (parent, name) = resolve_parent(fs, p, refs).await?;
            exclusive(fs, parent, name, refs).await?;
            let (a, h) = fs
                .create(
                    parent,
                    OsStr::new(name),
                    0o644,
                    0o022,
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
                    ME,
                )
                .await
                .map_err(e)?;
            refs.0.push(a.ino);
            if !d.is_empty() {
                fs.write(a.ino, h.fh, 0, Bytes::copy_from_slice(d))
                    .await
                    .map_err(e)?;
            }
            close(fs, a.ino, h.fh).await?;
            Ok(vec![])
        }
        Op::Append(p, d) => {
            let (ino, fh) = open_file(fs, p, libc::O_WRONLY | libc::O_APPEND, refs).await?;
            let r = fs.write(ino, fh, 0, Bytes::copy_from_slice(d)).await;
            let c = close(fs, ino, fh).await;
            r.map_err(e)?;
            c.map(|_| vec![])
        }
        Op::WriteAt(p, off, d) => {
            let (ino, fh) = open_file(fs, p, libc::O_WRONLY, refs).await?;
            let r = fs
                .write(ino, fh, *off as u64, Bytes::copy_from_slice(d))
                .await;
            let c = close(fs, ino, fh).await;
            r.map_err(e)?;
            c.map(|_| vec![])
        }
        Op::Truncate(p, n) => {
            let a = lookup_path(fs, p, refs).await?;
            if a.kind == FileKind::Dir {
                return Err(libc::EISDIR);
            }
            fs.setattr(
                a.ino,
                None,
                SetAttr {
                    size: Some(*n as u64),
                    ..SetAttr::default()
                },
            )
            .await
            .map_err(e)?;
            Ok(vec![])
        }
        Op::Read(p) => read_file_inner(fs, p, refs).await,
        Op::AppendBig(p, n, seed) => {
            let (ino, fh) = open_file(fs, p, libc::O_WRONLY | libc::O_APPEND, refs).await?;
            let data = big(*n, *seed);
            let mut r = Ok(0);
            for chunk in data.chunks(1 << 20) {
                r = fs.write(ino, fh, 0, Bytes::copy_from_slice(chunk)).await;
                if r.is_err() {
                    break;
                }
            }
            let c = close(fs, ino, fh).await;
            r.map_err(e)?;
            c.map(|_| vec![])
        }
        Op::OtherPut(..) | Op::OtherDelete(_) => {
            unreachable!("another client's steps go to the store, not the fs")
        }
        Op::Mkdir(p) => {
            let (parent, name) = resolve_parent(fs, p, refs).await?;
            exclusive(fs, parent, name, refs).await?;
            let a = fs
                .mkdir(parent, OsStr::new(name), 0o755, 0o022, ME)
                .await
                .map_err(e)?;
            refs.0.push(a.ino);
            Ok(vec![])
        }
        Op::Rmdir(p) => {
            let (parent, name) = resolve_parent(fs, p, refs).await?;
            fs.rmdir(parent, OsStr::new(name)).await.map_err(e)?;
            Ok(vec![])
        }
        Op::Unlink(p) => {
            let (parent, name) = resolve_parent(fs, p, refs).await?;
            fs.unlink(parent, OsStr::new(name)).await.map_err(e)?;
            Ok(vec![])
        }
        Op::Rename(a, b) => {
            let (pa, na) = resolve_parent(fs, a, refs).await?;
            let (pb, nb) = resolve_parent(fs, b, refs).await?;
            // The kernel refuses to move a directory into itself before asking the fs.
            let src = lookup_path(fs, a, refs).await?;
            if src.kind == FileKind::Dir && b.starts_with(&format!("{a}/")) {
                return Err(libc::EINVAL);
            }
            fs.rename(pa, OsStr::new(na), pb, OsStr::new(nb), 0)
                .await
                .map_err(e)?;
            Ok(vec![])
        }
    }
}

/// The whole tree as the fs shows it: every path with its kind and content.
async fn snapshot(fs: &Fs) -> BTreeMap<String, Node> {
    let mut out = BTreeMap::new();
    let mut todo = vec![(ROOT_INO, String::new())];
    while let Some((ino, path)) = todo.pop() {
        let fh = fs.opendir(ino).await.expect("opendir");
        let entries = fs.readdir(ino, fh, 0).await.expect("readdir");
        fs.releasedir(ino, fh);
        for ent in entries {
            if ent.name == "." || ent.name == ".." {
                continue;
            }
            let p = if path.is_empty() {
                ent.name.clone()
            } else {
                format!("{path}/{}", ent.name)
            };
            let a = fs.lookup(ino, OsStr::new(&ent.name)).await.expect("lookup");
            assert_eq!(a.kind, ent.kind, "{p}: readdir and lookup disagree");
            match a.kind {
                FileKind::Dir => {
                    out.insert(p.clone(), Node::Dir);
                    todo.push((a.ino, p)); // forgotten once listed
                }
                _ => {
                    fs.forget(a.ino, 1);
                    let data = read_file(fs, &p).await.expect("read");
                    assert_eq!(data.len() as u64, a.size, "{p}: size and content disagree");
                    out.insert(p, Node::File(data));
                }
            }
        }
        if ino != ROOT_INO {
            fs.forget(ino, 1);
        }
    }
    out
}

fn new_fs(mem: Arc<MemoryStore>, cache: &tempfile::TempDir) -> Arc<Fs> {
    new_fs_with_ttl(mem, cache, std::time::Duration::from_secs(60))
}

/// With a TTL of 0 every open re-checks the store (close-to-open), so another client's change
/// is seen by the next step.
fn new_fs_with_ttl(
    mem: Arc<MemoryStore>,
    cache: &tempfile::TempDir,
    ttl: std::time::Duration,
) -> Arc<Fs> {
    Fs::new(
        mem,
        FsConfig {
            cache_dir: cache.path().to_path_buf(),
            stat_ttl: ttl,
            negative_ttl: ttl.min(FsConfig::default().negative_ttl),
            uid: 0,
            gid: 0,
            ..FsConfig::default()
        },
    )
}

fn run_sequence(ops: Vec<Op>) -> Result<(), TestCaseError> {
    run_sequence_with_ttl(ops, std::time::Duration::from_secs(60))
}

fn run_sequence_with_ttl(ops: Vec<Op>, ttl: std::time::Duration) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let mem = Arc::new(MemoryStore::new());
        let cache = tempfile::tempdir().unwrap();
        let fs = new_fs_with_ttl(mem.clone(), &cache, ttl);
        let mut model = Model::default();
        for (i, op) in ops.iter().enumerate() {
            // Another client's key where the tree has no place for a file (no parent
            // directory, or a directory of that name) is covered by the key-mapping tests.
            if let Op::OtherPut(p, _) = op {
                if model.check_parent(p).is_err() || model.0.get(p) == Some(&Node::Dir) {
                    continue;
                }
            }
            let want = apply_model(&mut model, op);
            let got = match op {
                Op::OtherPut(p, d) => {
                    mem.put(p, Bytes::copy_from_slice(d), &UserMeta::new())
                        .await
                        .unwrap();
                    Ok(vec![])
                }
                Op::OtherDelete(p) => {
                    mem.delete(p).await.unwrap();
                    Ok(vec![])
                }
                _ => apply_fs(&fs, op).await,
            };
            prop_assert_eq!(&got, &want, "step {} {:?}", i, op);
            let tree = snapshot(&fs).await;
            prop_assert_eq!(&tree, &model.0, "tree after step {} {:?}", i, op);
        }
        // A remount (cold caches) sees the same tree: it is all in the store.
        let fs2 = new_fs(mem.clone(), &cache);
        let tree = snapshot(&fs2).await;
        prop_assert_eq!(&tree, &model.0, "tree after a remount");
        prop_assert_eq!(mem.pending_uploads(), 0, "multipart uploads left");
        Ok(())
    })
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 400,
        ..ProptestConfig::default()
    })]

    #[test]
    fn fs_core_matches_a_posix_model(ops in prop::collection::vec(op(), 1..30)) {
        run_sequence(ops)?;
    }

    /// Another S3 client puts and deletes objects between the steps, and files cross part
    /// boundaries: with close-to-open (TTL 0) every step sees the other client's last change,
    /// and appends build on the version they opened (never a mix of two).
    #[test]
    fn fs_core_matches_a_posix_model_with_another_client(
        ops in prop::collection::vec(op_with_other_client(), 1..24)
    ) {
        run_sequence_with_ttl(ops, std::time::Duration::ZERO)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Keys that cannot map to a tree (memory store: accepts what AWS S3 accepts)
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn unmappable_keys_follow_the_documented_rule() {
    let mem = Arc::new(MemoryStore::new());
    let long = "q".repeat(300);
    let keys: Vec<String> = vec![
        "a//b".into(),
        "a/ok".into(),
        "x".into(),
        "x/child".into(),
        "y".into(),
        "y/".into(),
        "./dot".into(),
        "../dotdot".into(),
        "d/./h".into(),
        "d/../i".into(),
        "d/real".into(),
        "/leading".into(),
        "trailing//".into(),
        format!("long/{long}"),
        "long/short".into(),
        "nul\u{0}byte".into(),
        "e/".into(),
        "e//".into(),
    ];
    for k in &keys {
        mem.put(k, Bytes::from(k.clone()), &UserMeta::new())
            .await
            .unwrap();
    }
    let cache = tempfile::tempdir().unwrap();
    let fs = new_fs(mem.clone(), &cache);
    let tree = snapshot(&fs).await;
    let want: BTreeMap<String, Node> = [
        ("a", Node::Dir),
        ("a/ok", Node::File(b"a/ok".to_vec())),
        ("x", Node::Dir),
        ("x/child", Node::File(b"x/child".to_vec())),
        ("y", Node::Dir),
        ("d", Node::Dir),
        ("d/real", Node::File(b"d/real".to_vec())),
        ("trailing", Node::Dir),
        ("long", Node::Dir),
        ("long/short", Node::File(b"long/short".to_vec())),
        ("e", Node::Dir),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(tree, want);
    // Changing what is visible never touches the keys that are not.
    let x = fs.lookup(ROOT_INO, OsStr::new("x")).await.unwrap();
    fs.unlink(x.ino, OsStr::new("child")).await.unwrap();
    let a = fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    fs.unlink(a.ino, OsStr::new("ok")).await.unwrap();
    for k in [
        "x",
        "a//b",
        "y",
        "./dot",
        "d/./h",
        "/leading",
        "nul\u{0}byte",
    ] {
        assert!(mem.head(k).await.is_ok(), "{k:?} was touched");
    }
}

// ---------------------------------------------------------------------------------------------
// Permanent store errors become the right errno
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn permanent_store_errors_map_to_their_errno() {
    let cases: Vec<(StoreError, i32)> = vec![
        (
            StoreError::AccessDenied("403 AccessDenied".into()),
            libc::EACCES,
        ),
        (StoreError::NotFound("404 NoSuchKey".into()), libc::ENOENT),
        (
            StoreError::PreconditionFailed("412 PreconditionFailed".into()),
            libc::ESTALE,
        ),
        (
            StoreError::NoSpace("507 XMinioStorageFull".into()),
            libc::ENOSPC,
        ),
        (StoreError::Transient("503 SlowDown".into()), libc::EIO),
    ];
    for (err, errno) in cases {
        let mem = Arc::new(MemoryStore::new());
        mem.put("f", Bytes::from_static(b"data"), &UserMeta::new())
            .await
            .unwrap();
        let fault = Arc::new(FaultStore::new(mem.clone() as Arc<dyn ObjectStore>));
        let cache = tempfile::tempdir().unwrap();
        let fs = Fs::new(
            fault.clone(),
            FsConfig {
                cache_dir: cache.path().to_path_buf(),
                ..FsConfig::default()
            },
        );
        // Writes: the upload at close.
        fault.inject(StoreOp::Put, 0, None, Fault::Error(err.clone()));
        let (a, h) = fs
            .create(ROOT_INO, OsStr::new("new"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
        fs.write(a.ino, h.fh, 0, Bytes::from_static(b"x"))
            .await
            .unwrap();
        let r = fs.flush(a.ino, h.fh).await;
        assert_eq!(r, Err(FsError(errno)), "close with PUT failing {err}");
        let _ = fs.release(a.ino, h.fh).await;
        fault.clear();
        assert!(mem.head("new").await.is_err(), "{err}: object appeared");
        // Reads: the GET.
        let f = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
        let h = fs.open(f.ino, libc::O_RDONLY).await.unwrap();
        fault.inject(StoreOp::Get, 0, None, Fault::Error(err.clone()));
        let r = fs.read(f.ino, h.fh, 0, 4).await;
        // A file gone from under an open descriptor is stale, not a missing path.
        let read_errno = if errno == libc::ENOENT {
            libc::ESTALE
        } else {
            errno
        };
        assert_eq!(
            r.map(|b| b.len()),
            Err(FsError(read_errno)),
            "read with GET failing {err}"
        );
        fault.clear();
        fs.release(f.ino, h.fh).await.unwrap();
        // Lookups: the HEAD (and LIST) of an unknown name.
        fault.inject(StoreOp::Head, 0, None, Fault::Error(err.clone()));
        fault.inject(StoreOp::List, 0, None, Fault::Error(err.clone()));
        let r = fs.lookup(ROOT_INO, OsStr::new("other")).await;
        assert_eq!(
            r.map(|a| a.ino),
            Err(FsError(errno)),
            "lookup with HEAD failing {err}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Fuzzing the key <-> path mapping
// ---------------------------------------------------------------------------------------------

fn valid_name(n: &str) -> bool {
    !n.is_empty() && n != "." && n != ".." && n.len() <= 255 && !n.contains('\0')
}

fn key_strategy() -> impl Strategy<Value = String> {
    let seg = prop_oneof![
        4 => "[a-c]{1,3}",
        1 => Just(String::new()),
        1 => Just(".".to_string()),
        1 => Just("..".to_string()),
        1 => "[ %+?#\n\u{e9}\u{65e5}\u{1f389}]{1,4}",
        1 => "q{250,260}",
    ];
    (prop::collection::vec(seg, 1..5), any::<bool>()).prop_map(|(segs, dir)| {
        let mut k = segs.join("/");
        if dir {
            k.push('/');
        }
        k
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases() * 2, ..ProptestConfig::default() })]

    /// Whatever keys a bucket holds, the tree shown is sound (every entry is a valid name and
    /// every file shows exactly the object of its path's key) and complete (every key made of
    /// valid names that no directory shadows shows as a file).
    #[test]
    fn any_bucket_maps_to_a_sound_tree(keys in prop::collection::btree_set(key_strategy(), 1..25)) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mem = Arc::new(MemoryStore::new());
            for k in &keys {
                mem.put(k, Bytes::from(format!("<{k}>")), &UserMeta::new()).await.unwrap();
            }
            let cache = tempfile::tempdir().unwrap();
            let fs = new_fs(mem.clone(), &cache);
            let tree = tokio::time::timeout(std::time::Duration::from_secs(30), snapshot(&fs))
                .await
                .expect("listing the tree hung");
            for (path, node) in &tree {
                for seg in path.split('/') {
                    prop_assert!(valid_name(seg), "invalid name {:?} in {:?}", seg, path);
                }
                if let Node::File(data) = node {
                    prop_assert_eq!(data, &format!("<{path}>").into_bytes(), "{:?}", path);
                    prop_assert!(keys.contains(path));
                }
            }
            for k in &keys {
                let shadowed = keys.iter().any(|o| o.len() > k.len() && o.starts_with(&format!("{k}/")));
                if !k.ends_with('/') && !shadowed && k.split('/').all(valid_name) {
                    prop_assert_eq!(
                        tree.get(k),
                        Some(&Node::File(format!("<{k}>").into_bytes())),
                        "key {:?} not shown", k
                    );
                }
            }
            Ok(())
        })?;
    }
}
