//! Metadata filters: which contexts a retrieval may return, by their metadata.
//!
//! A filter is a JSON object; a context matches when every one of its keys holds. A key's
//! value is either a scalar (its metadata must hold an equal value there) or an object of
//! operators, all of which must hold:
//!
//! | operator | the context's value at the key |
//! |---|---|
//! | `$eq: v` | equals `v` (a scalar `v` alone means the same) |
//! | `$ne: v` | does not equal `v`, or the key is missing |
//! | `$gt`, `$gte`, `$lt`, `$lte: v` | is a number above/below the number `v`, or a string after/before the string `v` (by code point: ISO dates order as dates) |
//! | `$in: [v, ...]` | equals one of them |
//! | `$nin: [v, ...]` | equals none of them, or the key is missing |
//! | `$exists: b` | the key is present (any value, `null` too) when `b` is true, absent when false |
//! | `$contains: v` | is a list holding a value equal to `v` |
//! | `$prefix: "s"` | is a string starting with the string `s` (by code point, case and accents as given) |
//! | `$regex: "p"` | is a string the pattern `p` (Rust's regex syntax; [`crate::pattern`]) matches somewhere (`^`, `$` anchor) |
//! | `$elemMatch: {...}` | is a list holding an element that passes all of the operators (tests of the element) and keys (tests within an object element) given, at once |
//! | `$not: {operators}` | does not pass all of the operators (a missing key passes) |
//!
//! `"$or": [filter, ...]` in place of a key holds when one of the filters does, `"$and": [...]`
//! when all do (to give one key's conditions in several places), `"$nor": [...]` when none does;
//! they nest.
//!
//! Within an object of operators, a key without `$` tests the value within the object at the
//! key: `{"author": {"name": "Ann", "born": {"$lt": 1900}}}` holds when the metadata's `author`
//! is an object whose `name` is `"Ann"` and whose `born` is below 1900 (MongoDB's
//! `"author.name"`). The path descends through objects only, not lists; a key missing on the
//! way is a missing key, so `$ne`, `$nin`, `$not` and `$exists: false` pass.
//!
//! Into lists, `$elemMatch` (MongoDB's): `{"authors": {"$elemMatch": {"name": "Ann", "role":
//! "editor"}}}` holds when one element of the list at `authors` is an object whose `name` is
//! `"Ann"` and whose `role` is `"editor"` (not when one author is Ann and another an editor);
//! `{"scores": {"$elemMatch": {"$gte": 80, "$lt": 90}}}` when one element is in the range. Its
//! operators test the element, its keys the values within an object element; `$or`, `$and` and
//! `$nor` are not taken there. `$elemMatch`es nest, for lists of lists.
//!
//! Equality: strings and booleans exactly, numbers by value (`2024` equals `2024.0`; integers
//! compare exactly, also beside floats), `null` only `null` (not a missing key); a value of
//! another type is never equal, below or above. Both catalogs answer with these rules (the folder
//! store from in-memory metadata columns that apply [`Filter::matches`]'s tests, PostgreSQL in
//! SQL over `jsonb`), and the catalogs' tests check them against [`Filter::matches`].

use std::cmp::Ordering;
use std::collections::BTreeMap;

use serde_json::{Number, Value};

use crate::error::{Error, Result};
use crate::metadata::Metadata;
use crate::pattern::Pattern;

/// The most conditions a filter may hold (a key's value, or one operator of it), nested ones
/// included.
pub const MAX_FILTER_CONDITIONS: usize = 64;

/// The deepest `$and` / `$or` / `$nor` may nest, and the most keys a path into nested objects
/// may have.
pub const MAX_FILTER_DEPTH: usize = 8;

/// The most values a filter's `$in` and `$nin` lists may hold together.
pub const MAX_FILTER_VALUES: usize = 1024;

/// The operators, as the error messages list them.
const OPERATORS: &str =
    "$eq, $ne, $gt, $gte, $lt, $lte, $in, $nin, $exists, $contains, $prefix, $regex, $elemMatch, $not";

/// A metadata filter, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Filter {
    root: Clause,
    json: Metadata,
}

/// A filter's structure: tests of keys, combined.
#[derive(Debug, Clone, PartialEq)]
pub enum Clause {
    /// A test of one key.
    Key(Condition),
    /// All hold (the keys of an object, `$and`).
    All(Vec<Clause>),
    /// One at least holds (`$or`).
    Any(Vec<Clause>),
    /// It does not hold (`$nor` of filters, a key's `$not` of operators).
    Not(Box<Clause>),
}

impl Clause {
    /// Whether it holds of the values `at` finds at its conditions' paths (`None`: missing).
    fn holds<'a>(&self, at: &impl Fn(&[String]) -> Option<&'a Value>) -> bool {
        match self {
            Self::Key(c) => c.test.passes(at(&c.path)),
            Self::All(clauses) => clauses.iter().all(|c| c.holds(at)),
            Self::Any(clauses) => clauses.iter().any(|c| c.holds(at)),
            Self::Not(clause) => !clause.holds(at),
        }
    }
}

/// One test of the value at one key, or within the object at one key.
#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    /// Where the tested value is, outermost key first: in a filter, a top-level metadata key
    /// and the keys below it (`["author", "name"]` for `{"author": {"name": ...}}`); in an
    /// `$elemMatch`, the keys within a list's element (empty for the element itself).
    pub path: Vec<String>,
    /// What the value must pass.
    pub test: Test,
}

/// The value at `path` within the metadata `metadata`, descending through objects only (`None`
/// when a key on the way is missing or holds no object).
pub fn in_metadata<'a>(metadata: &'a Metadata, path: &[String]) -> Option<&'a Value> {
    let (key, below_key) = path.split_first()?;
    below(metadata.get(key)?, below_key)
}

/// The value at `path` within `value`, descending through objects only (not lists).
pub fn below<'a>(value: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.as_object()?.get(key))
}

/// `Ok` for a path of at most [`MAX_FILTER_DEPTH`] steps (keys and `$elemMatch`es).
fn within_depth(path: &[String]) -> Result<()> {
    if path.len() > MAX_FILTER_DEPTH {
        return Err(Error::Input(format!(
            "metadata filter {:?}: keys within objects and $elemMatch nest deeper than {MAX_FILTER_DEPTH} levels",
            shown(path)
        )));
    }
    Ok(())
}

/// A path as messages show it: `author.name`, `tags.$elemMatch.name`.
fn shown(path: &[String]) -> String {
    path.join(".")
}

/// What a value must pass. Scalars are strings, numbers, booleans or `null`.
#[derive(Debug, Clone, PartialEq)]
pub enum Test {
    /// Equal to the scalar.
    Eq(Value),
    /// Not equal to the scalar (a missing key passes).
    Ne(Value),
    /// Ordered against a number or a string of the same type.
    Compare(Comparison, Value),
    /// Equal to one of the scalars.
    In(Vec<Value>),
    /// Equal to none of the scalars (a missing key passes).
    NotIn(Vec<Value>),
    /// Present (true) or absent (false).
    Exists(bool),
    /// A list holding a value equal to the scalar.
    Contains(Value),
    /// A string starting with this one.
    Prefix(String),
    /// A string the pattern matches (somewhere, unless anchored).
    Regex(Pattern),
    /// A list holding an element that passes the clause, whose conditions' paths are within
    /// the element (`$elemMatch`).
    Elements(Box<Clause>),
}

/// An order comparison: the context's value `op` the filter's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Comparison {
    /// `>`
    Gt,
    /// `>=`
    Gte,
    /// `<`
    Lt,
    /// `<=`
    Lte,
}

impl Comparison {
    /// The SQL operator.
    pub fn sql(self) -> &'static str {
        match self {
            Self::Gt => ">",
            Self::Gte => ">=",
            Self::Lt => "<",
            Self::Lte => "<=",
        }
    }

    fn holds(self, order: Ordering) -> bool {
        match self {
            Self::Gt => order.is_gt(),
            Self::Gte => order.is_ge(),
            Self::Lt => order.is_lt(),
            Self::Lte => order.is_le(),
        }
    }
}

impl Filter {
    /// Checks a filter given as JSON: refuses one that is empty, over
    /// [`MAX_FILTER_CONDITIONS`] conditions, [`MAX_FILTER_VALUES`] listed values or
    /// [`MAX_FILTER_DEPTH`] levels, with a list or object where a scalar belongs, an unknown
    /// operator, or a NUL character. The errors name the key and say what is expected.
    pub fn new(json: &Metadata) -> Result<Self> {
        let mut size = Size::default();
        let root = Self::object(json, 0, &mut size)?;
        if size.conditions > MAX_FILTER_CONDITIONS {
            return Err(Error::Input(format!(
                "a metadata filter of {} conditions; at most {MAX_FILTER_CONDITIONS}",
                size.conditions
            )));
        }
        if size.listed > MAX_FILTER_VALUES {
            return Err(Error::Input(format!(
                "a metadata filter listing {} values in $in and $nin; at most {MAX_FILTER_VALUES}",
                size.listed
            )));
        }
        Ok(Self { root, json: json.clone() })
    }

    /// The clause an object states: all of its keys hold.
    fn object(json: &Metadata, depth: usize, size: &mut Size) -> Result<Clause> {
        if json.is_empty() {
            return Err(Error::Input(
                "an empty metadata filter: give at least one key and value, or no filter to search every context"
                    .into(),
            ));
        }
        let mut all = Vec::new();
        for (key, value) in json {
            match (logical(key), value) {
                (Some(combine), Value::Array(filters)) if !filters.is_empty() => {
                    if depth + 1 > MAX_FILTER_DEPTH {
                        return Err(Error::Input(format!(
                            "metadata filter: $and, $or and $nor nest deeper than {MAX_FILTER_DEPTH} levels"
                        )));
                    }
                    let clauses = (filters.iter())
                        .map(|f| match f {
                            Value::Object(f) => Self::object(f, depth + 1, size),
                            _ => Err(Error::Input(format!("metadata filter {key}: {f} is not a filter (an object)"))),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    all.push(combine(clauses));
                }
                (Some(_), _) => {
                    return Err(Error::Input(format!(
                        "metadata filter {key}: takes a non-empty list of filters, not {value}"
                    )))
                }
                (None, _) => all.extend(Self::value(std::slice::from_ref(key), 0, value, false, size)?),
            }
        }
        Ok(Clause::All(all))
    }

    /// The clauses of what a filter gives for the value at `path`: a scalar it must equal, or
    /// an object of operators and of keys within it (`within_not` when in a `$not`). The
    /// conditions' paths start at `path[root]`: after the `$elemMatch` they are within, if any.
    fn value(path: &[String], root: usize, value: &Value, within_not: bool, size: &mut Size) -> Result<Vec<Clause>> {
        let key = path.last().expect("a path has a key");
        if key.contains('\0') {
            return Err(Error::Input(format!(
                "metadata filter {:?}: the key {key:?} holds a NUL character",
                shown(path)
            )));
        }
        within_depth(path)?;
        match value {
            Value::Object(entries) => Self::operators(path, root, entries, within_not, size),
            Value::Array(_) => Err(Error::Input(format!(
                "metadata filter {:?}: {value} is a list; to match one of several values give \
                 {{\"$in\": [...]}}, to match a list holding a value {{\"$contains\": value}}",
                shown(path)
            ))),
            _ => {
                size.conditions += 1;
                let test = Test::Eq(scalar(&shown(path), "", value)?);
                Ok(vec![Clause::Key(Condition { path: path[root..].to_vec(), test })])
            }
        }
    }

    /// The clauses of the object a filter gives for the value at `path`, all of which must
    /// hold: operators that test the value, and keys that test the values within it (an object
    /// there). `within_not` when the object is a `$not`'s (which may not hold another); `root`
    /// as for [`Self::value`].
    fn operators(
        path: &[String],
        root: usize,
        ops: &Metadata,
        within_not: bool,
        size: &mut Size,
    ) -> Result<Vec<Clause>> {
        let name = shown(path);
        if ops.is_empty() {
            return Err(Error::Input(if within_not {
                format!("metadata filter {name:?}: an empty $not; give the operators it negates, e.g. {{\"$not\": {{\"$gte\": 2020}}}}")
            } else {
                format!("metadata filter {name:?}: an empty object; give a value, or operators ({OPERATORS})")
            }));
        }
        let mut all = Vec::with_capacity(ops.len());
        for (op, operand) in ops {
            if op == "$not" {
                let Value::Object(negated) = operand else {
                    return Err(Error::Input(format!(
                        "metadata filter {name:?}: $not takes an object of operators, e.g. {{\"$not\": {{\"$gte\": 2020}}}}, \
                         not {operand} (for a value to differ from, give $ne)"
                    )));
                };
                if within_not {
                    return Err(Error::Input(format!(
                        "metadata filter {name:?}: $not within $not; give the operators themselves"
                    )));
                }
                all.push(Clause::Not(Box::new(Clause::All(Self::operators(path, root, negated, true, size)?))));
                continue;
            }
            if op == "$elemMatch" {
                all.push(Self::elements(path, root, operand, size)?);
                continue;
            }
            if logical(op).is_some() && root == path.len() {
                return Err(Error::Input(format!(
                    "metadata filter {name:?}: {op} within $elemMatch is not supported; for one of several values \
                     give $in, or give a top-level {op} of filters that each hold an $elemMatch (which may match \
                     different elements)"
                )));
            }
            if logical(op).is_some() {
                return Err(Error::Input(format!(
                    "metadata filter {name:?}: {op} goes at the top level of a filter, with whole keys in its \
                     filters (e.g. {{\"{op}\": [{{\"author\": {{\"name\": \"Ann\"}}}}, ...]}})"
                )));
            }
            if !op.starts_with('$') {
                // A key within the object at `path`.
                let mut inner = path.to_vec();
                inner.push(op.clone());
                all.extend(Self::value(&inner, root, operand, within_not, size)?);
                continue;
            }
            let test = Test::new(&name, op, operand)?;
            if let Test::In(values) | Test::NotIn(values) = &test {
                size.listed += values.len();
            }
            size.conditions += 1;
            all.push(Clause::Key(Condition { path: path[root..].to_vec(), test }));
        }
        Ok(all)
    }

    /// The clause of an `$elemMatch` of the value at `path`: a list holding an element that
    /// passes all of `operand`'s operators (a list of scalars) and keys (a list of objects).
    fn elements(path: &[String], root: usize, operand: &Value, size: &mut Size) -> Result<Clause> {
        let name = shown(path);
        let example = "e.g. {\"$elemMatch\": {\"name\": \"Ann\", \"born\": {\"$lt\": 1900}}} for a list of \
                       objects, {\"$elemMatch\": {\"$gte\": 80, \"$lt\": 90}} for a list of numbers";
        let Value::Object(element) = operand else {
            return Err(Error::Input(format!(
                "metadata filter {name:?}: $elemMatch takes an object of what one element must pass, {example}, \
                 not {operand} (for a list holding a value, give $contains)"
            )));
        };
        if element.is_empty() {
            return Err(Error::Input(format!(
                "metadata filter {name:?}: an empty $elemMatch; give what one element must pass, {example}"
            )));
        }
        let mut inner = path.to_vec();
        inner.push("$elemMatch".into());
        within_depth(&inner)?;
        let clause = Clause::All(Self::operators(&inner, inner.len(), element, false, size)?);
        size.conditions += 1;
        Ok(Clause::Key(Condition { path: path[root..].to_vec(), test: Test::Elements(Box::new(clause)) }))
    }

    /// A filter from the command line's `--filter` arguments, all of which must hold. Each is
    /// `KEY=VALUE`, `KEY!=VALUE`, `KEY>VALUE`, `KEY>=VALUE`, `KEY<VALUE`, `KEY<=VALUE`,
    /// `KEY^=TEXT` (a string starting with TEXT), `KEY~=PATTERN` (a string the regex PATTERN
    /// matches), or a whole filter as a JSON object (`{"lang": {"$in": ["en", "fr"]}}`). VALUE
    /// is read as JSON when it is a JSON number, boolean, null or string (`year=2024`,
    /// `draft=false`, `year="2024"`), else as the text it is (`lang=en`, `date>=2024-01-01`);
    /// TEXT and PATTERN are text (`code^=42`, `code~=^4[0-9]`). Conditions on one
    /// key combine (`year>=2000 year<2010`); the same operator twice on a key is refused.
    pub fn from_args<S: AsRef<str>>(args: &[S]) -> Result<Self> {
        let mut by_key: BTreeMap<String, BTreeMap<String, Value>> = BTreeMap::new();
        let mut add = |key: &str, op: &str, value: Value, arg: &str| {
            let ops = by_key.entry(key.to_string()).or_default();
            if ops.insert(op.to_string(), value).is_some() {
                return Err(Error::Input(format!(
                    "--filter {arg:?}: key {key:?} already has a {op} condition; give each once"
                )));
            }
            Ok(())
        };
        // `$and` / `$or` / `$nor` entries of JSON arguments, combined at the end.
        let mut combined: Vec<(String, Value)> = Vec::new();
        for arg in args {
            let arg = arg.as_ref();
            if arg.trim_start().starts_with('{') {
                let Ok(Value::Object(filter)) = serde_json::from_str::<Value>(arg) else {
                    return Err(Error::Input(format!("--filter {arg:?}: not a JSON object")));
                };
                for (key, value) in filter {
                    match value {
                        value if logical(&key).is_some() => combined.push((key, value)),
                        Value::Object(ops) => {
                            for (op, operand) in ops {
                                add(&key, &op, operand, arg)?;
                            }
                        }
                        value => add(&key, "$eq", value, arg)?,
                    }
                }
                continue;
            }
            let (key, op, raw) = split_condition(arg)?;
            let value = match serde_json::from_str::<Value>(raw) {
                Ok(v @ Value::String(_)) => v,
                // A prefix or a pattern is text, whatever it looks like.
                Ok(v @ (Value::Number(_) | Value::Bool(_) | Value::Null)) if op != "$prefix" && op != "$regex" => v,
                _ => Value::String(raw.to_string()),
            };
            add(key, op, value, arg)?;
        }
        // One key's conditions as JSON: a scalar for equality alone, else the operators.
        let mut json: Metadata = by_key
            .into_iter()
            .map(|(key, mut ops)| {
                let value = match ops.len() {
                    1 if ops.contains_key("$eq") => ops.remove("$eq").expect("present"),
                    _ => Value::Object(ops.into_iter().collect()),
                };
                (key, value)
            })
            .collect();
        let distinct =
            combined.iter().map(|(k, _)| k).collect::<std::collections::BTreeSet<_>>().len() == combined.len();
        if distinct {
            json.extend(combined);
        } else {
            // Two `$or`s: both must hold.
            let each = combined.into_iter().map(|(k, v)| Value::Object(Metadata::from_iter([(k, v)])));
            json.insert("$and".into(), Value::Array(each.collect()));
        }
        Self::new(&json)
    }

    /// Its structure: the top-level object's keys, all of which must hold.
    pub fn root(&self) -> &Clause {
        &self.root
    }

    /// The filter as JSON, as it was given.
    pub fn json(&self) -> &Metadata {
        &self.json
    }

    /// Whether a context with `metadata` passes every condition.
    pub fn matches(&self, metadata: &Metadata) -> bool {
        self.root.holds(&|path: &[String]| in_metadata(metadata, path))
    }
}

/// How much a filter holds, against the limits.
#[derive(Default)]
struct Size {
    conditions: usize,
    listed: usize,
}

impl Test {
    fn new(key: &str, op: &str, operand: &Value) -> Result<Self> {
        let list = || -> Result<Vec<Value>> {
            let Value::Array(values) = operand else {
                return Err(Error::Input(format!(
                    "metadata filter {key:?}: {op} takes a list of values, not {operand}"
                )));
            };
            values.iter().map(|v| scalar(key, op, v)).collect()
        };
        Ok(match op {
            "$eq" => Self::Eq(scalar(key, op, operand)?),
            "$ne" => Self::Ne(scalar(key, op, operand)?),
            "$gt" | "$gte" | "$lt" | "$lte" => {
                let comparison = match op {
                    "$gt" => Comparison::Gt,
                    "$gte" => Comparison::Gte,
                    "$lt" => Comparison::Lt,
                    _ => Comparison::Lte,
                };
                match operand {
                    Value::Number(_) | Value::String(_) => Self::Compare(comparison, scalar(key, op, operand)?),
                    _ => {
                        return Err(Error::Input(format!(
                            "metadata filter {key:?}: {op} compares with a number or a string, not {operand}"
                        )))
                    }
                }
            }
            "$in" => Self::In(list()?),
            "$nin" => Self::NotIn(list()?),
            "$exists" => match operand {
                Value::Bool(b) => Self::Exists(*b),
                _ => {
                    return Err(Error::Input(format!(
                        "metadata filter {key:?}: $exists takes true or false, not {operand}"
                    )))
                }
            },
            "$contains" => Self::Contains(scalar(key, op, operand)?),
            "$prefix" => match scalar(key, op, operand)? {
                Value::String(prefix) => Self::Prefix(prefix),
                _ => {
                    return Err(Error::Input(format!(
                        "metadata filter {key:?}: $prefix takes a string, not {operand} (to match numbers in a \
                         range, give $gte and $lt)"
                    )))
                }
            },
            "$regex" => match operand {
                Value::String(source) => Self::Regex(Pattern::new(key, source)?),
                _ => {
                    return Err(Error::Input(format!(
                        "metadata filter {key:?}: $regex takes a pattern as a string (Rust's regex syntax, e.g. \
                         \"(?i)^plant\"), not {operand}"
                    )))
                }
            },
            _ => {
                return Err(Error::Input(format!(
                    "metadata filter {key:?}: unknown operator {op:?}; the operators are {OPERATORS} (a key within \
                     an object there is written without a $)"
                )))
            }
        })
    }

    /// Whether the value at the key (`None`: missing) passes.
    pub(crate) fn passes(&self, have: Option<&Value>) -> bool {
        match (self, have) {
            (Self::Exists(want), have) => have.is_some() == *want,
            (Self::Ne(want), have) => !have.is_some_and(|h| scalar_eq(h, want)),
            (Self::NotIn(wants), have) => !have.is_some_and(|h| wants.iter().any(|w| scalar_eq(h, w))),
            (_, None) => false,
            (Self::Eq(want), Some(have)) => scalar_eq(have, want),
            (Self::In(wants), Some(have)) => wants.iter().any(|w| scalar_eq(have, w)),
            (Self::Compare(op, bound), Some(have)) => match (have, bound) {
                (Value::Number(a), Value::Number(b)) => op.holds(compare_numbers(a, b)),
                (Value::String(a), Value::String(b)) => op.holds(a.as_str().cmp(b.as_str())),
                _ => false,
            },
            (Self::Contains(want), Some(Value::Array(items))) => items.iter().any(|item| scalar_eq(item, want)),
            (Self::Contains(_), Some(_)) => false,
            (Self::Prefix(prefix), Some(Value::String(have))) => have.starts_with(prefix.as_str()),
            (Self::Prefix(_), Some(_)) => false,
            (Self::Regex(pattern), Some(Value::String(have))) => pattern.is_match(have),
            (Self::Regex(_), Some(_)) => false,
            (Self::Elements(element), Some(Value::Array(items))) => {
                items.iter().any(|item| element.holds(&|path: &[String]| below(item, path)))
            }
            (Self::Elements(_), Some(_)) => false,
        }
    }
}

/// What a logical key (`$and`, `$or`, `$nor`) makes of its filters' clauses; `None` for a
/// metadata key. The one list of logical keys, so parsing and `from_args` agree.
fn logical(key: &str) -> Option<fn(Vec<Clause>) -> Clause> {
    match key {
        "$and" => Some(Clause::All),
        "$or" => Some(Clause::Any),
        "$nor" => Some(|clauses| Clause::Not(Box::new(Clause::Any(clauses)))),
        _ => None,
    }
}

/// `value` if it is a scalar (with no NUL character), else an error naming the key and operator.
fn scalar(key: &str, op: &str, value: &Value) -> Result<Value> {
    let within = if op.is_empty() { String::new() } else { format!(" ({op})") };
    match value {
        Value::Object(_) | Value::Array(_) => Err(Error::Input(format!(
            "metadata filter {key:?}{within}: {value} is not a string, number, boolean or null"
        ))),
        Value::String(s) if s.contains('\0') => {
            Err(Error::Input(format!("metadata filter {key:?}{within}: the value holds a NUL character")))
        }
        _ => Ok(value.clone()),
    }
}

/// Splits `KEY<op>VALUE` at its first operator character.
fn split_condition(arg: &str) -> Result<(&str, &'static str, &str)> {
    let bad = || {
        Error::Input(format!(
            "--filter {arg:?}: expected KEY=VALUE, KEY!=VALUE, KEY>VALUE, KEY>=VALUE, KEY<VALUE, KEY<=VALUE, \
             KEY^=TEXT (starts with), KEY~=PATTERN (a regex matches) or a JSON object (e.g. --filter lang=en \
             --filter 'year>=2020')"
        ))
    };
    let at = arg.find(['=', '!', '<', '>']).ok_or_else(bad)?;
    let (key, rest) = arg.split_at(at);
    for (mark, op) in [('^', "$prefix"), ('~', "$regex")] {
        if let Some(key) = key.strip_suffix(mark).filter(|_| rest.starts_with('=')) {
            if key.is_empty() {
                return Err(Error::Input(format!("--filter {arg:?}: the key is empty")));
            }
            return Ok((key, op, &rest[1..]));
        }
    }
    if key.is_empty() {
        return Err(Error::Input(format!("--filter {arg:?}: the key is empty")));
    }
    let (op, len) = match rest.as_bytes() {
        [b'!', b'=', ..] => ("$ne", 2),
        [b'>', b'=', ..] => ("$gte", 2),
        [b'<', b'=', ..] => ("$lte", 2),
        [b'=', ..] => ("$eq", 1),
        [b'>', ..] => ("$gt", 1),
        [b'<', ..] => ("$lt", 1),
        _ => return Err(bad()),
    };
    let value = &rest[len..];
    if op == "$eq" && value.starts_with(['=', '<', '>']) {
        // `year=>2020`, `year=<2020`, `year==2020`: the operator mistyped.
        let (rest, meant) = (&value[1..], value.as_bytes()[0]);
        let hint = match meant {
            b'>' => format!("{key}>={rest}"),
            b'<' => format!("{key}<={rest}"),
            _ => format!("{key}={rest}"),
        };
        return Err(Error::Input(format!(
            "--filter {arg:?}: did you mean {hint}? (to match text that starts with {:?}, give a JSON filter: \
             --filter '{{\"{key}\": \"{value}\"}}')",
            meant as char
        )));
    }
    Ok((key, op, value))
}

/// Scalar equality: strings and booleans exactly, numbers by value, `null` only `null`.
pub(crate) fn scalar_eq(have: &Value, want: &Value) -> bool {
    match (have, want) {
        (Value::String(a), Value::String(b)) => a == b,
        (Value::Bool(a), Value::Bool(b)) => a == b,
        (Value::Null, Value::Null) => true,
        (Value::Number(a), Value::Number(b)) => compare_numbers(a, b).is_eq(),
        _ => false,
    }
}

/// Orders two JSON numbers by value, exactly: integers as integers, and an integer beside a
/// float by comparing the integer with the float's integer part, then the fraction (so
/// 2⁵³ + 1 is above 2⁵³ as a float, as SQLite and PostgreSQL say).
fn compare_numbers(a: &Number, b: &Number) -> Ordering {
    let int = |n: &Number| n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from));
    match (int(a), int(b)) {
        (Some(x), Some(y)) => x.cmp(&y),
        (Some(x), None) => int_vs_float(x, b.as_f64().unwrap_or(0.0)),
        (None, Some(y)) => int_vs_float(y, a.as_f64().unwrap_or(0.0)).reverse(),
        (None, None) => a.as_f64().unwrap_or(0.0).total_cmp(&b.as_f64().unwrap_or(0.0)),
    }
}

fn int_vs_float(x: i128, f: f64) -> Ordering {
    // JSON floats are finite; beyond i128 the float wins.
    if f >= 1.7e38 {
        return Ordering::Less;
    }
    if f <= -1.7e38 {
        return Ordering::Greater;
    }
    let whole = f.floor();
    match x.cmp(&(whole as i128)) {
        Ordering::Equal if f > whole => Ordering::Less,
        order => order,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Metadata {
        v.as_object().unwrap().clone()
    }

    fn filter(v: Value) -> Filter {
        Filter::new(&obj(v)).unwrap()
    }

    #[test]
    fn equality_matches_by_value_and_type() {
        let m = obj(json!({"lang": "en", "year": 2024, "score": 0.5, "draft": false, "note": null, "tags": ["a"]}));
        assert!(filter(json!({"lang": "en"})).matches(&m));
        assert!(filter(json!({"lang": "en", "year": 2024.0})).matches(&m));
        assert!(filter(json!({"score": 0.5, "draft": false, "note": null})).matches(&m));
        assert!(!filter(json!({"year": "2024"})).matches(&m));
        assert!(!filter(json!({"draft": 0})).matches(&m));
        assert!(!filter(json!({"missing": null})).matches(&m));
        assert!(!filter(json!({"lang": "EN"})).matches(&m));
    }

    #[test]
    fn operators_follow_the_rules() {
        let m = obj(json!({"lang": "en", "year": 2024, "date": "2024-03-01", "tags": ["a", 2], "note": null}));
        let yes = [
            json!({"year": {"$gte": 2024, "$lt": 2025}}),
            json!({"year": {"$gt": 2023.5}}),
            json!({"year": {"$lte": 2024.0}}),
            json!({"date": {"$gte": "2024-01-01", "$lt": "2024-12-31"}}),
            json!({"lang": {"$in": ["fr", "en"]}}),
            json!({"lang": {"$nin": ["fr", "de"]}, "missing": {"$nin": ["x"]}}),
            json!({"lang": {"$ne": "fr"}, "missing": {"$ne": 1}, "year": {"$ne": "2024"}}),
            json!({"note": {"$exists": true}, "missing": {"$exists": false}}),
            json!({"tags": {"$contains": "a"}}),
            json!({"tags": {"$contains": 2.0}}),
            json!({"date": {"$prefix": "2024-03"}, "lang": {"$prefix": ""}}),
            json!({"date": {"$prefix": "2024-03-01"}}),
            json!({"year": {"$eq": 2024}}),
            json!({"$or": [{"lang": "fr"}, {"year": {"$gt": 2000}}]}),
            json!({"lang": "en", "$and": [{"year": {"$gte": 2024}}, {"year": {"$lte": 2024}}]}),
            json!({"$or": [{"$and": [{"lang": "fr"}]}, {"$or": [{"x": 1}, {"note": null}]}]}),
            json!({"year": {"$not": {"$gt": 2024}}}),
            json!({"missing": {"$not": {"$gte": 0}}}),
            json!({"year": {"$not": {"$gte": 2020, "$lt": 2024}}}),
            json!({"lang": {"$not": {"$in": ["fr"]}, "$prefix": "e"}}),
            json!({"$nor": [{"lang": "fr"}, {"year": {"$lt": 2000}}]}),
            json!({"$nor": [{"$nor": [{"lang": "en"}]}]}),
            json!({"date": {"$regex": "^2024-0[1-3]-"}, "lang": {"$regex": "(?i)^EN$"}}),
            json!({"lang": {"$not": {"$regex": "^f"}}, "missing": {"$not": {"$regex": ""}}}),
        ];
        for f in yes {
            assert!(filter(f.clone()).matches(&m), "{f}");
        }
        let no = [
            json!({"year": {"$gt": 2024}}),
            json!({"year": {"$lt": "3000"}}),
            json!({"date": {"$gt": 1}}),
            json!({"lang": {"$in": []}}),
            json!({"lang": {"$in": ["EN"]}}),
            json!({"lang": {"$nin": ["en"]}}),
            json!({"lang": {"$ne": "en"}}),
            json!({"missing": {"$exists": true}}),
            json!({"note": {"$exists": false}}),
            json!({"tags": {"$contains": "b"}}),
            json!({"lang": {"$contains": "en"}}),
            json!({"date": {"$prefix": "2024-03-01T"}}),
            json!({"lang": {"$prefix": "E"}}),
            json!({"year": {"$prefix": "20"}}),
            json!({"tags": {"$prefix": "a"}}),
            json!({"missing": {"$prefix": ""}}),
            json!({"missing": {"$gte": 0}}),
            json!({"year": {"$gte": 2020, "$lt": 2024}}),
            json!({"$or": [{"lang": "fr"}, {"year": {"$gt": 2024}}]}),
            json!({"lang": "fr", "$or": [{"lang": "en"}, {"year": 2024}]}),
            json!({"year": {"$not": {"$gte": 2024}}}),
            json!({"tags": {"$not": {"$contains": "a"}}}),
            json!({"$nor": [{"lang": "fr"}, {"year": 2024}]}),
            json!({"lang": {"$not": {"$prefix": "e"}}, "year": 2024}),
            json!({"year": {"$regex": "20"}}),
            json!({"tags": {"$regex": "a"}}),
            json!({"missing": {"$regex": ""}}),
            json!({"lang": {"$regex": "^n"}}),
        ];
        for f in no {
            assert!(!filter(f.clone()).matches(&m), "{f}");
        }
    }

    #[test]
    fn keys_within_objects_descend_through_objects_only() {
        let m = obj(json!({
            "author": {"name": "Ann", "born": 1890, "tags": ["x"], "note": null, "home": {"city": "Oslo"}},
            "list": [{"name": "Ann"}, "b"],
            "flat": "Ann",
        }));
        let yes = [
            json!({"author": {"name": "Ann"}}),
            json!({"author": {"name": "Ann", "born": {"$lt": 1900}}}),
            json!({"author": {"$exists": true, "born": 1890.0, "home": {"city": {"$prefix": "Os"}}}}),
            json!({"author": {"tags": {"$contains": "x"}, "note": null, "note2": {"$exists": false}}}),
            json!({"author": {"name": {"$in": ["Bo", "Ann"]}, "missing": {"$ne": 1}}}),
            json!({"author": {"$not": {"name": "Bo"}}}),
            json!({"author": {"name": {"$not": {"$prefix": "B"}}}}),
            json!({"list": {"name": {"$ne": "Ann"}}, "flat": {"name": {"$exists": false}}}),
            json!({"list": {"0": {"$exists": false}}}),
            json!({"nobody": {"name": {"$nin": ["Ann"]}}}),
            json!({"$or": [{"author": {"name": "Bo"}}, {"author": {"home": {"city": "Oslo"}}}]}),
            json!({"$nor": [{"author": {"home": {"city": {"$gte": "P"}}}}]}),
        ];
        for f in yes {
            assert!(filter(f.clone()).matches(&m), "{f}");
        }
        let no = [
            json!({"author": {"name": "ann"}}),
            json!({"author": {"born": {"$gte": 1900}}}),
            json!({"author": {"home": {"city": "Oslo", "zip": {"$exists": true}}}}),
            json!({"author": {"note": {"$exists": false}}}),
            json!({"author": {"name": {"name": {"$exists": true}}}}),
            json!({"list": {"name": "Ann"}}),
            json!({"list": {"0": {"$exists": true}}}),
            json!({"flat": {"name": {"$prefix": ""}}}),
            json!({"nobody": {"name": {"$exists": true}}}),
            json!({"author": {"$not": {"name": "Ann", "born": 1890}}}),
        ];
        for f in no {
            assert!(!filter(f.clone()).matches(&m), "{f}");
        }
        let f = filter(json!({"author": {"home": {"city": {"$gte": "A"}}}}));
        let Clause::All(clauses) = f.root() else { panic!("{f:?}") };
        assert_eq!(
            clauses[..],
            [Clause::Key(Condition {
                path: vec!["author".into(), "home".into(), "city".into()],
                test: Test::Compare(Comparison::Gte, json!("A"))
            })]
        );
    }

    #[test]
    fn elem_match_needs_one_element_to_pass_all() {
        let m = obj(json!({
            "authors": [{"name": "Ann", "born": 1890}, {"name": "Bo", "born": 1950}],
            "scores": [70, 85.5, "90"],
            "nested": [[1, 2], [3]],
            "flat": "x",
            "obj": {"name": "Ann"},
        }));
        let yes = [
            json!({"authors": {"$elemMatch": {"name": "Ann", "born": {"$lt": 1900}}}}),
            json!({"authors": {"$elemMatch": {"name": "Bo"}}}),
            json!({"authors": {"$elemMatch": {"name": {"$ne": "Ann"}}}}),
            json!({"authors": {"$elemMatch": {"$not": {"name": "Ann"}}}}),
            json!({"authors": {"$elemMatch": {"home": {"$exists": false}}}}),
            json!({"authors": {"$not": {"$elemMatch": {"name": "Cy"}}}}),
            json!({"scores": {"$elemMatch": {"$gte": 80, "$lt": 90}}}),
            json!({"scores": {"$elemMatch": {"$eq": 85.5}}}),
            json!({"scores": {"$elemMatch": {"$prefix": "9"}}}),
            json!({"scores": {"$elemMatch": {"$in": [70.0, 1]}}}),
            json!({"nested": {"$elemMatch": {"$contains": 3}}}),
            json!({"nested": {"$elemMatch": {"$elemMatch": {"$gt": 1}}}}),
            json!({"missing": {"$not": {"$elemMatch": {"$exists": true}}}}),
            json!({"$or": [{"flat": 1}, {"authors": {"$elemMatch": {"born": 1950.0}}}]}),
        ];
        for f in yes {
            assert!(filter(f.clone()).matches(&m), "{f}");
        }
        let no = [
            // Each condition holds of an element, but not both of one.
            json!({"authors": {"$elemMatch": {"name": "Ann", "born": {"$gt": 1900}}}}),
            json!({"authors": {"$elemMatch": {"$eq": "Ann"}}}),
            json!({"authors": {"$not": {"$elemMatch": {"name": "Bo"}}}}),
            json!({"scores": {"$elemMatch": {"$gt": 86, "$lt": 90}}}),
            json!({"obj": {"$elemMatch": {"name": "Ann"}}}),
            json!({"flat": {"$elemMatch": {"$eq": "x"}}}),
            json!({"missing": {"$elemMatch": {"$exists": false}}}),
            // A list element is no scalar, and is not entered by a key.
            json!({"nested": {"$elemMatch": {"$eq": 1}}}),
            json!({"nested": {"$elemMatch": {"0": {"$exists": true}}}}),
        ];
        for f in no {
            assert!(!filter(f.clone()).matches(&m), "{f}");
        }
        let f = filter(json!({"authors": {"$elemMatch": {"name": "Ann", "$exists": true}}}));
        let Clause::All(clauses) = f.root() else { panic!("{f:?}") };
        let element = Clause::All(vec![
            Clause::Key(Condition { path: vec![], test: Test::Exists(true) }),
            Clause::Key(Condition { path: vec!["name".into()], test: Test::Eq(json!("Ann")) }),
        ]);
        assert_eq!(
            clauses[..],
            [Clause::Key(Condition { path: vec!["authors".into()], test: Test::Elements(Box::new(element)) })]
        );
    }

    #[test]
    fn numbers_compare_exactly() {
        let big = Number::from(9_007_199_254_740_993u64);
        let float = |f: f64| Number::from_f64(f).unwrap();
        assert_eq!(compare_numbers(&big, &float(9_007_199_254_740_992.0)), Ordering::Greater);
        assert_eq!(compare_numbers(&Number::from(2024), &float(2024.0)), Ordering::Equal);
        assert_eq!(compare_numbers(&Number::from(2023), &float(2023.5)), Ordering::Less);
        assert_eq!(compare_numbers(&Number::from(-3), &float(-2.5)), Ordering::Less);
        assert_eq!(compare_numbers(&float(-2.5), &Number::from(-3)), Ordering::Greater);
        assert_eq!(compare_numbers(&Number::from(u64::MAX), &Number::from(-1)), Ordering::Greater);
        assert_eq!(compare_numbers(&Number::from(1), &float(1e300)), Ordering::Less);
    }

    #[test]
    fn bad_filters_are_refused_with_a_reason() {
        let cases = [
            (json!({}), "empty metadata filter"),
            (json!({"tags": ["a"]}), "$in"),
            (json!({"x": {}}), "empty object"),
            (json!({"x": {"$lang": "fr"}}), "unknown operator \"$lang\""),
            (json!({"x": {"y": {}}}), "\"x.y\": an empty object"),
            (json!({"x": {"y": [1]}}), "\"x.y\": [1] is a list"),
            (json!({"x": {"y": {"$gt": true}}}), "\"x.y\": $gt compares"),
            (json!({"x": {"$or": [{"y": 1}]}}), "$or goes at the top level"),
            (json!({"x": {"y\u{0}": 1}}), "NUL"),
            (json!({"x\u{0}": 1}), "NUL"),
            (json!({"x": {"y": {"$not": {"z": {"$not": {"$eq": 1}}}}}}), "$not within $not"),
            (json!({"x": {"$gt": true}}), "number or a string"),
            (json!({"x": {"$in": "a"}}), "list of values"),
            (json!({"x": {"$in": [[1]]}}), "not a string, number"),
            (json!({"x": {"$exists": 1}}), "true or false"),
            (json!({"x": {"$contains": ["a"]}}), "not a string, number"),
            (json!({"x": {"$prefix": 20}}), "$prefix takes a string"),
            (json!({"x": {"$prefix": ["a"]}}), "not a string, number"),
            (json!({"x": "a\u{0}b"}), "NUL"),
            (json!({"x": {"$in": (0..1025).collect::<Vec<_>>()}}), "at most 1024"),
            (json!({"$or": []}), "non-empty list of filters"),
            (json!({"$or": {"a": 1}}), "non-empty list of filters"),
            (json!({"$and": [1]}), "is not a filter"),
            (json!({"$or": [{}]}), "empty metadata filter"),
            (json!({"x": {"$not": 1}}), "$not takes an object of operators"),
            (json!({"x": {"$not": {}}}), "an empty $not"),
            (json!({"x": {"$not": {"$not": {"$eq": 1}}}}), "$not within $not"),
            (json!({"x": {"$not": {"$lang": 1}}}), "unknown operator"),
            (json!({"$nor": []}), "non-empty list of filters"),
            (json!({"$nor": [1]}), "is not a filter"),
            (json!({"x": {"$elemMatch": 1}}), "$elemMatch takes an object"),
            (json!({"x": {"$regex": 1}}), "$regex takes a pattern as a string"),
            (json!({"x": {"$regex": "\\bx"}}), "word boundaries"),
            (json!({"x": {"y": {"$regex": "("}}}), "\"x.y\": $regex \"(\": not a valid pattern"),
            (json!({"x": {"$elemMatch": {}}}), "an empty $elemMatch"),
            (json!({"x": {"$elemMatch": {"$or": [{"a": 1}]}}}), "$or within $elemMatch is not supported"),
            (json!({"x": {"$elemMatch": {"$bad": 1}}}), "\"x.$elemMatch\": unknown operator \"$bad\""),
            (json!({"x": {"$elemMatch": {"y": [1]}}}), "\"x.$elemMatch.y\": [1] is a list"),
            (json!({"x": {"$elemMatch": {"y": {"$in": 1}}}}), "list of values"),
        ];
        for (f, want) in cases {
            let e = Filter::new(&obj(f.clone())).unwrap_err().to_string();
            assert!(e.contains(want), "{f}: {e}");
        }
        let many: Metadata = (0..65).map(|i| (format!("k{i}"), json!(1))).collect();
        assert!(Filter::new(&many).unwrap_err().to_string().contains("at most 64"));
        let mut deep = json!({"a": 1});
        for _ in 0..9 {
            deep = json!({"$or": [deep, {"b": 2}]});
        }
        assert!(Filter::new(&obj(deep)).unwrap_err().to_string().contains("deeper than 8"));
        let mut nested = json!(1);
        for _ in 0..9 {
            nested = json!({"k": nested});
        }
        assert!(Filter::new(&obj(nested)).unwrap_err().to_string().contains("deeper than 8"));
        let mut lists = json!({"$gt": 1});
        for _ in 0..8 {
            lists = json!({"$elemMatch": lists});
        }
        assert!(Filter::new(&obj(json!({"k": lists}))).unwrap_err().to_string().contains("deeper than 8"));
        let Value::Object(seven) = &lists["$elemMatch"] else { panic!() };
        Filter::new(&obj(json!({"k": seven}))).unwrap();
    }

    #[test]
    fn arguments_read_operators_json_scalars_and_text() {
        let f = Filter::from_args(&[
            "lang=en",
            "year>=2000",
            "year<2010",
            "draft=false",
            "id=\"7\"",
            "q=a=b",
            "n=null",
            "date<=2024-01-01",
            "kind!=stub",
            "url^=https://en.",
            "code^=42",
            "ref^=\"x=\"",
            "name~=^A.+n$",
            "num~=42",
            r#"{"tags": {"$contains": "x"}, "src": "wiki"}"#,
        ])
        .unwrap();
        assert_eq!(
            Value::Object(f.json().clone()),
            json!({"lang": "en", "year": {"$gte": 2000, "$lt": 2010}, "draft": false, "id": "7", "q": "a=b",
                   "n": null, "date": {"$lte": "2024-01-01"}, "kind": {"$ne": "stub"},
                   "url": {"$prefix": "https://en."}, "code": {"$prefix": "42"}, "ref": {"$prefix": "x="},
                   "name": {"$regex": "^A.+n$"}, "num": {"$regex": "42"},
                   "tags": {"$contains": "x"}, "src": "wiki"})
        );
        assert_eq!(Filter::from_args(&["^=x"]).unwrap_err().to_string(), "--filter \"^=x\": the key is empty");
        assert_eq!(Filter::from_args(&["tags=[1]"]).unwrap().json()["tags"], json!("[1]"));
        assert_eq!(
            Filter::from_args(&["a=1", "{\"a\": {\"$lt\": 5}}"]).unwrap().json()["a"],
            json!({"$eq": 1, "$lt": 5})
        );
        let two = Filter::from_args(&[r#"{"$or": [{"a": 1}, {"b": 2}]}"#, r#"{"$or": [{"c": 3}]}"#, "d=4"]).unwrap();
        assert_eq!(
            Value::Object(two.json().clone()),
            json!({"d": 4, "$and": [{"$or": [{"a": 1}, {"b": 2}]}, {"$or": [{"c": 3}]}]})
        );
        let none = Filter::from_args(&[r#"{"$nor": [{"a": 1}]}"#, r#"{"b": {"$not": {"$lt": 2}}}"#, "c!=3"]).unwrap();
        assert_eq!(
            Value::Object(none.json().clone()),
            json!({"b": {"$not": {"$lt": 2}}, "c": {"$ne": 3}, "$nor": [{"a": 1}]})
        );
        let within =
            Filter::from_args(&[r#"{"author": {"name": "Ann"}}"#, r#"{"author": {"born": {"$lt": 1900}}}"#]).unwrap();
        assert_eq!(Value::Object(within.json().clone()), json!({"author": {"name": "Ann", "born": {"$lt": 1900}}}));
        let bad: [&[&str]; 7] = [&["lang"], &["=en"], &["a=1", "a=2"], &[], &["a!1"], &["{1}"], &["a>true"]];
        for (arg, hint) in [("year=>2020", "year>=2020"), ("year=<2020", "year<=2020"), ("year==2020", "year=2020")] {
            let e = Filter::from_args(&[arg]).unwrap_err().to_string();
            assert!(e.contains(&format!("did you mean {hint}?")), "{e}");
        }
        assert_eq!(Filter::from_args(&[r#"{"a": "=x"}"#]).unwrap().json()["a"], json!("=x"));
        for args in bad {
            let e = Filter::from_args(args).unwrap_err().to_string();
            assert!(
                e.contains("--filter") || e.contains("empty metadata filter") || e.contains("number or a string"),
                "{args:?}: {e}"
            );
        }
    }
}
