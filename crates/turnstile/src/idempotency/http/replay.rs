//! How a response is stored for replay: status, an allow-list of headers, the body.
//!
//! The encoding is private to this layer: `TSR1`, the status (2 bytes), the header
//! count (2 bytes), each header as name length (2), name, value length (4), value, then
//! the body. A response too large to keep is stored as `TSX1` and the reason, so that a
//! repeat is told so instead of running the handler again; a first attempt whose outcome
//! is unknown (the handler panicked, its body broke off, a timeout layer inside cut it
//! off) as `TSU1` and what happened.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const STORED: &[u8; 4] = b"TSR1";
const NOT_STORED: &[u8; 4] = b"TSX1";
const UNKNOWN: &[u8; 4] = b"TSU1";

/// A response as replayed.
pub(crate) enum StoredOutcome {
    Response {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
    NotStored {
        reason: String,
    },
    /// The handler ran, but how far is unknown: its effects may or may not have
    /// happened, so it is not run again.
    Unknown {
        what_happened: String,
    },
}

pub(crate) fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    keep: &[HeaderName],
    body: &[u8],
) -> Vec<u8> {
    let kept: Vec<(&HeaderName, &HeaderValue)> = headers
        .iter()
        .filter(|(name, _)| keep.contains(name))
        .collect();
    let mut out = Vec::with_capacity(16 + body.len());
    out.extend_from_slice(STORED);
    out.extend_from_slice(&status.as_u16().to_be_bytes());
    out.extend_from_slice(&u16::try_from(kept.len()).unwrap_or(u16::MAX).to_be_bytes());
    for (name, value) in kept.into_iter().take(usize::from(u16::MAX)) {
        let name = name.as_str().as_bytes();
        out.extend_from_slice(&u16::try_from(name.len()).unwrap_or(0).to_be_bytes());
        out.extend_from_slice(name);
        let value = value.as_bytes();
        out.extend_from_slice(&u32::try_from(value.len()).unwrap_or(0).to_be_bytes());
        out.extend_from_slice(value);
    }
    out.extend_from_slice(body);
    out
}

pub(crate) fn encode_not_stored(reason: &str) -> Vec<u8> {
    let mut out = NOT_STORED.to_vec();
    out.extend_from_slice(reason.as_bytes());
    out
}

pub(crate) fn encode_unknown(what_happened: &str) -> Vec<u8> {
    let mut out = UNKNOWN.to_vec();
    out.extend_from_slice(what_happened.as_bytes());
    out
}

pub(crate) fn decode(stored: &[u8]) -> Option<StoredOutcome> {
    if let Some(what) = stored.strip_prefix(UNKNOWN) {
        return Some(StoredOutcome::Unknown {
            what_happened: String::from_utf8_lossy(what).into_owned(),
        });
    }
    if let Some(reason) = stored.strip_prefix(NOT_STORED) {
        return Some(StoredOutcome::NotStored {
            reason: String::from_utf8_lossy(reason).into_owned(),
        });
    }
    let mut rest = stored.strip_prefix(STORED)?;
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, tail) = (rest.get(..n)?, rest.get(n..)?);
        rest = tail;
        Some(head)
    };
    let status = StatusCode::from_u16(u16::from_be_bytes(take(2)?.try_into().ok()?)).ok()?;
    let count = u16::from_be_bytes(take(2)?.try_into().ok()?);
    let mut headers = HeaderMap::new();
    for _ in 0..count {
        let name_len = usize::from(u16::from_be_bytes(take(2)?.try_into().ok()?));
        let name = HeaderName::from_bytes(take(name_len)?).ok()?;
        let value_len = usize::try_from(u32::from_be_bytes(take(4)?.try_into().ok()?)).ok()?;
        let value = HeaderValue::from_bytes(take(value_len)?).ok()?;
        headers.append(name, value);
    }
    Some(StoredOutcome::Response {
        status,
        headers,
        body: Bytes::copy_from_slice(rest),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header;

    #[test]
    fn responses_round_trip_with_only_the_kept_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(header::LOCATION, HeaderValue::from_static("/payments/7"));
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("secret=1"));
        let keep = [header::CONTENT_TYPE, header::LOCATION];
        let stored = encode(StatusCode::CREATED, &headers, &keep, b"{\"id\":7}");
        let Some(StoredOutcome::Response {
            status,
            headers,
            body,
        }) = decode(&stored)
        else {
            panic!("did not decode");
        };
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(headers.len(), 2);
        assert_eq!(headers[header::LOCATION], "/payments/7");
        assert!(headers.get(header::SET_COOKIE).is_none());
        assert_eq!(&body[..], b"{\"id\":7}");
        assert!(matches!(
            decode(&encode_not_stored("too big")),
            Some(StoredOutcome::NotStored { .. })
        ));
        assert!(matches!(
            decode(&encode_unknown("the handler panicked")),
            Some(StoredOutcome::Unknown { what_happened }) if what_happened == "the handler panicked"
        ));
        assert!(decode(b"garbage").is_none());
        assert!(decode(b"TSR1\x00").is_none());
    }
}
