//! Control of the shared MinIO server: stop it and start it again (the fault tests).

use super::{env, required};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The shared MinIO server: stop it and start it again on the same port, data dir and
/// credentials. The pid file (`BUCKETFS_TEST_MINIO_PIDFILE`) always names the live server, so
/// scripts/test.sh stops the right process at the end.
pub struct Minio {
    pub bin: PathBuf,
    pub data: PathBuf,
    pub pidfile: Option<PathBuf>,
    pub log: Option<PathBuf>,
    pub addr: String,
}

impl Minio {
    pub fn from_env() -> Minio {
        let e = env();
        let addr = e
            .endpoint
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        Minio {
            bin: required("BUCKETFS_TEST_MINIO_BIN").into(),
            data: required("BUCKETFS_TEST_MINIO_DATA").into(),
            pidfile: std::env::var_os("BUCKETFS_TEST_MINIO_PIDFILE").map(PathBuf::from),
            log: std::env::var_os("BUCKETFS_TEST_MINIO_LOG").map(PathBuf::from),
            addr,
        }
    }

    /// The pid of the running server (the pid file wins over BUCKETFS_TEST_MINIO_PID, which
    /// goes stale after a restart).
    pub fn pid(&self) -> i32 {
        if let Some(p) = &self.pidfile {
            if let Ok(s) = std::fs::read_to_string(p) {
                if let Ok(pid) = s.trim().parse() {
                    return pid;
                }
            }
        }
        required("BUCKETFS_TEST_MINIO_PID")
            .trim()
            .parse()
            .expect("BUCKETFS_TEST_MINIO_PID is a pid")
    }

    pub fn healthy(&self) -> bool {
        use std::net::TcpStream;
        let Ok(mut s) = TcpStream::connect_timeout(
            &self.addr.parse().expect("endpoint is http://IP:PORT"),
            Duration::from_secs(2),
        ) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let req = format!(
            "GET /minio/health/live HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.addr
        );
        if s.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200")
    }

    fn accepts_connections(&self) -> bool {
        std::net::TcpStream::connect_timeout(
            &self.addr.parse().unwrap(),
            Duration::from_millis(500),
        )
        .is_ok()
    }

    /// SIGKILLs the server (a crash, not a clean shutdown) and waits until its port is closed.
    pub fn kill(&self) {
        let pid = self.pid();
        // SAFETY: kill(2) of the MinIO server scripts/test.sh (or an earlier restart) started.
        let r = unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(
            r,
            0,
            "kill MinIO pid {pid}: {}",
            std::io::Error::last_os_error()
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.accepts_connections() {
            assert!(
                Instant::now() < deadline,
                "MinIO still accepts connections after SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Spawns a helper process that, once `trigger` exists, SIGKILLs the server, keeps it down
    /// for `down`, starts it again (recording its pid in the pid file) and exits when it is
    /// healthy. A test that holds a file open for writing on a mount must restart MinIO this
    /// way rather than with [`Minio::start`]: a child forked by the test process closes that
    /// descriptor at exec (O_CLOEXEC), which is a FUSE flush that uploads, and would wait for
    /// the very server it is starting.
    pub fn restart_on_trigger(&self, trigger: &Path, down: Duration) -> Child {
        let e = env();
        let pidfile = self
            .pidfile
            .clone()
            .expect("BUCKETFS_TEST_MINIO_PIDFILE is needed to restart MinIO");
        let log = self
            .log
            .clone()
            .unwrap_or_else(|| PathBuf::from("/dev/null"));
        let script = r#"
            while [ ! -e "$TRIGGER" ]; do sleep 0.01; done
            kill -9 "$(cat "$PIDFILE")"
            while curl -s -o /dev/null --max-time 1 "http://$ADDR/minio/health/live"; do sleep 0.05; done
            sleep "$DOWN"
            MINIO_ROOT_USER="$AK" MINIO_ROOT_PASSWORD="$SK" MINIO_BROWSER=off MINIO_UPDATE=off                 setsid "$BIN" server --quiet --address "$ADDR" "$DATA" >>"$LOG" 2>&1 </dev/null &
            echo $! >"$PIDFILE"
            for i in $(seq 600); do
                curl -sf -o /dev/null --max-time 1 "http://$ADDR/minio/health/live" && exit 0
                sleep 0.1
            done
            exit 1
        "#;
        Command::new("bash")
            .arg("-c")
            .arg(script)
            .env("TRIGGER", trigger)
            .env("PIDFILE", &pidfile)
            .env("ADDR", &self.addr)
            .env("DOWN", format!("{:.3}", down.as_secs_f64()))
            .env("AK", &e.access_key)
            .env("SK", &e.secret_key)
            .env("BIN", &self.bin)
            .env("DATA", &self.data)
            .env("LOG", log)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn the restart helper")
    }

    /// Starts the server again with the same binary, address, data dir and credentials, waits
    /// until it is healthy and records its pid in the pid file.
    pub fn start(&self) {
        let e = env();
        let log = match &self.log {
            Some(p) => std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .unwrap(),
            None => File::create("/dev/null").unwrap(),
        };
        let child = Command::new(&self.bin)
            .args(["server", "--quiet", "--address", &self.addr])
            .arg(&self.data)
            .env("MINIO_ROOT_USER", &e.access_key)
            .env("MINIO_ROOT_PASSWORD", &e.secret_key)
            .env("MINIO_BROWSER", "off")
            .env("MINIO_UPDATE", "off")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.bin.display()));
        let pid = child.id();
        if let Some(p) = &self.pidfile {
            std::fs::write(p, format!("{pid}\n")).unwrap();
        }
        // The Child handle is dropped without waiting: the server outlives this test process
        // and scripts/test.sh stops it through the pid file.
        drop(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.healthy() {
            assert!(
                Instant::now() < deadline,
                "restarted MinIO (pid {pid}) not healthy within 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// While alive, MinIO is down; dropping it (also during a panic) starts the server again.
pub struct MinioOutage {
    minio: Minio,
    restarted: bool,
}

impl MinioOutage {
    pub fn begin() -> MinioOutage {
        let minio = Minio::from_env();
        assert!(minio.healthy(), "MinIO is not healthy before the outage");
        minio.kill();
        MinioOutage {
            minio,
            restarted: false,
        }
    }

    pub fn end(&mut self) {
        if !self.restarted {
            self.restarted = true;
            self.minio.start();
        }
    }
}

impl Drop for MinioOutage {
    fn drop(&mut self) {
        if !self.restarted {
            self.restarted = true;
            if std::thread::panicking() {
                // Must not panic again: report instead.
                if let Err(e) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.minio.start()))
                {
                    eprintln!("could not restart MinIO after a failed test: {e:?}");
                }
            } else {
                self.minio.start();
            }
        }
    }
}

/// MinIO's `host:port`, for proxies in front of it.
pub fn minio_addr() -> String {
    env()
        .endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string()
}
