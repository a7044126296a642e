//! What writes cost in requests, bytes and local disk, counted by the daemon's metrics against a
//! real MinIO through a real mount.

mod common;

use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use common::*;
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};

const MIB: u64 = 1024 * 1024;
const GIB: u64 = 1024 * MIB;

/// A `size`-byte object made server-side from copies of one 64 MiB object, so the test
/// uploads 64 MiB, not 2 GiB. Returns the bytes of the 64 MiB block.
fn big_object(bucket: &str, key: &str, size: u64) -> Vec<u8> {
    let block_len = 64 * MIB;
    let block = pattern::bytes(77, block_len as usize);
    let s3 = s3();
    s3.put(bucket, "block", block.clone());
    s3.block_on(async {
        let c = &s3.client;
        let up = c
            .create_multipart_upload()
            .bucket(bucket)
            .key(key)
            .send()
            .await
            .unwrap();
        let id = up.upload_id().unwrap();
        let mut parts = Vec::new();
        for n in 1..=(size / block_len) as i32 {
            let r = c
                .upload_part_copy()
                .bucket(bucket)
                .key(key)
                .upload_id(id)
                .part_number(n)
                .copy_source(format!("{bucket}/block"))
                .send()
                .await
                .unwrap();
            let etag = r.copy_part_result().unwrap().e_tag().unwrap().to_string();
            parts.push(CompletedPart::builder().part_number(n).e_tag(etag).build());
        }
        c.complete_multipart_upload()
            .bucket(bucket)
            .key(key)
            .upload_id(id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .send()
            .await
            .unwrap();
    });
    block
}

fn bytes_up(addr: &str) -> u64 {
    metric(addr, "bucketfs_store_bytes_up_total")
}

/// Appending 1 MiB to a 2 GiB object sends the new part only: the unchanged 2 GiB are copied
/// server-side (UploadPartCopy), so request bodies stay under 8 MiB.
#[test]
fn appending_1mib_to_a_2gib_object_sends_under_8mib() {
    let b = s3().new_bucket("append2g");
    let block = big_object(&b, "big.log", 2 * GIB);
    let addr = free_local_addr();
    let m = MountSpec::s3(&b, "")
        .arg("--metrics-addr")
        .arg(&addr)
        .mount();
    assert_eq!(std::fs::metadata(m.join("big.log")).unwrap().len(), 2 * GIB);
    let before = bytes_up(&addr);
    let tail = pattern::bytes(5, MIB as usize);
    {
        let mut f = OpenOptions::new()
            .append(true)
            .open(m.join("big.log"))
            .unwrap();
        f.write_all(&tail).unwrap();
        close_checked(f).unwrap();
    }
    let sent = bytes_up(&addr) - before;
    eprintln!("appending 1 MiB to 2 GiB sent {sent} bytes of request bodies");
    assert!(sent < 8 * MIB, "sent {sent} bytes");
    assert!(sent >= MIB, "the appended MiB was not sent ({sent} bytes)");
    // The object is whole: its size, its new end, and a block from the middle.
    assert_eq!(head_size(&b, "big.log"), 2 * GIB + MIB);
    let m = m.remount();
    let mut f = std::fs::File::open(m.join("big.log")).unwrap();
    let mut got = vec![0u8; MIB as usize];
    f.seek(SeekFrom::Start(2 * GIB)).unwrap();
    f.read_exact(&mut got).unwrap();
    assert!(got == tail, "the appended bytes differ");
    f.seek(SeekFrom::Start(GIB + 64 * MIB - 4096)).unwrap();
    let mut edge = vec![0u8; 8192];
    f.read_exact(&mut edge).unwrap();
    assert!(
        edge[..4096] == block[block.len() - 4096..] && edge[4096..] == block[..4096],
        "the copied parts differ"
    );
    drop(f);
    drop(m);
    s3().remove_bucket(&b);
}

fn head_size(bucket: &str, key: &str) -> u64 {
    s3().head(bucket, key).expect("object exists").size
}

/// A sequential write copies each streamed part once to the staging file (in the
/// background), so a reader of bytes already streamed (another descriptor, before close)
/// gets them from there: nothing is published before close, and the written bytes are all
/// there at close.
#[test]
fn a_streamed_write_stages_its_parts_and_its_bytes_read_back_before_close() {
    use std::os::unix::fs::FileExt;
    let s3 = s3();
    let b = s3.new_bucket("stream-disk");
    let addr = free_local_addr();
    let m = MountSpec::s3(&b, "")
        .arg("--part-size")
        .arg("8M")
        .arg("--metrics-addr")
        .arg(&addr)
        .mount();
    let data = pattern::bytes(91, 48 * MIB as usize);
    // Write-only: no page cache, so the reader below asks the daemon.
    let mut w = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.join("big"))
        .unwrap();
    for c in data[..40 * MIB as usize].chunks(MIB as usize) {
        w.write_all(c).unwrap();
    }
    // Parts 1-5 are uploaded (or uploading), each also copied to the staging file.
    assert_eq!(metric(&addr, "bucketfs_staged_bytes_total"), 40 * MIB);
    assert!(s3.head(&b, "big").is_none(), "visible before close");
    let r = std::fs::File::open(m.join("big")).unwrap();
    let mut got = vec![0u8; MIB as usize];
    r.read_exact_at(&mut got, 20 * MIB).unwrap();
    assert!(got[..] == data[20 * MIB as usize..21 * MIB as usize]);
    assert_eq!(metric(&addr, "bucketfs_unreadable_streamed_total"), 0);
    assert!(s3.head(&b, "big").is_none(), "published for the read");
    for c in data[40 * MIB as usize..].chunks(MIB as usize) {
        w.write_all(c).unwrap();
    }
    close_checked(w).unwrap();
    assert!(s3.get(&b, "big").unwrap() == data);
    drop(r);
}

/// A shell's `cmd > f` opens the file, duplicates the descriptor onto stdout and closes the
/// first one before the command writes: that close stores nothing (a duplicate stays open),
/// and the last one stores the file, so it costs one PUT, not an empty one and then another.
/// A single descriptor's close (`touch`) still stores the empty file before close returns.
#[test]
fn a_shell_redirect_stores_the_file_once() {
    let b = s3().new_bucket("redirect");
    let m = Mount::s3(&b);
    let f = m.join("f");
    let puts = |before: &std::collections::HashMap<String, u64>| {
        let sent = requests_between(before, &store_requests(m.path()));
        (sent.get("put").copied().unwrap_or(0), sent)
    };
    let before = store_requests(m.path());
    run("sh", &["-c", &format!("echo x > '{}'", f.display())]);
    let (n, sent) = puts(&before);
    assert_eq!(n, 1, "new file: {sent:?}");
    assert_eq!(s3().get(&b, "f").as_deref(), Some(&b"x\n"[..]));
    // Over an existing file (O_TRUNC): one PUT as well.
    let before = store_requests(m.path());
    run("sh", &["-c", &format!("echo yy > '{}'", f.display())]);
    let (n, sent) = puts(&before);
    assert_eq!(n, 1, "existing file: {sent:?}");
    assert_eq!(s3().get(&b, "f").as_deref(), Some(&b"yy\n"[..]));
    // One descriptor: the empty file is in the bucket when touch returns.
    let before = store_requests(m.path());
    run("touch", &[&m.join("empty").display().to_string()]);
    assert_eq!(s3().get(&b, "empty").as_deref(), Some(&b""[..]));
    let (n, sent) = puts(&before);
    assert_eq!(n, 1, "touch: {sent:?}");
}
