//! Keys made only of whitespace (` `, a tab, a newline, U+00A0, U+3000...). S3 stores them,
//! but the SDK refuses a key whose `trim()` is empty before sending anything ("key was
//! missing"), so such a file at the top of a whole-bucket mount was listed and could never be
//! read, written, renamed or deleted (in background mode: acknowledged and never stored).
//! Such a key goes to the SDK behind a mark ([`sdk_key`]: a NUL, a 0x01, `bucketfs-blank`,
//! a NUL), and [`BlankKeys`] takes the mark out of the request's path before the request is
//! signed. A key of another client holding NULs (copied by a directory rename) is sent as
//! it is: only that whole sequence is a mark.

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::BeforeTransmitInterceptorContextMut;
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::ConfigBag;
use std::borrow::Cow;

/// What [`sdk_key`] puts before a blank key.
const MARK: &str = "\0\u{1}bucketfs-blank\0";
/// [`MARK`] after a `/`, as the SDK's path encoding writes it.
const PATH_MARK: &str = "/%00%01bucketfs-blank%00";

/// `key` as it is given to the SDK: behind [`MARK`] when it is all whitespace.
pub fn sdk_key(key: &str) -> Cow<'_, str> {
    match !key.is_empty() && key.trim().is_empty() {
        true => Cow::Owned(format!("{MARK}{key}")),
        false => Cow::Borrowed(key),
    }
}

/// Takes the NUL of [`sdk_key`] out of a request's path: the request names the key itself.
#[derive(Debug)]
pub struct BlankKeys;

impl Intercept for BlankKeys {
    fn name(&self) -> &'static str {
        "bucketfs::BlankKeys"
    }

    fn modify_before_signing(
        &self,
        context: &mut BeforeTransmitInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let req = context.request_mut();
        if let Some(uri) = unmarked(req.uri()) {
            req.set_uri(uri)?;
        }
        Ok(())
    }
}

/// `uri` without the [`MARK`] that starts its key, if one does (never in the query).
fn unmarked(uri: &str) -> Option<String> {
    let path_end = uri.find('?').unwrap_or(uri.len());
    let at = uri[..path_end].find(PATH_MARK)?;
    Some(format!("{}/{}", &uri[..at], &uri[at + PATH_MARK.len()..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_blank_keys_are_marked_and_the_mark_leaves_only_the_path() {
        assert_eq!(sdk_key("a b"), "a b");
        assert_eq!(sdk_key(" x"), " x");
        assert_eq!(sdk_key(""), "");
        for blank in [" ", "\t", "\n", "\u{a0}", "\u{3000}", "\u{2028} "] {
            assert_eq!(sdk_key(blank), format!("{MARK}{blank}"));
        }
        assert_eq!(
            unmarked("http://h:9000/b/%00%01bucketfs-blank%00%20?x-id=PutObject").as_deref(),
            Some("http://h:9000/b/%20?x-id=PutObject")
        );
        assert_eq!(
            unmarked("https://b.s3.amazonaws.com/%00%01bucketfs-blank%00%C2%A0?tagging").as_deref(),
            Some("https://b.s3.amazonaws.com/%C2%A0?tagging")
        );
        // Not in the query; not a key of another client holding NULs.
        assert_eq!(
            unmarked("http://h/b/a%20b?prefix=%2F%00%01bucketfs-blank%00"),
            None
        );
        assert_eq!(unmarked("http://h/b/d/%00x"), None);
        assert_eq!(unmarked("http://h/b/d/%00%20"), None);
    }
}
