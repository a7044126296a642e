//! Listings that carry every key S3 can store.
//!
//! A key may hold characters XML 1.0 cannot carry (most control characters). S3 and MinIO put
//! them in a listing exactly only when it is asked with `encoding-type=url` (MinIO writes
//! U+FFFD otherwise, a name nobody can then open or delete), so every LIST asks for it and
//! every key, prefix and marker of the answer goes through [`decode`] when the answer says
//! `<EncodingType>url</EncodingType>`. A store that ignores the parameter and sends such
//! characters raw would make the whole answer unparseable (one key failing its directory):
//! [`SanitizeListing`] rewrites each as a character reference, which the XML decoder accepts,
//! before the SDK parses the answer, so that key comes through exact and the others with it.

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::BeforeDeserializationInterceptorContextMut;
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::body::SdkBody;
use aws_smithy_types::config_bag::ConfigBag;
use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

/// A url-encoded field of a listing, decoded: `%XX` is a byte and `+` a space (S3 encodes `+`
/// itself as `%2B`). `None` when the bytes are not UTF-8, which no key is.
pub fn decode(s: &str) -> Option<String> {
    if !s.contains(['%', '+']) {
        return Some(s.to_string());
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 3 <= b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(byte) => {
                        out.push(byte);
                        i += 3;
                        continue;
                    }
                    // Not an escape: kept as it is.
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// Whether XML 1.0 can carry `c` (as text or as a character reference alike).
fn xml_char(c: char) -> bool {
    !matches!(c, '\0'..='\u{8}' | '\u{b}' | '\u{c}' | '\u{e}'..='\u{1f}' | '\u{fffe}' | '\u{ffff}')
}

/// A listing answer XML can parse: characters it cannot carry become character references
/// (`&#8;`), which the SDK's decoder turns back into the character; bytes that are not UTF-8
/// become U+FFFD. An answer without them is returned as it is.
pub fn sanitize(body: Bytes) -> Bytes {
    let clean = match std::str::from_utf8(&body) {
        Ok(s) => s.chars().all(xml_char),
        Err(_) => false,
    };
    if clean {
        return body;
    }
    let text = String::from_utf8_lossy(&body);
    let mut out = String::with_capacity(text.len() + 64);
    let mut escaped = 0usize;
    for c in text.chars() {
        if xml_char(c) {
            out.push(c);
        } else {
            escaped += 1;
            out.push_str(&format!("&#{};", c as u32));
        }
    }
    tracing::warn!(
        "a listing answer carried {escaped} raw character(s) XML cannot hold{}: read as \
         character references (the store ignores encoding-type=url)",
        if matches!(text, std::borrow::Cow::Owned(_)) {
            " and bytes that are not UTF-8 (read as U+FFFD)"
        } else {
            ""
        }
    );
    Bytes::from(out)
}

/// A response body read whole, then given on as one [`sanitize`]d frame.
struct Sanitized {
    inner: Pin<Box<SdkBody>>,
    buf: BytesMut,
    done: bool,
}

impl Body for Sanitized {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        while !this.done {
            match ready!(this.inner.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        this.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => {
                    this.done = true;
                    let all = std::mem::take(&mut this.buf).freeze();
                    return Poll::Ready(Some(Ok(Frame::data(sanitize(all)))));
                }
            }
        }
        Poll::Ready(None)
    }
}

/// Puts every listing answer through [`sanitize`] before the SDK parses it.
#[derive(Debug, Clone, Copy)]
pub struct SanitizeListing;

impl Intercept for SanitizeListing {
    fn name(&self) -> &'static str {
        "bucketfs::SanitizeListing"
    }

    fn modify_before_deserialization(
        &self,
        context: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let body = context.response_mut().body_mut();
        let inner = std::mem::replace(body, SdkBody::taken());
        *body = SdkBody::from_body_1_x(Sanitized {
            inner: Box::pin(inner),
            buf: BytesMut::new(),
            done: false,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_what_s3_encodes() {
        assert_eq!(decode("d/a%08b%0Bc%1Fd").unwrap(), "d/a\u{8}b\u{b}c\u{1f}d");
        assert_eq!(decode("d/sp+ace%2Bplus%25").unwrap(), "d/sp ace+plus%");
        assert_eq!(decode("d/sub%1B/").unwrap(), "d/sub\u{1b}/");
        assert_eq!(decode("%C3%BC%E6%97%A5").unwrap(), "ü日");
        assert_eq!(decode("plain/key").unwrap(), "plain/key");
        // Not escapes: kept.
        assert_eq!(decode("100%").unwrap(), "100%");
        assert_eq!(decode("a%zzb%4").unwrap(), "a%zzb%4");
        // Not UTF-8: no key.
        assert_eq!(decode("bad%FF"), None);
    }

    #[test]
    fn sanitize_leaves_clean_answers_alone() {
        let b = Bytes::from_static(b"<a>\tx\ny\r&#8;</a>");
        assert_eq!(sanitize(b.clone()).as_ptr(), b.as_ptr());
    }

    #[test]
    fn sanitize_escapes_what_xml_cannot_carry() {
        let raw = Bytes::from(b"<K>a\x08b\x1f\xef\xbf\xbe\xff</K>".to_vec());
        assert_eq!(
            &sanitize(raw)[..],
            "<K>a&#8;b&#31;&#65534;\u{fffd}</K>".as_bytes()
        );
    }
}
