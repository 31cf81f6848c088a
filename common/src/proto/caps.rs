//! Capabilities: what a session's features are, negotiated in the handshake.
//!
//! A client's `Hello` offers capabilities (a name and a comma-separated list of the
//! choices it accepts, in its order of preference); the server's `Welcome` answers
//! with one choice for each capability it knows. Names a peer does not know are
//! ignored, never an error, so a feature is added without a new protocol version: the
//! version changes only when the encoding of an existing message does
//! (`docs/protocol.md`, "Version rule").
//!
//! A capability a client leaves out takes its default, which every peer of this
//! protocol version supports; a server that leaves one out of its welcome chose the
//! default.

use crate::msg::Capability;

/// Name of the chunk-hash capability: the algorithm of every chunk hash and manifest
/// of the session.
pub const HASH: &str = "hash";

/// A chunk-hash algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HashAlgorithm {
    /// SHA-256 (the default: every peer of this protocol version supports it).
    Sha256,
}

impl HashAlgorithm {
    /// Every algorithm this build supports, in its order of preference.
    pub const SUPPORTED: &'static [HashAlgorithm] = &[HashAlgorithm::Sha256];

    /// Its name on the wire and in messages.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgorithm::Sha256 => "sha256",
        }
    }

    /// The algorithm called `name`, if this build knows it.
    pub fn from_name(name: &str) -> Option<HashAlgorithm> {
        Self::SUPPORTED.iter().copied().find(|a| a.name() == name)
    }
}

/// What a client offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// Hash algorithms it accepts, preferred first (not empty).
    pub hashes: Vec<HashAlgorithm>,
}

impl Default for Offer {
    /// Everything this build supports.
    fn default() -> Offer {
        Offer {
            hashes: HashAlgorithm::SUPPORTED.to_vec(),
        }
    }
}

impl Offer {
    /// The offer as a hello's capabilities.
    pub fn to_capabilities(&self) -> Vec<Capability> {
        let hashes: Vec<&str> = self.hashes.iter().map(|h| h.name()).collect();
        vec![Capability::new(HASH, &hashes.join(","))]
    }
}

/// What a session agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// The algorithm of the session's chunk hashes.
    pub hash: HashAlgorithm,
}

impl Negotiated {
    /// The agreement as a welcome's capabilities.
    pub fn to_capabilities(&self) -> Vec<Capability> {
        vec![Capability::new(HASH, self.hash.name())]
    }
}

/// The value of the first capability called `name`, if any.
pub fn find<'a>(caps: &'a [Capability], name: &str) -> Option<&'a str> {
    caps.iter()
        .find(|c| c.name == name)
        .map(|c| c.value.as_str())
}

/// The server's choice for a client's `offered` capabilities: for each known
/// capability, the client's most preferred choice among `supported` ones. Unknown
/// capabilities and unknown choices are ignored. Fails, naming both sides' lists, when
/// a capability has no choice in common.
pub fn choose(offered: &[Capability], supported: &[HashAlgorithm]) -> Result<Negotiated, String> {
    let hash = match find(offered, HASH) {
        None => HashAlgorithm::Sha256,
        Some(list) => list
            .split(',')
            .filter_map(HashAlgorithm::from_name)
            .find(|h| supported.contains(h))
            .ok_or_else(|| {
                let ours: Vec<&str> = supported.iter().map(|h| h.name()).collect();
                format!(
                    "no hash algorithm in common: the client offers '{}', the server supports '{}'",
                    list.escape_debug(),
                    ours.join(",")
                )
            })?,
    };
    Ok(Negotiated { hash })
}

/// Checks the server's `chosen` capabilities against the client's `offer`: each choice
/// must be one the client offered. Unknown capabilities are ignored.
pub fn accept(chosen: &[Capability], offer: &Offer) -> Result<Negotiated, String> {
    let hash = match find(chosen, HASH) {
        None => HashAlgorithm::Sha256,
        Some(name) => HashAlgorithm::from_name(name)
            .filter(|h| offer.hashes.contains(h))
            .ok_or_else(|| {
                format!(
                    "the server chose hash algorithm '{}', which this client did not offer",
                    name.escape_debug()
                )
            })?,
    };
    Ok(Negotiated { hash })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_capabilities_and_choices_are_ignored() {
        let offered = vec![
            Capability::new("zstd-control", "1"),
            Capability::new(HASH, "sha3-512,sha256"),
        ];
        let n = choose(&offered, HashAlgorithm::SUPPORTED).unwrap();
        assert_eq!(n.hash, HashAlgorithm::Sha256);
        let mut welcome = n.to_capabilities();
        welcome.push(Capability::new("future", "x"));
        assert_eq!(accept(&welcome, &Offer::default()).unwrap(), n);
    }

    #[test]
    fn a_missing_capability_takes_its_default() {
        assert_eq!(
            choose(&[], HashAlgorithm::SUPPORTED).unwrap().hash,
            HashAlgorithm::Sha256
        );
        assert_eq!(
            accept(&[], &Offer::default()).unwrap().hash,
            HashAlgorithm::Sha256
        );
    }

    #[test]
    fn no_choice_in_common_is_an_error() {
        let e = choose(&[Capability::new(HASH, "md5")], HashAlgorithm::SUPPORTED).unwrap_err();
        assert!(e.contains("no hash algorithm in common"), "{e}");
        let e = accept(&[Capability::new(HASH, "md5")], &Offer::default()).unwrap_err();
        assert!(e.contains("did not offer"), "{e}");
    }

    #[test]
    fn the_first_of_a_repeated_capability_counts() {
        let offered = vec![
            Capability::new(HASH, "sha256"),
            Capability::new(HASH, "md5"),
        ];
        assert!(choose(&offered, HashAlgorithm::SUPPORTED).is_ok());
        assert_eq!(
            Offer::default().to_capabilities(),
            vec![Capability::new(HASH, "sha256")]
        );
    }
}
