//! Logging setup: tracing-subscriber to stderr, a file, or syslog.
//!
//! Where logs go: `--log-file` if given; else syslog with `--syslog`; else stderr in the
//! foreground; else (background) syslog through `/dev/log`, or
//! `<state dir>/logs/bucketfs-<pid>.log` when there is no syslog socket. Log files are never
//! opened through a symlink (at their last component) and are created 0600; the automatic one
//! is created fresh in a 0700 directory. `RUST_LOG` overrides the level with a full tracing filter. Chatty
//! dependencies (AWS SDK, HTTP stack, fuser) are held at `error` (`info` at debug level) unless
//! the level is `trace`; the request signer and the SDK's HTTP runtime never log at trace (it
//! would show session tokens).
//! The `log` records of fuser are bridged into tracing.
//!
//! The syslog writer is a small RFC 3164 client over a Unix datagram socket (facility daemon),
//! one datagram per event, with the severity taken from the event's level.
//!
//! A mount's log lines reach their sink through a bounded queue and a thread of their own
//! ([`Queue`]): a sink that blocks (a hung log disk, a syslog daemon that stopped reading, a
//! stderr pipe nobody reads) stalls that thread only, never a file operation that logs.
//! Lines beyond the queue are dropped and their number logged when the sink takes lines again.

use crate::config::LogLevel;
use std::io::{self, Write};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

const SYSLOG_SOCKET: &str = "/dev/log";

/// Where the log goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTarget {
    Stderr,
    File(PathBuf),
    Syslog,
}

impl LogTarget {
    /// Picks the target from the settings (see the module docs); `log_dir` is the private
    /// directory of the automatic log file.
    pub fn choose(
        log_file: Option<&Path>,
        syslog: bool,
        foreground: bool,
        log_dir: &Path,
    ) -> LogTarget {
        if let Some(f) = log_file {
            LogTarget::File(f.to_path_buf())
        } else if syslog {
            LogTarget::Syslog
        } else if foreground {
            LogTarget::Stderr
        } else if UnixDatagram::unbound()
            .and_then(|s| s.connect(SYSLOG_SOCKET))
            .is_ok()
        {
            LogTarget::Syslog
        } else {
            LogTarget::File(log_dir.join(format!("bucketfs-{}.log", std::process::id())))
        }
    }
}

fn filter(level: LogLevel) -> EnvFilter {
    if let Ok(f) = std::env::var("RUST_LOG") {
        if f.trim().is_empty() {
            // An empty RUST_LOG is "not set", not "log nothing".
        } else if let Ok(f) = EnvFilter::try_new(f) {
            return f;
        }
    }
    let mut spec = level.as_str().to_string();
    if level != LogLevel::Trace {
        // The SDK warns about every credential/region provider it tries (IMDS, profiles) on
        // machines where they do not apply: that is noise below debug.
        let cap = if level == LogLevel::Debug {
            "info"
        } else {
            "error"
        };
        for dep in [
            "aws_config",
            "aws_smithy_runtime",
            "aws_smithy_runtime_api",
            "aws_smithy_http_client",
            "aws_sdk_s3",
            "aws_sdk_sts",
            "aws_sdk_sso",
            "aws_sdk_ssooidc",
            "hyper",
            "hyper_util",
            "h2",
            "rustls",
        ] {
            spec.push_str(&format!(",{dep}={cap}"));
        }
        // fuser warns once per operation it does not implement (xattrs, locks): noise.
        let fuser = if level == LogLevel::Debug {
            "warn"
        } else {
            "error"
        };
        spec.push_str(&format!(",fuser={fuser}"));
    }
    EnvFilter::new(spec)
}

/// Whether an event may be logged whatever the level or `RUST_LOG` say: the request signer
/// and the SDK's HTTP runtime show the canonical request (the `x-amz-security-token` header
/// of session credentials among it) and whole requests at trace.
fn never_secret(meta: &Metadata<'_>) -> bool {
    let t = meta.target();
    *meta.level() != Level::TRACE || !(t.starts_with("aws_sigv4") || t.starts_with("aws_smithy"))
}

/// Installs the global subscriber of a mount: its lines go through a [`Queue`] (see the
/// module docs); [`flush`] before the process exits.
pub fn init_queued(level: LogLevel, target: &LogTarget) -> Result<(), String> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let builder = tracing_subscriber::fmt().with_env_filter(filter(level));
    let cap = tracing_subscriber::filter::filter_fn(never_secret);
    let r = match target {
        LogTarget::Stderr => builder
            .with_ansi(colour_stderr())
            .with_writer(Queue::start(Sink::Stream(Box::new(io::stderr()))))
            .finish()
            .with(cap)
            .try_init(),
        LogTarget::File(path) => {
            let f = open_log(path).map_err(|e| format!("log file {}: {e}", path.display()))?;
            builder
                .with_ansi(false)
                .with_writer(Queue::start(Sink::Stream(Box::new(f))))
                .finish()
                .with(cap)
                .try_init()
        }
        LogTarget::Syslog => {
            let w = SyslogWriter::connect().map_err(|e| format!("syslog {SYSLOG_SOCKET}: {e}"))?;
            builder
                .with_ansi(false)
                .without_time()
                .with_target(false)
                .with_level(false)
                .with_writer(Queue::start(Sink::Syslog(w)))
                .finish()
                .with(cap)
                .try_init()
        }
    };
    r.map_err(|e| format!("cannot set up logging: {e}"))
}

/// Waits up to `most` for the queued log lines to reach their sink (see [`Queue`]).
pub fn flush(most: Duration) {
    if let Some(q) = QUEUED.get() {
        q.flush(most);
    }
}

/// Installs the global subscriber, writing each line where it is made (a command's).
pub fn init(level: LogLevel, target: &LogTarget) -> Result<(), String> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let builder = tracing_subscriber::fmt().with_env_filter(filter(level));
    let cap = tracing_subscriber::filter::filter_fn(never_secret);
    let r = match target {
        LogTarget::Stderr => builder
            .with_ansi(colour_stderr())
            .with_writer(io::stderr)
            .finish()
            .with(cap)
            .try_init(),
        LogTarget::File(path) => {
            let f = open_log(path).map_err(|e| format!("log file {}: {e}", path.display()))?;
            builder
                .with_ansi(false)
                .with_writer(Mutex::new(f))
                .finish()
                .with(cap)
                .try_init()
        }
        LogTarget::Syslog => {
            let w = SyslogWriter::connect().map_err(|e| format!("syslog {SYSLOG_SOCKET}: {e}"))?;
            builder
                .with_ansi(false)
                .without_time()
                .with_target(false)
                .with_level(false)
                .with_writer(w)
                .finish()
                .with(cap)
                .try_init()
        }
    };
    r.map_err(|e| format!("cannot set up logging: {e}"))
}

/// Colours only for a person at a terminal: `-f 2>>file`, systemd's journal and pipes get
/// plain text, as files and syslog do. `NO_COLOR` turns them off everywhere.
fn colour_stderr() -> bool {
    use std::io::IsTerminal;
    io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none()
}

/// Opens a log file for appending: never through a symlink (a planted link could point a root
/// daemon's log at any file), created 0600. A fresh name is created exclusively; an existing
/// file (a name reused by a later pid in the private log directory, or a `--log-file`) is
/// appended to.
pub fn open_log(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let open = |excl: bool| {
        let mut o = std::fs::OpenOptions::new();
        o.append(true).mode(0o600).custom_flags(libc::O_NOFOLLOW);
        if excl {
            o.create_new(true);
        }
        o.open(path)
    };
    match open(true) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => open(false),
        r => r,
    }
}

/// Makes one [`SyslogLine`] per event.
#[derive(Clone)]
struct SyslogWriter {
    sock: Arc<UnixDatagram>,
    tag: Arc<str>,
}

impl SyslogWriter {
    fn connect() -> io::Result<Self> {
        let sock = UnixDatagram::unbound()?;
        sock.connect(SYSLOG_SOCKET)?;
        Ok(Self {
            sock: Arc::new(sock),
            tag: format!("bucketfs[{}]", std::process::id()).into(),
        })
    }
}

impl SyslogWriter {
    /// Sends one line as a datagram of severity `pri`.
    fn send(&self, pri: u8, line: &[u8]) {
        let text = String::from_utf8_lossy(line);
        let text = text.trim_end();
        if text.is_empty() {
            return;
        }
        let msg = format!("<{pri}>{}: {text}", self.tag);
        // A lost log line is not worth failing a file operation over.
        let _ = self.sock.send(msg.as_bytes());
    }
}

/// Severity (RFC 5424 numbers) of a tracing level.
fn severity(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

const FACILITY_DAEMON: u8 = 3;

/// Buffers one formatted event and sends it as one datagram when dropped.
struct SyslogLine {
    w: SyslogWriter,
    pri: u8,
    buf: Vec<u8>,
}

impl Write for SyslogLine {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for SyslogLine {
    fn drop(&mut self) {
        self.w.send(self.pri, &self.buf);
    }
}

impl<'a> MakeWriter<'a> for SyslogWriter {
    type Writer = SyslogLine;

    fn make_writer(&'a self) -> SyslogLine {
        SyslogLine {
            w: self.clone(),
            pri: FACILITY_DAEMON * 8 + 6,
            buf: Vec::new(),
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> SyslogLine {
        SyslogLine {
            w: self.clone(),
            pri: FACILITY_DAEMON * 8 + severity(meta.level()),
            buf: Vec::new(),
        }
    }
}

/// Lines waiting for the log's thread at most: about a minute of a busy mount's warnings.
const QUEUED_LINES: usize = 4096;

/// The queue of the mount's log, for [`flush`].
static QUEUED: OnceLock<Queue> = OnceLock::new();

/// Lines the log dropped (its queue was full) in this process's life, for the metrics.
static DROPPED_LINES: AtomicU64 = AtomicU64::new(0);

/// Log lines dropped so far because the log did not take them in time.
pub fn dropped_lines() -> u64 {
    DROPPED_LINES.load(Ordering::Relaxed)
}

/// Where the log's thread writes lines.
enum Sink {
    /// A file or stderr: each line as formatted.
    Stream(Box<dyn Write + Send>),
    Syslog(SyslogWriter),
}

impl Sink {
    fn put(&mut self, pri: u8, line: &[u8]) {
        // A lost log line is not worth stopping the log over.
        match self {
            Sink::Stream(w) => {
                let _ = w.write_all(line);
                let _ = w.flush();
            }
            Sink::Syslog(w) => w.send(pri, line),
        }
    }
}

/// A bounded queue of log lines and the thread that writes them to the sink (see the module
/// docs). Every event makes one [`QueuedLine`].
#[derive(Clone)]
struct Queue {
    tx: SyncSender<(u8, Vec<u8>)>,
    state: Arc<QueueState>,
}

#[derive(Default)]
struct QueueState {
    /// Lines sent and not yet written.
    pending: AtomicU64,
    /// Lines dropped (the queue was full) since the thread last said so.
    dropped: AtomicU64,
}

impl Queue {
    fn start(sink: Sink) -> Self {
        let q = Self::new(sink, QUEUED_LINES);
        let _ = QUEUED.set(q.clone());
        q
    }

    fn new(mut sink: Sink, lines: usize) -> Self {
        let (tx, rx): (_, Receiver<(u8, Vec<u8>)>) = sync_channel(lines);
        let state = Arc::new(QueueState::default());
        let st = state.clone();
        let spawned = std::thread::Builder::new()
            .name("bucketfs-log".into())
            .spawn(move || {
                for (pri, line) in rx {
                    let n = st.dropped.swap(0, Ordering::Relaxed);
                    if n > 0 {
                        let note =
                            format!("{n} log line(s) dropped: the log did not take them in time\n");
                        sink.put(
                            FACILITY_DAEMON * 8 + severity(&Level::WARN),
                            note.as_bytes(),
                        );
                    }
                    sink.put(pri, &line);
                    st.pending.fetch_sub(1, Ordering::Release);
                }
            });
        if let Err(e) = spawned {
            // No thread: every line is dropped (counted), none waited for.
            eprintln!("bucketfs: cannot start the log thread: {e}");
        }
        Self { tx, state }
    }

    fn send(&self, pri: u8, line: Vec<u8>) {
        self.state.pending.fetch_add(1, Ordering::Acquire);
        match self.tx.try_send((pri, line)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.state.pending.fetch_sub(1, Ordering::Release);
                self.state.dropped.fetch_add(1, Ordering::Relaxed);
                DROPPED_LINES.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn flush(&self, most: Duration) {
        let until = Instant::now() + most;
        while self.state.pending.load(Ordering::Acquire) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// One event's text, queued when dropped.
struct QueuedLine {
    q: Queue,
    pri: u8,
    buf: Vec<u8>,
}

impl Write for QueuedLine {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for QueuedLine {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            self.q.send(self.pri, std::mem::take(&mut self.buf));
        }
    }
}

impl<'a> MakeWriter<'a> for Queue {
    type Writer = QueuedLine;

    fn make_writer(&'a self) -> QueuedLine {
        QueuedLine {
            q: self.clone(),
            pri: FACILITY_DAEMON * 8 + 6,
            buf: Vec::new(),
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> QueuedLine {
        QueuedLine {
            q: self.clone(),
            pri: FACILITY_DAEMON * 8 + severity(meta.level()),
            buf: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_choice() {
        let d = Path::new("/d");
        assert_eq!(
            LogTarget::choose(Some(Path::new("/x.log")), true, true, d),
            LogTarget::File("/x.log".into())
        );
        assert_eq!(LogTarget::choose(None, true, true, d), LogTarget::Syslog);
        assert_eq!(LogTarget::choose(None, false, true, d), LogTarget::Stderr);
    }

    #[test]
    fn log_files_are_private_and_never_followed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let link = dir.path().join("link.log");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = open_log(&link).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        let log = dir.path().join("new.log");
        let mut f = open_log(&log).unwrap();
        writeln!(f, "a").unwrap();
        let mut f = open_log(&log).unwrap();
        writeln!(f, "b").unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "a\nb\n");
        let mode = std::fs::metadata(&log).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    /// A log sink that stopped taking lines (a syslog that stopped reading, a hung log disk)
    /// holds no event: the lines past the queue are dropped, counted, and said once the sink
    /// takes lines again.
    #[test]
    fn a_sink_that_blocks_holds_no_event() {
        /// Takes each write only once let through; keeps what it took.
        struct Held {
            go: std::sync::mpsc::Receiver<()>,
            took: Arc<Mutex<Vec<u8>>>,
        }
        impl Write for Held {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                // Blocks until let through; once the sender is gone, never again.
                let _ = self.go.recv();
                self.took.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let (go, held) = std::sync::mpsc::channel();
        let took = Arc::new(Mutex::new(Vec::new()));
        let sink = Held {
            go: held,
            took: took.clone(),
        };
        let q = Queue::new(Sink::Stream(Box::new(sink)), 16);
        let dropped_before = dropped_lines();
        let (done_tx, done) = std::sync::mpsc::channel();
        let q2 = q.clone();
        std::thread::spawn(move || {
            for i in 0..5000 {
                let mut l = q2.make_writer();
                writeln!(l, "line {i}").unwrap();
            }
            done_tx.send(()).unwrap();
        });
        done.recv_timeout(Duration::from_secs(60))
            .expect("logging returns while the sink blocks");
        // The sink takes lines again: the drop is said, the lines after it arrive.
        drop(go);
        q.flush(Duration::from_secs(60));
        writeln!(q.make_writer(), "after").unwrap();
        q.flush(Duration::from_secs(60));
        let text = String::from_utf8(took.lock().unwrap().clone()).unwrap();
        assert!(text.contains("log line(s) dropped"), "{text:.200}");
        assert!(text.ends_with("after\n"), "{text:.200}");
        // The metrics count them (at least those of this queue: tests run side by side).
        let lines = text.matches("line ").count() as u64;
        assert!(
            dropped_lines() - dropped_before >= 5000 - lines,
            "{} dropped counted, {lines} of 5000 written",
            dropped_lines() - dropped_before
        );
    }

    #[test]
    fn syslog_datagrams() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let server = UnixDatagram::bind(&path).unwrap();
        let sock = UnixDatagram::unbound().unwrap();
        sock.connect(&path).unwrap();
        let w = SyslogWriter {
            sock: Arc::new(sock),
            tag: "bucketfs[1]".into(),
        };
        {
            let mut l = SyslogLine {
                w: w.clone(),
                pri: FACILITY_DAEMON * 8 + severity(&Level::WARN),
                buf: Vec::new(),
            };
            writeln!(l, "hello").unwrap();
        }
        let mut buf = [0u8; 256];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"<28>bucketfs[1]: hello");
    }
}
