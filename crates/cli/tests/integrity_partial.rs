//! Nothing half written ever lands under a file's key, except through the writer's own
//! fsync: a reader of streamed bytes, a rename of the open file, SIGTERM and kill -9 all
//! leave each key with its previous complete object or the new complete one. And a file
//! renamed while open shows its content under the new name as soon as it is closed.

mod common;

use common::*;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::time::Duration;

/// 5 MiB parts: a 20 MiB write streams 4 of them.
fn mount_5m(bucket: &str) -> Mount {
    MountSpec::s3(bucket, "")
        .arg("--part-size")
        .arg("5M")
        .mount()
}

/// `len` bytes at `offset` of what [`ForeignWriter`]'s `fill` writes.
fn filled(offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| (offset + i) as u8).collect()
}

/// A second process reads bytes that only streamed parts held (a file rewritten with
/// `O_TRUNC` over a complete object, and a new one): it gets them exactly, and nothing is
/// published; after kill -9 the bucket holds the previous complete object, never a torn one,
/// and no object for the new file.
#[test]
fn reading_streamed_bytes_publishes_nothing_and_kill9_keeps_the_old_object() {
    let s3 = s3();
    let b = s3.new_bucket("nopartial-read");
    let old = pattern::bytes(41, 12 * MIB);
    s3.put(&b, "f", old.clone());
    let mut m = mount_5m(&b);
    let mut w = ForeignWriter::start();
    w.open("f", &m.join("f"));
    w.open("g", &m.join("g"));
    assert_eq!(w.cmd("fill f 20"), "ok");
    assert_eq!(w.cmd("fill g 20"), "ok");
    for name in ["f", "g"] {
        let r = File::open(m.join(name)).unwrap();
        for at in [MIB as u64, 6 * MIB as u64 + 4095, 9 * MIB as u64] {
            let mut got = vec![0u8; 64 * 1024];
            r.read_exact_at(&mut got, at).unwrap();
            assert!(got == filled(at, got.len()), "{name} at {at}: wrong bytes");
        }
    }
    assert_eq!(s3.get(&b, "f").unwrap(), old, "f changed before close");
    assert!(s3.head(&b, "g").is_none(), "g visible before close");
    m.kill9();
    drop(w);
    assert!(
        s3.get(&b, "f").unwrap() == old,
        "f is not its previous complete version"
    );
    assert!(s3.head(&b, "g").is_none(), "a torn g is visible");
    drop(m);
    s3.remove_bucket(&b);
}

/// Renaming a file being written publishes nothing: the old name is gone at once, the new
/// name holds the file's previous complete object (or nothing for a new file) until close,
/// and after kill -9 neither key holds partial content.
#[test]
fn rename_of_an_open_file_publishes_nothing_under_either_key() {
    let s3 = s3();
    let b = s3.new_bucket("nopartial-rename");
    let old = pattern::bytes(42, 3 * MIB);
    s3.put(&b, "a", old.clone());
    s3.put(&b, "replaced", "an older file");
    let mut m = mount_5m(&b);
    let mut w = ForeignWriter::start();
    w.open("a", &m.join("a"));
    w.open("n", &m.join("n"));
    assert_eq!(w.cmd("fill a 12"), "ok");
    assert_eq!(w.cmd("fill n 12"), "ok");
    fs::rename(m.join("a"), m.join("b")).unwrap();
    fs::rename(m.join("n"), m.join("replaced")).unwrap();
    assert_eq!(w.cmd("fill a 1"), "ok", "write after rename");
    let check = |when: &str| {
        assert!(
            s3.head(&b, "a").is_none(),
            "{when}: the old name a is still there"
        );
        assert!(s3.head(&b, "n").is_none(), "{when}: n is visible");
        assert!(
            s3.get(&b, "b").is_some_and(|d| d == old),
            "{when}: b is not a's previous complete version"
        );
        assert!(
            s3.head(&b, "replaced").is_none(),
            "{when}: the replaced file (or a partial n) is under its name"
        );
    };
    check("before close");
    assert_eq!(list_dir(m.path()), set(["b", "replaced"]));
    m.kill9();
    drop(w);
    check("after kill -9");
    drop(m);
    s3.remove_bucket(&b);
}

/// SIGTERM with a writer mid-file: the daemon keeps serving the descriptor, the key keeps
/// the previous complete object (never the partial one) while the writer writes on, and the
/// file is complete once the writer closes; then the daemon exits.
#[test]
fn sigterm_publishes_a_file_being_written_only_at_its_close() {
    let s3 = s3();
    let b = s3.new_bucket("nopartial-term");
    let old = pattern::bytes(43, 2 * MIB);
    s3.put(&b, "t", old.clone());
    let mut m = mount_5m(&b);
    let mut w = ForeignWriter::start();
    w.open("t", &m.join("t"));
    assert_eq!(w.cmd("fill t 12"), "ok");
    m.signal(libc::SIGTERM);
    wait_for("the lazy detach", Duration::from_secs(30), || {
        m.log().contains("detaching it lazily")
    });
    for _ in 0..4 {
        assert_eq!(w.cmd("fill t 2"), "ok", "write after SIGTERM");
        assert!(
            s3.get(&b, "t").is_some_and(|d| d == old),
            "t is not its previous complete version while being written"
        );
        // (The mount point is detached: only the process tells.)
        assert!(
            m.wait_exit(Duration::from_millis(100)).is_none(),
            "the daemon exited with a file open"
        );
    }
    assert_eq!(w.cmd("close t"), "ok", "close after SIGTERM");
    let st = m.wait_exit(Duration::from_secs(60));
    assert!(st.is_some_and(|s| s.success()), "exit {st:?}: {}", m.log());
    assert!(s3.get(&b, "t").unwrap() == filled(0, 20 * MIB));
    assert!(s3.list_multipart_uploads(&b).is_empty());
    drop(w);
    drop(m);
    s3.remove_bucket(&b);
}

/// Close-to-open inside one mount: a file written, renamed while open and closed shows its
/// size and content under the new name at once.
#[test]
fn a_file_renamed_while_open_shows_its_content_at_close() {
    let s3 = s3();
    let b = s3.new_bucket("nopartial-cto");
    let m = mount_5m(&b);
    for (name, len) in [("small", 100 * 1024), ("big", 12 * MIB)] {
        let data = pattern::bytes(44, len);
        let mut f = File::create(m.join(name)).unwrap();
        f.write_all(&data).unwrap();
        let new = format!("{name}.done");
        fs::rename(m.join(name), m.join(&new)).unwrap();
        close_checked(f).unwrap();
        assert_eq!(
            fs::metadata(m.join(&new)).unwrap().len(),
            len as u64,
            "{new}: size right after close"
        );
        assert!(read_file(&m.join(&new)) == data, "{new}: content");
        assert!(s3.get(&b, &new).unwrap() == data, "{new}: object");
        assert!(s3.head(&b, name).is_none());
    }
    drop(m);
    s3.remove_bucket(&b);
}
