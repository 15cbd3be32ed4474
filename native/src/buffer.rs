//! A contiguous, read-only byte view of any buffer-protocol object (numpy columns whatever
//! their dtype), held for as long as the view lives so the exporter cannot resize it.

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

pub struct Bytes {
    view: Box<ffi::Py_buffer>,
}

// The exporter keeps the memory alive and fixed while the view is held (buffer protocol);
// reading it without the GIL is what hashlib does too.
unsafe impl Send for Bytes {}
unsafe impl Sync for Bytes {}

impl Bytes {
    /// PyBUF_SIMPLE: a C-contiguous buffer as plain bytes, or a BufferError.
    pub fn of(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, ffi::PyBUF_SIMPLE) };
        if rc != 0 {
            return Err(PyErr::take(obj.py())
                .unwrap_or_else(|| PyBufferError::new_err("object has no contiguous buffer")));
        }
        Ok(Bytes { view })
    }

    pub fn as_slice(&self) -> &[u8] {
        let len = self.view.len as usize;
        if len == 0 {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(self.view.buf as *const u8, len) }
    }
}

impl Drop for Bytes {
    fn drop(&mut self) {
        // Py_buffer release needs the GIL.
        Python::attach(|_py| unsafe { ffi::PyBuffer_Release(&mut *self.view as *mut ffi::Py_buffer) });
    }
}
