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

use crate::config::LogLevel;
use std::io::{self, Write};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
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

/// Installs the global subscriber.
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
        let text = String::from_utf8_lossy(&self.buf);
        let text = text.trim_end();
        if text.is_empty() {
            return;
        }
        let msg = format!("<{}>{}: {}", self.pri, self.w.tag, text);
        // A lost log line is not worth failing a file operation over.
        let _ = self.w.sock.send(msg.as_bytes());
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
