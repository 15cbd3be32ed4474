//! `PackedRows.call_digests` (stage/contract/packed.py): every row's staged call digest (Gym
//! section 3.5) over the packed big-endian columns, in one call per rollout.

use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString};
use sha2::{Digest, Sha256};

use crate::buffer::Bytes;
use crate::hex::{digest32, hex64};

/// What one plainly valid row hashes: the payload up to its columns, the row's place in the
/// packed columns, and the three raw digests that close it.
struct Row {
    head: Vec<u8>,
    start: usize,
    end: usize,
    tail: [u8; 98],
}

fn exact_str<'a>(value: &'a Bound<'_, PyAny>) -> Option<&'a Bound<'a, PyString>> {
    if value.is_exact_instance_of::<PyString>() {
        value.cast::<PyString>().ok()
    } else {
        None
    }
}

/// An exact `int` in u64 range (Python: `type(v) is int` and the range checks).
fn exact_u64(value: &Bound<'_, PyAny>) -> Option<u64> {
    if value.is_exact_instance_of::<PyInt>() {
        value.extract::<u64>().ok()
    } else {
        None
    }
}

/// An exact `int` equal to `expected`.
fn exact_eq(value: &Bound<'_, PyAny>, expected: u64) -> bool {
    exact_u64(value) == Some(expected)
}

fn push_text(out: &mut Vec<u8>, text: &[u8]) {
    out.extend_from_slice(&(text.len() as u64).to_be_bytes());
    out.extend_from_slice(text);
}

/// A non-empty exact `str`, UTF-8 encoded; None also for a lone surrogate (the exact path's
/// UnicodeEncodeError).
fn id_text<'a>(value: &'a Bound<'_, PyAny>) -> Option<&'a [u8]> {
    let text = exact_str(value)?.to_str().ok()?;
    if text.is_empty() {
        None
    } else {
        Some(text.as_bytes())
    }
}

/// The row's payload head and tail, or None where `packed.py`'s loop appends None. The
/// attributes are read in that loop's order (the digests first, for every row).
fn plan_row(
    py: Python<'_>,
    head: &[u8],
    s: &Bound<'_, PyAny>,
    digests: [Option<[u8; 32]>; 3],
    start: usize,
    end: usize,
) -> PyResult<Option<Row>> {
    let parent = s.getattr(pyo3::intern!(py, "parent_call_id"))?;
    let mode = s.getattr(pyo3::intern!(py, "mode"))?;
    let prev = s.getattr(pyo3::intern!(py, "prev_len"))?;
    let delta = s.getattr(pyo3::intern!(py, "delta_len"))?;
    let cum = s.getattr(pyo3::intern!(py, "cum_len"))?;
    let version = s.getattr(pyo3::intern!(py, "weight_version"))?;
    let rollout_id = s.getattr(pyo3::intern!(py, "rollout_id"))?;
    let call_id = s.getattr(pyo3::intern!(py, "model_call_id"))?;
    let [Some(extras), Some(chain_hash), Some(cumulative)] = digests else { return Ok(None) };
    // versions: read lazily, as Python's `and` chain does
    if !exact_eq(&s.getattr(pyo3::intern!(py, "schema_version"))?, 2)
        || !exact_eq(&s.getattr(pyo3::intern!(py, "digest_version"))?, 2)
        || !exact_eq(&s.getattr(pyo3::intern!(py, "extras_digest_version"))?, 1)
    {
        return Ok(None);
    }
    let (Some(rollout_text), Some(call_text)) = (id_text(&rollout_id), id_text(&call_id)) else {
        return Ok(None);
    };
    let Some(mode) = exact_str(&mode).and_then(|m| m.to_str().ok()) else { return Ok(None) };
    if mode != "text" && mode != "token_in" {
        return Ok(None);
    }
    let (Some(prev), Some(delta), Some(cum), Some(version)) =
        (exact_u64(&prev), exact_u64(&delta), exact_u64(&cum), exact_u64(&version))
    else {
        return Ok(None); // not an exact int, negative, or past u64 (then cum <= U64_MAX fails)
    };
    let n = (end - start) as u64;
    if delta != n || n == 0 || prev.checked_add(delta) != Some(cum) {
        return Ok(None);
    }
    let parent_text = if parent.is_none() {
        if prev != 0 || mode != "text" {
            return Ok(None);
        }
        None
    } else {
        // not an exact non-empty str, a lone surrogate (the exact path's UnicodeEncodeError),
        // or a child that is not a token_in continuation: all the exact path's
        let Some(text) = exact_str(&parent).and_then(|p| p.to_str().ok()) else { return Ok(None) };
        if text.is_empty() || prev == 0 || mode != "token_in" {
            return Ok(None);
        }
        Some(text.as_bytes())
    };
    let mut payload = Vec::with_capacity(head.len() + 3 * 8 + rollout_text.len() + call_text.len() + 64 + 48);
    payload.extend_from_slice(head);
    push_text(&mut payload, rollout_text);
    push_text(&mut payload, call_text);
    match parent_text {
        None => payload.push(0),
        Some(text) => {
            payload.push(1);
            push_text(&mut payload, text);
        }
    }
    push_text(&mut payload, mode.as_bytes());
    for value in [prev, delta, cum, version, 8 + 8 * n, n] {
        payload.extend_from_slice(&value.to_be_bytes());
    }
    let mut tail = [0u8; 98];
    tail[..32].copy_from_slice(&extras);
    tail[32] = 1;
    tail[33..65].copy_from_slice(&chain_hash);
    tail[65] = 1;
    tail[66..].copy_from_slice(&cumulative);
    Ok(Some(Row { head: payload, start, end, tail }))
}

fn hash_row(row: &Row, tokens: &[u8], masks: &[u8], lps: &[u8]) -> [u8; 32] {
    let n = (row.end - row.start) as u64;
    let floats: Vec<u8> = [8 + 4 * n, n].iter().flat_map(|v| v.to_be_bytes()).collect();
    let mut h = Sha256::new();
    h.update(&row.head);
    h.update(&tokens[8 * row.start..8 * row.end]);
    h.update(&floats);
    h.update(&masks[4 * row.start..4 * row.end]);
    h.update(&floats);
    h.update(&lps[4 * row.start..4 * row.end]);
    h.update(row.tail);
    h.finalize().into()
}

/// `call_digests(head, snapshots, token_be, mask_f32, lp_f32, starts, ends)`: row i's call
/// digest (hex) over bytes `starts[i]:ends[i]` of the packed columns (u64be tokens, f32be masks
/// and log-probs), or None for a row that is not plainly valid. `head` is the payload's
/// domain and version bytes. Hashing runs without the GIL.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn call_digests<'py>(
    py: Python<'py>,
    head: &[u8],
    snapshots: &Bound<'py, PyList>,
    token_be: &Bound<'py, PyAny>,
    mask_f32: &Bound<'py, PyAny>,
    lp_f32: &Bound<'py, PyAny>,
    starts: Vec<usize>,
    ends: Vec<usize>,
) -> PyResult<Vec<Option<Py<PyString>>>> {
    let count = snapshots.len();
    if starts.len() != count || ends.len() != count {
        return Err(pyo3::exceptions::PyValueError::new_err("one start and end per snapshot"));
    }
    let (tokens, masks, lps) = (Bytes::of(token_be)?, Bytes::of(mask_f32)?, Bytes::of(lp_f32)?);
    let rows_in_columns = tokens.as_slice().len() / 8;
    if masks.as_slice().len() / 4 < rows_in_columns || lps.as_slice().len() / 4 < rows_in_columns {
        return Err(pyo3::exceptions::PyValueError::new_err("columns of unequal length"));
    }
    // Python decodes every row's three digests before its loop: so do we.
    let mut digests = Vec::with_capacity(count);
    for s in snapshots.iter() {
        digests.push([
            digest32(&s.getattr(pyo3::intern!(py, "extras_digest"))?),
            digest32(&s.getattr(pyo3::intern!(py, "chain_hash"))?),
            digest32(&s.getattr(pyo3::intern!(py, "cumulative_hash"))?),
        ]);
    }
    let mut plans = Vec::with_capacity(count);
    for (i, s) in snapshots.iter().enumerate() {
        let (start, end) = (starts[i], ends[i]);
        if start > end || end > rows_in_columns {
            return Err(pyo3::exceptions::PyValueError::new_err("row outside the packed columns"));
        }
        plans.push(plan_row(py, head, &s, digests[i], start, end)?);
    }
    let hashed: Vec<Option<[u8; 32]>> = py.detach(|| {
        let (t, m, l) = (tokens.as_slice(), masks.as_slice(), lps.as_slice());
        plans.iter().map(|p| p.as_ref().map(|row| hash_row(row, t, m, l))).collect()
    });
    Ok(hashed
        .into_iter()
        .map(|d| {
            d.map(|digest| {
                let text = hex64(&digest);
                // ASCII by construction
                PyString::new(py, std::str::from_utf8(&text).unwrap()).unbind()
            })
        })
        .collect())
}
