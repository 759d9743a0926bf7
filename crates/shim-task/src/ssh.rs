//! OpenSSH public keys: validation and SHA256 fingerprints.
//!
//! A key is accepted only as exactly one `<type> <base64> [comment]` line: no options
//! (`command="…"`, `from=…`), no line breaks, a known key type, and a base64 blob whose embedded
//! type matches the declared one. Keys are compared by fingerprint, so any formatting of the
//! same key (another comment, extra spaces) matches.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Key types accepted in authorized_keys lines.
pub const KEY_TYPES: &[&str] = &[
    "ssh-ed25519",
    "ssh-rsa",
    "ssh-dss",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
];

/// Why a string is not a single OpenSSH public key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid SSH public key {shown:?}: {why}")]
pub struct InvalidKey {
    /// The start of the rejected key, for the message.
    pub shown: String,
    /// What is wrong with it.
    pub why: String,
}

/// A validated OpenSSH public key.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PublicKey {
    line: String,
    key_type: String,
    fingerprint: String,
}

impl PublicKey {
    /// Parses and validates one key line.
    pub fn parse(s: &str) -> Result<Self, InvalidKey> {
        let fail = |why: &str| InvalidKey {
            shown: s.chars().take(40).collect(),
            why: why.to_owned(),
        };
        if s.contains(['\n', '\r', '\0']) {
            return Err(fail("contains a line break or NUL"));
        }
        let mut parts = s.split_ascii_whitespace();
        let key_type = parts.next().ok_or_else(|| fail("empty"))?;
        if !KEY_TYPES.contains(&key_type) {
            return Err(fail(
                "does not start with a known key type (options are not allowed)",
            ));
        }
        let b64 = parts.next().ok_or_else(|| fail("no key data"))?;
        let blob = STANDARD
            .decode(b64)
            .map_err(|_| fail("key data is not valid base64"))?;
        let embedded = embedded_type(&blob).ok_or_else(|| fail("key data is malformed"))?;
        if embedded != key_type.as_bytes() {
            return Err(fail("key data does not match the key type"));
        }
        let comment: Vec<&str> = parts.collect();
        let mut line = format!("{key_type} {b64}");
        if !comment.is_empty() {
            line.push(' ');
            line.push_str(&comment.join(" "));
        }
        let fingerprint = format!("SHA256:{}", STANDARD_NO_PAD.encode(Sha256::digest(&blob)));
        Ok(Self {
            line,
            key_type: key_type.to_owned(),
            fingerprint,
        })
    }

    /// The normalized line (`<type> <base64> [comment]`, single spaces).
    pub fn line(&self) -> &str {
        &self.line
    }

    /// The key type, e.g. `ssh-ed25519`.
    pub fn key_type(&self) -> &str {
        &self.key_type
    }

    /// `SHA256:<base64 without padding>`, as `ssh-keygen -l` prints it.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
}

/// The type string at the start of an SSH wire-format key blob.
fn embedded_type(blob: &[u8]) -> Option<&[u8]> {
    let len = u32::from_be_bytes(blob.get(..4)?.try_into().ok()?) as usize;
    let t = blob.get(4..4usize.checked_add(len)?)?;
    // There must be key material after the type.
    if blob.len() <= 4 + len {
        return None;
    }
    Some(t)
}

impl TryFrom<String> for PublicKey {
    type Error = InvalidKey;
    fn try_from(s: String) -> Result<Self, InvalidKey> {
        Self::parse(&s)
    }
}

impl From<PublicKey> for String {
    fn from(k: PublicKey) -> String {
        k.line
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({} {})", self.key_type, self.fingerprint)
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Generated with ssh-keygen -t ed25519; the fingerprint is what ssh-keygen -l printed.
    pub(crate) const ED25519: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe user@host";

    #[test]
    fn parses_and_fingerprints() {
        let k = PublicKey::parse(ED25519).unwrap();
        assert_eq!(k.key_type(), "ssh-ed25519");
        assert_eq!(
            k.fingerprint(),
            "SHA256:SiPrudq4nEEbxrcMgWUwXgSGvb1urNgsmIikfUlAl7A"
        );
        // Same key, other formatting: same fingerprint.
        let k2 = PublicKey::parse(
            "ssh-ed25519   AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe",
        )
        .unwrap();
        assert_eq!(k.fingerprint(), k2.fingerprint());
    }

    #[test]
    fn rejects_bad_keys() {
        for s in [
            "",
            "garbage",
            "ssh-ed25519",
            "ssh-ed25519 !!!notbase64",
            "ssh-rsa AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe",
            "command=\"x\" ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe",
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe\nssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe",
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5",
        ] {
            assert!(PublicKey::parse(s).is_err(), "{s:?}");
        }
    }
}
