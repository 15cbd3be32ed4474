//! The chain of `verify._linearize` (stage/contract/verify.py). The walk: each chain row's
//! chain hash (Gym section 3.3) extends its parent's, compared with the manifest's, then the
//! row's mask shape; the first failure is reported for Python to raise with Gym's text. The
//! gather: the chain's columns and its cumulative hash.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyList, PyString};
use sha2::{Digest, Sha256};

use crate::buffer::Bytes;
use crate::hex::hex64;

/// Why the walk stopped: the codes `verify._linearize` maps to its errors.
const CHAIN_HASH_MISMATCH: u8 = 0;
const INVALID_MASK_ORDER: u8 = 1;
const EMPTY_GENERATION: u8 = 2;

/// `chain_walk(domain, expected, token_be, chain, starts, ends, order_ok, carry)`: walk the
/// chain's rows root first (chain[k] is a row of the pack: `starts[r]:ends[r]` of the u64be
/// token column, its mask shape `order_ok[r]`, `carry[r]`); return `(k, code)` of the first
/// failure in Python's order (chain row k's chain hash, then its mask order, then an
/// all-carry mask), or None when every row passes. `expected[k]` is compared
/// as Python's `!=` would (an exact `str` by its bytes, anything else through Python).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn chain_walk<'py>(
    py: Python<'py>,
    domain: &[u8],
    expected: &Bound<'py, PyList>,
    token_be: &Bound<'py, PyAny>,
    chain: Vec<usize>,
    starts: Vec<usize>,
    ends: Vec<usize>,
    order_ok: Vec<bool>,
    carry: Vec<usize>,
) -> PyResult<Option<(usize, u8)>> {
    let count = expected.len();
    let rows = starts.len();
    if chain.len() != count || [ends.len(), order_ok.len(), carry.len()].iter().any(|&l| l != rows) {
        return Err(pyo3::exceptions::PyValueError::new_err("one entry per chain row and per row"));
    }
    let tokens = Bytes::of(token_be)?;
    let rows_in_column = tokens.as_slice().len() / 8;
    if chain.iter().any(|&r| r >= rows || starts[r] > ends[r] || ends[r] > rows_in_column) {
        return Err(pyo3::exceptions::PyValueError::new_err("row outside the packed column"));
    }
    let running: Vec<[u8; 32]> = py.detach(|| {
        let column = tokens.as_slice();
        let mut out: Vec<[u8; 32]> = Vec::with_capacity(count);
        for &r in &chain {
            let mut h = Sha256::new();
            h.update(domain);
            match out.last() {
                None => h.update([0u8]),
                Some(parent) => {
                    h.update([1u8]);
                    h.update(parent);
                }
            }
            h.update(((ends[r] - starts[r]) as u64).to_be_bytes());
            h.update(&column[8 * starts[r]..8 * ends[r]]);
            out.push(h.finalize().into());
        }
        out
    });
    for (k, item) in expected.iter().enumerate() {
        let text = hex64(&running[k]);
        let differs = if item.is_exact_instance_of::<PyString>() {
            item.cast::<PyString>()?.to_str().map_or(true, |s| s.as_bytes() != text)
        } else {
            item.ne(PyString::new(py, std::str::from_utf8(&text).unwrap()))?
        };
        if differs {
            return Ok(Some((k, CHAIN_HASH_MISMATCH)));
        }
        let r = chain[k];
        if !order_ok[r] {
            return Ok(Some((k, INVALID_MASK_ORDER)));
        }
        if carry[r] == ends[r] - starts[r] {
            return Ok(Some((k, EMPTY_GENERATION)));
        }
    }
    Ok(None)
}

/// The chain's token ids, masks and log-probs (bytearrays) and its cumulative hash (hex).
type Gathered<'py> =
    (Bound<'py, PyByteArray>, Bound<'py, PyByteArray>, Bound<'py, PyByteArray>, Bound<'py, PyString>);

/// `chain_gather(domain, chain, starts, ends, tokens, masks, logprobs, token_be)`: the chain's
/// rows of the packed native columns (u64, f64, f64) concatenated root first, as bytearrays,
/// and the cumulative hash (Gym section 3.2) over them: `H(domain || u64(n) || the chain's
/// u64be token images)` as hex. Copying and hashing run without the GIL.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn chain_gather<'py>(
    py: Python<'py>,
    domain: &[u8],
    chain: Vec<usize>,
    starts: Vec<usize>,
    ends: Vec<usize>,
    tokens: &Bound<'py, PyAny>,
    masks: &Bound<'py, PyAny>,
    logprobs: &Bound<'py, PyAny>,
    token_be: &Bound<'py, PyAny>,
) -> PyResult<Gathered<'py>> {
    let columns = [Bytes::of(tokens)?, Bytes::of(masks)?, Bytes::of(logprobs)?, Bytes::of(token_be)?];
    let rows_in_columns = columns[0].as_slice().len() / 8;
    if starts.len() != ends.len()
        || columns.iter().any(|c| c.as_slice().len() != 8 * rows_in_columns)
        || chain.iter().any(|&r| r >= starts.len() || starts[r] > ends[r] || ends[r] > rows_in_columns)
    {
        return Err(pyo3::exceptions::PyValueError::new_err("chain rows outside the packed columns"));
    }
    let total: usize = chain.iter().map(|&r| ends[r] - starts[r]).sum();
    let outputs = [
        PyByteArray::new_with(py, 8 * total, |_| Ok(()))?,
        PyByteArray::new_with(py, 8 * total, |_| Ok(()))?,
        PyByteArray::new_with(py, 8 * total, |_| Ok(()))?,
    ];
    // Safety: bytearrays created above, referenced nowhere else while they are written.
    let mut targets: Vec<&mut [u8]> = outputs.iter().map(|o| unsafe { o.as_bytes_mut() }).collect();
    let digest: [u8; 32] = py.detach(|| {
        let mut h = Sha256::new();
        h.update(domain);
        h.update((total as u64).to_be_bytes());
        let mut at = 0;
        for &r in &chain {
            let (a, b) = (8 * starts[r], 8 * ends[r]);
            for (target, column) in targets.iter_mut().zip(&columns) {
                target[at..at + b - a].copy_from_slice(&column.as_slice()[a..b]);
            }
            h.update(&columns[3].as_slice()[a..b]);
            at += b - a;
        }
        h.finalize().into()
    });
    let [ids, mask, lps] = outputs;
    let text = hex64(&digest);
    Ok((ids, mask, lps, PyString::new(py, std::str::from_utf8(&text).unwrap())))
}
