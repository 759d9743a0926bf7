//! Validated task identifiers.
//!
//! A task id and a task name become a directory name and part of a container name, so they are
//! restricted to 1–128 characters of `[A-Za-z0-9_.-]` starting with a letter or a digit: no
//! path separator, no `..`, nothing Docker rejects in a container name.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The longest id or name accepted.
pub const MAX_ID_LEN: usize = 128;

/// Why a string is not a valid task id or name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {value:?} is invalid: {why}")]
pub struct InvalidId {
    /// `id` or `name`.
    pub what: &'static str,
    /// The rejected value (truncated to keep messages readable).
    pub value: String,
    /// The rule it breaks.
    pub why: &'static str,
}

fn check(what: &'static str, s: &str) -> Result<(), InvalidId> {
    let fail = |why| InvalidId {
        what,
        value: s.chars().take(MAX_ID_LEN + 8).collect(),
        why,
    };
    if s.is_empty() {
        return Err(fail("must not be empty"));
    }
    if s.len() > MAX_ID_LEN {
        return Err(fail("must be at most 128 characters"));
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
    {
        return Err(fail("may contain only letters, digits, '_', '.' and '-'"));
    }
    if !s.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(fail("must start with a letter or a digit"));
    }
    Ok(())
}

macro_rules! id_type {
    ($(#[$doc:meta])* $ty:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $ty(String);

        impl $ty {
            /// Validates `s`.
            pub fn new(s: impl Into<String>) -> Result<Self, InvalidId> {
                let s = s.into();
                check($what, &s)?;
                Ok(Self(s))
            }

            /// The validated string.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $ty {
            type Error = InvalidId;
            fn try_from(s: String) -> Result<Self, InvalidId> {
                Self::new(s)
            }
        }

        impl std::str::FromStr for $ty {
            type Err = InvalidId;
            fn from_str(s: &str) -> Result<Self, InvalidId> {
                Self::new(s)
            }
        }

        impl From<$ty> for String {
            fn from(v: $ty) -> String {
                v.0
            }
        }

        impl AsRef<str> for $ty {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }
    };
}

id_type!(
    /// A task id (the server's UUID, in practice), validated.
    TaskId,
    "id"
);
id_type!(
    /// A task name, validated.
    TaskName,
    "name"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_valid() {
        for s in ["a", "0", "job-1.x_y", &"a".repeat(128), "5f9c-uuid"] {
            TaskId::new(s).unwrap();
            TaskName::new(s).unwrap();
        }
    }

    #[test]
    fn rejects_invalid() {
        for s in [
            "",
            "..",
            ".a",
            "-a",
            "_a",
            "a/b",
            "a\\b",
            "a b",
            "a\n",
            "é",
            "a\0",
            &"a".repeat(129),
        ] {
            assert!(TaskId::new(s).is_err(), "{s:?}");
        }
    }

    #[test]
    fn serde_validates() {
        assert!(serde_json::from_str::<TaskId>("\"../x\"").is_err());
        let id: TaskId = serde_json::from_str("\"abc\"").unwrap();
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"abc\"");
    }
}
