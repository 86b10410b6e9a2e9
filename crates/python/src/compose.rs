//! The free functions: `compose` (states into one), `weights` (a method's weights) and the
//! benchmark hook `_compose_seconds`.

use pyo3::prelude::*;

use picaso_model::Composition;

use crate::errors::{model_err, raise, Kind};
use crate::state::State;

fn composition_of(name: &str) -> PyResult<Composition> {
    name.parse::<Composition>().map_err(|e| raise(Kind::Invalid, e.to_string()))
}

/// Composes states of one model into one: "soup" (mean), "caso", "picaso-s" (exact average of
/// CASO over all orders) or "picaso-r" (average over rotations). The last state is nearest the
/// prompt; `order` (a permutation of range(len(states))) reorders them first.
#[pyfunction]
#[pyo3(signature = (states, method="picaso-r", order=None))]
pub(crate) fn compose(
    py: Python<'_>,
    states: Vec<PyRef<'_, State>>,
    method: &str,
    order: Option<Vec<usize>>,
) -> PyResult<State> {
    let method = composition_of(method)?;
    let refs: Vec<&picaso_model::State> = states.iter().map(|s| &s.inner).collect();
    let inner = py.detach(|| picaso_model::compose(method, &refs, order.as_deref())).map_err(model_err)?;
    Ok(State { inner })
}

/// Benchmark hook: seconds of each of `calls` compositions of `states` timed inside Rust (the
/// result allocated and freed within the timing), to compare with the same call made from
/// Python in the same process (scripts/bench_python_compose.py).
#[pyfunction]
pub(crate) fn _compose_seconds(
    py: Python<'_>,
    states: Vec<PyRef<'_, State>>,
    method: &str,
    calls: usize,
) -> PyResult<Vec<f64>> {
    let method = composition_of(method)?;
    let refs: Vec<&picaso_model::State> = states.iter().map(|s| &s.inner).collect();
    py.detach(|| {
        (0..calls)
            .map(|_| {
                let t = std::time::Instant::now();
                drop(picaso_model::compose(method, &refs, None)?);
                Ok(t.elapsed().as_secs_f64())
            })
            .collect::<picaso_model::Result<Vec<f64>>>()
    })
    .map_err(model_err)
}

/// The weights a method gives n contexts whose log-decays (log A(u_i), each <= 0) are given:
/// composed x = Σ_i w_i x_i for one decay channel.
#[pyfunction]
#[pyo3(signature = (log_decays, method="picaso-r"))]
pub(crate) fn weights(log_decays: Vec<f64>, method: &str) -> PyResult<Vec<f64>> {
    picaso_compose::weights(composition_of(method)?, &log_decays).map_err(|e| raise(Kind::Invalid, e.to_string()))
}
