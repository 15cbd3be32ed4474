//! Lowercase SHA-256 hex digests, exactly as `stage.contract.packed._digest32` accepts them.

use pyo3::prelude::*;
use pyo3::types::PyString;

const DIGITS: &[u8; 16] = b"0123456789abcdef";

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

/// The 32 bytes of `value` when it is an exact `str` of 64 lowercase hex digits, else None.
/// (Python: `bytes.fromhex` then the round trip through `.hex()`; a non-ASCII or surrogate
/// string never passes there either.)
pub fn digest32(value: &Bound<'_, PyAny>) -> Option<[u8; 32]> {
    if !value.is_exact_instance_of::<PyString>() {
        return None;
    }
    let text = value.cast::<PyString>().ok()?.to_str().ok()?.as_bytes();
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (k, pair) in text.chunks_exact(2).enumerate() {
        out[k] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

/// `bytes.hex()` of a 32-byte digest.
pub fn hex64(digest: &[u8]) -> [u8; 64] {
    let mut out = [0u8; 64];
    for (k, byte) in digest.iter().enumerate() {
        out[2 * k] = DIGITS[(byte >> 4) as usize];
        out[2 * k + 1] = DIGITS[(byte & 15) as usize];
    }
    out
}
