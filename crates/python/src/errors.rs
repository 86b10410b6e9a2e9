//! The kinds of error the package raises and the mapping of the Rust crates' errors onto them.

use pyo3::prelude::*;

/// The kinds of error the package raises; their classes live in `picaso/_errors.py` so that each
/// can derive from both `picaso.Error` and the built-in it means (ValueError, FileNotFoundError).
pub(crate) enum Kind {
    /// Bad argument values (ValueError).
    Invalid,
    /// A missing file or folder (FileNotFoundError).
    NotFound,
    /// A state that does not fit the model (ValueError).
    StateMismatch,
    /// Anything else (picaso.Error).
    Other,
}

pub(crate) fn raise(kind: Kind, message: impl Into<String>) -> PyErr {
    let name = match kind {
        Kind::Invalid => "InvalidArgument",
        Kind::NotFound => "NotFound",
        Kind::StateMismatch => "StateMismatch",
        Kind::Other => "Error",
    };
    let message = message.into();
    Python::attach(|py| {
        match py.import("picaso._errors").and_then(|m| m.getattr(name)) {
            Ok(class) => match class.call1((message.clone(),)) {
                Ok(instance) => PyErr::from_value(instance),
                Err(e) => e,
            },
            // Used without the package around it (a bare `_picaso` import): plain built-ins.
            Err(_) => match kind {
                Kind::NotFound => pyo3::exceptions::PyFileNotFoundError::new_err(message),
                Kind::Other => pyo3::exceptions::PyRuntimeError::new_err(message),
                _ => pyo3::exceptions::PyValueError::new_err(message),
            },
        }
    })
}

pub(crate) fn model_err(e: picaso_model::Error) -> PyErr {
    use picaso_model::Error as E;
    let kind = match &e {
        E::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => Kind::NotFound,
        E::Input(_) | E::Compose(_) => Kind::Invalid,
        E::State { .. } => Kind::StateMismatch,
        _ => Kind::Other,
    };
    raise(kind, e.to_string())
}

pub(crate) fn store_err(e: picaso_store::Error) -> PyErr {
    use picaso_store::Error as E;
    match e {
        E::Model(m) => model_err(m),
        E::WrongModel { .. } => raise(Kind::StateMismatch, e.to_string()),
        E::NotFound(_) | E::Input(_) => raise(Kind::Invalid, e.to_string()),
        E::Io { ref source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            raise(Kind::NotFound, e.to_string())
        }
        other => raise(Kind::Other, other.to_string()),
    }
}

pub(crate) fn embed_err(e: picaso_embed::Error) -> PyErr {
    raise(Kind::Other, e.to_string())
}
