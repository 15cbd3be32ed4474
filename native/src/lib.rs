//! `stage._native`: the per-row loops of verification in compiled code (issue 31).
//!
//! Python stays the reference: every function here reproduces one Python loop of
//! `stage/contract` byte for byte and returns None for any row the Python loop would hand to
//! its exact path, so errors are still raised by Python, in Gym's order, with Gym's text.
//! The differential tests (tests/contract/test_native_differential.py) hold the two together.

mod buffer;
mod call_digest;
mod chain;
mod columns;
mod hex;
mod objects;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(call_digest::call_digests, m)?)?;
    m.add_function(wrap_pyfunction!(chain::chain_walk, m)?)?;
    m.add_function(wrap_pyfunction!(chain::chain_gather, m)?)?;
    m.add_function(wrap_pyfunction!(columns::check_columns, m)?)?;
    m.add_function(wrap_pyfunction!(objects::build_all, m)?)?;
    Ok(())
}
