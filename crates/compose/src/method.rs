//! The methods the paper compares, by name: the one place where their names, their parsing,
//! their listings and the text of an unknown or unavailable name live. [`Composition`] is the
//! arithmetic this crate computes; [`Method`] is what a user picks, which adds the baselines
//! (no context, the contexts' tokens) and a hybrid's ablations that the model and store crates
//! carry out.

/// The weights a composition gives the contexts' states (the table in the crate's docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Composition {
    /// Mean of the states.
    Soup,
    /// Concatenation-aware: exact for one SSM layer; depends on the order.
    Caso,
    /// Mean of CASO over all permutations (order-invariant).
    PicasoS,
    /// Mean of CASO over the cyclic rotations of the given order.
    PicasoR,
}

/// A way to give a model its contexts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// No context.
    Naive,
    /// The contexts' tokens processed in front of the prompt, in order (the baseline picaso avoids).
    Concat,
    /// Concat averaged over the n rotations of the order (states averaged).
    PiConcatR,
    /// The contexts' stored states composed.
    Compose(Composition),
    /// A hybrid's ablation: only the union of the contexts' keys and values, the Mamba layers'
    /// states left at zero.
    KvUnion,
    /// A hybrid's ablation: PICASO-R on the Mamba layers alone, without the keys and values.
    PicasoRNoKv,
}

impl Composition {
    /// Every composition, in the order the paper introduces them.
    pub const ALL: [Composition; 4] =
        [Composition::Soup, Composition::Caso, Composition::PicasoS, Composition::PicasoR];

    /// The name on the command line, the wire and in tables.
    pub fn name(self) -> &'static str {
        Method::Compose(self).name()
    }
}

impl Method {
    /// Every method: baselines, compositions, a hybrid's ablations.
    pub const ALL: [Method; 9] = [
        Method::Naive,
        Method::Concat,
        Method::PiConcatR,
        Method::Compose(Composition::Soup),
        Method::Compose(Composition::Caso),
        Method::Compose(Composition::PicasoS),
        Method::Compose(Composition::PicasoR),
        Method::KvUnion,
        Method::PicasoRNoKv,
    ];

    /// The paper's methods: its baselines and its compositions.
    pub const PAPER: [Method; 7] = [
        Method::Naive,
        Method::Concat,
        Method::PiConcatR,
        Method::Compose(Composition::Soup),
        Method::Compose(Composition::Caso),
        Method::Compose(Composition::PicasoS),
        Method::Compose(Composition::PicasoR),
    ];

    /// The compositions, as methods.
    pub const COMPOSITIONS: [Method; 4] = [
        Method::Compose(Composition::Soup),
        Method::Compose(Composition::Caso),
        Method::Compose(Composition::PicasoS),
        Method::Compose(Composition::PicasoR),
    ];

    /// What a query (CLI, server, Python) can use, the recommended first.
    pub const QUERY: [Method; 6] = [
        Method::Compose(Composition::PicasoR),
        Method::Compose(Composition::PicasoS),
        Method::Compose(Composition::Caso),
        Method::Compose(Composition::Soup),
        Method::Concat,
        Method::Naive,
    ];

    /// What a query can use that reads the contexts (all of [`Method::QUERY`] but naive).
    pub const WITH_CONTEXT: [Method; 5] = [
        Method::Compose(Composition::PicasoR),
        Method::Compose(Composition::PicasoS),
        Method::Compose(Composition::Caso),
        Method::Compose(Composition::Soup),
        Method::Concat,
    ];

    /// The name on the command line, the wire and in tables.
    pub fn name(self) -> &'static str {
        match self {
            Method::Naive => "naive",
            Method::Concat => "concat",
            Method::PiConcatR => "piconcat-r",
            Method::Compose(Composition::Soup) => "soup",
            Method::Compose(Composition::Caso) => "caso",
            Method::Compose(Composition::PicasoS) => "picaso-s",
            Method::Compose(Composition::PicasoR) => "picaso-r",
            Method::KvUnion => "kv-union",
            Method::PicasoRNoKv => "picaso-r-no-kv",
        }
    }

    /// The composition this method computes, if it is one.
    pub fn composition(self) -> Option<Composition> {
        match self {
            Method::Compose(c) => Some(c),
            _ => None,
        }
    }

    /// Whether only a hybrid model (with attention layers) can use it.
    pub fn hybrid_only(self) -> bool {
        matches!(self, Method::KvUnion | Method::PicasoRNoKv)
    }

    /// `methods`' names for a message: "a, b or c".
    pub fn list(methods: &[Method]) -> String {
        let names: Vec<&str> = methods.iter().map(|m| m.name()).collect();
        match names.split_last() {
            None => String::new(),
            Some((last, [])) => last.to_string(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        }
    }

    /// The method named `name`, which must be one of `allowed`.
    pub fn parse_among(name: &str, allowed: &[Method]) -> Result<Method, UnknownMethod> {
        match allowed.iter().find(|m| m.name() == name) {
            Some(&m) => Ok(m),
            None => Err(UnknownMethod {
                name: name.to_string(),
                known: Method::ALL.iter().find(|m| m.name() == name).copied(),
                allowed: allowed.to_vec(),
            }),
        }
    }

    /// This method, or an error listing `allowed` unless it is one of them.
    pub fn check_among(self, allowed: &[Method]) -> Result<Method, UnknownMethod> {
        match allowed.contains(&self) {
            true => Ok(self),
            false => Err(UnknownMethod { name: self.name().to_string(), known: Some(self), allowed: allowed.to_vec() }),
        }
    }
}

/// A method name that is unknown, or known but not available where it was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownMethod {
    /// The name given.
    pub name: String,
    /// The method it names, if it names one (then it is only unavailable here).
    pub known: Option<Method>,
    /// The methods available here.
    pub allowed: Vec<Method>,
}

impl std::fmt::Display for UnknownMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let use_ = Method::list(&self.allowed);
        match self.known {
            None if self.allowed == Method::COMPOSITIONS => {
                write!(f, "unknown composition method {:?}: use {use_}", self.name)
            }
            None => write!(f, "unknown method {:?}: use {use_}", self.name),
            Some(m) if m.hybrid_only() && self.allowed.iter().all(|a| !a.hybrid_only()) => {
                write!(
                    f,
                    "method {} is an ablation of `picaso eval` on hybrid models, not available here: use {use_}",
                    self.name
                )
            }
            Some(_) => write!(f, "method {} is not available here: use {use_}", self.name),
        }
    }
}

impl std::error::Error for UnknownMethod {}

impl std::str::FromStr for Method {
    type Err = UnknownMethod;
    fn from_str(s: &str) -> Result<Self, UnknownMethod> {
        Method::parse_among(s, &Method::ALL)
    }
}

impl std::str::FromStr for Composition {
    type Err = UnknownMethod;
    fn from_str(s: &str) -> Result<Self, UnknownMethod> {
        Ok(Method::parse_among(s, &Method::COMPOSITIONS)?.composition().expect("COMPOSITIONS holds compositions"))
    }
}

/// Written as its name (reports, journals, the wire).
impl serde::Serialize for Method {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for Method {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::fmt::Display for Composition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_to_its_method() {
        for m in Method::ALL {
            assert_eq!(m.name().parse::<Method>().unwrap(), m);
        }
        let names: std::collections::HashSet<_> = Method::ALL.iter().map(|m| m.name()).collect();
        assert_eq!(names.len(), Method::ALL.len());
        for c in Composition::ALL {
            assert_eq!(c.name().parse::<Composition>().unwrap(), c);
        }
    }

    #[test]
    fn errors_list_what_is_allowed() {
        let e = Method::parse_among("picaso", &Method::QUERY).unwrap_err();
        assert_eq!(e.to_string(), "unknown method \"picaso\": use picaso-r, picaso-s, caso, soup, concat or naive");
        let e = Method::parse_among("concat", &Method::COMPOSITIONS).unwrap_err();
        assert_eq!(e.to_string(), "method concat is not available here: use soup, caso, picaso-s or picaso-r");
        let e = Method::parse_among("kv-union", &Method::QUERY).unwrap_err();
        assert!(e.to_string().starts_with("method kv-union is an ablation of `picaso eval` on hybrid models"), "{e}");
        assert_eq!(Method::list(&[Method::Naive]), "naive");
        let e = "average".parse::<Composition>().unwrap_err();
        assert_eq!(e.to_string(), "unknown composition method \"average\": use soup, caso, picaso-s or picaso-r");
    }
}
