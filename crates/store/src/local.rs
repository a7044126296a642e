//! A local directory used as a bucket: the embedded default, so `bucketfs mount ./data ./mnt`
//! works with no account and no server.
//!
//! Key `a/b/c` is the file `<root>/a/b/c`; key `a/b/` (a directory marker) is the directory
//! `<root>/a/b`. Every directory therefore has a marker. User metadata lives in `user.bucketfs.*`
//! extended attributes. Keys that cannot be file paths (`a//b`, `.`/`..` segments) are refused
//! with [`StoreError::Invalid`]. In-progress uploads and temp files live under
//! `<root>/.bucketfs-store/`, which is hidden from listings.

use crate::listing::page_from_sorted;
use crate::*;
use async_trait::async_trait;
use bytes::Bytes;
use std::ffi::CString;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// fsync of a file or directory (its entries, its attributes).
fn sync_path(p: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    tests::SYNCED.lock().push(p.to_path_buf());
    File::open(p)?.sync_all()
}

/// Name of the hidden directory holding uploads in progress and temp files.
pub const INTERNAL_DIR: &str = ".bucketfs-store";
const XATTR_PREFIX: &str = "user.bucketfs.";

pub struct LocalStore {
    inner: Arc<Inner>,
}

struct Inner {
    root: PathBuf,
    seq: AtomicU64,
    /// Held from the ETag check of a conditional publish to its rename, and by every other
    /// publish, so that none lands between the two (within this process).
    publishing: parking_lot::Mutex<()>,
}

impl LocalStore {
    /// Opens `root` as a bucket. The directory must exist.
    pub fn open(root: impl AsRef<Path>) -> StoreResult<Self> {
        let root = root.as_ref();
        let md = fs::metadata(root)
            .map_err(|e| StoreError::NoSuchBucket(format!("{}: {}", root.display(), e)))?;
        if !md.is_dir() {
            return Err(StoreError::NoSuchBucket(format!(
                "{} is not a directory",
                root.display()
            )));
        }
        let root = root.canonicalize()?;
        fs::create_dir_all(root.join(INTERNAL_DIR).join("tmp"))?;
        fs::create_dir_all(root.join(INTERNAL_DIR).join("uploads"))?;
        Ok(Self {
            inner: Arc::new(Inner {
                root,
                seq: AtomicU64::new(0),
                publishing: parking_lot::Mutex::new(()),
            }),
        })
    }

    async fn run<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Inner) -> StoreResult<T> + Send + 'static,
    {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| StoreError::Other(format!("local store task failed: {e}")))?
    }
}

/// Checks that every segment of `key` is a usable file name.
fn validate_key(key: &str) -> StoreResult<()> {
    let body = key.strip_suffix('/').unwrap_or(key);
    if body.is_empty() {
        return Ok(());
    }
    for seg in body.split('/') {
        if seg.is_empty() || seg == "." || seg == ".." || seg.contains('\0') {
            return Err(StoreError::Invalid(format!(
                "key {key:?} cannot be stored in a local directory"
            )));
        }
    }
    if body.split('/').next() == Some(INTERNAL_DIR) {
        return Err(StoreError::Invalid(format!("key {key:?} is reserved")));
    }
    Ok(())
}

/// A version's ETag: what changes whenever its bytes or metadata do. The ctime is in it
/// because the mtime alone can be put back (`cp -p`, `rsync --inplace -t`, `touch -r` onto a
/// file rewritten in place), which would name new bytes with an old version's ETag, and a
/// data cache keeps bytes by ETag across mounts.
fn etag_of(md: &fs::Metadata) -> String {
    format!(
        "\"{:x}-{:x}-{:x}-{:x}-{:x}-{:x}\"",
        md.mtime(),
        md.mtime_nsec(),
        md.ctime(),
        md.ctime_nsec(),
        md.size(),
        md.ino()
    )
}

fn cpath(p: &Path) -> StoreResult<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| StoreError::Invalid("NUL in path".into()))
}

fn read_xattrs(path: &Path) -> StoreResult<UserMeta> {
    let c = cpath(path)?;
    let mut meta = UserMeta::new();
    let mut names = vec![0u8; 4096];
    // SAFETY: buffer pointer and length describe a valid writable allocation.
    let n = unsafe { libc::listxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n < 0 {
        return Ok(meta);
    }
    names.truncate(n as usize);
    for name in names.split(|b| *b == 0).filter(|s| !s.is_empty()) {
        let Ok(name) = std::str::from_utf8(name) else {
            continue;
        };
        let Some(short) = name.strip_prefix(XATTR_PREFIX) else {
            continue;
        };
        let cname = CString::new(name).expect("no NUL in xattr name");
        let mut val = vec![0u8; 4096];
        // SAFETY: as above.
        let len = unsafe {
            libc::getxattr(
                c.as_ptr(),
                cname.as_ptr(),
                val.as_mut_ptr().cast(),
                val.len(),
            )
        };
        if len >= 0 {
            val.truncate(len as usize);
            meta.insert(
                short.to_string(),
                String::from_utf8_lossy(&val).into_owned(),
            );
        }
    }
    Ok(meta)
}

fn write_xattrs(path: &Path, meta: &UserMeta) -> StoreResult<()> {
    let c = cpath(path)?;
    for (k, _) in read_xattrs(path)? {
        if !meta.contains_key(&k) {
            let cname = CString::new(format!("{XATTR_PREFIX}{k}")).expect("no NUL");
            // SAFETY: valid C strings.
            unsafe { libc::removexattr(c.as_ptr(), cname.as_ptr()) };
        }
    }
    for (k, v) in meta {
        let cname = CString::new(format!("{XATTR_PREFIX}{k}"))
            .map_err(|_| StoreError::Invalid("NUL in metadata key".into()))?;
        // SAFETY: valid C strings and a readable value buffer.
        let rc =
            unsafe { libc::setxattr(c.as_ptr(), cname.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            return Err(StoreError::Other(format!(
                "cannot store metadata on {} (does the file system support user xattrs?): {err}",
                path.display()
            )));
        }
    }
    Ok(())
}

impl Inner {
    fn path(&self, key: &str) -> StoreResult<PathBuf> {
        validate_key(key)?;
        let body = key.strip_suffix('/').unwrap_or(key);
        Ok(if body.is_empty() {
            self.root.clone()
        } else {
            self.root.join(body)
        })
    }

    fn tmp_path(&self) -> PathBuf {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        self.root
            .join(INTERNAL_DIR)
            .join("tmp")
            .join(format!("{}-{}", std::process::id(), n))
    }

    fn upload_dir(&self, upload_id: &str) -> StoreResult<PathBuf> {
        if upload_id.is_empty()
            || !upload_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(StoreError::NotFound(format!("upload {upload_id}")));
        }
        let p = self.root.join(INTERNAL_DIR).join("uploads").join(upload_id);
        if !p.is_dir() {
            return Err(StoreError::NotFound(format!("upload {upload_id}")));
        }
        Ok(p)
    }

    fn object_md(&self, key: &str) -> StoreResult<(PathBuf, fs::Metadata)> {
        let p = self.path(key)?;
        let md = fs::metadata(&p).map_err(|_| StoreError::NotFound(key.to_string()))?;
        let is_marker = key.ends_with('/') || key.is_empty();
        if md.is_dir() != is_marker {
            return Err(StoreError::NotFound(key.to_string()));
        }
        Ok((p, md))
    }

    fn make_parents(&self, key: &str) -> StoreResult<()> {
        let p = self.path(key)?;
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).map_err(|e| {
                StoreError::Invalid(format!("cannot create parents of {key:?}: {e}"))
            })?;
        }
        Ok(())
    }

    /// Moves a finished temp file into place as `key` with `meta`, if `key` still has ETag
    /// `if_match` (S3 `If-Match`).
    fn publish(
        &self,
        tmp: &Path,
        key: &str,
        meta: &UserMeta,
        if_match: Option<&str>,
    ) -> StoreResult<String> {
        let dst = self.path(key)?;
        if !key.ends_with('/') {
            // Durable before it has the name (outside the lock: the slow part).
            if let Err(e) = write_xattrs(tmp, meta).and_then(|()| Ok(sync_path(tmp)?)) {
                let _ = fs::remove_file(tmp);
                return Err(e);
            }
        }
        let publishing = self.publishing.lock();
        if let Err(e) = self.check_etag(key, if_match) {
            let _ = fs::remove_file(tmp);
            return Err(e);
        }
        // The directories made for it: their entries must be durable too.
        let first_new = self.first_missing_dir(&dst);
        if key.ends_with('/') {
            fs::create_dir_all(&dst)?;
            let _ = fs::remove_file(tmp);
            write_xattrs(&dst, meta)?;
            let etag = etag_of(&fs::metadata(&dst)?);
            // Under the lock: a put into a directory made here must not return before the
            // directory's own entry is durable.
            sync_path(&dst)?;
            self.sync_parents(&dst, first_new.as_deref())?;
            drop(publishing);
            return Ok(etag);
        }
        if dst.is_dir() {
            let _ = fs::remove_file(tmp);
            return Err(StoreError::Invalid(format!(
                "key {key:?} names a directory in the local store"
            )));
        }
        self.make_parents(key)?;
        fs::rename(tmp, &dst)?;
        let etag = etag_of(&fs::metadata(&dst)?);
        // The close or fsync this answers returns once the object would survive a crash of
        // the machine, as the store's answer to a PUT says for S3. Under the lock: a put into
        // a directory another put made must not return before that directory's entry is
        // durable.
        self.sync_parents(&dst, first_new.as_deref())?;
        drop(publishing);
        Ok(etag)
    }

    /// The topmost directory above `path` (below the root) that does not exist yet.
    fn first_missing_dir(&self, path: &Path) -> Option<PathBuf> {
        let mut missing = None;
        let mut p = path.parent();
        while let Some(d) = p.filter(|d| d.starts_with(&self.root) && *d != self.root) {
            if d.exists() {
                break;
            }
            missing = Some(d.to_path_buf());
            p = d.parent();
        }
        missing
    }

    /// fsync of the directory holding `path`'s entry, and, when directories were made for
    /// it (`first_new` the topmost), of each of theirs.
    fn sync_parents(&self, path: &Path, first_new: Option<&Path>) -> StoreResult<()> {
        let top = first_new
            .and_then(Path::parent)
            .unwrap_or(self.root.as_path());
        let mut p = path.parent();
        // Never above the root (the marker of the root itself).
        while let Some(d) = p.filter(|d| d.starts_with(&self.root)) {
            sync_path(d)?;
            if d == top || !d.starts_with(&self.root) || first_new.is_none() {
                break;
            }
            p = d.parent();
        }
        Ok(())
    }

    /// S3's `If-Match` on `key`: not found when it is gone, failed when its ETag differs.
    fn check_etag(&self, key: &str, if_match: Option<&str>) -> StoreResult<()> {
        let Some(tag) = if_match else {
            return Ok(());
        };
        if tag == crate::IF_ABSENT {
            return match self.object_md(key) {
                Ok(_) => Err(StoreError::PreconditionFailed(key.to_string())),
                Err(StoreError::NotFound(_)) => Ok(()),
                Err(e) => Err(e),
            };
        }
        let (_, md) = self.object_md(key)?;
        if etag_of(&md) != tag {
            return Err(StoreError::PreconditionFailed(key.to_string()));
        }
        Ok(())
    }

    /// Opens object `key` for a copy, if it has ETag `if_match`. The check is made on the
    /// open file, so the bytes copied are those of the version checked even if a publish
    /// renames another file over the key meanwhile.
    fn open_source(&self, key: &str, if_match: Option<&str>) -> StoreResult<(File, fs::Metadata)> {
        let (p, _) = self.object_md(key)?;
        let f = File::open(&p).map_err(|_| StoreError::NotFound(key.to_string()))?;
        let md = f.metadata()?;
        if if_match.is_some_and(|tag| tag != etag_of(&md)) {
            return Err(StoreError::PreconditionFailed(key.to_string()));
        }
        Ok((f, md))
    }

    fn write_tmp(&self, data: &[u8]) -> StoreResult<PathBuf> {
        let tmp = self.tmp_path();
        let mut f = File::create(&tmp)?;
        f.write_all(data)?;
        Ok(tmp)
    }

    /// Every key under the directory part of `prefix` that starts with `prefix`, sorted.
    /// Directories appear as marker keys (`name/`); with `recursive` their contents follow.
    fn collect(&self, prefix: &str, recursive: bool) -> StoreResult<Vec<ObjectMeta>> {
        let (dir_key, _) = match prefix.rfind('/') {
            Some(i) => prefix.split_at(i + 1),
            None => ("", prefix),
        };
        let dir = match self.path(dir_key) {
            Ok(p) => p,
            Err(_) => return Ok(Vec::new()),
        };
        let mut out = Vec::new();
        if !dir.is_dir() {
            return Ok(out);
        }
        if !dir_key.is_empty() && prefix == dir_key {
            let md = fs::metadata(&dir)?;
            out.push(meta_of(dir_key, &md));
        }
        self.walk(&dir, dir_key, prefix, recursive, &mut out)?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn walk(
        &self,
        dir: &Path,
        dir_key: &str,
        prefix: &str,
        recursive: bool,
        out: &mut Vec<ObjectMeta>,
    ) -> StoreResult<()> {
        let rd = match fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        for ent in rd {
            let ent = ent?;
            let Ok(name) = ent.file_name().into_string() else {
                continue;
            };
            if dir_key.is_empty() && name == INTERNAL_DIR {
                continue;
            }
            let Ok(md) = fs::symlink_metadata(ent.path()) else {
                continue;
            };
            let key = if md.is_dir() {
                format!("{dir_key}{name}/")
            } else {
                format!("{dir_key}{name}")
            };
            if !key.starts_with(prefix) && !prefix.starts_with(&key) {
                continue;
            }
            if md.is_dir() {
                if key.starts_with(prefix) {
                    out.push(meta_of(&key, &md));
                }
                if recursive || prefix.len() > key.len() {
                    self.walk(&ent.path(), &key, prefix, recursive, out)?;
                }
            } else if md.is_file() && key.starts_with(prefix) {
                out.push(meta_of(&key, &md));
            }
        }
        Ok(())
    }
}

fn read_range_of(mut f: File, range: Range<u64>) -> StoreResult<Bytes> {
    let len = f.metadata()?.len();
    let start = range.start.min(len);
    let end = range.end.min(len).max(start);
    let mut buf = vec![0u8; (end - start) as usize];
    f.seek(SeekFrom::Start(start))?;
    f.read_exact(&mut buf)?;
    Ok(Bytes::from(buf))
}

fn meta_of(key: &str, md: &fs::Metadata) -> ObjectMeta {
    ObjectMeta {
        key: key.to_string(),
        size: if md.is_dir() { 0 } else { md.len() },
        etag: Some(etag_of(md)),
        last_modified: md.modified().ok(),
        user: UserMeta::new(),
        user_complete: false,
    }
}

#[async_trait]
impl ObjectStore for LocalStore {
    fn describe(&self) -> String {
        self.inner.root.display().to_string()
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        let key = key.to_string();
        self.run(move |s| {
            let (p, md) = s.object_md(&key)?;
            let mut m = meta_of(&key, &md);
            m.user = read_xattrs(&p)?;
            m.user_complete = true;
            Ok(m)
        })
        .await
    }

    async fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> StoreResult<Bytes> {
        let key = key.to_string();
        let if_match = if_match.map(str::to_string);
        self.run(move |s| {
            let (p, _) = s.object_md(&key)?;
            // The ETag is checked on the open file, as `open_source` does: a publish that
            // renames another version over the key in between cannot hand out its bytes
            // under this one's ETag.
            let f = File::open(&p).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => StoreError::NotFound(key.clone()),
                _ => e.into(),
            })?;
            let md = f.metadata()?;
            if if_match.is_some_and(|tag| tag != etag_of(&md)) {
                return Err(StoreError::PreconditionFailed(key));
            }
            if md.is_dir() {
                return Ok(Bytes::new());
            }
            read_range_of(f, range)
        })
        .await
    }

    async fn put_if(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
        if_match: Option<&str>,
        // Objects here have no headers but the user metadata.
        _headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        let key = key.to_string();
        let meta = meta.clone();
        let if_match = if_match.map(str::to_string);
        self.run(move |s| {
            s.path(&key)?;
            let tmp = s.write_tmp(&body)?;
            s.publish(&tmp, &key, &meta, if_match.as_deref())
        })
        .await
    }

    async fn create_multipart(
        &self,
        key: &str,
        meta: &UserMeta,
        // Objects here have no headers but the user metadata.
        _headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        let key = key.to_string();
        let meta = meta.clone();
        self.run(move |s| {
            s.path(&key)?;
            let id = format!(
                "{}-{}-{}",
                std::process::id(),
                s.seq.fetch_add(1, Ordering::Relaxed),
                rand::random::<u32>()
            );
            let dir = s.root.join(INTERNAL_DIR).join("uploads").join(&id);
            fs::create_dir_all(&dir)?;
            let mut f = File::create(dir.join("key"))?;
            f.write_all(key.as_bytes())?;
            write_xattrs(&dir.join("key"), &meta)?;
            Ok(id)
        })
        .await
    }

    async fn upload_part(
        &self,
        _key: &str,
        upload_id: &str,
        part_number: u32,
        body: Bytes,
    ) -> StoreResult<String> {
        let upload_id = upload_id.to_string();
        self.run(move |s| {
            let dir = s.upload_dir(&upload_id)?;
            let p = dir.join(format!("part-{part_number:05}"));
            fs::write(&p, &body)?;
            Ok(etag_of(&fs::metadata(&p)?))
        })
        .await
    }

    async fn upload_part_copy(
        &self,
        key: &str,
        upload_id: &str,
        part_number: u32,
        src_key: &str,
        range: Range<u64>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        let src_key = src_key.to_string();
        let src_if_match = src_if_match.map(str::to_string);
        let data = self
            .run(move |s| {
                let (f, md) = s.open_source(&src_key, src_if_match.as_deref())?;
                if range.end > md.len() || range.start >= range.end {
                    return Err(StoreError::Invalid(format!("bad copy range {range:?}")));
                }
                read_range_of(f, range)
            })
            .await?;
        self.upload_part(key, upload_id, part_number, data).await
    }

    async fn complete_multipart(
        &self,
        key: &str,
        upload_id: &str,
        parts: &[CompletedPart],
        if_match: Option<&str>,
    ) -> StoreResult<String> {
        let key = key.to_string();
        let upload_id = upload_id.to_string();
        let parts = parts.to_vec();
        let if_match = if_match.map(str::to_string);
        let min_part = self.limits().min_part;
        self.run(move |s| {
            let dir = s.upload_dir(&upload_id)?;
            // Checked again when the result is renamed into place; this first check saves
            // assembling an object that cannot be published.
            s.check_etag(&key, if_match.as_deref())?;
            let meta = read_xattrs(&dir.join("key"))?;
            let tmp = s.tmp_path();
            let mut out = File::create(&tmp)?;
            for (i, part) in parts.iter().enumerate() {
                let p = dir.join(format!("part-{:05}", part.part_number));
                let md = fs::metadata(&p).map_err(|_| {
                    StoreError::Invalid(format!("missing part {}", part.part_number))
                })?;
                if etag_of(&md) != part.etag {
                    return Err(StoreError::Invalid(format!(
                        "part {} etag",
                        part.part_number
                    )));
                }
                if i + 1 < parts.len() && md.len() < min_part {
                    return Err(StoreError::Invalid(format!(
                        "part {} smaller than 5 MiB",
                        part.part_number
                    )));
                }
                std::io::copy(&mut File::open(&p)?, &mut out)?;
            }
            drop(out);
            // As S3: a failed precondition leaves the upload open.
            let etag = s.publish(&tmp, &key, &meta, if_match.as_deref())?;
            fs::remove_dir_all(&dir)?;
            Ok(etag)
        })
        .await
    }

    async fn abort_multipart(&self, _key: &str, upload_id: &str) -> StoreResult<()> {
        let upload_id = upload_id.to_string();
        self.run(move |s| match s.upload_dir(&upload_id) {
            Ok(dir) => Ok(fs::remove_dir_all(dir)?),
            Err(_) => Ok(()),
        })
        .await
    }

    async fn list_multipart_uploads(&self, prefix: &str) -> StoreResult<Vec<MultipartUpload>> {
        let prefix = prefix.to_string();
        self.run(move |s| {
            let mut out = Vec::new();
            for ent in fs::read_dir(s.root.join(INTERNAL_DIR).join("uploads"))? {
                let ent = ent?;
                let Ok(key) = fs::read_to_string(ent.path().join("key")) else {
                    continue;
                };
                if key.starts_with(&prefix) {
                    out.push(MultipartUpload {
                        key,
                        upload_id: ent.file_name().to_string_lossy().into_owned(),
                        initiated: ent.metadata().ok().and_then(|m| m.modified().ok()),
                    });
                }
            }
            Ok(out)
        })
        .await
    }

    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        let src_key = src_key.to_string();
        let dst_key = dst_key.to_string();
        let meta = meta.cloned();
        let src_if_match = src_if_match.map(str::to_string);
        self.run(move |s| {
            let (p, md) = s.object_md(&src_key)?;
            s.path(&dst_key)?;
            let tmp = s.tmp_path();
            let meta = if md.is_dir() {
                s.check_etag(&src_key, src_if_match.as_deref())?;
                File::create(&tmp)?;
                meta
            } else {
                // From the open source, whose ETag (and so version) was checked.
                let (mut f, _) = s.open_source(&src_key, src_if_match.as_deref())?;
                let mut out = File::create(&tmp)?;
                std::io::copy(&mut f, &mut out)?;
                meta
            };
            let meta = match meta {
                Some(m) => m,
                None => read_xattrs(&p)?,
            };
            let dst_if_match = src_if_match.as_deref().filter(|_| src_key == dst_key);
            s.publish(&tmp, &dst_key, &meta, dst_if_match)
        })
        .await
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        let key = key.to_string();
        self.run(move |s| {
            let p = s.path(&key)?;
            let Ok(md) = fs::symlink_metadata(&p) else {
                return Ok(());
            };
            if key.ends_with('/') {
                if md.is_dir() && fs::remove_dir(&p).is_err() {
                    // Not empty: like S3, deleting the marker leaves the children.
                    write_xattrs(&p, &UserMeta::new())?;
                }
            } else if !md.is_dir() {
                fs::remove_file(&p)?;
            }
            Ok(())
        })
        .await
    }

    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> StoreResult<ListPage> {
        let prefix = prefix.to_string();
        let delimiter = delimiter.map(str::to_string);
        let with_user = detail == ListDetail::UserMeta;
        self.run(move |s| {
            let recursive = delimiter.is_none();
            let all = s.collect(&prefix, recursive)?;
            let mut page = page_from_sorted(
                all,
                &prefix,
                delimiter.as_deref(),
                from.after_key(),
                max_keys,
            );
            // The metadata is a few xattr calls away (what a HEAD costs here too): give it
            // with the page's entries when asked, so listed files need no HEAD.
            if with_user {
                for o in &mut page.objects {
                    if let Ok(user) = s.path(&o.key).and_then(|p| read_xattrs(&p)) {
                        o.user = user;
                        o.user_complete = true;
                    }
                }
            }
            Ok(page)
        })
        .await
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every path [`sync_path`] synced, in order (all tests of this binary).
    pub(super) static SYNCED: parking_lot::Mutex<Vec<PathBuf>> =
        parking_lot::Mutex::new(Vec::new());

    fn synced_below(root: &Path) -> Vec<PathBuf> {
        SYNCED
            .lock()
            .iter()
            .filter(|p| p.starts_with(root))
            .cloned()
            .collect()
    }

    /// A put (the close or fsync of a file on a local mount) returned before anything was
    /// fsync'd: after a crash of the machine a new key could be empty or missing, and a
    /// replaced one empty (ext4 without auto_da_alloc, XFS). The object's bytes and
    /// attributes are synced before it takes its name, and the directory entries it added
    /// (its own, and those of directories made for it) after.
    #[tokio::test]
    async fn a_put_is_durable_when_it_returns() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        let root = s.inner.root.clone();
        s.put("a/b/f", Bytes::from_static(b"data"), &UserMeta::new())
            .await
            .unwrap();
        let synced = synced_below(&root);
        let tmp = root.join(INTERNAL_DIR).join("tmp");
        assert!(
            synced.first().is_some_and(|p| p.starts_with(&tmp)),
            "the bytes first: {synced:?}"
        );
        for d in [root.join("a/b"), root.join("a"), root.clone()] {
            assert!(
                synced.contains(&d),
                "{} not synced: {synced:?}",
                d.display()
            );
        }
        // Into an existing directory: its entry only.
        SYNCED.lock().retain(|p| !p.starts_with(&root));
        s.put("a/b/g", Bytes::from_static(b"more"), &UserMeta::new())
            .await
            .unwrap();
        let synced = synced_below(&root);
        assert_eq!(synced.len(), 2, "{synced:?}");
        assert_eq!(synced[1], root.join("a/b"));
        // A marker: the directory and its entry.
        SYNCED.lock().retain(|p| !p.starts_with(&root));
        s.put("c/", Bytes::new(), &UserMeta::new()).await.unwrap();
        let synced = synced_below(&root);
        assert!(
            synced.contains(&root.join("c")) && synced.contains(&root),
            "{synced:?}"
        );
    }

    /// Every condition of the trait, as S3 has them, on `s` (shared by the in-process stores).
    pub(crate) async fn check_conditions(s: &dyn ObjectStore) {
        let none = UserMeta::new();
        let body = |b: &'static [u8]| Bytes::from_static(b);
        let old = s.put("k", body(b"old"), &none).await.unwrap();
        let pf = |r: StoreResult<String>| matches!(r, Err(StoreError::PreconditionFailed(_)));
        // PUT If-Match.
        assert!(pf(s
            .put_if("k", body(b"x"), &none, Some("\"nope\""), None)
            .await));
        assert!(s
            .put_if("gone", body(b"x"), &none, Some(&old), None)
            .await
            .unwrap_err()
            .is_not_found());
        let cur = s
            .put_if("k", body(b"cur"), &none, Some(&old), None)
            .await
            .unwrap();
        // Copies from a pinned source, onto another key and onto itself.
        let copy = |dst: &'static str, tag: String| async move {
            s.copy("k", dst, Some(&UserMeta::new()), Some(&tag)).await
        };
        assert!(pf(copy("k2", old.clone()).await));
        assert!(pf(copy("k", old.clone()).await));
        let copied = copy("k2", cur.clone()).await.unwrap();
        assert_eq!(Some(copied), s.head("k2").await.unwrap().etag);
        let copied = copy("k", cur.clone()).await.unwrap();
        let cur = s.head("k").await.unwrap().etag.unwrap();
        assert_eq!(copied, cur, "a copy answers with the ETag of what it made");
        // Part copies and Complete If-Match; a refused Complete leaves the upload open.
        let id = s.create_multipart("k", &none, None).await.unwrap();
        assert!(pf(s
            .upload_part_copy("k", &id, 1, "k", 0..2, Some(&old))
            .await));
        let e1 = s
            .upload_part_copy("k", &id, 1, "k", 0..2, Some(&cur))
            .await
            .unwrap();
        let parts = [CompletedPart {
            part_number: 1,
            etag: e1,
        }];
        assert!(pf(s.complete_multipart("k", &id, &parts, Some(&old)).await));
        assert_eq!(s.list_multipart_uploads("").await.unwrap().len(), 1);
        s.complete_multipart("k", &id, &parts, Some(&cur))
            .await
            .unwrap();
        assert_eq!(&s.get_range("k", 0..9, None).await.unwrap()[..], b"cu");
    }

    /// A GET pinned to an ETag returns that version's bytes or is refused, never another
    /// version's, while other versions are renamed over the key (an earlier build checked the
    /// ETag on the path, then opened the path again: another version's bytes under it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pinned_get_never_returns_another_versions_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(LocalStore::open(dir.path()).unwrap());
        let none = UserMeta::new();
        let versions = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
        let first = s
            .put("k", Bytes::from(vec![0u8; 4096]), &none)
            .await
            .unwrap();
        versions.lock().unwrap().insert(first, 0u8);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (s, versions, stop) = (s.clone(), versions.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i += 1;
                    let byte = (i % 250) as u8 + 1;
                    let body = Bytes::from(vec![byte; 4096]);
                    let etag = s.put("k", body, &UserMeta::new()).await.unwrap();
                    versions.lock().unwrap().insert(etag, byte);
                }
            })
        };
        let (mut served, mut refused, mut unknown) = (0, 0, 0);
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while std::time::Instant::now() < until {
            let etag = s.head("k").await.unwrap().etag.unwrap();
            match s.get_range("k", 0..4096, Some(&etag)).await {
                Ok(b) => {
                    served += 1;
                    // The writer records each version's ETag once its put returns. Bounded:
                    // a suite run once spun here for good (an ETag no put returned, cause
                    // not found; the writer may also have died).
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
                    let byte = loop {
                        if let Some(b) = versions.lock().unwrap().get(&etag) {
                            break Some(*b);
                        }
                        if writer.is_finished() || std::time::Instant::now() > deadline {
                            break None;
                        }
                        tokio::task::yield_now().await;
                    };
                    match byte {
                        Some(byte) => assert!(
                            b.iter().all(|&x| x == byte),
                            "bytes of another version under {etag}"
                        ),
                        None => unknown += 1,
                    }
                }
                Err(StoreError::PreconditionFailed(_)) => refused += 1,
                Err(e) => panic!("{e}"),
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.await.unwrap();
        assert!(
            served > 100 && refused > 0 && unknown * 10 <= served,
            "{served} served, {refused} refused, {unknown} under an ETag no put returned"
        );
    }

    /// A file rewritten in place with bytes of the same size and its old mtime put back
    /// (`cp -p` onto it, `rsync --inplace -t`) is another version: another ETag.
    #[tokio::test]
    async fn a_rewrite_with_the_old_mtime_put_back_is_another_version() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        s.put("k", Bytes::from_static(b"old!"), &UserMeta::new())
            .await
            .unwrap();
        let before = s.head("k").await.unwrap().etag.unwrap();
        let p = dir.path().join("k");
        let mtime = fs::metadata(&p).unwrap().modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs::write(&p, b"new!").unwrap();
        File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert_eq!(fs::metadata(&p).unwrap().modified().unwrap(), mtime);
        let after = s.head("k").await.unwrap().etag.unwrap();
        assert_ne!(before, after, "new bytes under the old version's ETag");
    }

    #[tokio::test]
    async fn conditions_are_honoured() {
        let dir = tempfile::tempdir().unwrap();
        check_conditions(&LocalStore::open(dir.path()).unwrap()).await;
    }

    #[tokio::test]
    async fn put_head_list_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        let mut meta = UserMeta::new();
        meta.insert("mode".into(), "33188".into());
        s.put("a/b/c.txt", Bytes::from_static(b"hello"), &meta)
            .await
            .unwrap();
        s.put("a/d/", Bytes::new(), &UserMeta::new()).await.unwrap();
        let h = s.head("a/b/c.txt").await.unwrap();
        assert_eq!(h.size, 5);
        assert_eq!(h.user.get("mode").unwrap(), "33188");
        assert!(s.head("a/b").await.unwrap_err().is_not_found());
        assert!(s.head("a/b/").await.is_ok());
        let page = s
            .list("a/", Some("/"), ListFrom::Start, 1000, ListDetail::Plain)
            .await
            .unwrap();
        assert!(page.objects.iter().all(|o| !o.user_complete));
        assert_eq!(page.objects[0].key, "a/");
        assert_eq!(page.common_prefixes, ["a/b/", "a/d/"]);
        let all = s
            .list("", None, ListFrom::Start, 1000, ListDetail::UserMeta)
            .await
            .unwrap();
        let keys: Vec<_> = all.objects.iter().map(|o| o.key.as_str()).collect();
        assert_eq!(keys, ["a/", "a/b/", "a/b/c.txt", "a/d/"]);
        // Listings carry the user metadata, so listed files need no HEAD.
        assert!(all.objects.iter().all(|o| o.user_complete));
        assert_eq!(all.objects[2].user, h.user);
        let got = s
            .get_range("a/b/c.txt", 1..100, h.etag.as_deref())
            .await
            .unwrap();
        assert_eq!(&got[..], b"ello");
        assert!(matches!(
            s.get_range("a/b/c.txt", 0..1, Some("\"nope\"")).await,
            Err(StoreError::PreconditionFailed(_))
        ));
        assert!(matches!(s.head("a//b").await, Err(StoreError::Invalid(_))));
    }

    #[tokio::test]
    async fn multipart_assembles_parts() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        let id = s
            .create_multipart("big", &UserMeta::new(), None)
            .await
            .unwrap();
        let p1 = vec![1u8; StoreLimits::S3.min_part as usize];
        let e1 = s.upload_part("big", &id, 1, Bytes::from(p1)).await.unwrap();
        let e2 = s
            .upload_part("big", &id, 2, Bytes::from_static(b"tail"))
            .await
            .unwrap();
        assert_eq!(s.list_multipart_uploads("").await.unwrap().len(), 1);
        s.complete_multipart(
            "big",
            &id,
            &[
                CompletedPart {
                    part_number: 1,
                    etag: e1,
                },
                CompletedPart {
                    part_number: 2,
                    etag: e2,
                },
            ],
            None,
        )
        .await
        .unwrap();
        assert_eq!(
            s.head("big").await.unwrap().size,
            StoreLimits::S3.min_part + 4
        );
        assert!(s.list_multipart_uploads("").await.unwrap().is_empty());
    }
}
