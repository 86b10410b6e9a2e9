//! The scope of a search ([`Scope`]): which documents, which metadata. Its own module so that
//! metadata does not depend on the filters that match it.

use crate::filter::Filter;

/// Which contexts a search may return: every context, those of some documents, those whose
/// metadata matches a filter, or both at once.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scope<'a> {
    /// Only these documents' contexts (`None`: every document's).
    pub documents: Option<&'a [String]>,
    /// Only contexts whose metadata matches this filter (`None`: any metadata).
    pub filter: Option<&'a Filter>,
}

impl<'a> Scope<'a> {
    /// Every context.
    pub fn all() -> Self {
        Self::default()
    }

    /// The contexts of `documents`.
    pub fn within(documents: &'a [String]) -> Self {
        Self { documents: Some(documents), filter: None }
    }

    /// The contexts whose metadata matches `filter`.
    pub fn matching(filter: &'a Filter) -> Self {
        Self { documents: None, filter: Some(filter) }
    }

    /// Whether it names neither documents nor a filter.
    pub fn is_all(&self) -> bool {
        self.documents.is_none() && self.filter.is_none()
    }
}
