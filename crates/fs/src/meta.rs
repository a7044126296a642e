//! File attributes and their encoding in object user metadata.
//!
//! Compatible with s3fs-fuse, ossfs 1.x and rclone: `x-amz-meta-mode` is the decimal `st_mode`
//! including the type bits, `-uid`/`-gid` decimal ids, `-mtime`/`-atime` seconds since the epoch
//! (a fraction is allowed and kept). Objects without metadata get the mount's defaults.

use bucketfs_store::{ObjectMeta, UserMeta};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// An inode number as the kernel sees it.
pub type Ino = u64;

/// The mount root.
pub const ROOT_INO: Ino = 1;

pub const META_MODE: &str = "mode";
pub const META_UID: &str = "uid";
pub const META_GID: &str = "gid";
pub const META_MTIME: &str = "mtime";
pub const META_ATIME: &str = "atime";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
}

impl FileKind {
    /// The `S_IFMT` bits of this kind.
    pub fn mode_bits(self) -> u32 {
        match self {
            FileKind::File => libc::S_IFREG,
            FileKind::Dir => libc::S_IFDIR,
            FileKind::Symlink => libc::S_IFLNK,
        }
    }
}

/// What `stat` shows for one inode.
#[derive(Debug, Clone, PartialEq)]
pub struct Attr {
    pub ino: Ino,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits only (no type bits).
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub mtime: SystemTime,
    pub atime: SystemTime,
    pub ctime: SystemTime,
}

impl Attr {
    pub fn nlink(&self) -> u32 {
        if self.kind == FileKind::Dir {
            2
        } else {
            1
        }
    }

    /// 512-byte blocks, as `du` expects.
    pub fn blocks(&self) -> u64 {
        self.size.div_ceil(512)
    }
}

/// The POSIX metadata an object carries (each part optional: foreign objects have none).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PosixMeta {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mtime: Option<SystemTime>,
    pub atime: Option<SystemTime>,
}

/// Unix seconds with an optional fraction. `SECONDS.DIGITS` (what this mount and s3fs write)
/// is read exactly: an f64 keeps only about 16 digits, not a nanosecond's 19.
fn parse_time(s: &str) -> Option<SystemTime> {
    let s = s.trim();
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if !secs.is_empty() && secs.len() <= 19 && digits(secs) && digits(frac) {
        let nanos = frac
            .bytes()
            .chain(std::iter::repeat(b'0'))
            .take(9)
            .fold(0u32, |n, b| n * 10 + u32::from(b - b'0'));
        let d = Duration::new(secs.parse().ok()?, nanos);
        return UNIX_EPOCH.checked_add(d);
    }
    let f: f64 = s.parse().ok()?;
    if f < 0.0 {
        return None;
    }
    UNIX_EPOCH.checked_add(Duration::try_from_secs_f64(f).ok()?)
}

/// An object's Last-Modified as a time of its file: in whole seconds, as a `HEAD` gives it (a
/// listing gives milliseconds), so that the mtime of an object another tool wrote does not
/// move by itself when the next answer about it comes from the other request.
pub fn whole_seconds(t: SystemTime) -> SystemTime {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    UNIX_EPOCH + std::time::Duration::from_secs(d.as_secs())
}

fn format_time(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    if d.subsec_nanos() == 0 {
        d.as_secs().to_string()
    } else {
        format!("{}.{:09}", d.as_secs(), d.subsec_nanos())
    }
}

impl PosixMeta {
    pub fn from_user(user: &UserMeta) -> Self {
        let num = |k: &str| user.get(k).and_then(|v| v.trim().parse::<u32>().ok());
        PosixMeta {
            mode: num(META_MODE),
            uid: num(META_UID),
            gid: num(META_GID),
            mtime: user.get(META_MTIME).and_then(|v| parse_time(v)),
            atime: user.get(META_ATIME).and_then(|v| parse_time(v)),
        }
    }

    /// Writes the known fields into `user`, keeping any other metadata it holds.
    pub fn write_into(&self, user: &mut UserMeta) {
        if let Some(m) = self.mode {
            user.insert(META_MODE.into(), m.to_string());
        }
        if let Some(u) = self.uid {
            user.insert(META_UID.into(), u.to_string());
        }
        if let Some(g) = self.gid {
            user.insert(META_GID.into(), g.to_string());
        }
        if let Some(t) = self.mtime {
            user.insert(META_MTIME.into(), format_time(t));
        }
        if let Some(t) = self.atime {
            user.insert(META_ATIME.into(), format_time(t));
        }
    }

    pub fn to_user(&self) -> UserMeta {
        let mut u = UserMeta::new();
        self.write_into(&mut u);
        u
    }

    /// The kind the mode bits claim, if any.
    pub fn kind(&self) -> Option<FileKind> {
        match self.mode? & libc::S_IFMT {
            libc::S_IFDIR => Some(FileKind::Dir),
            libc::S_IFLNK => Some(FileKind::Symlink),
            libc::S_IFREG => Some(FileKind::File),
            _ => None,
        }
    }
}

/// Defaults and overrides that turn stored metadata into attributes.
#[derive(Debug, Clone)]
pub struct AttrPolicy {
    pub uid: u32,
    pub gid: u32,
    pub force_uid: Option<u32>,
    pub force_gid: Option<u32>,
    pub file_mode: u16,
    pub dir_mode: u16,
    /// Permission bits cleared from every file and directory, whatever mode it stores.
    pub umask: u16,
    /// Permission bits cleared from the root directory's, after `umask`.
    pub mp_umask: u16,
}

impl AttrPolicy {
    /// Attributes of an object (or marker) with this stored state.
    pub fn attr(
        &self,
        ino: u64,
        kind: FileKind,
        size: u64,
        meta: &PosixMeta,
        last_modified: Option<SystemTime>,
    ) -> Attr {
        let perm = self.stored_perm(kind, meta);
        let perm = match kind {
            FileKind::Symlink => perm,
            _ if ino == crate::ROOT_INO => perm & !self.umask & !self.mp_umask,
            _ => perm & !self.umask,
        };
        let mtime = meta
            .mtime
            .or(last_modified.map(whole_seconds))
            .unwrap_or(UNIX_EPOCH);
        Attr {
            ino,
            kind,
            size,
            perm,
            uid: self.force_uid.or(meta.uid).unwrap_or(self.uid),
            gid: self.force_gid.or(meta.gid).unwrap_or(self.gid),
            mtime,
            atime: meta.atime.unwrap_or(mtime),
            ctime: last_modified.unwrap_or(mtime),
        }
    }

    /// The permission bits an entry has before `umask`: its stored mode's, else the
    /// default for its kind. What a change of its metadata stores again.
    pub fn stored_perm(&self, kind: FileKind, meta: &PosixMeta) -> u16 {
        let default_perm = match kind {
            FileKind::Dir => self.dir_mode,
            FileKind::File => self.file_mode,
            FileKind::Symlink => 0o777,
        };
        meta.mode
            .map(|m| (m & 0o7777) as u16)
            .unwrap_or(default_perm)
    }

    pub fn attr_of_object(&self, ino: u64, kind: FileKind, obj: &ObjectMeta) -> Attr {
        let meta = PosixMeta::from_user(&obj.user);
        let size = if kind == FileKind::Dir { 0 } else { obj.size };
        self.attr(ino, kind, size, &meta, obj.last_modified)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3fs_metadata_round_trips() {
        let mut user = UserMeta::new();
        user.insert("mode".into(), "33188".into()); // s3fs writes S_IFREG|0644 in decimal
        user.insert("uid".into(), "1000".into());
        user.insert("gid".into(), "100".into());
        user.insert("mtime".into(), "1700000000".into());
        user.insert("other".into(), "kept".into());
        let m = PosixMeta::from_user(&user);
        assert_eq!(m.mode, Some(libc::S_IFREG | 0o644));
        assert_eq!(m.kind(), Some(FileKind::File));
        assert_eq!(
            m.mtime,
            Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        let mut out = UserMeta::new();
        out.insert("other".into(), "kept".into());
        m.write_into(&mut out);
        assert_eq!(out, user);
    }

    #[test]
    fn fractional_mtime_and_garbage() {
        let mut user = UserMeta::new();
        user.insert("mtime".into(), "1700000000.5".into());
        user.insert("mode".into(), "rw-r--r--".into());
        let m = PosixMeta::from_user(&user);
        assert_eq!(
            m.mtime,
            Some(UNIX_EPOCH + Duration::from_millis(1_700_000_000_500))
        );
        assert_eq!(m.mode, None);
        assert_eq!(format_time(m.mtime.unwrap()), "1700000000.500000000");
    }

    /// Nanosecond times come back exactly (through an f64 they were off by up to a few
    /// hundred ns: `tar -d` said "Mod time differs", `test -ot` said older).
    #[test]
    fn nanosecond_times_round_trip_exactly() {
        for s in [
            "1577836800.123456789",
            "1577836800.000000001",
            "4102444800.999999999",
        ] {
            let t = parse_time(s).unwrap();
            assert_eq!(format_time(t), s);
        }
        let t = parse_time(" 1700000000.12 ").unwrap();
        assert_eq!(format_time(t), "1700000000.120000000");
        // More digits than a nanosecond: cut, not rounded up into the next second.
        let t = parse_time("1700000000.9999999999").unwrap();
        assert_eq!(format_time(t), "1700000000.999999999");
        // Other number forms still read; nonsense and negatives not.
        assert_eq!(
            parse_time("1.7e9"),
            Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        // A foreign tool's huge value is no time (the parse panicked: EIO for the request).
        for bad in ["-1", "x", "1.2.3", "", "NaN", "inf", "1e300"] {
            assert_eq!(parse_time(bad), None, "{bad}");
        }
    }

    #[test]
    fn defaults_and_forced_owner() {
        let p = AttrPolicy {
            uid: 1,
            gid: 2,
            force_uid: Some(7),
            force_gid: None,
            file_mode: 0o640,
            dir_mode: 0o750,
            umask: 0,
            mp_umask: 0o077,
        };
        let a = p.attr(5, FileKind::File, 10, &PosixMeta::default(), None);
        assert_eq!((a.perm, a.uid, a.gid), (0o640, 7, 2));
        let d = p.attr(6, FileKind::Dir, 0, &PosixMeta::default(), None);
        assert_eq!(d.perm, 0o750);
        // The mount point alone gets `mp_umask`.
        let root = p.attr(
            crate::ROOT_INO,
            FileKind::Dir,
            0,
            &PosixMeta::default(),
            None,
        );
        assert_eq!(root.perm, 0o700);
    }
}
