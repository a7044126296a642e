//! Plain data passed across the store trait.

use std::collections::BTreeMap;
use std::time::SystemTime;

/// User metadata (`x-amz-meta-*`), keys lower-case and without the prefix.
pub type UserMeta = BTreeMap<String, String>;

/// The version of an object whose headers other than the user metadata a new object takes
/// (see [`crate::ObjectStore::create_multipart`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadersFrom<'a> {
    pub key: &'a str,
    /// Its ETag, when known: the headers of that version only.
    pub etag: Option<&'a str>,
}

/// What HEAD (or a LIST entry) says about one object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObjectMeta {
    pub key: String,
    pub size: u64,
    pub etag: Option<String>,
    pub last_modified: Option<SystemTime>,
    /// User metadata. HEAD always fills it; a LIST entry has it only when the store can say
    /// it in a listing (MinIO's `metadata=true`, the local and memory stores when asked).
    pub user: UserMeta,
    /// `user` is the object's whole user metadata (a HEAD, or a listing that carried it).
    /// When false, `user` is empty and says nothing: ask HEAD.
    pub user_complete: bool,
}

/// What the entries of a LIST should carry besides key, size, ETag and time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListDetail {
    /// Nothing more: the cheapest listing.
    Plain,
    /// Their user metadata too, where the store can give it in a listing (MinIO's
    /// `metadata=true`, the local store); it costs the server a little per entry.
    UserMeta,
}

/// Where a LIST page starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListFrom {
    /// At the first key under the prefix.
    Start,
    /// At the first key after this one (S3 `start-after`). A directory listing starts after
    /// its own marker `dir/`, so a directory of 1,000 entries fits one page.
    After(String),
    /// Where the previous page ended: its [`ListPage::next_continuation`].
    Token(String),
}

impl ListFrom {
    /// For stores whose continuation token is the last key returned (the in-process ones):
    /// the key the page starts after, if any.
    pub fn after_key(&self) -> Option<&str> {
        match self {
            ListFrom::Start => None,
            ListFrom::After(k) | ListFrom::Token(k) => Some(k),
        }
    }
}

/// One page of a LIST.
#[derive(Debug, Clone, Default)]
pub struct ListPage {
    pub objects: Vec<ObjectMeta>,
    /// Rolled-up prefixes, each ending with the delimiter.
    pub common_prefixes: Vec<String>,
    /// Pass back to get the next page; `None` on the last page.
    pub next_continuation: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletedPart {
    pub part_number: u32,
    pub etag: String,
}

#[derive(Debug, Clone)]
pub struct MultipartUpload {
    pub key: String,
    pub upload_id: String,
    pub initiated: Option<SystemTime>,
}
