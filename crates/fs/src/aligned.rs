//! A growable byte buffer whose data starts on a 4 KiB boundary, so a full part can be written
//! to the staging file with `O_DIRECT`, and that freezes into [`Bytes`] without a copy.

use bytes::Bytes;

/// Alignment `O_DIRECT` needs for the buffer, the file offset and the length.
pub const ALIGN: usize = 4096;

#[derive(Default)]
pub struct AlignedBuf {
    /// The allocation: `off` bytes of padding up to the boundary, then the data.
    vec: Vec<u8>,
    off: usize,
}

impl AlignedBuf {
    pub fn len(&self) -> usize {
        self.vec.len() - self.off
    }

    /// Bytes it can hold without moving.
    fn capacity(&self) -> usize {
        self.vec.capacity().saturating_sub(self.off)
    }

    /// Makes room for `total` bytes in all (moving the data once if it must grow).
    pub fn reserve_total(&mut self, total: usize) {
        if total <= self.capacity() {
            return;
        }
        // Uninitialized capacity: no pass over memory the data will overwrite anyway.
        let mut vec: Vec<u8> = Vec::with_capacity(total + ALIGN);
        let off = vec.as_ptr().align_offset(ALIGN);
        vec.resize(off, 0);
        vec.extend_from_slice(self.as_slice());
        self.vec = vec;
        self.off = off;
    }

    pub fn extend_from_slice(&mut self, data: &[u8]) {
        let end = self.len() + data.len();
        if end > self.capacity() {
            self.reserve_total(end.max(2 * self.len()));
        }
        self.vec.extend_from_slice(data);
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.vec[self.off..]
    }

    /// The data as `Bytes`, still aligned, without a copy.
    pub fn freeze(self) -> Bytes {
        let off = self.off;
        Bytes::from(self.vec).slice(off..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_aligned_and_keeps_its_bytes_while_growing() {
        let mut b = AlignedBuf::default();
        let mut want = Vec::new();
        for i in 0..300u32 {
            let chunk: Vec<u8> = (0..(i * 37 % 5000)).map(|j| (i + j) as u8).collect();
            b.extend_from_slice(&chunk);
            want.extend_from_slice(&chunk);
            assert_eq!(b.as_slice(), &want[..]);
            if b.len() > 0 {
                assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
            }
        }
        b.reserve_total(want.len() * 2);
        assert_eq!(b.as_slice(), &want[..]);
        let frozen = b.freeze();
        assert_eq!(frozen.as_ptr() as usize % ALIGN, 0);
        assert_eq!(&frozen[..], &want[..]);
    }
}
