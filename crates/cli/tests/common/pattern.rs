//! Reproducible pseudo-random contents: block `i` (1 MiB) of the file with `seed` is generated
//! from `(seed, i)`, so any range can be re-created without keeping the file in memory.

use super::MIB;
use rand::{RngCore, SeedableRng};
use std::io::{Read, Write};

pub fn block(seed: u64, index: u64) -> Vec<u8> {
    let mut rng =
        rand::rngs::StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index);
    let mut b = vec![0u8; MIB];
    rng.fill_bytes(&mut b);
    b
}

/// The whole content (for small files).
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut i = 0;
    while v.len() < len {
        let b = block(seed, i);
        let n = (len - v.len()).min(MIB);
        v.extend_from_slice(&b[..n]);
        i += 1;
    }
    v
}

/// Writes `len` bytes in 1 MiB `write_all` calls.
pub fn write(w: &mut impl Write, seed: u64, len: u64) -> std::io::Result<()> {
    let mut done = 0u64;
    let mut i = 0;
    while done < len {
        let b = block(seed, i);
        let n = (len - done).min(MIB as u64) as usize;
        w.write_all(&b[..n])?;
        done += n as u64;
        i += 1;
    }
    Ok(())
}

/// Checks that a slice holds exactly the content.
pub fn check_slice(data: &[u8], seed: u64, len: u64) -> Result<(), String> {
    if data.len() as u64 != len {
        return Err(format!("length is {} bytes, expected {len}", data.len()));
    }
    for (i, chunk) in data.chunks(MIB).enumerate() {
        let b = block(seed, i as u64);
        if chunk != &b[..chunk.len()] {
            let at = chunk.iter().zip(&b).position(|(x, y)| x != y).unwrap_or(0);
            return Err(format!("content differs at byte {}", i * MIB + at));
        }
    }
    Ok(())
}

/// Reads the reader to its end and checks it returns exactly the content.
pub fn check_reader(r: &mut impl Read, seed: u64, len: u64) -> Result<(), String> {
    let mut buf = vec![0u8; MIB];
    let mut off = 0u64;
    let mut i = 0;
    loop {
        // Fill a whole block (reads may be short).
        let mut got = 0;
        while got < MIB {
            match r.read(&mut buf[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("read at byte {}: {e}", off + got as u64)),
            }
        }
        if got == 0 {
            break;
        }
        if off + got as u64 > len {
            return Err(format!("more than the expected {len} bytes"));
        }
        let b = block(seed, i);
        if buf[..got] != b[..got] {
            let at = buf[..got]
                .iter()
                .zip(&b)
                .position(|(x, y)| x != y)
                .unwrap_or(0);
            return Err(format!("content differs at byte {}", off + at as u64));
        }
        off += got as u64;
        i += 1;
        if got < MIB {
            break;
        }
    }
    if off != len {
        return Err(format!("ended after {off} bytes, expected {len}"));
    }
    Ok(())
}
