//! Who may call the service: bearer tokens, each with scopes and, optionally, a tenant.
//!
//! Tokens come from a JSON file (`--tokens FILE`) or the `TURNSTILE_TOKENS` environment
//! variable, in the same shape:
//!
//! ```json
//! {"tokens": [
//!   {"name": "billing-cron", "token": "…at least 16 characters…",
//!    "scopes": ["locks:write"], "tenant": "billing"},
//!   {"name": "ops", "token_sha256": "…64 hex digits…", "scopes": ["admin"]}
//! ]}
//! ```
//!
//! A presented token is hashed and compared with every configured hash in constant time,
//! with no early exit, so neither the match nor its position leaks through timing.
//! Tokens are never logged; the `name` is what logs and the dashboard show.

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use subtle::{ConditionallySelectable, ConstantTimeEq};

use super::Service;
use super::problem::Problem;

/// What a token allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Lock status and the dashboard.
    LocksRead,
    /// Acquire, extend, release (and read).
    LocksWrite,
    /// Break a lock someone else holds.
    LocksBreak,
    /// Read idempotency records.
    IdempotencyRead,
    /// Claim, complete, release and heartbeat (and read).
    IdempotencyWrite,
    /// Outbox status.
    OutboxRead,
    /// Redrive a parked outbox key (and read).
    OutboxWrite,
    /// Everything, for every tenant.
    Admin,
}

impl Scope {
    /// The scopes a configured name stands for.
    fn parse(text: &str) -> Result<&'static [Scope], String> {
        Ok(match text {
            "locks:read" => &[Scope::LocksRead],
            "locks:write" => &[Scope::LocksWrite],
            "locks:break" => &[Scope::LocksBreak],
            "locks:*" => &[Scope::LocksWrite, Scope::LocksBreak],
            "idempotency:read" => &[Scope::IdempotencyRead],
            "idempotency:write" => &[Scope::IdempotencyWrite],
            "idempotency:*" => &[Scope::IdempotencyWrite],
            "outbox:read" => &[Scope::OutboxRead],
            "outbox:write" => &[Scope::OutboxWrite],
            "outbox:*" => &[Scope::OutboxWrite],
            "admin" => &[Scope::Admin],
            other => {
                return Err(format!(
                    "unknown scope {other:?}; known: locks:read, locks:write, locks:break, \
                     locks:*, idempotency:read, idempotency:write, idempotency:*, outbox:read, \
                     outbox:write, outbox:*, admin"
                ));
            }
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Scope::LocksRead => "locks:read",
            Scope::LocksWrite => "locks:write",
            Scope::LocksBreak => "locks:break",
            Scope::IdempotencyRead => "idempotency:read",
            Scope::IdempotencyWrite => "idempotency:write",
            Scope::OutboxRead => "outbox:read",
            Scope::OutboxWrite => "outbox:write",
            Scope::Admin => "admin",
        }
    }
}

/// The caller of a request.
#[derive(Debug, Clone)]
pub(crate) struct Principal {
    /// The token's name (never the token).
    pub(crate) name: String,
    /// The tenant whose names and keys the caller sees; `None` for all of them.
    pub(crate) tenant: Option<String>,
    scopes: Vec<Scope>,
}

impl Principal {
    /// Whose held locks a call counts against (`--max-locks-per-tenant`): the tenant,
    /// or the token's name for a token without one.
    pub(crate) fn holder(&self) -> &str {
        self.tenant.as_deref().unwrap_or(&self.name)
    }

    /// Whether the caller may do what `needed` covers.
    pub(crate) fn allows(&self, needed: Scope) -> bool {
        self.scopes.iter().any(|&granted| {
            granted == needed
                || granted == Scope::Admin
                || matches!(
                    (granted, needed),
                    (Scope::LocksWrite, Scope::LocksRead)
                        | (Scope::IdempotencyWrite, Scope::IdempotencyRead)
                        | (Scope::OutboxWrite, Scope::OutboxRead)
                )
        })
    }

    /// `Ok` if the caller may do what `needed` covers, else a 403 naming the scope.
    pub(crate) fn require(&self, needed: Scope) -> Result<(), Problem> {
        if self.allows(needed) {
            return Ok(());
        }
        Err(Problem::forbidden(format!(
            "token {:?} lacks the scope {:?} this needs",
            self.name,
            needed.name()
        ))
        .with("required_scope", needed.name()))
    }

    /// `Ok` for a caller that is not confined to a tenant (shared resources: the outbox).
    pub(crate) fn require_all_tenants(&self, what: &str) -> Result<(), Problem> {
        match &self.tenant {
            None => Ok(()),
            Some(tenant) => Err(Problem::forbidden(format!(
                "{what} is shared by every tenant; token {:?} is confined to tenant {tenant:?}",
                self.name
            ))),
        }
    }
}

/// The configured tokens, or none (open mode: every caller is an admin of all tenants).
#[derive(Debug)]
pub(crate) struct Auth {
    tokens: Vec<([u8; 32], Principal)>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    tokens: Vec<TokenEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    token: Option<String>,
    token_sha256: Option<String>,
    scopes: Vec<String>,
    tenant: Option<String>,
}

/// The shortest token accepted: guessing 16 random characters is hopeless, guessing
/// "secret" is not.
const MIN_TOKEN_LEN: usize = 16;

impl Auth {
    /// No tokens: every caller is an admin.
    pub(crate) fn open() -> Auth {
        Auth { tokens: Vec::new() }
    }

    pub(crate) fn is_open(&self) -> bool {
        self.tokens.is_empty()
    }

    pub(crate) fn token_count(&self) -> usize {
        self.tokens.len()
    }

    /// Parses a tokens document (see the module docs); the error names the entry.
    pub(crate) fn from_json(text: &str) -> Result<Auth, String> {
        let file: TokensFile = serde_json::from_str(text)
            .map_err(|error| format!("the tokens document is not valid: {error}"))?;
        if file.tokens.is_empty() {
            return Err("the tokens document lists no tokens".to_owned());
        }
        let mut tokens = Vec::new();
        for (index, entry) in file.tokens.into_iter().enumerate() {
            let at = format!("token #{} ({:?})", index + 1, entry.name);
            if entry.name.is_empty() || entry.name.chars().any(char::is_control) {
                return Err(format!(
                    "{at}: a name is required, without control characters"
                ));
            }
            let hash = match (entry.token, entry.token_sha256) {
                (Some(token), None) => {
                    if token.len() < MIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
                        return Err(format!(
                            "{at}: a token is at least {MIN_TOKEN_LEN} visible ASCII characters \
                             (e.g. `openssl rand -hex 24`)"
                        ));
                    }
                    Sha256::digest(token.as_bytes()).into()
                }
                (None, Some(hex)) => parse_sha256(&hex)
                    .ok_or_else(|| format!("{at}: token_sha256 is 64 hex digits"))?,
                _ => return Err(format!("{at}: give exactly one of token and token_sha256")),
            };
            let mut scopes = Vec::new();
            for scope in &entry.scopes {
                scopes.extend_from_slice(Scope::parse(scope).map_err(|e| format!("{at}: {e}"))?);
            }
            if scopes.is_empty() {
                return Err(format!("{at}: no scopes"));
            }
            if let Some(tenant) = &entry.tenant {
                check_tenant(tenant).map_err(|e| format!("{at}: {e}"))?;
                if scopes.contains(&Scope::Admin) {
                    return Err(format!(
                        "{at}: admin covers every tenant; drop the tenant or the admin scope"
                    ));
                }
            }
            if tokens.iter().any(|(known, _)| known == &hash) {
                return Err(format!("{at}: the same token is listed twice"));
            }
            tokens.push((
                hash,
                Principal {
                    name: entry.name,
                    tenant: entry.tenant,
                    scopes,
                },
            ));
        }
        Ok(Auth { tokens })
    }

    /// The caller of a request with this `Authorization` header.
    pub(crate) fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Principal, Problem> {
        if self.is_open() {
            return Ok(Principal {
                name: "anonymous".to_owned(),
                tenant: None,
                scopes: vec![Scope::Admin],
            });
        }
        let Some(value) = authorization else {
            return Err(Problem::unauthenticated(
                "send `Authorization: Bearer <token>`",
            ));
        };
        let Some(token) = bearer(value) else {
            return Err(Problem::unauthenticated(
                "the Authorization header must be `Bearer <token>`",
            ));
        };
        let presented: [u8; 32] = Sha256::digest(token).into();
        // Look at every entry, whatever matches, and pick the match without branching.
        let mut found = subtle::Choice::from(0);
        let mut index = 0u32;
        for (position, (hash, _)) in self.tokens.iter().enumerate() {
            let matches = hash.ct_eq(&presented);
            index.conditional_assign(&(position as u32), matches);
            found |= matches;
        }
        if bool::from(found) {
            Ok(self.tokens[index as usize].1.clone())
        } else {
            Err(Problem::unauthenticated("unknown token"))
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header value.
pub(crate) fn bearer(value: &[u8]) -> Option<&[u8]> {
    value
        .strip_prefix(b"Bearer ")
        .or_else(|| value.strip_prefix(b"bearer "))
}

fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// A tenant id: 1 to 63 of `a-z 0-9 _ -`, starting with a letter or digit. It prefixes
/// the tenant's lock names (`tenant/name`) and idempotency scopes, so it may not hold
/// `/`: no two tenants' names can then meet.
fn check_tenant(tenant: &str) -> Result<(), String> {
    let ok = !tenant.is_empty()
        && tenant.len() <= 63
        && tenant.as_bytes()[0].is_ascii_alphanumeric()
        && tenant
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "tenant {tenant:?} must be 1 to 63 of a-z, 0-9, _ and -, starting with a letter or digit"
        ))
    }
}

impl FromRequestParts<Arc<Service>> for Principal {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut Parts,
        service: &Arc<Service>,
    ) -> Result<Self, Self::Rejection> {
        let header = parts
            .headers
            .get(header::AUTHORIZATION)
            .map(|value| value.as_bytes());
        service.auth.authenticate(header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = r#"{"tokens": [
        {"name": "a", "token": "aaaaaaaaaaaaaaaaaaaa", "scopes": ["locks:write"], "tenant": "acme"},
        {"name": "b", "token_sha256": "5f4dcc3b5aa765d61d8327deb882cf99aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "scopes": ["admin"]}
    ]}"#;

    #[test]
    fn tokens_authenticate_to_their_scopes_and_tenant() {
        let auth = Auth::from_json(DOC).unwrap();
        let a = auth
            .authenticate(Some(b"Bearer aaaaaaaaaaaaaaaaaaaa"))
            .unwrap();
        assert_eq!(a.name, "a");
        assert_eq!(a.tenant.as_deref(), Some("acme"));
        assert!(a.allows(Scope::LocksRead));
        assert!(!a.allows(Scope::LocksBreak));
        assert!(
            auth.authenticate(Some(b"Bearer nope-nope-nope-nope"))
                .is_err()
        );
        assert!(auth.authenticate(None).is_err());
        assert!(auth.authenticate(Some(b"Basic xyz")).is_err());
    }

    #[test]
    fn bad_documents_are_refused_with_the_entry_named() {
        let weak = r#"{"tokens":[{"name":"w","token":"short","scopes":["admin"]}]}"#;
        assert!(Auth::from_json(weak).unwrap_err().contains("\"w\""));
        let scope =
            r#"{"tokens":[{"name":"s","token":"aaaaaaaaaaaaaaaaaaaa","scopes":["locks:steal"]}]}"#;
        assert!(Auth::from_json(scope).unwrap_err().contains("locks:steal"));
        let tenant = r#"{"tokens":[{"name":"t","token":"aaaaaaaaaaaaaaaaaaaa","scopes":["locks:read"],"tenant":"a/b"}]}"#;
        assert!(Auth::from_json(tenant).unwrap_err().contains("tenant"));
        let admin = r#"{"tokens":[{"name":"t","token":"aaaaaaaaaaaaaaaaaaaa","scopes":["admin"],"tenant":"a"}]}"#;
        assert!(Auth::from_json(admin).is_err());
        assert!(Auth::from_json(r#"{"tokens":[]}"#).is_err());
        assert!(Auth::from_json("not json").is_err());
    }
}
