//! MinIO dies in the middle of a large write: the writer must get an error (from write(2),
//! fsync(2) or close(2)), no object may appear under the key and no multipart upload may be
//! left behind once the daemon has exited.
//!
//! This test stops and restarts the shared MinIO server, so `scripts/test.sh` runs this file
//! alone, after every other test (`cargo test -p bucketfs --test fault -- --test-threads=1`),
//! and skips it in the parallel run with `--skip minio_outage::`.

mod common;

mod minio_outage {
    use super::common::*;
    use std::fs::File;
    use std::io::Write;
    use std::time::{Duration, Instant};

    const TOTAL_MIB: u64 = 300;
    const STOP_AT_MIB: u64 = 100;

    #[test]
    fn large_write_fails_cleanly_when_the_server_dies() {
        let s3 = s3();
        let b = s3.new_bucket("fault");
        s3.put(&b, "witness", "written before the outage");
        // Declared before the outage guard, so it is dropped after MinIO is back up.
        let mut mount = MountSpec::s3(&b, "")
            .watchdog(Duration::from_secs(900))
            .mount();
        let path = mount.join("big.bin");
        let mut f = File::create(&path).expect("create big.bin");

        let mut outage = None;
        let mut errors: Vec<String> = Vec::new();
        let started = Instant::now();
        let mut written_mib = 0;
        for i in 0..TOTAL_MIB {
            if i == STOP_AT_MIB {
                eprintln!(
                    "{STOP_AT_MIB} MiB written in {:?}: killing MinIO",
                    started.elapsed()
                );
                outage = Some(MinioOutage::begin());
            }
            let block = pattern::block(7, i);
            if let Err(e) = f.write_all(&block) {
                errors.push(format!(
                    "write(2) of MiB {i}: {e} (errno {:?})",
                    e.raw_os_error()
                ));
                break;
            }
            written_mib += 1;
        }
        assert!(
            outage.is_some(),
            "MinIO was never stopped (only {written_mib} MiB written)"
        );
        eprintln!(
            "{written_mib} MiB accepted by write(2) in {:?}",
            started.elapsed()
        );
        if let Err(e) = f.sync_all() {
            errors.push(format!("fsync(2): {e} (errno {:?})", e.raw_os_error()));
        }
        if let Err(e) = close_checked(f) {
            errors.push(format!("close(2): {e} (errno {:?})", e.raw_os_error()));
        }
        eprintln!("errors seen by the writer: {errors:#?}");
        assert!(
            !mount.watchdog_fired(),
            "the writer hung for 15 min and the watchdog had to unmount; errors: {errors:?}"
        );
        assert!(
            mount.daemon_alive(),
            "the daemon died during the outage (errors {errors:?}); its output:\n{}",
            mount.log()
        );
        assert!(
            !errors.is_empty(),
            "MinIO was down for the last {} MiB, yet write, fsync and close all succeeded: \
             data loss is not reported",
            TOTAL_MIB - STOP_AT_MIB
        );
        for e in &errors {
            assert!(
                !e.contains(&format!("errno Some({})", libc::ENOTCONN)),
                "ENOTCONN means the daemon went away, not a reported upload error: {e}"
            );
        }

        // Bring MinIO back: the failed file must not appear, now or after the daemon exits.
        outage.as_mut().unwrap().end();
        assert!(
            s3.head(&b, "big.bin").is_none(),
            "a failed upload became visible as an object"
        );
        assert_eq!(s3.get(&b, "witness").unwrap(), b"written before the outage");

        let (status, log) = mount.unmount();
        eprintln!("daemon exited with {status:?}");
        assert!(status.is_some(), "daemon did not exit; output:\n{log}");
        assert!(
            s3.head(&b, "big.bin").is_none(),
            "the failed file was published at unmount; daemon output:\n{log}"
        );
        let uploads = s3.list_multipart_uploads(&b);
        assert!(
            uploads.is_empty(),
            "multipart uploads left in the bucket after the daemon exited: {uploads:?}\n\
             daemon output:\n{log}"
        );
        // The server works normally again for the other tests.
        let b2 = s3.new_bucket("fault-after");
        s3.put(&b2, "k", "v");
        assert_eq!(s3.get(&b2, "k").unwrap(), b"v");
    }
}
