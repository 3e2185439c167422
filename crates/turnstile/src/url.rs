//! Store URLs: Turnstile's own `turnstile_*` options split off before a driver sees
//! them, and every credential a URL can carry hidden before it is shown to anyone.
//! Every engine reads its URL through these, so that one rule holds for all schemes.

use crate::error::ErrorKind;

/// A URL with every credential it can carry hidden, for messages, logs and anything
/// shown to people: the userinfo (`user:***@`, and a bare `***@` where the userinfo is
/// one word, a token or a password alone), in each host of a comma-separated list, and
/// the value of every query parameter whose name says it holds a secret (`password`,
/// `pass`, `pwd`, `token`, `secret`, `auth`, `sslkey`, `apikey`, …).
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = authority
        .split(',')
        .map(|host| match host.rsplit_once('@') {
            Some((credentials, host)) => match credentials.split_once(':') {
                Some((user, _password)) => format!("{user}:***@{host}"),
                None => format!("***@{host}"),
            },
            None => host.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",");
    let (path, query) = match tail.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (tail, None),
    };
    let Some(query) = query else {
        return format!("{scheme}://{authority}{path}");
    };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, format!("#{fragment}")),
        None => (query, String::new()),
    };
    let query = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret_parameter(name) => format!("{name}=***"),
            _ => pair.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("&");
    format!("{scheme}://{authority}{path}?{query}{fragment}")
}

/// Whether a URL query parameter's name says that its value is a secret (or, like
/// `sslkey`, points at one).
fn is_secret_parameter(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "pass",
        "pwd",
        "token",
        "secret",
        "auth",
        "key",
        "credential",
        "signature",
    ]
    .iter()
    .any(|word| name.contains(word))
}

/// Splits Turnstile's own `turnstile_*` options off a store URL's query string,
/// returning the URL the driver should see and the options (without the prefix).
#[cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "redis",
        feature = "postgres",
        feature = "mysql"
    )),
    allow(dead_code)
)]
pub(crate) fn split_url_options(url: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut ours = Vec::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if let Some(option) = key.strip_prefix("turnstile_") {
            ours.push((option.to_owned(), value.to_owned()));
        } else {
            kept.push(pair);
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (url, ours)
}

/// The error for a `turnstile_*` URL option an engine does not know.
#[allow(dead_code)]
pub(crate) fn unknown_option(key: &str, value: &str, known: &str) -> crate::Error {
    crate::Error::new(
        ErrorKind::InvalidUrl,
        format!("unknown or invalid option turnstile_{key}={value:?}; known: {known}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_credential_form_is_redacted() {
        for (url, shown) in [
            ("redis://u:secret@h:1/0", "redis://u:***@h:1/0"),
            ("redis://:secret@h:1", "redis://:***@h:1"),
            ("redis://TOKEN@h:1", "redis://***@h:1"),
            ("postgres://app@h/db", "postgres://***@h/db"),
            ("redis://h:1", "redis://h:1"),
            ("sqlite:///tmp/a", "sqlite:///tmp/a"),
            (
                "postgres://h/db?password=secret&sslmode=require",
                "postgres://h/db?password=***&sslmode=require",
            ),
            ("mysql://h/db?pass=s&PWD=s", "mysql://h/db?pass=***&PWD=***"),
            (
                "postgres://h/db?sslkey=/k.pem&sslpassword=s&sslrootcert=/ca.pem",
                "postgres://h/db?sslkey=***&sslpassword=***&sslrootcert=/ca.pem",
            ),
            ("redis://h?token=s&auth=s", "redis://h?token=***&auth=***"),
            (
                "redis://h?access_token=s#frag",
                "redis://h?access_token=***#frag",
            ),
            (
                "redis+sentinel://u:a@h1:1,u:b@h2:2/mymaster?password=c",
                "redis+sentinel://u:***@h1:1,u:***@h2:2/mymaster?password=***",
            ),
            (
                "sqlite://keys.db?turnstile_migrate=off",
                "sqlite://keys.db?turnstile_migrate=off",
            ),
        ] {
            assert_eq!(redact(url), shown, "{url}");
            assert!(!redact(url).contains("secret"), "{url}");
        }
    }

    #[test]
    fn our_options_are_split_off() {
        let (url, ours) =
            split_url_options("postgres://h/db?sslmode=disable&turnstile_schema=locks");
        assert_eq!(url, "postgres://h/db?sslmode=disable");
        assert_eq!(ours, vec![("schema".to_owned(), "locks".to_owned())]);
        assert_eq!(split_url_options("postgres://h/db").0, "postgres://h/db");
    }
}
