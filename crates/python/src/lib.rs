//! # picaso-python
//!
//! The `picaso._picaso` extension module behind the `picaso` Python package: the engine
//! (`Model`), states as numpy arrays (`State`), composition (`compose`, `weights`) and the
//! store (`Store`). The package's `__init__.py` re-exports these and adds the exception classes
//! and the transformers interop (pure Python).
//!
//! Design: a thin shell. Every call goes straight to the Rust crates the CLI uses, so the same
//! inputs give the same numbers and the same error messages; model and store work runs with the
//! GIL released (`Python::detach`), so Python threads can serve several requests at once.
//!
//! One module per class or concept: `model` (`Model`), `state` (`State`), `generation`
//! (`Generation`), `store` (`Store`), `compose` (the free functions `compose`, `weights`),
//! `records` (store records, metadata, filters and documents between Python and Rust) and
//! `errors` (the error kinds the package raises and how the Rust crates' errors map onto them).
//! This file only registers them.

mod compose;
mod errors;
mod generation;
mod model;
mod records;
mod state;
mod store;

use pyo3::prelude::*;

use crate::generation::Generation;
use crate::model::Model;
use crate::state::State;
use crate::store::Store;

/// The extension module.
#[pymodule]
fn _picaso(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Model>()?;
    m.add_class::<State>()?;
    m.add_class::<Generation>()?;
    m.add_class::<Store>()?;
    m.add_function(wrap_pyfunction!(compose::compose, m)?)?;
    m.add_function(wrap_pyfunction!(compose::weights, m)?)?;
    m.add_function(wrap_pyfunction!(compose::_compose_seconds, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
