//! User metadata in listings: MinIO's `metadata=true` extension of ListObjectsV2.
//!
//! Plain S3 listings carry key, size, ETag and time but no user metadata, so the mode, owner
//! and mtime that bucketfs (like s3fs) keeps in `x-amz-meta-*` cost one HEAD per object. MinIO
//! answers `GET /bucket?list-type=2&metadata=true` with one more element per `<Contents>`:
//!
//! ```xml
//! <Contents><Key>d/a</Key>...<UserMetadata><X-Amz-Meta-Mode>33188</X-Amz-Meta-Mode>
//!   <content-type>binary/octet-stream</content-type></UserMetadata>...</Contents>
//! ```
//!
//! It is there for every object (with at least the content type), so an entry with the element
//! has its whole user metadata and an entry without it (any other server) has none.
//! `aws-sdk-s3` skips elements it does not know, so [`S3Store`](crate::s3::S3Store) adds the
//! query parameter before signing and reads the raw answer with an interceptor; this module
//! holds the setting, the parser and the interceptor.

use crate::UserMeta;
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::AfterDeserializationInterceptorContextRef;
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::ConfigBag;
use aws_smithy_xml::decode::{try_data, Document, ScopedDecoder};
use parking_lot::Mutex;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// Whether LIST requests ask for user metadata (`--list-metadata`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ListMetadata {
    /// Ask only when the server says it is MinIO (`Server: MinIO`); others get plain LISTs.
    #[default]
    Auto,
    /// Always ask. A server that ignores the parameter still works: its entries simply come
    /// without metadata and are HEADed as before.
    On,
    /// Never ask.
    Off,
}

impl FromStr for ListMetadata {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            _ => Err(format!("{s:?} is not one of auto, on, off")),
        }
    }
}

impl fmt::Display for ListMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        })
    }
}

/// The query parameter that asks MinIO for user metadata.
pub const QUERY_PARAM: &str = "metadata=true";

/// Whether a `Server` response header names MinIO.
pub fn is_minio(server: Option<&str>) -> bool {
    server.is_some_and(|s| s.trim().to_ascii_lowercase().starts_with("minio"))
}

/// Appends [`QUERY_PARAM`] to a request URI.
pub fn with_query_param(uri: &str) -> String {
    let sep = if uri.contains('?') { '&' } else { '?' };
    format!("{uri}{sep}{QUERY_PARAM}")
}

/// One `<Contents>` of a listing: its key, and its user metadata if the answer had it.
pub type Entry = (String, Option<UserMeta>);

/// The user metadata of each `<Contents>` of a ListObjectsV2 answer, in document order:
/// `None` for an entry without `<UserMetadata>`. Keys are lower-case without `x-amz-meta-`;
/// other headers in the element (content type, encryption) are not user metadata and are left
/// out, so the map equals what HEAD gives.
pub fn parse_listing(body: &[u8]) -> Result<Vec<Entry>, String> {
    let mut doc = Document::try_from(body).map_err(|e| e.to_string())?;
    let mut root = doc.root_element().map_err(|e| e.to_string())?;
    if !root.start_el().matches("ListBucketResult") {
        return Err(format!("unexpected root <{}>", root.start_el().local()));
    }
    let mut out = Vec::new();
    while let Some(mut el) = root.next_tag() {
        if el.start_el().matches("Contents") {
            out.push(parse_contents(&mut el)?);
        }
    }
    Ok(out)
}

fn parse_contents(el: &mut ScopedDecoder<'_, '_>) -> Result<Entry, String> {
    let mut key = None;
    let mut user = None;
    while let Some(mut child) = el.next_tag() {
        if child.start_el().matches("Key") {
            key = Some(
                try_data(&mut child)
                    .map_err(|e| e.to_string())?
                    .into_owned(),
            );
        } else if child.start_el().matches("UserMetadata") {
            let mut meta = UserMeta::new();
            while let Some(mut h) = child.next_tag() {
                let name = h.start_el().local().to_ascii_lowercase();
                let value = try_data(&mut h).map_err(|e| e.to_string())?;
                if let Some(short) = name.strip_prefix("x-amz-meta-") {
                    meta.insert(short.to_string(), value.into_owned());
                }
            }
            user = Some(meta);
        }
    }
    Ok((key.ok_or("<Contents> without <Key>")?, user))
}

/// What one LIST answer said beyond what the SDK parses.
#[derive(Debug, Default)]
pub struct Captured {
    /// The `Server` header names MinIO.
    pub minio: bool,
    /// The parsed entries, when asked for and the answer was a success.
    pub entries: Option<Result<Vec<Entry>, String>>,
}

/// Reads the `Server` header and, with `parse`, the raw body of a ListObjectsV2 answer.
#[derive(Debug, Clone)]
pub struct ListCapture {
    pub parse: bool,
    pub out: Arc<Mutex<Captured>>,
}

impl ListCapture {
    pub fn new(parse: bool) -> Self {
        Self {
            parse,
            out: Arc::default(),
        }
    }

    pub fn take(&self) -> Captured {
        std::mem::take(&mut *self.out.lock())
    }
}

impl Intercept for ListCapture {
    fn name(&self) -> &'static str {
        "bucketfs::ListCapture"
    }

    fn read_after_deserialization(
        &self,
        context: &AfterDeserializationInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let resp = context.response();
        let mut out = self.out.lock();
        out.minio = is_minio(resp.headers().get("server"));
        out.entries = None;
        if self.parse && resp.status().is_success() {
            // The body was read whole before deserialization (ListObjectsV2 does not stream).
            out.entries = resp.body().bytes().map(parse_listing);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer as MinIO gives it (captured from a real server), with escapes in keys and
    /// values, an entry without user metadata and a common prefix.
    const MINIO: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>tlm</Name><Prefix>d/</Prefix><KeyCount>4</KeyCount><MaxKeys>1000</MaxKeys><Delimiter>/</Delimiter><IsTruncated>false</IsTruncated><Contents><Key>d/a</Key><LastModified>2026-11-23T01:50:26.587Z</LastModified><ETag>&#34;764efa883dda1e11db47671c4a3bbd9e&#34;</ETag><Size>3</Size><StorageClass>STANDARD</StorageClass><UserMetadata><X-Amz-Meta-Uid>1000</X-Amz-Meta-Uid><X-Amz-Meta-Mtime>1700000000.5</X-Amz-Meta-Mtime><X-Amz-Meta-Gid>1000</X-Amz-Meta-Gid><X-Amz-Meta-Mode>33188</X-Amz-Meta-Mode><content-type>binary/octet-stream</content-type></UserMetadata><Internal><K>1</K><M>0</M></Internal></Contents><Contents><Key>d/b</Key><LastModified>2026-11-23T01:50:27.245Z</LastModified><ETag>&#34;764efa883dda1e11db47671c4a3bbd9e&#34;</ETag><Size>3</Size><StorageClass>STANDARD</StorageClass><UserMetadata><content-type>binary/octet-stream</content-type></UserMetadata><Internal><K>1</K><M>0</M></Internal></Contents><Contents><Key>d/x&amp;y&lt;z&gt;</Key><LastModified>2026-11-23T01:50:27.906Z</LastModified><ETag>&#34;764efa883dda1e11db47671c4a3bbd9e&#34;</ETag><Size>3</Size><StorageClass>STANDARD</StorageClass><UserMetadata><content-type>text/plain</content-type><X-Amz-Meta-Mode>33261</X-Amz-Meta-Mode><X-Amz-Meta-Weird-Key>a&amp;b&lt;c&gt;</X-Amz-Meta-Weird-Key></UserMetadata><Internal><K>1</K><M>0</M></Internal></Contents><CommonPrefixes><Prefix>d/sub/</Prefix></CommonPrefixes></ListBucketResult>"#;

    fn meta(pairs: &[(&str, &str)]) -> Option<UserMeta> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn parses_minio_user_metadata() {
        let got = parse_listing(MINIO.as_bytes()).unwrap();
        assert_eq!(
            got,
            vec![
                (
                    "d/a".to_string(),
                    meta(&[
                        ("uid", "1000"),
                        ("gid", "1000"),
                        ("mtime", "1700000000.5"),
                        ("mode", "33188")
                    ])
                ),
                // No x-amz-meta-* at all: complete and empty (the content type is not user
                // metadata).
                ("d/b".to_string(), meta(&[])),
                (
                    "d/x&y<z>".to_string(),
                    meta(&[("mode", "33261"), ("weird-key", "a&b<c>")])
                ),
            ]
        );
    }

    #[test]
    fn entries_without_the_element_have_no_metadata() {
        // What AWS S3 (or any server ignoring the parameter) answers.
        let xml = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix></Prefix><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated><NextContinuationToken>tok</NextContinuationToken><Contents><Key>a</Key><Size>1</Size></Contents><Contents><Key>b/</Key><Size>0</Size><UserMetadata/></Contents></ListBucketResult>"#;
        let got = parse_listing(xml.as_bytes()).unwrap();
        assert_eq!(
            got,
            vec![("a".to_string(), None), ("b/".to_string(), meta(&[]))]
        );
    }

    #[test]
    fn empty_listing_and_empty_values() {
        let xml = r#"<ListBucketResult><Contents><Key>k</Key><UserMetadata><X-Amz-Meta-Empty></X-Amz-Meta-Empty><X-AMZ-META-Upper>V</X-AMZ-META-Upper></UserMetadata></Contents></ListBucketResult>"#;
        assert_eq!(
            parse_listing(xml.as_bytes()).unwrap(),
            vec![("k".to_string(), meta(&[("empty", ""), ("upper", "V")]))]
        );
        assert_eq!(
            parse_listing(b"<ListBucketResult></ListBucketResult>").unwrap(),
            vec![]
        );
    }

    #[test]
    fn rejects_what_is_not_a_listing() {
        assert!(parse_listing(b"<Error><Code>x</Code></Error>").is_err());
        assert!(parse_listing(b"not xml").is_err());
        assert!(parse_listing(
            b"<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>"
        )
        .is_err());
    }

    #[test]
    fn setting_and_helpers() {
        assert_eq!("auto".parse::<ListMetadata>().unwrap(), ListMetadata::Auto);
        assert_eq!(" ON ".parse::<ListMetadata>().unwrap(), ListMetadata::On);
        assert_eq!("off".parse::<ListMetadata>().unwrap(), ListMetadata::Off);
        assert!("yes".parse::<ListMetadata>().is_err());
        assert_eq!(ListMetadata::On.to_string(), "on");
        assert!(is_minio(Some("MinIO")));
        assert!(!is_minio(Some("AmazonS3")));
        assert!(!is_minio(None));
        assert_eq!(
            with_query_param("http://h/b?list-type=2&prefix=a"),
            "http://h/b?list-type=2&prefix=a&metadata=true"
        );
        assert_eq!(with_query_param("http://h/b"), "http://h/b?metadata=true");
    }
}
