//! Subtree listing: one LIST of a directory without a delimiter, from one subdirectory on,
//! answers the lookups of that subdirectory and of the siblings after it, down to every
//! level, instead of one LIST per directory (goofys calls it "slurp"). A job that opens the
//! files of 100 directories of 20 files each costs 3 LISTs instead of 101.
//!
//! [`split`] turns such a page into the listing each directory below would have given,
//! keeping only the directories whose keys the page holds all of (keys come in order, so
//! those are all but the one the page ends in, or all of them on the last page).

use bucketfs_store::{ListPage, ObjectMeta};
use std::collections::BTreeMap;

/// What one page of a subtree listing of the directory with key prefix `prefix` shows.
#[derive(Debug, Default)]
pub struct Subtrees {
    /// Directories the page holds whole, by path below the listed directory (`s`, `s/x`;
    /// parents before their children), each with the page a delimiter LIST of it from its
    /// start would give (its marker first).
    pub complete: Vec<(String, ListPage)>,
    /// The name of the listed directory's entry the page ended in, where the next page
    /// starts (after `prefix` + it): `None` on the last page, and when the page ended in
    /// the entry it started with (one subtree bigger than a page: listing it again from its
    /// start would get no further).
    pub next: Option<String>,
}

/// One directory being assembled from a page.
#[derive(Default)]
struct Dir {
    marker: Option<ObjectMeta>,
    objects: Vec<ObjectMeta>,
    prefixes: Vec<String>,
}

/// Splits `page`, a LIST of `prefix` with no delimiter, into [`Subtrees`].
pub fn split(prefix: &str, page: ListPage) -> Subtrees {
    let truncated = page.next_continuation.is_some();
    let first_entry = page
        .objects
        .first()
        .and_then(|o| entry_of(prefix, &o.key))
        .map(str::to_string);
    let last_key = page.objects.last().map(|o| o.key.clone());
    // Directories by key (`prefix` + path + `/`), in key order: parents sort before children.
    let mut dirs: BTreeMap<String, Dir> = BTreeMap::new();
    for o in page.objects {
        let Some(rel) = o.key.strip_prefix(prefix) else {
            continue;
        };
        let rel_len = rel.len();
        let slashes: Vec<usize> = rel.match_indices('/').map(|(i, _)| i).collect();
        // Each directory the key is below: the key is its marker, one of its objects, or
        // below one of its subdirectories.
        for (n, &i) in slashes.iter().enumerate() {
            let dir_key = o.key[..prefix.len() + i + 1].to_string();
            let d = dirs.entry(dir_key.clone()).or_default();
            if i + 1 == rel_len {
                d.marker = Some(o.clone());
            } else if let Some(&j) = slashes.get(n + 1) {
                let sub = o.key[..prefix.len() + j + 1].to_string();
                if d.prefixes.last() != Some(&sub) {
                    d.prefixes.push(sub);
                }
            } else {
                d.objects.push(o.clone());
            }
        }
    }
    let complete = dirs
        .into_iter()
        .filter(|(k, _)| !truncated || last_key.as_ref().is_some_and(|l| !l.starts_with(k)))
        .map(|(k, d)| {
            let path = k[prefix.len()..k.len() - 1].to_string();
            let objects = d.marker.into_iter().chain(d.objects).collect();
            let page = ListPage {
                objects,
                common_prefixes: d.prefixes,
                next_continuation: None,
            };
            (path, page)
        })
        .collect();
    let next = match (truncated, last_key) {
        (true, Some(l)) => entry_of(prefix, &l)
            .filter(|e| first_entry.as_deref() != Some(*e))
            .map(str::to_string),
        _ => None,
    };
    Subtrees { complete, next }
}

/// The name of the listed directory's entry `key` is (or is below).
fn entry_of<'a>(prefix: &str, key: &'a str) -> Option<&'a str> {
    let rel = key.strip_prefix(prefix)?;
    Some(rel.split('/').next().unwrap_or(rel))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(keys: &[&str], truncated: bool) -> ListPage {
        ListPage {
            objects: keys
                .iter()
                .map(|k| ObjectMeta {
                    key: k.to_string(),
                    ..Default::default()
                })
                .collect(),
            common_prefixes: vec![],
            next_continuation: truncated.then(|| "token".to_string()),
        }
    }

    fn keys(p: &ListPage) -> Vec<&str> {
        p.objects.iter().map(|o| o.key.as_str()).collect()
    }

    #[test]
    fn a_last_page_holds_every_directory_below_at_every_level() {
        let s = split(
            "p/",
            page(
                &[
                    "p/a/", "p/a/f", "p/a/x/g", "p/a/x/h", "p/a/y/", "p/b/f", "p/c",
                ],
                false,
            ),
        );
        let names: Vec<&str> = s.complete.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "a/x", "a/y", "b"]);
        let (_, a) = &s.complete[0];
        assert_eq!(keys(a), ["p/a/", "p/a/f"], "marker first, then files");
        assert_eq!(a.common_prefixes, ["p/a/x/", "p/a/y/"]);
        assert_eq!(keys(&s.complete[1].1), ["p/a/x/g", "p/a/x/h"]);
        assert_eq!(keys(&s.complete[2].1), ["p/a/y/"]);
        assert_eq!(s.next, None);
    }

    #[test]
    fn a_truncated_page_holds_all_but_the_directory_it_ends_in() {
        let s = split("p/", page(&["p/a/f", "p/b/f", "p/b/x/g", "p/c/f"], true));
        let names: Vec<&str> = s.complete.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b", "b/x"]);
        assert_eq!(s.next.as_deref(), Some("c"));
        // Ends in a file of the listed directory: every directory seen is whole.
        let s = split("p/", page(&["p/a/f", "p/b"], true));
        assert_eq!(s.complete.len(), 1);
        assert_eq!(s.next.as_deref(), Some("b"));
    }

    #[test]
    fn one_subtree_bigger_than_a_page_gives_no_next_page() {
        let s = split("p/", page(&["p/a/f", "p/a/g", "p/a/x/h"], true));
        // `a/x` may hold more after the page; so may `a`.
        assert!(s.complete.is_empty());
        assert_eq!(s.next, None);
    }

    #[test]
    fn names_with_empty_parts_are_split_as_a_delimiter_listing_would() {
        // `a//f`: `a` holds a subdirectory with an empty name (left out by `page_entries`).
        let s = split("", page(&["a//f", "a/b"], false));
        let (_, a) = &s.complete[0];
        assert_eq!(a.common_prefixes, ["a//"]);
        assert_eq!(keys(a), ["a/b"]);
        assert_eq!(s.complete[1].0, "a/");
    }
}
