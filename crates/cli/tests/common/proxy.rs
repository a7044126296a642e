//! A TCP proxy in front of MinIO that injects the network faults a real server cannot be made
//! to produce on demand: latency and low bandwidth (a slow server), connections reset in the
//! middle of a response body, every open connection dropped at once, `503 SlowDown`
//! answers, `501 NotImplemented` to a request carrying a given header (a store without that
//! feature), and a stall (requests read, never answered). Mount through [`FaultProxy::endpoint`] instead of the MinIO endpoint.
//!
//! It only ever connects to the loopback address it was given, and stops (closing every
//! connection) when dropped.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
struct State {
    /// Sleep this long before forwarding each chunk (both directions).
    delay_ms: AtomicU64,
    /// Forward at most this many bytes per second per connection and direction (0: no limit).
    bytes_per_sec: AtomicU64,
    /// Bumped to reset every connection opened before.
    generation: AtomicU64,
    /// This many upcoming server→client transfers are cut after `cut_after` bytes.
    cuts_left: AtomicU64,
    cut_after: AtomicU64,
    /// This many upcoming new connections get `503 SlowDown` and are closed.
    slowdowns_left: AtomicU64,
    /// Stalled: every request is read and never answered (see [`FaultProxy::stall`]).
    stalled: AtomicBool,
    /// Bytes read and dropped while stalled.
    pub swallowed: AtomicU64,
    /// When the last of them came.
    last_swallowed: Mutex<Option<std::time::Instant>>,
    /// Counters.
    pub connections: AtomicU64,
    pub cuts: AtomicU64,
    pub slowdowns: AtomicU64,
    pub resets: AtomicU64,
    stop: AtomicBool,
    open: Mutex<Vec<TcpStream>>,
    /// Requests whose first line starts with this fail (connection reset, nothing forwarded)
    /// while the count lasts.
    fail: Mutex<Option<(String, u64)>>,
    /// Requests whose first line starts with this are forwarded, and their answer is never
    /// delivered (the connection is reset when it comes), while the count lasts.
    drop_answer: Mutex<Option<(String, u64)>>,
    /// Answers dropped so far.
    pub dropped: AtomicU64,
    /// Requests whose first line starts with the first string and whose head has the header
    /// named by the second get this status (`NotImplemented`), nothing forwarded.
    reject: Mutex<Option<(String, String, u16)>>,
    /// Requests answered so.
    pub rejected: AtomicU64,
    /// The heads of the latest requests (request line and headers), oldest first.
    heads: Mutex<std::collections::VecDeque<String>>,
}

/// Request heads kept by [`FaultProxy::request_heads`].
const HEADS_KEPT: usize = 1000;

pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
}

const SLOWDOWN: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
<Message>Please reduce your request rate (injected by the test proxy).</Message>\
<RequestId>proxy-slowdown</RequestId></Error>";

impl FaultProxy {
    /// Starts a proxy to `upstream` (an `IP:PORT` on the loopback).
    pub fn start(upstream: &str) -> FaultProxy {
        let upstream: SocketAddr = upstream.parse().expect("upstream is IP:PORT");
        assert!(
            upstream.ip().is_loopback(),
            "the proxy only forwards to loopback"
        );
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State::default());
        let st = state.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if st.stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let st = st.clone();
                std::thread::spawn(move || serve(client, upstream, st));
            }
        });
        FaultProxy { addr, state }
    }

    /// `http://127.0.0.1:PORT` of the proxy.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Latency added to every chunk forwarded, both ways.
    pub fn set_delay(&self, d: Duration) {
        self.state
            .delay_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    /// Bandwidth cap per connection and direction (0: none).
    pub fn set_bandwidth(&self, bytes_per_sec: u64) {
        self.state
            .bytes_per_sec
            .store(bytes_per_sec, Ordering::SeqCst);
    }

    /// Drops every connection open now (their requests fail mid-flight).
    pub fn reset_all(&self) {
        self.state.generation.fetch_add(1, Ordering::SeqCst);
        self.state.resets.fetch_add(1, Ordering::SeqCst);
        for s in self.state.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// The next `n` responses are cut off after `after` bytes (a body broken mid-transfer).
    pub fn cut_responses(&self, n: u64, after: u64) {
        self.state.cut_after.store(after, Ordering::SeqCst);
        self.state.cuts_left.store(n, Ordering::SeqCst);
    }

    /// The next `n` new connections get `503 SlowDown`; open connections are dropped so that
    /// the next requests come on new ones.
    pub fn slow_down(&self, n: u64) {
        self.state.slowdowns_left.store(n, Ordering::SeqCst);
        self.reset_all();
    }

    /// A store that accepts connections and never answers. On: new connections are accepted
    /// and read, never forwarded; open ones stop forwarding either way, for good (what they
    /// carry from now on is read and dropped). Off: those connections are closed (a client
    /// that reused one would wait forever) and new ones are served again.
    pub fn stall(&self, on: bool) {
        self.state.stalled.store(on, Ordering::SeqCst);
        if !on {
            self.reset_all();
        }
    }

    /// The next `n` requests whose first line starts with `line` (`"PUT /bucket/key"`) fail:
    /// the connection is reset before anything reaches the server. 0 ends it.
    pub fn fail_requests(&self, line: &str, n: u64) {
        *self.state.fail.lock().unwrap() = Some((line.to_string(), n));
    }

    /// The next `n` requests whose first line starts with `line` reach the server, and its
    /// answer is lost: the connection is reset when it comes (a reply lost in the network).
    pub fn drop_answers(&self, line: &str, n: u64) {
        *self.state.drop_answer.lock().unwrap() = Some((line.to_string(), n));
    }

    /// From now on, every request whose first line starts with `line` and whose head carries
    /// header `header` (any case) is answered `status` and not forwarded: with error code
    /// `AccessDenied` for 403 (a credential without the permission the header needs), else
    /// `NotImplemented` (a store that does not support that header on that request).
    pub fn reject_with_header(&self, line: &str, header: &str, status: u16) {
        *self.state.reject.lock().unwrap() =
            Some((line.to_string(), header.to_ascii_lowercase(), status));
    }

    /// Requests answered by [`Self::reject_with_header`].
    pub fn rejected(&self) -> u64 {
        self.state.rejected.load(Ordering::SeqCst)
    }

    /// The heads (request line and headers) of the latest requests whose request line
    /// starts with `line`, oldest first.
    pub fn request_heads(&self, line: &str) -> Vec<String> {
        let heads = self.state.heads.lock().unwrap();
        heads
            .iter()
            .filter(|h| h.starts_with(line))
            .cloned()
            .collect()
    }

    /// Answers dropped by [`Self::drop_answers`].
    pub fn dropped(&self) -> u64 {
        self.state.dropped.load(Ordering::SeqCst)
    }

    /// Bytes of requests read and dropped while stalled.
    pub fn swallowed(&self) -> u64 {
        self.state.swallowed.load(Ordering::SeqCst)
    }

    /// When the last byte was read and dropped while stalled.
    pub fn last_swallowed(&self) -> Option<std::time::Instant> {
        *self.state.last_swallowed.lock().unwrap()
    }

    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::SeqCst)
    }
    pub fn cuts(&self) -> u64 {
        self.state.cuts.load(Ordering::SeqCst)
    }
    pub fn slowdowns(&self) -> u64 {
        self.state.slowdowns.load(Ordering::SeqCst)
    }
    pub fn resets(&self) -> u64 {
        self.state.resets.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        self.reset_all();
        // Wake the accept loop so it sees `stop`.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn take(c: &AtomicU64) -> bool {
    c.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

fn swallow(st: &State, n: usize) {
    st.swallowed.fetch_add(n as u64, Ordering::SeqCst);
    *st.last_swallowed.lock().unwrap() = Some(std::time::Instant::now());
}

fn serve(mut client: TcpStream, upstream: SocketAddr, st: Arc<State>) {
    st.connections.fetch_add(1, Ordering::SeqCst);
    let _ = client.set_nodelay(true);
    if take(&st.slowdowns_left) {
        // Read the request head, answer 503 SlowDown and close.
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        let _ = client.set_read_timeout(Some(Duration::from_secs(5)));
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
            match client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let resp = format!(
            "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
             x-amz-request-id: proxy-slowdown\r\nConnection: close\r\n\r\n{SLOWDOWN}",
            SLOWDOWN.len()
        );
        let _ = client.write_all(resp.as_bytes());
        st.slowdowns.fetch_add(1, Ordering::SeqCst);
        let _ = client.shutdown(Shutdown::Write);
        std::thread::sleep(Duration::from_millis(50));
        return;
    }
    if st.stalled.load(Ordering::SeqCst) {
        // Read whatever comes until the connection is closed or reset; answer nothing.
        st.open.lock().unwrap().push(client.try_clone().unwrap());
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = client.read(&mut buf) {
            swallow(&st, n);
        }
        return;
    }
    let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(5)) else {
        return; // upstream down: the client sees the connection close
    };
    let _ = server.set_nodelay(true);
    {
        let mut open = st.open.lock().unwrap();
        open.push(client.try_clone().unwrap());
        open.push(server.try_clone().unwrap());
    }
    let generation = st.generation.load(Ordering::SeqCst);
    let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
    let st2 = st.clone();
    // The request on this connection whose answer is to be dropped.
    let lose = Arc::new(AtomicBool::new(false));
    let lose2 = lose.clone();
    let up = std::thread::spawn(move || pump(c2, s2, &st2, generation, false, &lose2));
    pump(server, client, &st, generation, true, &lose);
    let _ = up.join();
}

/// Whether a chunk starting with `chunk` is a request that `rule` picks, counting it.
fn picked(rule: &Mutex<Option<(String, u64)>>, chunk: &[u8]) -> bool {
    let mut r = rule.lock().unwrap();
    match r.as_mut() {
        Some((line, n)) if *n > 0 && chunk.starts_with(line.as_bytes()) => {
            *n -= 1;
            true
        }
        _ => false,
    }
}

/// Answers a request starting in `chunk` that [`FaultProxy::reject_with_header`] picks, on
/// `client`; whether it did.
fn reject(st: &State, chunk: &[u8], client: &mut TcpStream) -> bool {
    let status = match st.reject.lock().unwrap().as_ref() {
        Some((line, header, status)) if chunk.starts_with(line.as_bytes()) => {
            let end = chunk
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .unwrap_or(chunk.len());
            let head = String::from_utf8_lossy(&chunk[..end]).to_ascii_lowercase();
            if !head.contains(&format!("\r\n{header}:")) {
                return false;
            }
            *status
        }
        _ => return false,
    };
    let (code, reason) = match status {
        403 => ("AccessDenied", "Forbidden"),
        _ => ("NotImplemented", "Not Implemented"),
    };
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
<Message>Refused by the test proxy.</Message><RequestId>proxy-reject</RequestId></Error>"
    );
    let resp = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n\
         Content-Length: {}\r\nx-amz-request-id: proxy-reject\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = client.write_all(resp.as_bytes());
    st.rejected.fetch_add(1, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(50));
    true
}

/// Keeps the head of a request starting in `chunk` (one starts with a method and a path).
fn note_head(st: &State, chunk: &[u8]) {
    let is_request = chunk.first().is_some_and(u8::is_ascii_uppercase)
        && chunk
            .windows(2)
            .position(|w| w == b" /")
            .is_some_and(|i| i < 10);
    if !is_request {
        return;
    }
    let end = chunk
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(chunk.len());
    let mut heads = st.heads.lock().unwrap();
    heads.push_back(String::from_utf8_lossy(&chunk[..end]).into_owned());
    if heads.len() > HEADS_KEPT {
        heads.pop_front();
    }
}

fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    st: &State,
    generation: u64,
    downstream: bool,
    lose: &AtomicBool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut sent = 0u64;
    let mut cut_at: Option<u64> = None;
    let mut frozen = false;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if st.generation.load(Ordering::SeqCst) != generation || st.stop.load(Ordering::SeqCst) {
            break;
        }
        if !downstream {
            note_head(st, &buf[..n]);
        }
        if !downstream && picked(&st.fail, &buf[..n]) {
            break;
        }
        if !downstream && reject(st, &buf[..n], &mut from) {
            break;
        }
        if !downstream && picked(&st.drop_answer, &buf[..n]) {
            lose.store(true, Ordering::SeqCst);
        }
        if downstream && lose.load(Ordering::SeqCst) {
            st.dropped.fetch_add(1, Ordering::SeqCst);
            break;
        }
        frozen |= st.stalled.load(Ordering::SeqCst);
        if frozen {
            if !downstream {
                swallow(st, n);
                continue; // the request is read and dropped
            }
            // The answer is held until the connection is reset.
            while st.generation.load(Ordering::SeqCst) == generation
                && !st.stop.load(Ordering::SeqCst)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            break;
        }
        if downstream && cut_at.is_none() && take(&st.cuts_left) {
            cut_at = Some(sent + st.cut_after.load(Ordering::SeqCst));
        }
        let delay = st.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay));
        }
        let bps = st.bytes_per_sec.load(Ordering::SeqCst);
        if bps > 0 {
            std::thread::sleep(Duration::from_secs_f64(n as f64 / bps as f64));
        }
        let mut chunk = &buf[..n];
        if let Some(at) = cut_at {
            if sent + n as u64 >= at {
                chunk = &buf[..(at - sent) as usize];
                let _ = to.write_all(chunk);
                st.cuts.fetch_add(1, Ordering::SeqCst);
                break;
            }
        }
        if to.write_all(chunk).is_err() {
            break;
        }
        sent += n as u64;
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
