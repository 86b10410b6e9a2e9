//! How counts read in messages for people: "1 context", "2 contexts". Every crate's messages
//! use it, so it lives at the bottom of the workspace.

/// `n` and `noun`, with the plural `s` unless `n` is 1 (regular nouns only). Any integer type.
pub fn counted(n: impl std::fmt::Display, noun: &str) -> String {
    let n = n.to_string();
    let s = if n == "1" { "" } else { "s" };
    format!("{n} {noun}{s}")
}

#[cfg(test)]
mod tests {
    use super::counted;

    #[test]
    fn one_is_singular_and_every_other_count_plural() {
        assert_eq!(counted(0, "context"), "0 contexts");
        assert_eq!(counted(1, "context"), "1 context");
        assert_eq!(counted(2u64, "document"), "2 documents");
        assert_eq!(counted(-1i64, "token"), "-1 tokens");
    }
}
