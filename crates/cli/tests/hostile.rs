//! Hostile names and keys through a real mount: names at and over the 255-byte limit, names
//! full of URL and shell metacharacters, newlines and multi-byte UTF-8, and bucket keys that
//! cannot map to a file tree (`a//b`, `x` and `x/` both present, `.`/`..` segments, long
//! keys). Every case must end in a documented result: a round trip, a clear errno, or an entry
//! that is skipped, never a crash or a hang (the daemon must still serve afterwards).

mod common;

use common::*;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

/// Names that must round-trip byte for byte (as file names and as object keys).
fn hostile_names() -> Vec<String> {
    let mut v: Vec<String> = [
        "with space",
        " leading space",
        "trailing space ",
        "100%",
        "%41%2F%00",
        "a+b",
        "what?",
        "#hash",
        "frag#ment?q=1&r=2",
        "new\nline",
        "tab\there",
        "cr\rhere",
        "quote\"'`",
        "back\\slash",
        "semi;colon:colon",
        "star*?[x]",
        "lt<gt>|pipe",
        "~tilde",
        "-dash-first",
        "trailing dot.",
        "...",
        ".hidden",
        "$HOME",
        "{braces}",
        "ü日本語🎉",
        "e\u{301}combining",
        "zero\u{200b}width",
        "rtl\u{202e}txt",
        "emoji👨‍👩‍👧",
        "\u{7f}del",
        "\u{1}ctrl",
        // Only whitespace: at the top of a whole-bucket mount, the key is the name, which
        // the SDK refuses as a key unless the mount works around it.
        " ",
        "\t",
        "\n",
        "\u{a0}",
        "\u{3000}",
        "\u{2028}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // 255 bytes exactly, ASCII and multi-byte.
    v.push("n".repeat(255));
    v.push(format!("{}a", "é".repeat(127)));
    v.push(format!("{}b", "日".repeat(84)) + "cc");
    v
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
fn prefix(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[test]
fn hostile_names_round_trip_as_files_and_keys() {
    let s3 = s3();
    let b = s3.new_bucket("hostile-names");
    let spec = MountSpec::s3(&b, "").watchdog(Duration::from_secs(300));
    let m = spec.mount();
    let names = hostile_names();
    for n in &names {
        assert!(n.len() <= 255, "{n:?} is {} bytes", n.len());
        write_file(&m.join(n), n.as_bytes());
        let d = m.join("dir ".to_string() + prefix(n, 200));
        fs::create_dir(&d).unwrap_or_else(|e| panic!("mkdir {d:?}: {e}"));
    }
    // Through the S3 API: the keys are exactly the names.
    let keys = s3.list_keys(&b, "");
    for n in &names {
        assert!(keys.contains(n), "key {n:?} missing; keys: {keys:?}");
        assert_eq!(s3.get(&b, n).unwrap(), n.as_bytes(), "content of {n:?}");
    }
    // Through the mount: listing and content, then again from a cold mount.
    let m = m.remount();
    let listed = list_dir(m.path());
    for n in &names {
        assert!(listed.contains(n), "{n:?} not listed");
        assert_eq!(read_file(&m.join(n)), n.as_bytes(), "read {n:?}");
        let md = fs::metadata(m.join(n)).unwrap();
        assert_eq!(md.len(), n.len() as u64);
    }
    assert_eq!(listed.len(), 2 * names.len(), "{listed:?}");
    // Renames keep every byte, away from each name and back to it.
    for n in &names {
        let to = format!("r{}", prefix(n, 250));
        fs::rename(m.join(n), m.join(&to)).unwrap_or_else(|e| panic!("rename {n:?}: {e}"));
        fs::rename(m.join(&to), m.join(n)).unwrap_or_else(|e| panic!("rename to {n:?}: {e}"));
        assert_eq!(
            s3.get(&b, n).unwrap(),
            n.as_bytes(),
            "renamed back to {n:?}"
        );
        fs::rename(m.join(n), m.join(&to)).unwrap();
        assert!(s3.head(&b, &to).is_some(), "renamed key {to:?}");
        assert!(s3.head(&b, n).is_none(), "old key {n:?} still there");
        fs::remove_file(m.join(&to)).unwrap();
    }
    assert!(s3.list_keys(&b, "r").is_empty());
    eprintln!("hostile names: {} names round-tripped", names.len());
}

#[test]
fn names_over_255_bytes_and_keys_over_1024_give_enametoolong() {
    let s3 = s3();
    let b = s3.new_bucket("hostile-long");
    let m = Mount::s3(&b);
    let long = "l".repeat(256);
    let long_mb = format!("{}x", "é".repeat(128)); // 257 bytes, 129 characters
    for n in [&long, &long_mb] {
        let p = m.join(n);
        assert_eq!(errno(fs::File::create(&p)), libc::ENAMETOOLONG, "create");
        assert_eq!(errno(fs::create_dir(&p)), libc::ENAMETOOLONG, "mkdir");
        assert_eq!(
            errno(std::os::unix::fs::symlink("t", &p)),
            libc::ENAMETOOLONG,
            "symlink"
        );
        assert_eq!(errno(fs::metadata(&p)), libc::ENAMETOOLONG, "stat");
        write_file(&m.join("src"), b"x");
        assert_eq!(
            errno(fs::rename(m.join("src"), &p)),
            libc::ENAMETOOLONG,
            "rename"
        );
    }
    // Paths whose key would pass S3's 1,024-byte limit. Directory names here are 246 bytes:
    // MinIO stores a directory marker `name/` as `name__XLDIR__` and so refuses markers whose
    // last segment is over 246 bytes (EINVAL through the mount).
    let seg = "s".repeat(246);
    let mut p = m.path().to_path_buf();
    for _ in 0..4 {
        p.push(&seg);
        fs::create_dir(&p).unwrap_or_else(|e| panic!("mkdir of a 246-byte name: {e}"));
    }
    // Four levels are 988 bytes of key prefix: a 35-byte name gives a 1,023-byte key...
    let name35 = "f".repeat(35);
    write_file(&p.join(&name35), b"deep");
    let key = format!("{seg}/{seg}/{seg}/{seg}/{name35}");
    assert_eq!(key.len(), 1023);
    assert_eq!(s3.get(&b, &key).unwrap(), b"deep");
    assert_eq!(read_file(&p.join(&name35)), b"deep");
    // ...a 36-byte one is refused: the key (plus a marker's `/`) would pass 1,024 bytes.
    let name36 = "g".repeat(36);
    assert_eq!(errno(fs::File::create(p.join(&name36))), libc::ENAMETOOLONG);
    assert_eq!(errno(fs::create_dir(p.join(&name36))), libc::ENAMETOOLONG);
    assert_eq!(
        errno(fs::rename(p.join(&name35), p.join(&name36))),
        libc::ENAMETOOLONG
    );
    // A 255-byte directory name is refused by MinIO itself (see above), cleanly.
    assert_eq!(
        errno(fs::create_dir(m.join("d".repeat(255)))),
        libc::EINVAL,
        "MinIO's __XLDIR__ limit"
    );
    // Names the kernel passes but object keys cannot hold: not UTF-8.
    let bad = OsStr::from_bytes(b"bad\xff\xfename");
    assert_eq!(errno(fs::File::create(m.join(bad))), libc::EINVAL);
    let mut m = m;
    assert!(m.daemon_alive(), "daemon died: {}", m.log());
}

/// Keys put directly into the bucket that a file tree cannot show as they are. The rule
/// (README, "Metadata and compatibility"): a directory wins over a file of the same name;
/// names that are empty (`a//b`), `.` or `..`, or over 255 bytes are skipped in listings;
/// everything else is shown and readable.
#[test]
fn keys_that_cannot_map_to_a_tree_follow_the_documented_rule() {
    let s3 = s3();
    let b = s3.new_bucket("hostile-keys");
    let seg = "k".repeat(255);
    let long_name = "q".repeat(300);
    let deep = format!("{seg}/{seg}/{seg}/{}", "z".repeat(255)); // 1,023 bytes
    let puts: Vec<(String, &str)> = vec![
        ("a/ok".into(), "fine"),
        ("x".into(), "file x"),
        ("x/".into(), ""),
        ("d/real".into(), "real"),
        ("long/short".into(), "short"),
        (deep.clone(), "deep"),
        ("sp ace/new\nline/%2F".into(), "nested specials"),
    ];
    for (k, v) in &puts {
        s3.put(&b, k, v.as_bytes().to_vec());
    }
    // MinIO cannot hold `x` and `x/child` together (it drops the second); `x` with the
    // marker `x/` it can.
    // Keys MinIO refuses to store (they exist on AWS S3; the fs-core test
    // `crates/fs/tests/model.rs` covers them on the memory store).
    let refused = [
        "a//b".to_string(),
        "./dot".into(),
        "../dotdot".into(),
        "d/./h".into(),
        "d/../i".into(),
        "trailing//".into(),
        format!("long/{long_name}"),
        format!("{}/{}", "o".repeat(600), "p".repeat(600)),
    ];
    for k in &refused {
        let r = s3.block_on(
            s3.client
                .put_object()
                .bucket(&b)
                .key(k)
                .body(aws_sdk_s3::primitives::ByteStream::from_static(b"x"))
                .send(),
        );
        assert!(
            r.is_err(),
            "MinIO now accepts {k:?}: move it to the mounted set"
        );
    }
    let m = MountSpec::s3(&b, "")
        .watchdog(Duration::from_secs(120))
        .mount();
    let root = list_dir(m.path());
    // `a`, `x` (directory wins), `y` (directory wins), `d`, `long`, `trailing`, the deep
    // chain and the specials; no "", ".", "..".
    for want in ["a", "x", "d", "long", "sp ace"] {
        assert!(root.contains(want), "{want:?} not in {root:?}");
    }
    assert!(root.contains(&seg));
    for never in ["", ".", ".."] {
        assert!(!root.contains(never), "{never:?} listed: {root:?}");
    }
    assert!(
        fs::metadata(m.join("x")).unwrap().is_dir(),
        "directory wins"
    );
    assert_eq!(
        list_dir(&m.join("x")),
        set([]),
        "the marker is not an entry"
    );
    assert_eq!(list_dir(&m.join("a")), set(["ok"]));
    assert_eq!(list_dir(&m.join("d")), set(["real"]));
    assert_eq!(list_dir(&m.join("long")), set(["short"]));
    assert_eq!(read_file(&m.join(&deep)), b"deep", "1,023-byte key");
    assert_eq!(
        read_file(&m.join("sp ace/new\nline/%2F")),
        b"nested specials"
    );
    // `find` walks the whole tree without errors or loops.
    let out = std::process::Command::new("find")
        .arg(m.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "find failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = String::from_utf8_lossy(&out.stdout).lines().count();
    assert!((10..40).contains(&lines), "find printed {lines} lines");
    // Deleting through the mount touches only the key it names.
    fs::remove_file(m.join("a/ok")).unwrap();
    assert!(s3.head(&b, "a/ok").is_none());
    fs::remove_dir(m.join("x")).unwrap();
    assert!(s3.head(&b, "x/").is_none(), "rmdir x removed the marker");
    assert!(
        s3.head(&b, "x").is_some(),
        "the shadowed file x is untouched"
    );
    assert!(
        fs::metadata(m.join("x")).is_ok(),
        "with the marker gone, the file x shows"
    );
    let mut m = m;
    assert!(m.daemon_alive(), "daemon died: {}", m.log());
    eprintln!(
        "hostile keys: {} keys put and handled by the rule, {} refused by MinIO",
        puts.len(),
        refused.len()
    );
}

/// Directories whose names MinIO cannot give a marker (247 to 255 bytes: it stores a marker
/// `name/` as `name__XLDIR__`, so it refuses one past 255 bytes). The last file of such a
/// directory unlinked: the marker that would keep it is refused, logged, and the mount goes
/// on listing the directories above it, without it (before: the refused marker stayed
/// pending, every listing above it failed with `EIO` for good, `rm -rf` failed and the
/// unmount exited 1).
/// A directory renamed to such a name: refused before anything is copied (before: part of
/// its files were copied to a directory nobody made, which then showed).
#[test]
fn directories_whose_names_cannot_have_a_marker_fail_cleanly() {
    let s3 = s3();
    let b = s3.new_bucket("hostile-markers");
    let long = "L".repeat(250);
    s3.put(&b, &format!("top/{long}/f"), b"1".to_vec());
    let m = MountSpec::s3(&b, "").mount();
    fs::remove_file(m.join("top").join(&long).join("f")).unwrap();
    // The bucket cannot hold the emptied directory: the listings go on without it.
    assert!(!list_dir(m.path()).contains("top"));

    fs::create_dir(m.join("src")).unwrap();
    for i in 0..20 {
        write_file(&m.join(format!("src/f{i:02}")), b"x");
    }
    assert_eq!(
        errno(fs::rename(m.join("src"), m.join("M".repeat(250)))),
        libc::EINVAL
    );
    assert_eq!(list_dir(&m.join("src")).len(), 20);
    let keys = s3.list_keys(&b, "");
    assert!(keys.iter().all(|k| !k.starts_with('M')), "copied: {keys:?}");
    assert_eq!(keys.iter().filter(|k| k.starts_with("src/")).count(), 21);
    let (status, log) = m.unmount();
    assert!(status.is_some_and(|s| s.success()), "{status:?}: {log}");
}

/// Names ending in `__XLDIR__`: MinIO stores the marker of a directory `foo/` as
/// `foo__XLDIR__`, so a file of that name is that marker. Making one is refused (`EPERM`:
/// before, `d/foo__XLDIR__` written became a directory `foo` and its bytes were gone, and
/// `d/bar__XLDIR__` overwrote the marker of directory `bar`, its mode with it), and looking
/// one up finds nothing (before: `bar`'s marker, as an empty file).
#[test]
fn names_that_are_minio_marker_aliases_are_refused() {
    let s3 = s3();
    let b = s3.new_bucket("hostile-xldir");
    let m = MountSpec::s3(&b, "").mount();
    fs::create_dir(m.join("d")).unwrap();
    fs::create_dir(m.join("d/bar")).unwrap();
    fs::set_permissions(m.join("d/bar"), fs::Permissions::from_mode(0o700)).unwrap();
    assert_eq!(
        errno(fs::File::create(m.join("d/foo__XLDIR__"))),
        libc::EPERM
    );
    assert_eq!(errno(fs::metadata(m.join("d/bar__XLDIR__"))), libc::ENOENT);
    assert_eq!(
        errno(fs::File::create(m.join("d/bar__XLDIR__"))),
        libc::EPERM
    );
    assert_eq!(errno(fs::create_dir(m.join("d/x__XLDIR__"))), libc::EPERM);
    write_file(&m.join("d/f"), b"f");
    assert_eq!(
        errno(fs::rename(m.join("d/f"), m.join("d/bar__XLDIR__"))),
        libc::EPERM
    );
    let m = m.remount();
    assert_eq!(
        list_dir(&m.join("d")),
        ["bar", "f"].iter().map(|s| s.to_string()).collect()
    );
    let md = fs::metadata(m.join("d/bar")).unwrap();
    assert!(md.is_dir());
    assert_eq!(md.permissions().mode() & 0o7777, 0o700);
}
