//! The secret capability of an idempotency claim taken through the API.
//!
//! A claim's fencing token is a clock value that `GET /v1/idempotency/record` shows to
//! any reader of the tenant: on its own it must not be enough to complete, renew or
//! give back someone's claim (a forged outcome would be replayed to every retry). So a
//! claim also gets a capability, an HMAC-SHA256 of (scope, key, token) under the
//! service's secret, handed to the claimer only and required by heartbeat, complete
//! and release. Nothing is stored: every instance with the same secret checks it.

use sha2::{Digest, Sha256};

/// The capability's length in bytes (shown as 32 hex digits).
const LENGTH: usize = 16;

/// The key that signs capabilities.
pub(super) struct ClaimSecret([u8; 32]);

impl ClaimSecret {
    /// A secret derived from `material` (a secret file's contents, or the tokens
    /// document, which every instance of a deployment shares).
    pub(super) fn derive(material: &[u8]) -> ClaimSecret {
        let mut hasher = Sha256::new();
        hasher.update(b"turnstile claim capability\0");
        hasher.update(material);
        ClaimSecret(hasher.finalize().into())
    }

    /// A secret of this process alone.
    pub(super) fn random() -> ClaimSecret {
        ClaimSecret::derive(&rand::random::<[u8; 32]>())
    }

    fn mac(&self, scope: &str, key: &str, token: u64) -> [u8; LENGTH] {
        // HMAC (RFC 2104) over SHA-256, the key being one block's worth or less.
        let mut inner_key = [0x36u8; 64];
        let mut outer_key = [0x5cu8; 64];
        for (i, byte) in self.0.iter().enumerate() {
            inner_key[i] ^= byte;
            outer_key[i] ^= byte;
        }
        let mut inner = Sha256::new();
        inner.update(inner_key);
        for part in [scope.as_bytes(), key.as_bytes()] {
            inner.update((part.len() as u64).to_be_bytes());
            inner.update(part);
        }
        inner.update(token.to_be_bytes());
        let mut outer = Sha256::new();
        outer.update(outer_key);
        outer.update(inner.finalize());
        let digest = outer.finalize();
        let mut mac = [0u8; LENGTH];
        mac.copy_from_slice(&digest[..LENGTH]);
        mac
    }

    /// The capability of the claim (`scope`, `key`, `token`), as hex.
    pub(super) fn capability(&self, scope: &str, key: &str, token: u64) -> String {
        self.mac(scope, key, token)
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect()
    }

    /// Whether `given` is that claim's capability (compared in constant time).
    pub(super) fn verify(&self, scope: &str, key: &str, token: u64, given: &str) -> bool {
        use subtle::ConstantTimeEq;
        let expected = self.capability(scope, key, token);
        bool::from(expected.as_bytes().ct_eq(given.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_bind_scope_key_token_and_secret() {
        let secret = ClaimSecret::derive(b"one");
        let capability = secret.capability("acme/shop", "pay-1", 42);
        assert_eq!(capability.len(), 32);
        assert!(secret.verify("acme/shop", "pay-1", 42, &capability));
        for (scope, key, token) in [
            ("acme/shop", "pay-1", 43),
            ("acme/shop", "pay-2", 42),
            ("acme/sho", "ppay-1", 42),
        ] {
            assert!(
                !secret.verify(scope, key, token, &capability),
                "{scope} {key} {token}"
            );
        }
        assert!(!ClaimSecret::derive(b"two").verify("acme/shop", "pay-1", 42, &capability));
        assert!(!secret.verify("acme/shop", "pay-1", 42, "short"));
    }
}
