//! [`Mount`]: a guard around one `bucketfs mount -f` daemon; it unmounts, reaps the daemon
//! and removes its temp dir on drop, even when the test panics, and a watchdog force-unmounts
//! it when a test hangs in a file operation. [`MountSpec`] says what to mount and how.

use super::{bin, env, proxy};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Whether `path` is a mount point right now (per /proc/self/mountinfo).
pub fn is_mounted(path: &Path) -> bool {
    let want = path.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| unescape_mountinfo(mp) == want)
}

fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            if let Ok(v) =
                u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 4]).unwrap_or("x"), 8)
            {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn fusermount(args: &[&str], path: &Path) -> bool {
    Command::new("fusermount3")
        .args(args)
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Unmounts `path` (normal, then lazy). Returns whether it is unmounted now.
pub fn force_unmount(path: &Path) -> bool {
    if !is_mounted(path) {
        return true;
    }
    for _ in 0..3 {
        if fusermount(&["-u"], path) || !is_mounted(path) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    fusermount(&["-uz"], path);
    !is_mounted(path)
}

/// How a [`Mount`] is started.
#[derive(Debug, Clone)]
pub struct MountSpec {
    /// `s3://bucket[/prefix]` or a local directory.
    pub source: String,
    /// Extra arguments after the mount point.
    pub args: Vec<String>,
    /// Extra environment for the daemon.
    pub envs: Vec<(String, String)>,
    /// After this long the watchdog force-unmounts and kills the daemon, so a hung file
    /// operation fails the test instead of hanging the suite.
    pub watchdog: Duration,
    /// The program to run instead of the built binary (a link to it under another name).
    pub program: Option<PathBuf>,
    /// The arguments before SOURCE: `mount -f` unless a test runs another command line; an
    /// empty SOURCE is left out.
    pub command: Vec<String>,
}

impl MountSpec {
    /// A mount of `s3://bucket[/prefix]` on the test MinIO with the test credentials.
    pub fn s3(bucket: &str, prefix: &str) -> Self {
        let e = env();
        let prefix = prefix.trim_matches('/');
        let source = if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        };
        MountSpec {
            source,
            args: s3_args(),
            envs: vec![
                ("AWS_ACCESS_KEY_ID".into(), e.access_key.clone()),
                ("AWS_SECRET_ACCESS_KEY".into(), e.secret_key.clone()),
            ],
            watchdog: Duration::from_secs(600),
            program: None,
            command: vec!["mount".into(), "-f".into()],
        }
    }

    /// A mount of a local directory (the embedded store).
    pub fn local(dir: &Path) -> Self {
        MountSpec {
            source: dir.to_string_lossy().into_owned(),
            args: vec![],
            envs: vec![],
            watchdog: Duration::from_secs(300),
            program: None,
            command: vec!["mount".into(), "-f".into()],
        }
    }

    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.to_string());
        self
    }

    pub fn watchdog(mut self, d: Duration) -> Self {
        self.watchdog = d;
        self
    }

    pub fn mount(&self) -> Mount {
        Mount::start(self.clone()).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// `--endpoint-url ... --force-path-style --region us-east-1` for the test MinIO.
pub fn s3_args() -> Vec<String> {
    vec![
        "--endpoint-url".into(),
        env().endpoint.clone(),
        "--force-path-style".into(),
        "--region".into(),
        "us-east-1".into(),
    ]
}

/// Environment every bucketfs process of the tests gets: no AWS settings of the machine leak
/// in, and no IMDS lookups.
pub fn isolate_env(cmd: &mut Command, home: &Path) {
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("AWS_") || (k.starts_with("BUCKETFS_") && !k.starts_with("BUCKETFS_TEST"))
        {
            cmd.env_remove(&k);
        }
    }
    // Empty AWS config files: nothing from the machine, and no SDK warning about missing ones.
    for f in ["aws-config", "aws-credentials"] {
        let p = home.join(f);
        if !p.exists() {
            let _ = File::create(&p);
        }
    }
    cmd.env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("AWS_CONFIG_FILE", home.join("aws-config"))
        .env("AWS_SHARED_CREDENTIALS_FILE", home.join("aws-credentials"))
        .env("AWS_EC2_METADATA_DISABLED", "true");
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "info");
    }
}

struct Watch {
    done: Mutex<bool>,
    cv: Condvar,
    fired: AtomicBool,
}

/// One running `bucketfs mount -f` daemon. Dropping it unmounts, reaps the daemon and removes
/// the mount point, whatever state the test is in.
pub struct Mount {
    spec: MountSpec,
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    watch: Arc<Watch>,
    exit: Option<ExitStatus>,
    /// The daemon had to be killed: it did not exit within 120 s of the unmount.
    hung: bool,
}

impl Mount {
    pub fn s3(bucket: &str) -> Mount {
        MountSpec::s3(bucket, "").mount()
    }

    pub fn s3_prefix(bucket: &str, prefix: &str) -> Mount {
        MountSpec::s3(bucket, prefix).mount()
    }

    pub fn start(spec: MountSpec) -> Result<Mount, String> {
        let dir = tempfile::Builder::new()
            .prefix("bucketfs-mnt-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).map_err(|e| format!("mkdir {}: {e}", path.display()))?;
        let path = path.canonicalize().unwrap();
        let home = dir.path().join("home");
        std::fs::create_dir(&home).unwrap();
        let log = dir.path().join("daemon.log");
        let logf = File::create(&log).unwrap();

        let mut cmd = Command::new(spec.program.as_deref().unwrap_or(Path::new(bin())));
        cmd.args(&spec.command);
        if !spec.source.is_empty() {
            cmd.arg(&spec.source);
        }
        cmd.arg(&path)
            .args(&spec.args)
            .stdin(Stdio::null())
            .stdout(logf.try_clone().unwrap())
            .stderr(logf);
        isolate_env(&mut cmd, &home);
        for (k, v) in &spec.envs {
            cmd.env(k, v);
        }
        let child = cmd.spawn().map_err(|e| format!("spawn {}: {e}", bin()))?;
        let mut m = Mount {
            spec,
            dir: Some(dir),
            path,
            log,
            child: Some(child),
            watch: Arc::new(Watch {
                done: Mutex::new(false),
                cv: Condvar::new(),
                fired: AtomicBool::new(false),
            }),
            exit: None,
            hung: false,
        };

        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if is_mounted(&m.path) {
                break;
            }
            if let Some(st) = m.child.as_mut().unwrap().try_wait().unwrap() {
                m.child = None;
                m.exit = Some(st);
                return Err(format!(
                    "bucketfs mount -f {} exited ({st}) before mounting; its output:\n{}",
                    m.spec.source,
                    m.log()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "bucketfs mount -f {} did not mount {} within 30 s; its output:\n{}",
                    m.spec.source,
                    m.path.display(),
                    m.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        m.start_watchdog();
        Ok(m)
    }

    fn start_watchdog(&self) {
        let watch = self.watch.clone();
        let path = self.path.clone();
        let pid = self.child.as_ref().unwrap().id() as libc::pid_t;
        let limit = self.spec.watchdog;
        std::thread::spawn(move || {
            let deadline = Instant::now() + limit;
            let mut done = watch.done.lock().unwrap();
            while !*done {
                let now = Instant::now();
                if now >= deadline {
                    eprintln!(
                        "watchdog: mount {} still in use after {} s: force-unmounting and \
                         killing its daemon (pid {pid})",
                        path.display(),
                        limit.as_secs()
                    );
                    watch.fired.store(true, Ordering::SeqCst);
                    fusermount(&["-uz"], &path);
                    // SAFETY: plain kill(2) of the daemon this harness spawned; `done` is false
                    // under the lock, so it has not been reaped and the pid is still ours.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    return;
                }
                done = watch.cv.wait_timeout(done, deadline - now).unwrap().0;
            }
        });
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `mount point / rel`.
    pub fn join(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.path.join(rel)
    }

    /// Everything the daemon printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the watchdog had to force-unmount this mount (the test hung).
    pub fn watchdog_fired(&self) -> bool {
        self.watch.fired.load(Ordering::SeqCst)
    }

    /// Whether the daemon is still running (and mounted).
    pub fn daemon_alive(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().ok().flatten().is_none() && is_mounted(&self.path),
            None => false,
        }
    }

    pub fn spec(&self) -> &MountSpec {
        &self.spec
    }

    /// The daemon's pid (while it runs).
    pub fn daemon_pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Sends `sig` to the daemon.
    pub fn signal(&self, sig: i32) {
        let pid = self.daemon_pid().expect("daemon running") as libc::pid_t;
        // SAFETY: kill(2) of the daemon this harness spawned and has not reaped.
        unsafe { libc::kill(pid, sig) };
    }

    /// Waits up to `limit` for the daemon to exit on its own (after a signal); returns its
    /// status. The mount point is left as it is.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            let child = self.child.as_mut()?;
            if let Ok(Some(st)) = child.try_wait() {
                *self.watch.done.lock().unwrap() = true;
                self.watch.cv.notify_all();
                self.child = None;
                self.exit = Some(st);
                return Some(st);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the daemon (a crash) and reaps it. The mount point stays behind as a dead FUSE
    /// mount ("Transport endpoint is not connected") until the guard is dropped.
    pub fn kill9(&mut self) {
        *self.watch.done.lock().unwrap() = true;
        self.watch.cv.notify_all();
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            self.exit = c.wait().ok();
        }
    }

    /// Unmounts and waits for the daemon; returns its exit status and output.
    pub fn unmount(mut self) -> (Option<ExitStatus>, String) {
        self.stop();
        (self.exit, self.log())
    }

    /// Unmounts and mounts the same source again (fresh daemon, cold caches).
    pub fn remount(self) -> Mount {
        let spec = self.spec.clone();
        let (st, log) = self.unmount();
        if st.is_some_and(|s| !s.success()) {
            eprintln!("note: daemon exited with {st:?} at remount; its output:\n{log}");
        }
        spec.mount()
    }

    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            // The daemon is gone already (kill9, wait_exit): clear a dead mount it left.
            if !force_unmount(&self.path) {
                eprintln!("could not unmount {}", self.path.display());
            }
            return;
        };
        // From here on the watchdog must not act (it would kill a pid that we reap below).
        *self.watch.done.lock().unwrap() = true;
        self.watch.cv.notify_all();
        let unmounted = force_unmount(&self.path);
        // The daemon publishes what is still being written before it exits: give it time.
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            match child.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    eprintln!(
                        "daemon of {} did not exit within 120 s of the unmount: killing it",
                        self.path.display()
                    );
                    self.hung = true;
                    let _ = child.kill();
                    break child.wait().ok();
                }
            }
        };
        self.exit = status;
        if !unmounted && !force_unmount(&self.path) {
            eprintln!(
                "could not unmount {}: leaving its temp dir",
                self.path.display()
            );
            if let Some(d) = self.dir.take() {
                let _ = d.keep();
            }
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.stop();
        if self.hung && !std::thread::panicking() {
            // A test holding a descriptor across its unmount, or a daemon that hangs.
            panic!(
                "the daemon of {} did not exit within 120 s of the unmount; its output:\n{}",
                self.path.display(),
                self.log()
            );
        }
        if std::thread::panicking() {
            eprintln!(
                "---- output of bucketfs mount -f {} ({}) ----\n{}\n---- end ----",
                self.spec.source,
                self.path.display(),
                self.log()
            );
        }
    }
}

/// A mount of `bucket` through `proxy`.
pub fn via_proxy(bucket: &str, proxy: &proxy::FaultProxy) -> MountSpec {
    let mut spec = MountSpec::s3(bucket, "");
    spec.args = vec![
        "--endpoint-url".into(),
        proxy.endpoint(),
        "--force-path-style".into(),
        "--region".into(),
        "us-east-1".into(),
    ];
    spec
}
