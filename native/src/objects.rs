//! `linearized.build_all`: the verifier's frozen output objects (one a chain call) made
//! without an `__init__` call each, as unpickling makes them: allocated by the type and given
//! their field dict.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple, PyType};

/// `build_all(cls, names, columns)`: `[obj, ...]` with `obj.__dict__ == dict(zip(names, row))`
/// for each row of `columns` (lists of equal length, one per name). For plain classes with an
/// instance dict only (the dataclasses of stage/contract/linearized.py).
#[pyfunction]
pub fn build_all<'py>(
    py: Python<'py>,
    cls: &Bound<'py, PyType>,
    names: &Bound<'py, PyTuple>,
    columns: Vec<Bound<'py, PyList>>,
) -> PyResult<Bound<'py, PyList>> {
    if columns.len() != names.len() {
        return Err(pyo3::exceptions::PyValueError::new_err("one column per name"));
    }
    let rows = columns.first().map_or(0, |c| c.len());
    if columns.iter().any(|c| c.len() != rows) {
        return Err(pyo3::exceptions::PyValueError::new_err("columns of unequal length"));
    }
    let out = PyList::empty(py);
    let empty = PyTuple::empty(py);
    for i in 0..rows {
        // object.__new__(cls)
        let item = unsafe {
            let new = (*std::ptr::addr_of_mut!(ffi::PyBaseObject_Type)).tp_new.expect("object has tp_new");
            Bound::from_owned_ptr_or_err(py, new(cls.as_type_ptr(), empty.as_ptr(), std::ptr::null_mut()))?
        };
        let values = PyDict::new(py);
        for (name, column) in names.iter().zip(&columns) {
            values.set_item(name, column.get_item(i)?)?;
        }
        // object.__setattr__(item, "__dict__", values): a frozen dataclass refuses setattr
        let rc =
            unsafe { ffi::PyObject_GenericSetDict(item.as_ptr(), values.as_ptr(), std::ptr::null_mut()) };
        if rc != 0 {
            return Err(PyErr::fetch(py));
        }
        out.append(item)?;
    }
    Ok(out)
}
