//! Every context's metadata in memory, one column per top-level key, for the folder store's
//! filters: a filter reads the columns of the keys it names and combines sorted id lists,
//! instead of SQLite extracting each key from every context's JSON on every search (25–45 ms
//! at 100k contexts; BENCHMARKS.md). A column holds each distinct value once and a small code
//! per context, so a test runs once per distinct value and a scan reads no strings.

use std::borrow::Cow;
use std::collections::HashMap;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::filter::{below, Clause, Condition, Filter};

/// The metadata of a set of contexts, by key.
#[derive(Debug, Default)]
pub(crate) struct MetadataColumns {
    /// Every context's id, ascending (a context without metadata is here, in no column).
    ids: Vec<i64>,
    columns: HashMap<String, Column>,
}

/// One key's values: the contexts that have the key, ascending, and their values' codes.
#[derive(Debug, Default)]
struct Column {
    ids: Vec<i64>,
    codes: Vec<u32>,
    /// The distinct values, by code (a value no context holds any more stays until the columns
    /// are read again).
    values: Vec<Value>,
    /// Each distinct value's code, by its JSON text.
    code_of: HashMap<String, u32>,
}

impl Column {
    fn push(&mut self, id: i64, raw: &RawValue) -> Result<()> {
        let code = match self.code_of.get(raw.get()) {
            Some(&code) => code,
            None => {
                let value =
                    serde_json::from_str(raw.get()).map_err(|e| Error::Input(format!("stored metadata: {e}")))?;
                let code = self.values.len() as u32;
                self.values.push(value);
                self.code_of.insert(raw.get().to_owned(), code);
                code
            }
        };
        self.ids.push(id);
        self.codes.push(code);
        Ok(())
    }
}

/// A JSON object's entries, borrowed from its text: the keys (copied only when they hold an
/// escape) and each value's JSON text.
struct Entries<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

#[derive(Deserialize)]
struct Key<'a>(#[serde(borrow)] Cow<'a, str>);

impl<'de> Deserialize<'de> for Entries<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct Object;
        impl<'de> Visitor<'de> for Object {
            type Value = Entries<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> std::result::Result<Entries<'de>, M::Error> {
                let mut entries: Vec<(Cow<'de, str>, &'de RawValue)> = Vec::new();
                while let Some((Key(key), value)) = map.next_entry::<Key<'de>, &'de RawValue>()? {
                    // A repeated key keeps its last value, as `serde_json::Map` (and so a
                    // record's metadata) does.
                    match entries.iter_mut().find(|(k, _)| *k == key) {
                        Some(entry) => entry.1 = value,
                        None => entries.push((key, value)),
                    }
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_map(Object)
    }
}

impl MetadataColumns {
    /// Adds context `id` with its metadata given as JSON text. Ids must come in ascending
    /// order: `Ok(false)` (and nothing added) for one not above every id here, which the caller
    /// answers by reading the columns again. After an error (metadata that is not an object)
    /// the columns may hold part of it: drop them.
    pub(crate) fn push(&mut self, id: i64, json: &str) -> Result<bool> {
        if self.ids.last().is_some_and(|&last| id <= last) {
            return Ok(false);
        }
        let Entries(entries) = serde_json::from_str(json)
            .map_err(|e| Error::Input(format!("stored metadata is not a JSON object ({e}): {json:.80}")))?;
        for (key, value) in entries {
            match self.columns.get_mut(key.as_ref()) {
                Some(column) => column.push(id, value)?,
                None => {
                    let mut column = Column::default();
                    column.push(id, value)?;
                    self.columns.insert(key.into_owned(), column);
                }
            }
        }
        self.ids.push(id);
        Ok(true)
    }

    /// Removes the contexts `ids` (ascending; those not here are skipped), in one pass over
    /// each column.
    pub(crate) fn remove(&mut self, ids: &[i64]) {
        if ids.is_empty() {
            return;
        }
        let gone = |id: &i64| ids.binary_search(id).is_ok();
        self.ids.retain(|id| !gone(id));
        self.columns.retain(|_, column| {
            let mut keep = column.ids.iter().map(|id| !gone(id));
            column.codes.retain(|_| keep.next().unwrap_or(true));
            column.ids.retain(|id| !gone(id));
            !column.ids.is_empty()
        });
    }

    /// The ids of the contexts whose metadata matches `filter`, ascending.
    pub(crate) fn matching(&self, filter: &Filter) -> Vec<i64> {
        self.clause(filter.root())
    }

    fn clause(&self, clause: &Clause) -> Vec<i64> {
        match clause {
            Clause::Key(condition) => self.condition(condition),
            Clause::All(clauses) => {
                let mut clauses = clauses.iter();
                let Some(first) = clauses.next() else { return self.ids.clone() };
                let mut ids = self.clause(first);
                for clause in clauses {
                    if ids.is_empty() {
                        break;
                    }
                    ids = intersection(&ids, &self.clause(clause));
                }
                ids
            }
            Clause::Any(clauses) => clauses.iter().fold(Vec::new(), |ids, clause| union(&ids, &self.clause(clause))),
            Clause::Not(clause) => difference(&self.ids, &self.clause(clause)),
        }
    }

    /// The contexts passing one key's test: those whose value passes, plus (for the tests a
    /// missing key passes: `$ne`, `$nin`, `$exists: false`) every context without the key. A
    /// test of a value within the key's objects reads it from each distinct value.
    fn condition(&self, Condition { path, test }: &Condition) -> Vec<i64> {
        let (key, path) = path.split_first().expect("a top-level condition names a key");
        let Some(column) = self.columns.get(key) else {
            return if test.passes(None) { self.ids.clone() } else { Vec::new() };
        };
        let passes: Vec<bool> = column.values.iter().map(|v| test.passes(below(v, path))).collect();
        let with = |want: bool| {
            column.ids.iter().zip(&column.codes).filter(move |&(_, &c)| passes[c as usize] == want).map(|(&id, _)| id)
        };
        if test.passes(None) {
            difference(&self.ids, &with(false).collect::<Vec<_>>())
        } else {
            with(true).collect()
        }
    }
}

/// The ids in both ascending lists.
fn intersection(a: &[i64], b: &[i64]) -> Vec<i64> {
    let (mut i, mut j, mut out) = (0, 0, Vec::with_capacity(a.len().min(b.len())));
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out
}

/// The ids in either ascending list, once each.
fn union(a: &[i64], b: &[i64]) -> Vec<i64> {
    let (mut i, mut j, mut out) = (0, 0, Vec::with_capacity(a.len() + b.len()));
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                out.push(b[j]);
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

/// The ids of the ascending list `a` that are not in the ascending list `b`.
fn difference(a: &[i64], b: &[i64]) -> Vec<i64> {
    let mut j = 0;
    a.iter()
        .copied()
        .filter(|&id| {
            while j < b.len() && b[j] < id {
                j += 1;
            }
            b.get(j) != Some(&id)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    fn set(v: &[i64]) -> BTreeSet<i64> {
        v.iter().copied().collect()
    }

    proptest! {
        /// The merges agree with set arithmetic.
        #[test]
        fn merges_are_set_operations(
            a in proptest::collection::btree_set(0i64..60, 0..40),
            b in proptest::collection::btree_set(0i64..60, 0..40),
        ) {
            let (a, b): (Vec<i64>, Vec<i64>) = (a.into_iter().collect(), b.into_iter().collect());
            let (sa, sb) = (set(&a), set(&b));
            prop_assert_eq!(intersection(&a, &b), sa.intersection(&sb).copied().collect::<Vec<_>>());
            prop_assert_eq!(union(&a, &b), sa.union(&sb).copied().collect::<Vec<_>>());
            prop_assert_eq!(difference(&a, &b), sa.difference(&sb).copied().collect::<Vec<_>>());
        }
    }

    /// Pushes, removals and refused out-of-order pushes keep the columns as a fresh load of
    /// the same contexts would be: every filter answers like `Filter::matches`.
    #[test]
    fn edits_keep_the_columns_true() {
        let metadata = |i: i64| -> crate::metadata::Metadata {
            let tag = ["a", "b", "c"][(i % 3) as usize];
            let mut m = json!({"n": i % 5, "tag": tag});
            if i % 4 == 0 {
                m["only4"] = json!(true);
            }
            if i % 3 != 2 {
                m["by"] = json!({"n": i % 7, "in": {"tag": tag}});
            }
            if i % 2 == 0 {
                m["refs"] = json!([{"n": i % 3, "tag": tag}, i % 5]);
            }
            m.as_object().unwrap().clone()
        };
        let mut columns = MetadataColumns::default();
        for i in 1..=40 {
            assert!(columns.push(i, &crate::metadata::to_json(&metadata(i))).unwrap());
        }
        assert!(!columns.push(40, "{}").unwrap(), "an id not above the others is refused");
        assert!(columns.push(41, "[1]").is_err(), "metadata that is not an object is refused");
        columns.remove(&[1, 8, 9]);
        columns.remove(&[40, 77]);
        let kept: Vec<i64> = (2..40).filter(|i| ![8, 9].contains(i)).collect();
        for f in [
            json!({"n": 2}),
            json!({"n": {"$ne": 2}, "tag": "a"}),
            json!({"only4": {"$exists": false}}),
            json!({"$or": [{"n": {"$gte": 3}}, {"only4": true}], "tag": {"$nin": ["b"]}}),
            json!({"missing": {"$nin": [1]}}),
            json!({"missing": 1}),
            json!({"$nor": [{"tag": "a"}], "n": {"$not": {"$lt": 2}}}),
            json!({"missing": {"$not": {"$eq": 1}}}),
            json!({"by": {"n": {"$gte": 3}, "in": {"tag": {"$ne": "a"}}}}),
            json!({"by": {"in": {"tag": {"$exists": false}}}}),
            json!({"by": {"$not": {"n": 2}}, "tag": "c"}),
            json!({"refs": {"$elemMatch": {"n": 1, "tag": {"$ne": "b"}}}}),
            json!({"refs": {"$elemMatch": {"$gte": 3}}, "tag": "b"}),
            json!({"refs": {"$not": {"$elemMatch": {"n": {"$exists": true}}}}}),
        ] {
            let filter = Filter::new(f.as_object().unwrap()).unwrap();
            let want: Vec<i64> = kept.iter().copied().filter(|&i| filter.matches(&metadata(i))).collect();
            assert_eq!(columns.matching(&filter), want, "{f}");
        }
        assert!(!columns.columns.contains_key("missing"));
        columns.remove(&[4]);
        columns.remove(&[12]);
        columns.remove(&(16..40).step_by(4).collect::<Vec<_>>());
        assert!(!columns.columns.contains_key("only4"), "an emptied column is dropped");
    }
}
