//! LIST semantics over a sorted set of keys, shared by the in-process backends so that they
//! page and roll up prefixes exactly like S3 does.

use crate::{ListPage, ObjectMeta};

/// Builds one LIST page from `entries`, which must be sorted by key and already restricted to
/// keys starting with `prefix`, after key `after` if given. The continuation token is the last
/// key or prefix returned, so it works as `after` too.
pub fn page_from_sorted<I>(
    entries: I,
    prefix: &str,
    delimiter: Option<&str>,
    after: Option<&str>,
    max_keys: usize,
) -> ListPage
where
    I: IntoIterator<Item = ObjectMeta>,
{
    let max_keys = max_keys.max(1);
    let mut page = ListPage::default();
    let mut count = 0usize;
    let mut last_emitted: Option<String> = None;
    for obj in entries {
        if let Some(after) = after {
            if obj.key.as_str() <= after {
                continue;
            }
        }
        let rest = &obj.key[prefix.len()..];
        let rolled = delimiter.and_then(|d| rest.find(d).map(|i| (i, d.len())));
        if let Some((i, dlen)) = rolled {
            let cp = format!("{}{}", prefix, &rest[..i + dlen]);
            if page.common_prefixes.last() == Some(&cp) {
                continue;
            }
            if let Some(after) = after {
                if cp.as_str() <= after {
                    continue;
                }
            }
            if count == max_keys {
                page.next_continuation = last_emitted;
                return page;
            }
            last_emitted = Some(cp.clone());
            page.common_prefixes.push(cp);
        } else {
            if count == max_keys {
                page.next_continuation = last_emitted;
                return page;
            }
            last_emitted = Some(obj.key.clone());
            page.objects.push(obj);
        }
        count += 1;
    }
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objs(keys: &[&str]) -> Vec<ObjectMeta> {
        keys.iter()
            .map(|k| ObjectMeta {
                key: k.to_string(),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn rolls_up_and_pages() {
        let all = objs(&["d/", "d/a", "d/b/1", "d/b/2", "d/c", "d/e/x"]);
        let p = page_from_sorted(all.clone(), "d/", Some("/"), None, 2);
        assert_eq!(
            p.objects.iter().map(|o| o.key.as_str()).collect::<Vec<_>>(),
            ["d/", "d/a"]
        );
        assert!(p.common_prefixes.is_empty());
        let tok = p.next_continuation.unwrap();
        let p2 = page_from_sorted(all.clone(), "d/", Some("/"), Some(&tok), 2);
        assert_eq!(p2.common_prefixes, ["d/b/"]);
        assert_eq!(p2.objects[0].key, "d/c");
        let tok = p2.next_continuation.unwrap();
        let p3 = page_from_sorted(all, "d/", Some("/"), Some(&tok), 2);
        assert_eq!(p3.common_prefixes, ["d/e/"]);
        assert!(p3.next_continuation.is_none());
    }

    #[test]
    fn starts_after_a_key() {
        let all = objs(&["d/", "d/a", "d/b/1", "d/c"]);
        let p = page_from_sorted(all, "d/", Some("/"), Some("d/"), 2);
        assert_eq!(p.objects[0].key, "d/a");
        assert_eq!(p.common_prefixes, ["d/b/"]);
        assert_eq!(p.next_continuation.as_deref(), Some("d/b/"));
    }
}
