//! Directory pages kept on local disk across mounts (with `--data-cache`).
//!
//! The first LIST page a directory's lookup fetches is saved with the wall-clock time its LIST
//! was sent. After a remount, the lookup of a directory that this mount knows nothing of yet
//! uses a saved page younger than half the stat TTL (so that it lasts the job that follows a
//! while) instead of a LIST, as if this mount had fetched
//! it then: its entries are believed only until the TTL counted from that time, so another
//! client's change shows within the TTL as it does within one mount. A page is used only
//! while this mount has changed nothing (it predates every change made here), only if its
//! LIST was sent after the last change any mount sharing the disk made (each records when
//! it changes something, at most once a second: an earlier build showed the names and
//! versions from before this machine's own changes after a remount), and never over what
//! this mount already knows. The bytes (the page, its time and its detail) are this
//! module's format; where they live, and their checksums, are the disk's
//! ([`ListingDisk`]).

use bucketfs_store::{ListDetail, ListPage, ObjectMeta};
use futures::future::BoxFuture;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Where pages are saved: the data cache's directory.
pub trait ListingDisk: Send + Sync {
    /// Saves `blob` as the page of directory `dir_key`, replacing any (in the background;
    /// may be dropped).
    fn save(&self, dir_key: &str, blob: Vec<u8>);
    /// The blob last saved for `dir_key`, checked sound, and until when a mount sharing
    /// this disk last said it changes something: `None` when there is none, or the disk
    /// does not answer in time.
    fn load(&self, dir_key: &str) -> BoxFuture<'static, Option<(Vec<u8>, Option<SystemTime>)>>;
    /// A mount changes something in the store, until `until` at the latest: pages saved
    /// before then are not used by later mounts (they may predate the change). In the
    /// background (callers may hold locks).
    fn changing_until(&self, until: SystemTime);
}

const VERSION: u8 = 1;

/// A page as saved.
pub struct Saved {
    pub page: ListPage,
    /// When its LIST was sent.
    pub sent: SystemTime,
    pub detail: ListDetail,
}

impl Saved {
    /// How old it is now; `None` if it claims to be from the future (a clock set back).
    pub fn age(&self) -> Option<Duration> {
        SystemTime::now().duration_since(self.sent).ok()
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

fn put_time(b: &mut Vec<u8>, t: Option<SystemTime>) {
    match t.and_then(|t| t.duration_since(UNIX_EPOCH).ok()) {
        Some(d) => {
            b.push(1);
            b.extend_from_slice(&d.as_secs().to_le_bytes());
            b.extend_from_slice(&d.subsec_nanos().to_le_bytes());
        }
        None => b.push(0),
    }
}

pub fn encode(page: &ListPage, sent: SystemTime, detail: ListDetail) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + page.objects.len() * 160);
    b.push(VERSION);
    put_time(&mut b, Some(sent));
    b.push(u8::from(detail == ListDetail::UserMeta));
    match &page.next_continuation {
        Some(c) => {
            b.push(1);
            put_str(&mut b, c);
        }
        None => b.push(0),
    }
    b.extend_from_slice(&(page.common_prefixes.len() as u32).to_le_bytes());
    for p in &page.common_prefixes {
        put_str(&mut b, p);
    }
    b.extend_from_slice(&(page.objects.len() as u32).to_le_bytes());
    for o in &page.objects {
        put_str(&mut b, &o.key);
        b.extend_from_slice(&o.size.to_le_bytes());
        match &o.etag {
            Some(e) => {
                b.push(1);
                put_str(&mut b, e);
            }
            None => b.push(0),
        }
        put_time(&mut b, o.last_modified);
        b.push(u8::from(o.user_complete));
        b.extend_from_slice(&(o.user.len() as u32).to_le_bytes());
        for (k, v) in &o.user {
            put_str(&mut b, k);
            put_str(&mut b, v);
        }
    }
    b
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Some(h)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn string(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
    fn time(&mut self) -> Option<Option<SystemTime>> {
        match self.u8()? {
            0 => Some(None),
            1 => {
                let secs = self.u64()?;
                let nanos = self.u32()?;
                Some(UNIX_EPOCH.checked_add(Duration::new(secs, nanos)))
            }
            _ => None,
        }
    }
    fn flag(&mut self) -> Option<bool> {
        match self.u8()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
    /// A count of items that each take at least `min` bytes: bounded by what is left.
    fn count(&mut self, min: usize) -> Option<usize> {
        let n = self.u32()? as usize;
        (n <= self.0.len() / min).then_some(n)
    }
}

/// The page in `blob`; `None` if it is not one this version wrote.
pub fn decode(blob: &[u8]) -> Option<Saved> {
    let mut r = Reader(blob);
    if r.u8()? != VERSION {
        return None;
    }
    let sent = r.time()??;
    let detail = match r.flag()? {
        true => ListDetail::UserMeta,
        false => ListDetail::Plain,
    };
    let next_continuation = match r.flag()? {
        true => Some(r.string()?),
        false => None,
    };
    let common_prefixes = (0..r.count(4)?)
        .map(|_| r.string())
        .collect::<Option<Vec<_>>>()?;
    let n = r.count(4 + 8 + 1 + 1 + 1 + 4)?;
    let mut objects = Vec::with_capacity(n);
    for _ in 0..n {
        let key = r.string()?;
        let size = r.u64()?;
        let etag = match r.flag()? {
            true => Some(r.string()?),
            false => None,
        };
        let last_modified = r.time()?;
        let user_complete = r.flag()?;
        let user = (0..r.count(8)?)
            .map(|_| Some((r.string()?, r.string()?)))
            .collect::<Option<_>>()?;
        objects.push(ObjectMeta {
            key,
            size,
            etag,
            last_modified,
            user,
            user_complete,
        });
    }
    if !r.0.is_empty() {
        return None;
    }
    Some(Saved {
        page: ListPage {
            objects,
            common_prefixes,
            next_continuation,
        },
        sent,
        detail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bucketfs_store::UserMeta;

    #[test]
    fn a_page_comes_back_as_it_was_saved_and_damage_is_refused() {
        let mut user = UserMeta::new();
        user.insert("mode".into(), "33188".into());
        let page = ListPage {
            objects: vec![
                ObjectMeta {
                    key: "d/".into(),
                    ..Default::default()
                },
                ObjectMeta {
                    key: "d/f".into(),
                    size: 7,
                    etag: Some("\"abc\"".into()),
                    last_modified: Some(UNIX_EPOCH + Duration::new(1_700_000_000, 5)),
                    user,
                    user_complete: true,
                },
            ],
            common_prefixes: vec!["d/sub/".into()],
            next_continuation: Some("tok".into()),
        };
        let sent = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let blob = encode(&page, sent, ListDetail::UserMeta);
        let s = decode(&blob).unwrap();
        assert_eq!(s.sent, sent);
        assert_eq!(s.detail, ListDetail::UserMeta);
        assert_eq!(s.page.common_prefixes, page.common_prefixes);
        assert_eq!(s.page.next_continuation, page.next_continuation);
        assert_eq!(s.page.objects.len(), 2);
        let (a, b) = (&s.page.objects[1], &page.objects[1]);
        assert_eq!(
            (
                &a.key,
                a.size,
                &a.etag,
                a.last_modified,
                &a.user,
                a.user_complete
            ),
            (
                &b.key,
                b.size,
                &b.etag,
                b.last_modified,
                &b.user,
                b.user_complete
            )
        );
        for cut in 0..blob.len() {
            assert!(decode(&blob[..cut]).is_none(), "cut at {cut}");
        }
        let mut longer = blob.clone();
        longer.push(0);
        assert!(decode(&longer).is_none());
    }
}
