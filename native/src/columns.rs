//! The column checks and big-endian images of `PackedRows.try_pack` (stage/contract/packed.py)
//! in one pass over the packed columns, instead of ~15 numpy passes and their calls.

use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::buffer::Bytes;

type Checked<'py> =
    (Bound<'py, PyByteArray>, Bound<'py, PyByteArray>, Bound<'py, PyByteArray>, Vec<usize>, Vec<bool>);

/// `check_columns(tokens, masks, logprobs, bounds)`: the packed native-order columns (u64,
/// f64, f64) of rows `bounds[r]:bounds[r + 1]`. None where `try_pack` gives up (a mask
/// outside {0.0, 1.0}, a carried position with a log-prob other than +-0.0, a log-prob that
/// is not finite in float32); else the u64be token image, the f32be mask and log-prob images
/// (round to nearest even, as numpy's cast), and per row the carry (positions not generated)
/// and whether no generated position is followed by a carried one within the row.
#[pyfunction]
pub fn check_columns<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    masks: &Bound<'py, PyAny>,
    logprobs: &Bound<'py, PyAny>,
    bounds: Vec<usize>,
) -> PyResult<Option<Checked<'py>>> {
    let (tokens, masks, logprobs) = (Bytes::of(tokens)?, Bytes::of(masks)?, Bytes::of(logprobs)?);
    let (t, m, l) = (tokens.as_slice(), masks.as_slice(), logprobs.as_slice());
    let total = t.len() / 8;
    if t.len() % 8 != 0
        || m.len() != 8 * total
        || l.len() != 8 * total
        || bounds.first() != Some(&0)
        || bounds.last() != Some(&total)
        || bounds.windows(2).any(|w| w[0] > w[1])
    {
        return Err(pyo3::exceptions::PyValueError::new_err("columns and bounds do not match"));
    }
    let token_be = PyByteArray::new_with(py, 8 * total, |_| Ok(()))?;
    let mask_f32 = PyByteArray::new_with(py, 4 * total, |_| Ok(()))?;
    let lp_f32 = PyByteArray::new_with(py, 4 * total, |_| Ok(()))?;
    // Safety: three bytearrays created above, referenced nowhere else while they are written.
    let (tb, mb, lb) = unsafe { (token_be.as_bytes_mut(), mask_f32.as_bytes_mut(), lp_f32.as_bytes_mut()) };
    for (src, dst) in t.chunks_exact(8).zip(tb.chunks_exact_mut(8)) {
        let value = u64::from_ne_bytes(src.try_into().unwrap());
        dst.copy_from_slice(&value.to_be_bytes());
    }
    let rows = bounds.len() - 1;
    let (mut carry, mut order_ok) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    for r in 0..rows {
        let (start, end) = (bounds[r], bounds[r + 1]);
        let (mask_in, lp_in) = (&m[8 * start..8 * end], &l[8 * start..8 * end]);
        let (mask_out, lp_out) = (&mut mb[4 * start..4 * end], &mut lb[4 * start..4 * end]);
        let (mut generated, mut drops, mut bad, mut previous) = (0usize, 0usize, false, false);
        for (((mask, lp), mask_to), lp_to) in mask_in
            .chunks_exact(8)
            .zip(lp_in.chunks_exact(8))
            .zip(mask_out.chunks_exact_mut(4))
            .zip(lp_out.chunks_exact_mut(4))
        {
            let mask = f64::from_ne_bytes(mask.try_into().unwrap());
            let lp = f64::from_ne_bytes(lp.try_into().unwrap());
            let is_generated = mask == 1.0;
            // a carried position (0.0 or -0.0) must have a zero log-prob; NaN is neither
            bad |= !is_generated & ((mask != 0.0) | (lp != 0.0));
            let lp32 = lp as f32;
            bad |= !lp32.is_finite();
            drops += (previous & !is_generated) as usize; // a generated position, then a carried one
            previous = is_generated;
            generated += is_generated as usize;
            mask_to.copy_from_slice(&(mask as f32).to_be_bytes());
            lp_to.copy_from_slice(&lp32.to_be_bytes());
        }
        if bad {
            return Ok(None);
        }
        carry.push(end - start - generated);
        order_ok.push(drops == 0);
    }
    Ok(Some((token_be, mask_f32, lp_f32, carry, order_ok)))
}
