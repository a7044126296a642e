//! A set of byte ranges (the dirty parts of a file being rewritten), kept merged and sorted.

use std::collections::BTreeMap;
use std::ops::Range;

#[derive(Debug, Clone, Default)]
pub struct Extents {
    /// start -> end, non-overlapping and non-adjacent.
    map: BTreeMap<u64, u64>,
}

impl Extents {
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Adds `r`, merging it with any range it overlaps or touches.
    pub fn insert(&mut self, r: Range<u64>) {
        if r.start >= r.end {
            return;
        }
        let (mut start, mut end) = (r.start, r.end);
        // A range starting at or before `start` may reach into the new one.
        if let Some((&s, &e)) = self.map.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
            }
        }
        let absorbed: Vec<u64> = self.map.range(start..=end).map(|(&s, _)| s).collect();
        for s in absorbed {
            let e = self.map.remove(&s).unwrap_or(s);
            end = end.max(e);
        }
        self.map.insert(start, end);
    }

    /// Forgets everything at or after `offset` (truncate).
    pub fn truncate(&mut self, offset: u64) {
        let cut: Vec<u64> = self.map.range(offset..).map(|(&s, _)| s).collect();
        for s in cut {
            self.map.remove(&s);
        }
        if let Some((_, e)) = self.map.range_mut(..offset).next_back() {
            if *e > offset {
                *e = offset;
            }
        }
    }

    /// Removes every byte of `r` from the set.
    pub fn remove(&mut self, r: Range<u64>) {
        if !self.intersects(&r) {
            return;
        }
        for (s, e) in std::mem::take(&mut self.map) {
            if s < r.start {
                self.map.insert(s, e.min(r.start));
            }
            if e > r.end {
                self.map.insert(s.max(r.end), e);
            }
        }
    }

    /// Whether every byte of `r` is in the set.
    pub fn covers(&self, r: &Range<u64>) -> bool {
        if r.start >= r.end {
            return true;
        }
        match self.map.range(..=r.start).next_back() {
            Some((_, &e)) => e >= r.end,
            None => false,
        }
    }

    /// Whether any byte of `r` is in the set.
    pub fn intersects(&self, r: &Range<u64>) -> bool {
        self.segments(r.clone()).any(|(_, dirty)| dirty)
    }

    /// Splits `r` into consecutive pieces, each marked dirty (in the set) or clean.
    pub fn segments(&self, r: Range<u64>) -> impl Iterator<Item = (Range<u64>, bool)> + '_ {
        let mut pos = r.start;
        let end = r.end;
        let mut inner = self
            .map
            .range(..end)
            .filter(move |(_, &e)| e > r.start)
            .map(|(&s, &e)| (s, e))
            .peekable();
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            match inner.peek().copied() {
                Some((s, e)) if s <= pos => {
                    inner.next();
                    let stop = e.min(end);
                    let seg = pos..stop;
                    pos = stop;
                    Some((seg, true))
                }
                Some((s, _)) => {
                    let seg = pos..s.min(end);
                    pos = seg.end;
                    Some((seg, false))
                }
                None => {
                    let seg = pos..end;
                    pos = end;
                    Some((seg, false))
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(x: &Extents) -> Vec<(u64, u64)> {
        x.map.iter().map(|(&s, &e)| (s, e)).collect()
    }

    #[test]
    fn merges_overlapping_and_touching() {
        let mut x = Extents::default();
        x.insert(10..20);
        x.insert(30..40);
        x.insert(20..25);
        assert_eq!(ranges(&x), [(10, 25), (30, 40)]);
        x.insert(5..35);
        assert_eq!(ranges(&x), [(5, 40)]);
        x.insert(50..60);
        x.insert(45..46);
        assert_eq!(ranges(&x), [(5, 40), (45, 46), (50, 60)]);
        assert!(x.covers(&(6..40)));
        assert!(!x.covers(&(6..41)));
        assert!(x.intersects(&(40..46)));
        assert!(!x.intersects(&(40..45)));
    }

    #[test]
    fn remove_splits() {
        let mut x = Extents::default();
        x.insert(0..10);
        x.insert(20..30);
        x.remove(5..25);
        assert_eq!(ranges(&x), [(0, 5), (25, 30)]);
        x.remove(26..27);
        assert_eq!(ranges(&x), [(0, 5), (25, 26), (27, 30)]);
        x.remove(100..200);
        x.remove(0..30);
        assert!(ranges(&x).is_empty());
    }

    #[test]
    fn truncate_cuts() {
        let mut x = Extents::default();
        x.insert(0..10);
        x.insert(20..30);
        x.truncate(25);
        assert_eq!(ranges(&x), [(0, 10), (20, 25)]);
        x.truncate(5);
        assert_eq!(ranges(&x), [(0, 5)]);
    }

    #[test]
    fn segments_alternate() {
        let mut x = Extents::default();
        x.insert(10..20);
        x.insert(30..40);
        let s: Vec<_> = x.segments(0..35).collect();
        assert_eq!(
            s,
            [
                (0..10, false),
                (10..20, true),
                (20..30, false),
                (30..35, true)
            ]
        );
        let s: Vec<_> = x.segments(15..16).collect();
        assert_eq!(s, [(15..16, true)]);
        let s: Vec<_> = x.segments(40..50).collect();
        assert_eq!(s, [(40..50, false)]);
    }
}
