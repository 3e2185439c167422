//! `turnstile serve`, driven as its users drive it: the real binary on a free loopback
//! port, a real HTTP client, a real SQLite file or redis-server behind it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use turnstile_test_support::{shared_redis, spawn_tied_to_process, unique_name};

/// A running `turnstile serve`, killed when dropped.
struct Service {
    child: Child,
    base: String,
    http: reqwest::Client,
    token: Option<String>,
    _dir: Arc<tempfile::TempDir>,
}

const ADMIN: &str = "admin-token-0123456789abcdef";
const ACME: &str = "acme-token-0123456789abcdef";
const GLOBEX: &str = "globex-token-0123456789abcdef";
const READER: &str = "reader-token-0123456789abcdef";

/// Tokens: an admin, two tenants that may take locks but not break them, and a reader.
fn tokens_document() -> String {
    json!({"tokens": [
        {"name": "ops", "token": ADMIN, "scopes": ["admin"]},
        {"name": "acme-worker", "token": ACME, "scopes": ["locks:write", "idempotency:*"], "tenant": "acme"},
        {"name": "globex-worker", "token": GLOBEX, "scopes": ["locks:write", "locks:break"], "tenant": "globex"},
        {"name": "reader", "token": READER, "scopes": ["locks:read"]},
    ]})
    .to_string()
}

impl Service {
    fn sqlite() -> Service {
        let dir = Arc::new(tempfile::tempdir().unwrap());
        let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
        Service::start(&store, &[], dir)
    }

    fn start(store: &str, extra: &[&str], dir: Arc<tempfile::TempDir>) -> Service {
        Service::start_with(store, extra, dir, None)
    }

    fn start_with(
        store: &str,
        extra: &[&str],
        dir: Arc<tempfile::TempDir>,
        tokens: Option<&str>,
    ) -> Service {
        Service::start_on(store, extra, dir, tokens, None)
    }

    /// Started on `clock` (the service's wall clock, which the test can move) when given.
    fn start_on(
        store: &str,
        extra: &[&str],
        dir: Arc<tempfile::TempDir>,
        tokens: Option<&str>,
        clock: Option<&turnstile_test_support::SteppableClock>,
    ) -> Service {
        let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
        if let Some(clock) = clock {
            clock.apply(&mut command);
        }
        command
            .args(["serve", "--store", store, "--listen", "127.0.0.1:0"])
            .args(extra)
            .env_remove("TURNSTILE_TOKENS")
            .env("XDG_STATE_HOME", dir.path().join("state"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(
                std::fs::File::create(dir.path().join(format!("serve-{}.log", unique_name("s"))))
                    .unwrap(),
            ));
        if let Some(tokens) = tokens {
            command.env("TURNSTILE_TOKENS", tokens);
        }
        let mut child = spawn_tied_to_process(command).unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let base = loop {
            let line = lines
                .next()
                .expect("turnstile serve exited before listening")
                .unwrap();
            if let Some(rest) = line.strip_prefix("listening on ") {
                break rest.split_whitespace().next().unwrap().to_owned();
            }
        };
        // Keep reading stdout so the service never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Service {
            child,
            base,
            http: reqwest::Client::new(),
            token: None,
            _dir: dir,
        }
    }

    /// The same service, called with `token`.
    fn as_token(&self, token: &str) -> Caller<'_> {
        Caller {
            service: self,
            token: Some(token.to_owned()),
        }
    }

    fn anonymous(&self) -> Caller<'_> {
        Caller {
            service: self,
            token: self.token.clone(),
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Requests to a service with one token (or none).
struct Caller<'a> {
    service: &'a Service,
    token: Option<String>,
}

/// A response: status, content type, and the JSON body.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    content_type: String,
    body: Value,
    headers: reqwest::header::HeaderMap,
}

impl Answer {
    fn problem_type(&self) -> &str {
        assert_eq!(
            self.content_type, "application/problem+json",
            "an error must be a problem document: {self:?}"
        );
        self.body["type"].as_str().unwrap_or("")
    }
}

impl Caller<'_> {
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let url = format!("{}{path}", self.service.base);
        let request = self.service.http.request(method, url);
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Answer {
        let response = request.send().await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let content_type = headers
            .get(reqwest::header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let text = response.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Answer {
            status,
            content_type,
            body,
            headers,
        }
    }

    async fn post(&self, path: &str, body: Value) -> Answer {
        self.send(self.request(reqwest::Method::POST, path).json(&body))
            .await
    }

    async fn get(&self, path: &str) -> Answer {
        self.send(self.request(reqwest::Method::GET, path)).await
    }

    async fn delete(&self, path: &str) -> Answer {
        self.send(self.request(reqwest::Method::DELETE, path)).await
    }

    async fn acquire(&self, name: &str, body: Value) -> Answer {
        self.post(&format!("/v1/locks/{name}/acquire"), body).await
    }
}

/// Every lock endpoint and its errors, on one store.
async fn lock_lifecycle(service: &Service) {
    let api = service.anonymous();
    let name = unique_name("orders:42");

    // Acquire, then a second acquire that may not wait is refused with lock-held.
    let first = api.acquire(&name, json!({"ttl_ms": 5000})).await;
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    let owner = first.body["owner"].as_str().unwrap().to_owned();
    let token = first.body["fencing_token"].as_u64().unwrap();
    assert_eq!(owner.len(), 32);
    let refused = api.acquire(&name, json!({})).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "/problems/lock-held");

    // Status shows the holder (only a prefix of its owner id) and token.
    let status = api.get(&format!("/v1/locks/{name}")).await;
    assert_eq!(status.body["held"], true);
    assert_eq!(status.body["fencing_token"], token);
    assert_eq!(status.body["holder"], owner[..8]);

    // Extend, then a waiter long-polls and gets the lock as soon as it is released.
    let extended = api
        .post(
            &format!("/v1/locks/{name}/extend"),
            json!({"owner": owner, "ttl_ms": 5000}),
        )
        .await;
    assert_eq!(extended.status, StatusCode::OK, "{extended:?}");
    let waiter = async {
        let started = Instant::now();
        let answer = api
            .acquire(&name, json!({"ttl_ms": 5000, "wait_ms": 10000}))
            .await;
        (answer, started.elapsed())
    };
    let releaser = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        api.post(
            &format!("/v1/locks/{name}/release"),
            json!({"owner": owner}),
        )
        .await
    };
    let ((second, waited), released) = tokio::join!(waiter, releaser);
    assert_eq!(released.body["outcome"], "released", "{released:?}");
    assert_eq!(second.status, StatusCode::OK, "{second:?}");
    // Woken by the release (at 300 ms), not by a re-check at the holder's TTL (5 s);
    // a second of margin for a loaded machine.
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_millis(1300),
        "waited {waited:?}"
    );
    let second_token = second.body["fencing_token"].as_u64().unwrap();
    assert!(
        second_token > token,
        "tokens grow: {second_token} after {token}"
    );
    let second_owner = second.body["owner"].as_str().unwrap().to_owned();

    // The first holder's lease is gone: extending it is lock-lost, releasing it says
    // someone else holds the lock, and leaves that holder alone.
    let lost = api
        .post(&format!("/v1/locks/{name}/extend"), json!({"owner": owner}))
        .await;
    assert_eq!(lost.status, StatusCode::CONFLICT);
    assert_eq!(lost.problem_type(), "/problems/lock-lost");
    let late = api
        .post(
            &format!("/v1/locks/{name}/release"),
            json!({"owner": owner}),
        )
        .await;
    assert_eq!(late.body["outcome"], "held_by_other");
    assert_eq!(
        api.get(&format!("/v1/locks/{name}")).await.body["fencing_token"],
        second_token
    );

    // Break: what was held comes back; then the lock is free and the holder's release
    // finds its lease gone.
    let broken = api.delete(&format!("/v1/locks/{name}")).await;
    assert_eq!(broken.status, StatusCode::OK);
    assert_eq!(broken.body["held"], true);
    assert_eq!(broken.body["fencing_token"], second_token);
    assert_eq!(
        api.get(&format!("/v1/locks/{name}")).await.body["held"],
        false
    );
    let after_break = api
        .post(
            &format!("/v1/locks/{name}/release"),
            json!({"owner": second_owner}),
        )
        .await;
    assert_eq!(after_break.body["outcome"], "already_expired");

    // A lease that is not extended runs out on its own, and the dashboard says so.
    let short = api.acquire(&name, json!({"ttl_ms": 300})).await;
    assert_eq!(short.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let next = api.acquire(&name, json!({"ttl_ms": 1000})).await;
    assert_eq!(
        next.status,
        StatusCode::OK,
        "an expired lease frees the lock"
    );
    let events = api.get("/v1/dashboard").await.body["events"].clone();
    let kinds: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|event| event["name"] == name.as_str())
        .map(|event| event["kind"].as_str().unwrap())
        .collect();
    for kind in ["expired", "broken", "released_late", "lost"] {
        assert!(kinds.contains(&kind), "no {kind:?} event in {kinds:?}");
    }
}

#[tokio::test]
async fn locks_over_http_on_sqlite() {
    lock_lifecycle(&Service::sqlite()).await;
}

#[tokio::test]
async fn locks_over_http_on_redis() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let service = Service::start(&shared_redis().url(), &[], dir);
    lock_lifecycle(&service).await;
}

#[tokio::test]
async fn bad_input_gets_a_problem_document_and_changes_nothing() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    // A small body limit, so that the oversized body below is sent whole before the
    // service answers (a larger one is cut off mid-send, which the client reports as a
    // broken connection instead of the 413).
    let service = Service::start(&store, &["--max-body", "4096"], dir);
    let api = service.anonymous();
    let cases: Vec<(Answer, StatusCode, &str)> = vec![
        (
            api.acquire("bad%07name", json!({})).await,
            StatusCode::BAD_REQUEST,
            "control characters",
        ),
        (
            api.acquire("n", json!({"ttl_ms": 0})).await,
            StatusCode::BAD_REQUEST,
            "TTL",
        ),
        (
            api.acquire("n", json!({"ttl_ms": 99_999_999_999_999u64}))
                .await,
            StatusCode::BAD_REQUEST,
            "--max-ttl",
        ),
        (
            api.acquire("n", json!({"wait_ms": 3_600_000})).await,
            StatusCode::BAD_REQUEST,
            "--max-wait",
        ),
        (
            api.acquire("n", json!({"ttl": 5})).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown field",
        ),
        (
            api.post("/v1/locks/n/release", json!({"owner": "me"}))
                .await,
            StatusCode::BAD_REQUEST,
            "32 lowercase hex",
        ),
        (
            api.send(
                api.request(reqwest::Method::POST, "/v1/locks/n/acquire")
                    .header("content-type", "application/json")
                    .body("{not json"),
            )
            .await,
            StatusCode::BAD_REQUEST,
            "JSON",
        ),
        (
            api.send(
                api.request(reqwest::Method::POST, "/v1/locks/n/acquire")
                    .body("{}"),
            )
            .await,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Content-Type",
        ),
        (
            api.post(
                "/v1/idempotency/claim",
                json!({"key": "k", "fingerprint": "x".repeat(8 * 1024)}),
            )
            .await,
            StatusCode::PAYLOAD_TOO_LARGE,
            "--max-body",
        ),
        (
            api.post(
                "/v1/idempotency/claim",
                json!({"key": "k", "fingerprint": "abc"}),
            )
            .await,
            StatusCode::BAD_REQUEST,
            "64 hex digits",
        ),
        (
            api.post(
                "/v1/idempotency/claim",
                json!({"key": "é", "fingerprint": "a".repeat(64)}),
            )
            .await,
            StatusCode::BAD_REQUEST,
            "visible ASCII",
        ),
        (
            api.get("/v1/outbox?parked_limit=5000").await,
            StatusCode::BAD_REQUEST,
            "at most 1000",
        ),
        (
            api.get("/v1/nowhere").await,
            StatusCode::NOT_FOUND,
            "openapi.json",
        ),
        (
            api.send(api.request(reqwest::Method::PUT, "/v1/locks/n/acquire"))
                .await,
            StatusCode::METHOD_NOT_ALLOWED,
            "method",
        ),
    ];
    for (answer, status, says) in cases {
        assert_eq!(answer.status, status, "{answer:?}");
        answer.problem_type();
        let detail = answer.body["detail"].as_str().unwrap();
        assert!(detail.contains(says), "{detail:?} should say {says:?}");
    }
    // None of it took a lock.
    let status = api.get("/v1/locks/n").await;
    assert_eq!(status.body["held"], false);
}

#[tokio::test]
async fn tokens_confine_callers_to_their_scopes_and_tenant() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let service = Service::start_with(&store, &[], dir, Some(&tokens_document()));
    let (admin, acme, globex, reader) = (
        service.as_token(ADMIN),
        service.as_token(ACME),
        service.as_token(GLOBEX),
        service.as_token(READER),
    );

    // No token, or an unknown one: 401 with a Bearer challenge.
    for caller in [
        service.anonymous(),
        service.as_token("wrong-token-0123456789"),
    ] {
        let answer = caller.acquire("job", json!({})).await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
        assert_eq!(answer.problem_type(), "/problems/unauthenticated");
        assert!(answer.headers.contains_key("www-authenticate"));
    }

    // acme takes "job"; globex's "job" is another lock, and globex cannot see or
    // release acme's even with acme's owner id.
    let taken = acme.acquire("job", json!({"ttl_ms": 10000})).await;
    assert_eq!(taken.status, StatusCode::OK);
    let owner = taken.body["owner"].as_str().unwrap().to_owned();
    assert_eq!(globex.get("/v1/locks/job").await.body["held"], false);
    let stolen = globex
        .post("/v1/locks/job/release", json!({"owner": owner}))
        .await;
    assert_eq!(stolen.body["outcome"], "already_expired");
    assert_eq!(globex.delete("/v1/locks/job").await.body["held"], false);
    assert_eq!(acme.get("/v1/locks/job").await.body["held"], true);
    let other = globex.acquire("job", json!({})).await;
    assert_eq!(other.status, StatusCode::OK, "globex's job is its own lock");

    // The admin sees every tenant's names as the store keeps them.
    assert_eq!(admin.get("/v1/locks/acme%2Fjob").await.body["held"], true);

    // Scopes: acme cannot break; the reader can look but not take; the outbox is not
    // for tenant tokens.
    let refused = acme.delete("/v1/locks/job").await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert_eq!(refused.body["required_scope"], "locks:break");
    assert_eq!(reader.get("/v1/locks/job").await.status, StatusCode::OK);
    assert_eq!(
        reader.acquire("job", json!({})).await.status,
        StatusCode::FORBIDDEN
    );
    assert_eq!(acme.get("/v1/outbox").await.status, StatusCode::FORBIDDEN);
    assert_eq!(
        globex
            .post(
                "/v1/idempotency/claim",
                json!({"key": "k", "fingerprint": "a".repeat(64)})
            )
            .await
            .status,
        StatusCode::FORBIDDEN
    );

    // The dashboard shows a tenant only its own locks.
    let seen = acme.get("/v1/dashboard").await;
    let names: Vec<&str> = seen.body["held"]
        .as_array()
        .unwrap()
        .iter()
        .map(|lock| lock["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["job"]);
    assert_eq!(seen.body["held"][0]["tenant"], "acme");
    assert_eq!(seen.body["may_break"], false);
    let everything = admin.get("/v1/dashboard").await;
    assert_eq!(everything.body["held"].as_array().unwrap().len(), 2);
}

/// A store URL's credentials reach no one: a `?password=` in the URL is hidden from
/// the admin's dashboard, tenants and readers see no store description at all, and the
/// errors of a store that went down name no credential either.
#[tokio::test]
async fn a_store_password_reaches_no_token_and_no_error() {
    const SECRET: &str = "hunter2-in-the-url";
    let server = turnstile_test_support::PostgresServer::spawn();
    let store = format!(
        "{}?password={SECRET}&application_name=turnstile",
        server.url()
    );
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let service = Service::start_with(&store, &[], Arc::clone(&dir), Some(&tokens_document()));
    let (admin, acme, reader) = (
        service.as_token(ADMIN),
        service.as_token(ACME),
        service.as_token(READER),
    );
    for caller in [&acme, &reader] {
        let seen = caller.get("/v1/dashboard").await;
        assert_eq!(seen.status, StatusCode::OK);
        assert_eq!(seen.body["store"], Value::Null, "a non-admin saw the store");
    }
    let seen = admin.get("/v1/dashboard").await;
    let shown = seen.body["store"].as_str().unwrap();
    assert!(shown.contains("password=***"), "{shown}");
    assert!(!shown.contains(SECRET), "{shown}");

    server.kill();
    // The killed server's backends linger a moment: ask until the store's absence shows.
    let mut answers = Vec::new();
    for attempt in 0..100 {
        for caller in [&admin, &acme] {
            let name = format!("job-{attempt}");
            answers.push(caller.acquire(&name, json!({"ttl_ms": 5000})).await);
            answers.push(caller.get(&format!("/v1/locks/{name}")).await);
        }
        if answers.iter().any(|answer| answer.status.is_server_error()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        answers.iter().any(|answer| answer.status.is_server_error()),
        "the store is down: {answers:?}"
    );
    for answer in &answers {
        assert!(!answer.body.to_string().contains(SECRET), "{answer:?}");
        if answer.status.is_server_error() {
            // The driver's text stays in the log; the client gets an id to quote.
            let detail = answer.body["detail"].as_str().unwrap_or_default();
            assert!(detail.contains("error id"), "{answer:?}");
        }
    }
    drop(service);
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|ext| ext == "log") {
            let log = std::fs::read_to_string(&path).unwrap();
            assert!(!log.contains(SECRET), "{}: {log}", path.display());
        }
    }
}

/// `--sweep-every` deletes completed records past their retention in the background:
/// afterwards a manual `turnstile idempotency sweep` finds nothing left to delete.
#[tokio::test]
async fn the_service_sweeps_expired_idempotency_records() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("keys.sqlite3").display());
    let service = Service::start(&store, &["--sweep-every", "200ms"], Arc::clone(&dir));
    let api = service.anonymous();
    for n in 0..3 {
        let claimed = api
            .post(
                "/v1/idempotency/claim",
                json!({"key": format!("k{n}"), "fingerprint": "ab".repeat(32),
                       "lease_ms": 1000, "retention_ms": 1000}),
            )
            .await;
        assert_eq!(claimed.body["state"], "started", "{claimed:?}");
        let done = api
            .post(
                "/v1/idempotency/complete",
                json!({"key": format!("k{n}"), "token": claimed.body["token"],
                       "capability": claimed.body["capability"],
                       "outcome": "ok", "retention_ms": 1000}),
            )
            .await;
        assert_eq!(done.body["state"], "done", "{done:?}");
    }
    tokio::time::sleep(Duration::from_millis(1_800)).await;
    let output = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["idempotency", "sweep", "--store", &store, "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let swept: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(swept["swept"], 0, "the service left expired records behind");
}

#[tokio::test]
async fn idempotency_keys_over_http_on_sqlite() {
    idempotency_keys_over_http(&Service::sqlite(), "sqlite").await;
}

#[tokio::test]
async fn idempotency_keys_over_http_on_redis() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let service = Service::start(&shared_redis().url(), &[], dir);
    idempotency_keys_over_http(&service, "redis").await;
}

/// Every idempotency endpoint and its refusals, on one store (`engine` names it in the
/// metrics).
async fn idempotency_keys_over_http(service: &Service, engine: &str) {
    let api = service.anonymous();
    let key = unique_name("payment");
    let fingerprint = "ab".repeat(32);

    let first = api
        .post(
            "/v1/idempotency/claim",
            json!({"key": key, "scope": "shop", "fingerprint": fingerprint, "lease_ms": 10000}),
        )
        .await;
    assert_eq!(first.body["state"], "started", "{first:?}");
    let token = first.body["token"].as_u64().unwrap();
    let capability = first.body["capability"].as_str().unwrap().to_owned();

    let busy = api
        .post(
            "/v1/idempotency/claim",
            json!({"key": key, "scope": "shop", "fingerprint": fingerprint}),
        )
        .await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.problem_type(), "/problems/in-progress");
    assert!(busy.body["lease_left_ms"].as_u64().unwrap() > 0);
    assert!(busy.headers.contains_key("retry-after"));

    let other = api
        .post(
            "/v1/idempotency/claim",
            json!({"key": key, "scope": "shop", "fingerprint": "cd".repeat(32)}),
        )
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.problem_type(), "/problems/key-mismatch");

    // The same key in another scope is another record.
    let elsewhere = api
        .post(
            "/v1/idempotency/claim",
            json!({"key": key, "scope": "other-shop", "fingerprint": fingerprint}),
        )
        .await;
    assert_eq!(elsewhere.body["state"], "started");

    let beat = api
        .post(
            "/v1/idempotency/heartbeat",
            json!({"key": key, "scope": "shop", "token": token, "capability": capability, "lease_ms": 10000}),
        )
        .await;
    assert_eq!(beat.status, StatusCode::OK, "{beat:?}");
    // The token alone (which any reader of the record sees) completes nothing: a
    // forged outcome would be replayed to every retry.
    for forged in [
        json!("0".repeat(32)),
        // The real one with its first digit changed.
        json!(format!(
            "{}{}",
            if capability.starts_with('0') {
                '1'
            } else {
                '0'
            },
            &capability[1..]
        )),
    ] {
        let refused = api
            .post(
                "/v1/idempotency/complete",
                json!({"key": key, "scope": "shop", "token": token, "capability": forged, "outcome": "forged"}),
            )
            .await;
        assert_eq!(refused.status, StatusCode::FORBIDDEN, "{refused:?}");
        assert_eq!(refused.body["reason"], "claim-capability");
    }
    let missing = api
        .post(
            "/v1/idempotency/complete",
            json!({"key": key, "scope": "shop", "token": token, "outcome": "forged"}),
        )
        .await;
    assert_eq!(
        missing.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{missing:?}"
    );
    let earlier = api
        .post(
            "/v1/idempotency/claim",
            json!({"key": format!("{key}-older"), "scope": "shop", "fingerprint": fingerprint}),
        )
        .await;
    let wrong = api
        .post(
            "/v1/idempotency/complete",
            json!({"key": format!("{key}-older"), "scope": "shop", "token": earlier.body["token"].as_u64().unwrap() - 1,
                   "capability": capability, "outcome": "nope"}),
        )
        .await;
    assert_eq!(wrong.status, StatusCode::FORBIDDEN, "{wrong:?}");
    let done = api
        .post(
            "/v1/idempotency/complete",
            json!({"key": key, "scope": "shop", "token": token, "capability": capability, "outcome": "{\"charged\":true}"}),
        )
        .await;
    assert_eq!(done.body["state"], "done", "{done:?}");

    let replay = api
        .post(
            "/v1/idempotency/claim",
            json!({"key": key, "scope": "shop", "fingerprint": fingerprint}),
        )
        .await;
    assert_eq!(replay.body["state"], "replay");
    assert_eq!(replay.body["outcome"], "{\"charged\":true}");
    assert_eq!(replay.body["outcome_base64"], "eyJjaGFyZ2VkIjp0cnVlfQ==");

    let record = api
        .get(&format!("/v1/idempotency/record?key={key}&scope=shop"))
        .await;
    assert_eq!(record.body["state"], "completed");
    assert_eq!(record.body["fingerprint"], fingerprint);
    assert_eq!(record.body["token"], token);
    assert!(
        record.body.get("capability").is_none(),
        "a reader saw the capability"
    );
    // A claim whose lease ran out and was taken over is fenced, its capability
    // notwithstanding.
    let lapsed_key = unique_name("lapsed");
    let lapsed = api
        .post(
            "/v1/idempotency/claim",
            json!({"key": lapsed_key, "fingerprint": fingerprint, "lease_ms": 1000}),
        )
        .await;
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let taken_over = api
        .post(
            "/v1/idempotency/claim",
            json!({"key": lapsed_key, "fingerprint": fingerprint}),
        )
        .await;
    assert_eq!(taken_over.body["state"], "started");
    let fenced = api
        .post(
            "/v1/idempotency/complete",
            json!({"key": lapsed_key, "token": lapsed.body["token"],
                   "capability": lapsed.body["capability"], "outcome": "late"}),
        )
        .await;
    assert_eq!(fenced.status, StatusCode::CONFLICT, "{fenced:?}");
    assert_eq!(fenced.problem_type(), "/problems/fenced");
    let missing = api.get("/v1/idempotency/record?key=never-used").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.problem_type(), "/problems/no-record");

    // A released claim lets the next claim start, with a larger token.
    let other_key = unique_name("refund");
    let claimed = api
        .post(
            "/v1/idempotency/claim",
            json!({"key": other_key, "fingerprint": fingerprint}),
        )
        .await;
    let first_token = claimed.body["token"].as_u64().unwrap();
    let given_back = api
        .post(
            "/v1/idempotency/release",
            json!({"key": other_key, "token": first_token, "capability": claimed.body["capability"]}),
        )
        .await;
    assert_eq!(given_back.body["state"], "done");
    let again = api
        .post(
            "/v1/idempotency/claim",
            json!({"key": other_key, "fingerprint": fingerprint}),
        )
        .await;
    assert_eq!(again.body["state"], "started");
    assert!(again.body["token"].as_u64().unwrap() > first_token);

    // The outcomes are counted for /metrics and the dashboard.
    let metrics = api.get("/metrics").await;
    let text = metrics.body.as_str().unwrap();
    for expected in [
        "turnstile_serve_idempotency_total{outcome=\"replayed\"} 1",
        "turnstile_serve_idempotency_total{outcome=\"mismatched\"} 1",
        &format!("turnstile_serve_store_seconds_bucket{{engine=\"{engine}\",operation=\"claim\""),
    ] {
        assert!(text.contains(expected), "/metrics lacks {expected:?}");
    }
}

/// Two instances on one store: a critical section guarded through either of them is
/// never entered twice at once, and the instances really contend: some acquire through
/// one instance was still waiting while a holder that came through the other was inside
/// (its wait overlaps that hold), so the store kept it waiting for that holder's release.
/// A run whose workers took turns one after another would have no such overlap.
async fn two_instances_keep_exclusion(store: &str) {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let services = [
        Service::start(store, &[], Arc::clone(&dir)),
        Service::start(store, &[], dir),
    ];
    let name = unique_name("shared");
    // Every step below takes the next number of this clock, so overlaps are read off
    // the order the steps happened in, not off timings.
    let clock = AtomicU64::new(0);
    let inside = AtomicBool::new(false);
    // (instance, acquire sent, lease answered) and (instance, entered, left).
    let waits = std::sync::Mutex::new(Vec::new());
    let holds = std::sync::Mutex::new(Vec::new());
    let worker = |index: usize| {
        let (services, clock, inside, waits, holds, name) =
            (&services, &clock, &inside, &waits, &holds, &name);
        async move {
            for round in 0..15 {
                let instance = (index + round) % 2;
                let api = services[instance].anonymous();
                let sent = clock.fetch_add(1, Ordering::SeqCst);
                let lease = api
                    .acquire(name, json!({"ttl_ms": 10000, "wait_ms": 20000}))
                    .await;
                let answered = clock.fetch_add(1, Ordering::SeqCst);
                assert_eq!(lease.status, StatusCode::OK, "{lease:?}");
                waits.lock().unwrap().push((instance, sent, answered));
                assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                let entered = clock.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
                let left = clock.fetch_add(1, Ordering::SeqCst);
                inside.store(false, Ordering::SeqCst);
                holds.lock().unwrap().push((instance, entered, left));
                let owner = lease.body["owner"].as_str().unwrap();
                // Release through the other instance: the service keeps no state.
                let other = services[(instance + 1) % 2].anonymous();
                let released = other
                    .post(
                        &format!("/v1/locks/{name}/release"),
                        json!({"owner": owner}),
                    )
                    .await;
                assert_eq!(released.body["outcome"], "released");
            }
        }
    };
    // All four workers at once, on this task: while one sleeps inside the section the
    // others' acquires are sent and wait in the instances.
    tokio::join!(worker(0), worker(1), worker(2), worker(3));
    let (waits, holds) = (waits.into_inner().unwrap(), holds.into_inner().unwrap());
    assert_eq!(holds.len(), 60);
    let waited_across = waits
        .iter()
        .filter(|(instance, sent, answered)| {
            holds.iter().any(|(holder, entered, left)| {
                holder != instance && sent < left && answered > entered
            })
        })
        .count();
    assert!(
        waited_across > 0,
        "no acquire waited while a holder from the other instance was inside: \
         the instances never contended"
    );
}

#[tokio::test]
async fn two_instances_on_one_sqlite_file_keep_exclusion() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("shared.sqlite3").display());
    two_instances_keep_exclusion(&store).await;
}

#[tokio::test]
async fn two_instances_on_one_redis_keep_exclusion() {
    two_instances_keep_exclusion(&shared_redis().url()).await;
}

#[tokio::test]
async fn the_openapi_document_describes_every_route_it_serves() {
    let service = Service::sqlite();
    let api = service.anonymous();
    let document = api.get("/openapi.json").await;
    assert_eq!(document.status, StatusCode::OK);
    let document = document.body;
    assert_eq!(document["openapi"], "3.1.0");
    assert_eq!(
        document["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    let paths = document["paths"].as_object().unwrap();
    let mut operations = 0;
    for (path, methods) in paths {
        for (method, operation) in methods.as_object().unwrap() {
            operations += 1;
            assert!(
                operation["responses"]
                    .as_object()
                    .is_some_and(|r| !r.is_empty()),
                "{method} {path} documents no responses"
            );
            // Every documented operation is served: calling it never gets the
            // router's not-found or method-not-allowed answer.
            let concrete = path.replace("{name}", "probe");
            let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
            if concrete.ends_with("/observe") {
                // A stream that lasts until the client leaves: its head is the answer.
                let head = api.request(method, &concrete).send().await.unwrap();
                assert_eq!(head.status(), StatusCode::OK, "{concrete}");
                continue;
            }
            let answer = api
                .send(api.request(method.clone(), &concrete).json(&json!({})))
                .await;
            assert!(
                !matches!(
                    answer.status,
                    StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED
                ) || answer.body["type"] == "/problems/no-record",
                "{method} {concrete} is documented but not served: {answer:?}"
            );
        }
    }
    assert_eq!(
        operations, 19,
        "locks 5, elections 6, idempotency 5, outbox 2, dashboard 1"
    );
}

#[tokio::test]
async fn the_dashboard_page_and_metrics_are_served() {
    let service = Service::sqlite();
    let api = service.anonymous();
    let page = api.get("/").await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.content_type.starts_with("text/html"));
    let html = page.body.as_str().unwrap();
    assert!(html.contains("<title>Turnstile</title>"));
    // Nothing is fetched from anywhere else: the only absolute URL is SVG's namespace.
    let absolute = html.matches("http://").count() + html.matches("https://").count();
    let namespaces = html.matches("\"http://www.w3.org/2000/svg\"").count();
    assert_eq!(absolute, namespaces, "the page refers to another host");

    let name = unique_name("dash");
    let lease = api.acquire(&name, json!({"ttl_ms": 10000})).await;
    assert_eq!(lease.status, StatusCode::OK);
    let state = api.get("/v1/dashboard").await;
    let held = state.body["held"].as_array().unwrap();
    assert!(held.iter().any(|lock| lock["name"] == name.as_str()));
    let metrics = api.get("/metrics").await.body;
    let text = metrics.as_str().unwrap();
    for expected in [
        "turnstile_lock_acquired_total{via=\"store\"}",
        "turnstile_http_requests_total{method=\"POST\",route=\"/v1/locks/{name}/acquire\",status=\"200\"}",
        "turnstile_serve_store_seconds_bucket{engine=\"sqlite\",operation=\"acquire\"",
    ] {
        assert!(
            text.contains(expected),
            "/metrics lacks {expected:?}:\n{text}"
        );
    }
    assert!(
        !text.contains(&name),
        "lock names must not become metric labels"
    );
}

#[tokio::test]
async fn sigterm_ends_long_polls_at_once_and_stops_cleanly() {
    let mut service = Service::sqlite();
    let api = service.anonymous();
    let held = api.acquire("busy", json!({"ttl_ms": 30000})).await;
    assert_eq!(held.status, StatusCode::OK);
    let pid = service.child.id() as i32;
    let waiter = api.acquire("busy", json!({"wait_ms": 25000}));
    let terminate = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        // SAFETY: sending a signal to our own child process.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        Instant::now()
    };
    let (answer, sent) = tokio::join!(waiter, terminate);
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert_eq!(answer.problem_type(), "/problems/shutting-down");
    // At once: well before the wait (25 s) or a re-check (1 s) would end it.
    assert!(
        sent.elapsed() < Duration::from_millis(800),
        "the long poll ended {:?} after SIGTERM",
        sent.elapsed()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = service.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still running 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_open_service_refuses_a_non_loopback_address_and_bad_tokens_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("l.sqlite3").display());
    let run = |args: &[&str], tokens: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
        command
            .args(["serve", "--store", &store])
            .args(args)
            .env_remove("TURNSTILE_TOKENS");
        if let Some(tokens) = tokens {
            command.env("TURNSTILE_TOKENS", tokens);
        }
        command.output().unwrap()
    };
    let open = run(&["--listen", "0.0.0.0:0"], None);
    assert_eq!(open.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&open.stderr).contains("--tokens"));
    let weak = run(
        &["--listen", "127.0.0.1:0"],
        Some(r#"{"tokens":[{"name":"ci","token":"short","scopes":["admin"]}]}"#),
    );
    assert_eq!(weak.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&weak.stderr).contains("\"ci\""));
}

#[tokio::test]
async fn https_with_a_given_certificate() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    // A test CA, and a certificate for 127.0.0.1 that it signs.
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    std::fs::write(path("leaf.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let steps: [Vec<String>; 3] = [
        [
            "req",
            "-x509",
            "-days",
            "1",
            "-subj",
            "/CN=turnstile test CA",
        ]
        .iter()
        .chain(&ec)
        .map(|s| s.to_string())
        .chain([
            "-keyout".into(),
            path("ca.key"),
            "-out".into(),
            path("ca.pem"),
        ])
        .collect(),
        ["req", "-subj", "/CN=127.0.0.1"]
            .iter()
            .chain(&ec)
            .map(|s| s.to_string())
            .chain([
                "-keyout".into(),
                path("key.pem"),
                "-out".into(),
                path("leaf.csr"),
            ])
            .collect(),
        ["x509", "-req", "-days", "1", "-CAcreateserial"]
            .iter()
            .map(|s| s.to_string())
            .chain([
                "-in".into(),
                path("leaf.csr"),
                "-CA".into(),
                path("ca.pem"),
                "-CAkey".into(),
                path("ca.key"),
                "-extfile".into(),
                path("leaf.ext"),
                "-out".into(),
                path("cert.pem"),
            ])
            .collect(),
    ];
    for step in steps {
        let made = Command::new("openssl")
            .args(&step)
            .output()
            .expect("openssl is installed (scripts/test installs it)");
        assert!(made.status.success(), "openssl {step:?}: {made:?}");
    }
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let service = Service::start(
        &store,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
        Arc::clone(&dir),
    );
    assert!(service.base.starts_with("https://"), "{}", service.base);
    let address = service.base.trim_start_matches("https://").to_owned();

    // A TLS client that trusts only the given certificate.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_file(path("ca.pem")).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(&address).await.unwrap();
    let server_name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = connector.connect(server_name, tcp).await.unwrap();
    tls.write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    tls.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("ok\n"));

    // Plain HTTP to the TLS port gets nowhere.
    let plain = reqwest::Client::new()
        .get(format!("http://{address}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err() || !plain.unwrap().status().is_success());
}

/// A headless Chromium driven through chromedriver's WebDriver protocol.
struct Browser {
    driver: Child,
    http: reqwest::Client,
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Browser {
        let port = turnstile_test_support::free_port();
        let mut command = Command::new("chromedriver");
        // Its own process group, so that dropping the browser also ends the Chromium
        // processes chromedriver started, even when a test fails before closing them.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        command
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let driver = spawn_tied_to_process(command)
            .expect("chromedriver is installed (scripts/test installs chromium-driver)");
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while http.get(format!("{base}/status")).send().await.is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let profile = tempfile::tempdir().unwrap();
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage",
                         format!("--user-data-dir={}", profile.path().display())],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let created: Value = http
            .post(format!("{base}/session"))
            .json(&capabilities)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no browser session: {created}"))
            .to_owned();
        Browser {
            driver,
            http,
            session: format!("{base}/session/{session}"),
            _profile: profile,
        }
    }

    async fn command(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let request = self.http.request(method, format!("{}{path}", self.session));
        let request = match body {
            Some(body) => request.json(&body),
            None => request,
        };
        let answer: Value = request.send().await.unwrap().json().await.unwrap();
        answer["value"].clone()
    }

    async fn go(&self, url: &str) {
        self.command(reqwest::Method::POST, "/url", Some(json!({"url": url})))
            .await;
    }

    async fn script(&self, script: &str) -> Value {
        self.command(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
        .await
    }

    async fn element(&self, css: &str) -> String {
        let found = self
            .command(
                reqwest::Method::POST,
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        found["element-6066-11e4-a52e-4f735466cecf"]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css:?}: {found}"))
            .to_owned()
    }

    async fn click(&self, css: &str) {
        let element = self.element(css).await;
        self.command(
            reqwest::Method::POST,
            &format!("/element/{element}/click"),
            Some(json!({})),
        )
        .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let element = self.element(css).await;
        self.command(
            reqwest::Method::POST,
            &format!("/element/{element}/value"),
            Some(json!({"text": text})),
        )
        .await;
    }

    /// Waits (up to `limit`) until `script` returns true; how long it took.
    async fn until(&self, script: &str, limit: Duration) -> Option<Duration> {
        let started = Instant::now();
        while started.elapsed() < limit {
            if self.script(script).await == Value::Bool(true) {
                return Some(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    /// The page's console messages at level SEVERE (errors).
    async fn console_errors(&self) -> Vec<Value> {
        let log = self
            .command(
                reqwest::Method::POST,
                "/se/log",
                Some(json!({"type": "browser"})),
            )
            .await;
        log.as_array()
            .unwrap_or_else(|| panic!("no browser log: {log}"))
            .iter()
            .filter(|entry| entry["level"] == "SEVERE")
            .cloned()
            .collect()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // SAFETY: signals the process group this test started (chromedriver's own).
        unsafe { libc::kill(-(self.driver.id() as i32), libc::SIGKILL) };
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

#[tokio::test]
async fn the_dashboard_in_a_real_browser_shows_locks_live_and_breaks_them() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let service = Service::start_with(&store, &[], dir, Some(&tokens_document()));
    let browser = Browser::start().await;

    // Without a token the page asks for one; with the admin's it shows the store.
    browser.go(&format!("{}/", service.base)).await;
    let asks = browser
        .until(
            "return getComputedStyle(document.getElementById('login')).display === 'block'",
            Duration::from_secs(10),
        )
        .await;
    assert!(asks.is_some(), "the page did not ask for a token");
    browser.type_into("#token", ADMIN).await;
    browser.click("#signin").await;
    let signed_in = browser
        .until(
            "return document.getElementById('caller').textContent === 'as ops'",
            Duration::from_secs(10),
        )
        .await;
    assert!(signed_in.is_some(), "the page did not sign in");

    // A lock taken through the API shows up within a second.
    let name = unique_name("browser");
    let lease = service
        .as_token(ACME)
        .acquire(&name, json!({"ttl_ms": 60000}))
        .await;
    assert_eq!(lease.status, StatusCode::OK);
    let shown = browser
        .until(
            &format!(
                "return document.querySelector('#held button[data-name=\"acme/{name}\"]') !== null"
            ),
            Duration::from_secs(1),
        )
        .await;
    assert!(shown.is_some(), "the lock was not shown within a second");

    // Break it from the page: a confirmation, then the lock is free and the break is
    // listed.
    browser
        .click(&format!("#held button[data-name=\"acme/{name}\"]"))
        .await;
    let dialog = browser
        .command(reqwest::Method::GET, "/alert/text", None)
        .await;
    assert!(
        dialog.as_str().is_some_and(|text| text.contains(&name)),
        "no confirmation naming the lock: {dialog}"
    );
    browser
        .command(reqwest::Method::POST, "/alert/accept", Some(json!({})))
        .await;
    let admin = service.as_token(ADMIN);
    let deadline = Instant::now() + Duration::from_secs(5);
    while admin.get(&format!("/v1/locks/acme%2F{name}")).await.body["held"] != false {
        assert!(Instant::now() < deadline, "the break did not free the lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let listed = browser
        .until(
            "return document.getElementById('events').textContent.includes('broken')",
            Duration::from_secs(5),
        )
        .await;
    assert!(listed.is_some(), "the break is not in the events");

    // Cancelling the confirmation breaks nothing.
    let other = unique_name("kept");
    let kept = service
        .as_token(ACME)
        .acquire(&other, json!({"ttl_ms": 60000}))
        .await;
    assert_eq!(kept.status, StatusCode::OK);
    let selector = format!("#held button[data-name=\"acme/{other}\"]");
    let shown = browser
        .until(
            &format!(
                "return document.querySelector('{}') !== null",
                selector.replace('\'', "\\'")
            ),
            Duration::from_secs(5),
        )
        .await;
    assert!(shown.is_some());
    browser.click(&selector).await;
    browser
        .command(reqwest::Method::POST, "/alert/dismiss", Some(json!({})))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        admin.get(&format!("/v1/locks/acme%2F{other}")).await.body["held"],
        true
    );

    // The 401 the page met before signing in is a console error in Chromium ("Failed to
    // load resource"); anything else is a defect.
    let errors: Vec<Value> = browser
        .console_errors()
        .await
        .into_iter()
        .filter(|entry| {
            !entry["message"]
                .as_str()
                .is_some_and(|m| m.contains("/v1/dashboard") && m.contains("401"))
        })
        .collect();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    browser.command(reqwest::Method::DELETE, "", None).await;
}

#[tokio::test]
async fn outbox_status_and_redrive_over_http() {
    use turnstile::outbox::sqlite::SqliteOutbox;
    use turnstile::outbox::{Backoff, Failure, Message, OutboxStore, Settlement};

    let dir = Arc::new(tempfile::tempdir().unwrap());
    let path = dir.path().join("locks.sqlite3");
    // Three messages for "orders", one for "refunds" whose delivery fails for good.
    let outbox = SqliteOutbox::open(&path).await.unwrap();
    let mut transaction = outbox.pool().begin().await.unwrap();
    for (key, n) in [("orders", 1), ("orders", 2), ("orders", 3), ("refunds", 1)] {
        let message = Message::new("events", key, format!("{n}").into_bytes()).unwrap();
        outbox.enqueue(&mut transaction, &message).await.unwrap();
    }
    outbox.commit(transaction).await.unwrap();
    let leased = outbox.claim(10, 10, Duration::from_secs(30)).await.unwrap();
    let settlements: Vec<Settlement> = leased
        .iter()
        .map(|key| Settlement {
            key: key.key.clone(),
            token: key.token,
            delivered_through: 0,
            failure: (key.key == "refunds").then(|| Failure {
                permanent: true,
                reason: "the broker refused it".to_owned(),
            }),
        })
        .collect();
    outbox
        .settle(&settlements, 1, Backoff::default())
        .await
        .unwrap();

    let service = Service::start(&format!("sqlite://{}", path.display()), &[], dir);
    let api = service.anonymous();
    let status = api.get("/v1/outbox").await;
    assert_eq!(status.status, StatusCode::OK, "{status:?}");
    assert_eq!(status.body["pending"], 3);
    assert_eq!(status.body["pending_keys"], 1);
    assert!(status.body["oldest_pending_ms"].as_u64().is_some());
    assert_eq!(status.body["parked"][0]["key"], "refunds");
    assert_eq!(status.body["parked"][0]["attempts"], 1);
    assert_eq!(status.body["parked"][0]["reason"], "the broker refused it");

    let redriven = api
        .post("/v1/outbox/redrive", json!({"key": "refunds"}))
        .await;
    assert_eq!(redriven.body["redriven"], true);
    let again = api
        .post("/v1/outbox/redrive", json!({"key": "refunds"}))
        .await;
    assert_eq!(again.body["redriven"], false);
    let after = api.get("/v1/outbox").await;
    assert_eq!(after.body["parked"].as_array().unwrap().len(), 0);
    assert_eq!(after.body["pending"], 4);

    // A store without an outbox answers 501 on these routes.
    let redis = Service::start(
        &shared_redis().url(),
        &[],
        Arc::new(tempfile::tempdir().unwrap()),
    );
    let none = redis.anonymous().get("/v1/outbox").await;
    assert_eq!(none.status, StatusCode::NOT_IMPLEMENTED);
    assert_eq!(none.problem_type(), "/problems/unsupported-store");
}

#[tokio::test]
async fn a_service_with_relay_publishes_the_outbox_and_shows_it_on_metrics() {
    use turnstile::outbox::Message;
    use turnstile::outbox::sqlite::SqliteOutbox;

    let dir = Arc::new(tempfile::tempdir().unwrap());
    let path = dir.path().join("locks.sqlite3");
    let outbox = SqliteOutbox::open(&path).await.unwrap();
    let mut transaction = outbox.pool().begin().await.unwrap();
    let topic = unique_name("relayed");
    for n in 0..2 {
        let message = Message::new(topic.clone(), "k", vec![n]).unwrap();
        outbox.enqueue(&mut transaction, &message).await.unwrap();
    }
    outbox.commit(transaction).await.unwrap();

    let broker = shared_redis().url();
    let service = Service::start(
        &format!("sqlite://{}", path.display()),
        &["--relay", &broker],
        dir,
    );
    let api = service.anonymous();
    let deadline = Instant::now() + Duration::from_secs(20);
    while api.get("/v1/outbox").await.body["pending"] != 0 {
        assert!(Instant::now() < deadline, "the relay did not publish");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = api.get("/metrics").await.body;
    let text = metrics.as_str().unwrap();
    assert!(
        text.contains("turnstile_outbox_published_total 2"),
        "/metrics:\n{text}"
    );
    assert!(text.contains("turnstile_outbox_publish_seconds_bucket"));
}

/// The service's address as host:port, for raw sockets.
fn address_of(service: &Service) -> String {
    service
        .base
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned()
}

/// The series /metrics shows (each line without its value): what new label values
/// would grow.
async fn metric_series(service: &Service) -> std::collections::BTreeSet<String> {
    let text = service.anonymous().get("/metrics").await.body;
    text.as_str()
        .unwrap()
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.rsplit_once(' ').map(|(series, _)| series.to_owned()))
        .collect()
}

/// Any method name hyper accepts becomes one `OTHER` label, not a series of its own:
/// 2,000 made-up methods before any token leave /metrics with the same series.
#[tokio::test]
async fn unknown_methods_add_no_metric_series() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let service = Service::sqlite();
    let address = address_of(&service);
    let send = async |method: String| {
        let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
        let request =
            format!("{method} /v1/locks/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer).await;
    };
    for n in 0..10 {
        send(format!("WARMUP{n}")).await;
    }
    // The first read of /metrics makes its own series.
    metric_series(&service).await;
    let before = metric_series(&service).await;
    for n in 0..2_000 {
        send(format!("M{n}ETHOD")).await;
    }
    let after = metric_series(&service).await;
    let new: Vec<&String> = after.difference(&before).collect();
    assert!(new.is_empty(), "new series: {new:?}");
    assert!(!after.iter().any(|series| series.contains("ETHOD")));
}

/// Half a request line held open is closed after the header timeout (slowloris), and a
/// kept-alive connection that sends nothing more is closed the same way.
#[tokio::test]
async fn half_sent_requests_and_idle_connections_are_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let service = Service::start(&store, &["--header-timeout", "2s"], dir);
    let address = address_of(&service);
    let mut half = tokio::net::TcpStream::connect(&address).await.unwrap();
    half.write_all(b"GET /healthz HTT").await.unwrap();
    let mut idle = tokio::net::TcpStream::connect(&address).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    for (what, stream) in [
        ("half a request", &mut half),
        ("an idle connection", &mut idle),
    ] {
        let mut answer = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(8), stream.read_to_end(&mut answer)).await;
        assert!(
            closed.is_ok(),
            "{what} was held open past the header timeout"
        );
    }
    assert!(started.elapsed() >= Duration::from_millis(1_500));
}

/// Past --max-connections a new connection is told to come back (503, Retry-After),
/// /healthz still answers, and once the held connections are gone a real client is
/// served again; 3,000 half-open connections do not stop it.
#[tokio::test]
async fn a_flood_of_half_open_connections_does_not_stop_a_real_client() {
    use tokio::io::AsyncWriteExt;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let service = Service::start(
        &store,
        &["--max-connections", "64", "--header-timeout", "3s"],
        dir,
    );
    let address = address_of(&service);
    let mut held = Vec::new();
    for _ in 0..3_000 {
        if let Ok(mut stream) = tokio::net::TcpStream::connect(&address).await {
            let _ = stream.write_all(b"POST /v1/locks/x/acquire HTT").await;
            held.push(stream);
        }
    }
    // While the flood is held: /healthz answers, and work is refused with a retry hint
    // or served, never hung.
    let api = service.anonymous();
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut healthy = false;
    while Instant::now() < deadline && !healthy {
        if let Ok(Ok(response)) = tokio::time::timeout(
            Duration::from_secs(2),
            reqwest::get(format!("{}/healthz", service.base)),
        )
        .await
        {
            healthy = response.status() == StatusCode::OK;
        }
    }
    assert!(healthy, "/healthz did not answer under the flood");
    let mut served = false;
    while Instant::now() < deadline && !served {
        let answer = tokio::time::timeout(
            Duration::from_secs(2),
            api.request(reqwest::Method::POST, "/v1/locks/flood/acquire")
                .json(&json!({}))
                .send(),
        )
        .await;
        match answer {
            Ok(Ok(response)) if response.status() == StatusCode::OK => served = true,
            Ok(Ok(response)) => {
                assert_eq!(
                    response.status(),
                    StatusCode::SERVICE_UNAVAILABLE,
                    "{response:?}"
                );
                assert!(
                    response.headers().contains_key("retry-after"),
                    "{response:?}"
                );
            }
            // Timed out, or a kept-alive connection the server had closed under the
            // flood (the client sees an incomplete message): neither is a hang; try again.
            Ok(Err(_)) | Err(_) => {}
        }
    }
    assert!(
        served,
        "a real client was not served while half-open connections were held"
    );
    drop(held);
}

/// --max-long-polls bounds the acquires that wait: the next one is told to come back.
#[tokio::test]
async fn waiting_acquires_are_bounded() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let service = Service::start(&store, &["--max-long-polls", "2"], dir);
    let api = service.anonymous();
    assert_eq!(
        api.acquire("busy", json!({"ttl_ms": 20000})).await.status,
        StatusCode::OK
    );
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let request = api
                .request(reqwest::Method::POST, "/v1/locks/busy/acquire")
                .json(&json!({"wait_ms": 4000}));
            tokio::spawn(request.send())
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let third = api.acquire("busy", json!({"wait_ms": 4000})).await;
    assert_eq!(third.status, StatusCode::SERVICE_UNAVAILABLE, "{third:?}");
    assert_eq!(third.problem_type(), "/problems/too-many-long-polls");
    assert!(third.headers.contains_key("retry-after"));
    for waiter in waiting {
        let _ = waiter.await;
    }
}

/// One tenant cannot take the service from the others: leases are bounded by
/// --max-ttl (a crashed client's lock frees within it, and the OpenAPI document says
/// so), and past --max-locks-per-tenant an acquire gets 429 while another tenant is
/// still served.
#[tokio::test]
async fn one_tenant_cannot_hold_every_lock() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let service = Service::start_with(
        &store,
        &["--max-locks-per-tenant", "3", "--max-ttl", "1m"],
        dir,
        Some(&tokens_document()),
    );
    let (acme, globex) = (service.as_token(ACME), service.as_token(GLOBEX));
    let long = acme.acquire("long", json!({"ttl_ms": 120_000})).await;
    assert_eq!(long.status, StatusCode::BAD_REQUEST, "{long:?}");
    let mut owners = Vec::new();
    for name in ["a", "b", "c"] {
        let taken = acme.acquire(name, json!({"ttl_ms": 60_000})).await;
        assert_eq!(taken.status, StatusCode::OK, "{taken:?}");
        owners.push(taken.body["owner"].as_str().unwrap().to_owned());
    }
    let refused = acme.acquire("d", json!({"ttl_ms": 60_000})).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{refused:?}");
    assert_eq!(refused.problem_type(), "/problems/tenant-lock-limit");
    assert!(refused.headers.contains_key("retry-after"));
    assert_eq!(globex.acquire("a", json!({})).await.status, StatusCode::OK);
    let released = acme
        .post("/v1/locks/a/release", json!({"owner": owners[0]}))
        .await;
    assert_eq!(released.body["outcome"], "released");
    assert_eq!(acme.acquire("d", json!({})).await.status, StatusCode::OK);
    let document = service.anonymous().get("/openapi.json").await.body;
    assert_eq!(
        document["components"]["schemas"]["AcquireRequest"]["properties"]["ttl_ms"]["maximum"],
        60_000
    );
}

/// Sends one raw request and returns its status (a way to set `Host`, `Origin` and
/// `Sec-Fetch-Site` as a browser or a rebinding page would).
async fn raw_status(
    service: &Service,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &str,
) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address_of(service))
        .await
        .unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    for header in headers {
        request.push_str(header);
        request.push_str("\r\n");
    }
    request.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ));
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    answer.split(' ').nth(1).unwrap().parse().unwrap()
}

/// Without tokens the service answers only to its own address (a DNS-rebinding page
/// names its own host), refuses changes from pages of other sites, and says in its
/// banner what the mode is for; the dashboard cannot be framed.
#[tokio::test]
async fn no_token_mode_refuses_other_hosts_and_cross_site_changes() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let service = Service::start(&store, &["--allowed-host", "Locks.Internal:7070"], dir);
    let own = format!("Host: {}", address_of(&service));
    let acquire = "/v1/locks/rebound/acquire";
    let rebinding = raw_status(
        &service,
        "POST",
        acquire,
        &["Host: evil.example:7070"],
        "{}",
    )
    .await;
    assert_eq!(rebinding, 421);
    let cross_origin = raw_status(
        &service,
        "POST",
        acquire,
        &[&own, "Origin: http://evil.example"],
        "{}",
    )
    .await;
    assert_eq!(cross_origin, 403);
    let cross_site = raw_status(
        &service,
        "DELETE",
        "/v1/locks/rebound",
        &[&own, "Sec-Fetch-Site: cross-site"],
        "",
    )
    .await;
    assert_eq!(cross_site, 403);
    assert_eq!(
        service.anonymous().get("/v1/locks/rebound").await.body["held"],
        false,
        "a refused request changed something"
    );
    // Its own address, a named host, and its own pages are served.
    let own_origin = format!("Origin: http://{}", address_of(&service));
    assert_eq!(
        raw_status(&service, "POST", acquire, &[&own, &own_origin], "{}").await,
        200
    );
    assert_eq!(
        raw_status(
            &service,
            "GET",
            "/healthz",
            &["Host: locks.internal:7070"],
            ""
        )
        .await,
        200
    );
    let page = service
        .http
        .get(format!("{}/", service.base))
        .send()
        .await
        .unwrap();
    let policy = page.headers()["content-security-policy"].to_str().unwrap();
    assert!(policy.contains("frame-ancestors 'none'"), "{policy}");
}

/// Tokens over plain HTTP to a non-loopback address are refused at start unless the
/// operator says the network is trusted.
#[test]
fn tokens_over_plain_http_elsewhere_are_refused() {
    let output = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "serve",
            "--store",
            "sqlite:///nonexistent/never.db",
            "--listen",
            "0.0.0.0:0",
        ])
        .env("TURNSTILE_TOKENS", tokens_document())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64), "{output:?}");
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(said.contains("--insecure-http"), "{said}");
}

/// The dashboard is per tenant and failed calls change nothing on it: another tenant's
/// many events do not push a tenant's own out, and an extend with a wrong owner id
/// does not remove the real holder's row.
#[tokio::test]
async fn the_dashboard_cannot_be_disturbed_by_other_callers() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let service = Service::start_with(&store, &[], dir, Some(&tokens_document()));
    let (acme, globex) = (service.as_token(ACME), service.as_token(GLOBEX));
    // acme's own event: a lease it lets run out, then an extend that finds it lost.
    let short = acme.acquire("short", json!({"ttl_ms": 100})).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lost = acme
        .post(
            "/v1/locks/short/extend",
            json!({"owner": short.body["owner"], "ttl_ms": 1000}),
        )
        .await;
    assert_eq!(lost.status, StatusCode::CONFLICT, "{lost:?}");
    let held = acme.acquire("row", json!({"ttl_ms": 60_000})).await;
    assert_eq!(held.status, StatusCode::OK);
    // A wrong owner id: refused, and nothing shown changes.
    let wrong = acme
        .post(
            "/v1/locks/row/extend",
            json!({"owner": "0".repeat(32), "ttl_ms": 1000}),
        )
        .await;
    assert_eq!(wrong.status, StatusCode::CONFLICT, "{wrong:?}");
    // Another tenant makes 150 events of its own.
    for n in 0..150 {
        let late = globex
            .post(
                &format!("/v1/locks/free-{n}/release"),
                json!({"owner": "1".repeat(32)}),
            )
            .await;
        assert_eq!(late.body["outcome"], "already_expired");
    }
    let seen = acme.get("/v1/dashboard").await;
    let names: Vec<&str> = seen.body["held"]
        .as_array()
        .unwrap()
        .iter()
        .map(|lock| lock["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["row"], "the real holder's row was removed");
    let events = seen.body["events"].as_array().unwrap();
    assert!(
        events.iter().any(|event| event["name"] == "short"),
        "another tenant's events pushed this tenant's out: {events:?}"
    );
}

/// --metrics-token closes /metrics to callers without it.
#[tokio::test]
async fn metrics_can_require_a_token() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let service = Service::start(&store, &["--metrics-token", "scrape-token-0123456789"], dir);
    let anonymous = service.anonymous().get("/metrics").await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    let scraper = service
        .as_token("scrape-token-0123456789")
        .get("/metrics")
        .await;
    assert_eq!(scraper.status, StatusCode::OK);
    assert!(
        scraper
            .body
            .as_str()
            .unwrap()
            .contains("turnstile_http_requests_total")
    );
}

// ---- elections ----

/// A server-sent event stream, read one event at a time.
struct EventStream {
    response: reqwest::Response,
    buffer: String,
}

impl EventStream {
    async fn open(caller: &Caller<'_>, path: &str) -> Result<EventStream, Answer> {
        let response = caller
            .request(reqwest::Method::GET, path)
            .send()
            .await
            .unwrap();
        if response.status() != StatusCode::OK {
            let status = response.status();
            let headers = response.headers().clone();
            let content_type = headers
                .get(reqwest::header::CONTENT_TYPE)
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default();
            let body = response.json().await.unwrap_or(Value::Null);
            return Err(Answer {
                status,
                content_type,
                body,
                headers,
            });
        }
        assert_eq!(
            response.headers()[reqwest::header::CONTENT_TYPE],
            "text/event-stream"
        );
        Ok(EventStream {
            response,
            buffer: String::new(),
        })
    }

    /// The next event with data, as (event name, data), or `None` if the stream ended
    /// or nothing came within `within`.
    async fn next(&mut self, within: Duration) -> Option<(String, Value)> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            while let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let mut event = "message".to_owned();
                let mut data = None;
                for line in block.lines() {
                    if let Some(name) = line.strip_prefix("event:") {
                        event = name.trim().to_owned();
                    } else if let Some(text) = line.strip_prefix("data:") {
                        data = Some(serde_json::from_str(text.trim()).unwrap());
                    }
                }
                // Keep-alive comments carry no data.
                if let Some(data) = data {
                    return Some((event, data));
                }
            }
            let chunk = tokio::time::timeout_at(deadline, self.response.chunk())
                .await
                .ok()?
                .unwrap()?;
            self.buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }
}

/// Every election endpoint on one store: a campaign answers with an epoch, a second
/// candidate is refused or waits, the leader proclaims and resigns and the waiting
/// candidate leads with a larger epoch, the deposed leader can neither extend nor
/// proclaim, and an observer sees each change in order.
async fn election_lifecycle(service: &Service) {
    let api = service.anonymous();
    let name = unique_name("scheduler");
    let path = |action: &str| format!("/v1/elections/{name}{action}");
    let mut observer = EventStream::open(&api, &path("/observe")).await.unwrap();
    let (event, first) = observer.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!(event, "leader");
    assert_eq!(first["leading"], false, "{first}");

    let a = api
        .post(
            &path("/campaign"),
            json!({"value": "10.0.0.1:80", "ttl_ms": 20000}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{a:?}");
    let (a_owner, a_epoch) = (
        a.body["owner"].as_str().unwrap(),
        a.body["epoch"].as_u64().unwrap(),
    );
    assert_eq!(a.body["value"], "10.0.0.1:80");
    let led = api.get(&path("")).await;
    assert_eq!(led.body["leading"], true, "{led:?}");
    assert_eq!(led.body["epoch"], a_epoch);
    assert_eq!(led.body["value"], "10.0.0.1:80");
    assert_eq!(led.body["holder"].as_str().unwrap(), &a_owner[..8]);
    assert!(
        !led.body.to_string().contains(a_owner),
        "the owner id is a capability"
    );

    let refused = api.post(&path("/campaign"), json!({"value": "b"})).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{refused:?}");
    assert_eq!(refused.problem_type(), "/problems/election-led");

    // B waits while A proclaims a new value and then resigns.
    let campaign_path = path("/campaign");
    let waiting = api.post(
        &campaign_path,
        json!({"value": "10.0.0.2:80", "wait_ms": 15000}),
    );
    let leader_a = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let proclaimed = api
            .post(
                &path("/proclaim"),
                json!({"owner": a_owner, "value": "10.0.0.1:81"}),
            )
            .await;
        assert_eq!(proclaimed.status, StatusCode::OK, "{proclaimed:?}");
        let extended = api
            .post(&path("/extend"), json!({"owner": a_owner, "ttl_ms": 20000}))
            .await;
        assert_eq!(extended.status, StatusCode::OK, "{extended:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        api.post(&path("/resign"), json!({"owner": a_owner})).await
    };
    let (b, resigned) = tokio::join!(waiting, leader_a);
    assert_eq!(resigned.body["outcome"], "released", "{resigned:?}");
    assert_eq!(b.status, StatusCode::OK, "{b:?}");
    let b_epoch = b.body["epoch"].as_u64().unwrap();
    assert!(
        b_epoch > a_epoch,
        "epochs must grow: {a_epoch} then {b_epoch}"
    );

    // The deposed leader can change nothing.
    let stale = api
        .post(
            &path("/proclaim"),
            json!({"owner": a_owner, "value": "stale"}),
        )
        .await;
    assert_eq!(stale.status, StatusCode::CONFLICT, "{stale:?}");
    assert_eq!(stale.problem_type(), "/problems/leadership-lost");
    let stale = api.post(&path("/extend"), json!({"owner": a_owner})).await;
    assert_eq!(stale.problem_type(), "/problems/leadership-lost");
    let led = api.get(&path("")).await;
    assert_eq!(led.body["value"], "10.0.0.2:80", "{led:?}");
    assert_eq!(led.body["epoch"], b_epoch);

    // The observer saw A, A's new value and B, in that order (and maybe nobody
    // between A's resign and B's campaign). A campaign takes the lock, then writes
    // its value: a new leader may be seen first without one, never with another's.
    let mut seen: Vec<(Option<u64>, Option<String>)> = Vec::new();
    while seen.last() != Some(&(Some(b_epoch), Some("10.0.0.2:80".to_owned()))) {
        let Some((event, data)) = observer.next(Duration::from_secs(5)).await else {
            panic!("the observer saw {seen:?}, not B leading");
        };
        assert_eq!(event, "leader", "{data}");
        if data["leading"] == true {
            seen.push((
                data["epoch"].as_u64(),
                data["value"].as_str().map(str::to_owned),
            ));
        }
    }
    for pair in seen.windows(2) {
        if pair[0].1.is_none() {
            assert_eq!(
                pair[0].0, pair[1].0,
                "a leader seen without its value: {seen:?}"
            );
        }
    }
    seen.retain(|(_, value)| value.is_some());
    assert_eq!(
        seen,
        [
            (Some(a_epoch), Some("10.0.0.1:80".to_owned())),
            (Some(a_epoch), Some("10.0.0.1:81".to_owned())),
            (Some(b_epoch), Some("10.0.0.2:80".to_owned())),
        ]
    );

    // The dashboard shows the election: B leading, A's term resigned.
    let dashboard = api.get("/v1/dashboard").await;
    let election = dashboard.body["elections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|election| election["name"] == name.as_str())
        .unwrap_or_else(|| panic!("no election in {}", dashboard.body))
        .clone();
    assert_eq!(election["leader"]["epoch"], b_epoch, "{election}");
    assert_eq!(election["leader"]["value"], "10.0.0.2:80");
    assert_eq!(election["history"][0]["epoch"], a_epoch);
    assert_eq!(election["history"][0]["ended"], "resigned");
    assert_eq!(election["history"][0]["value"], "10.0.0.1:81");
    let kinds: Vec<_> = dashboard.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|event| event["name"] == name.as_str())
        .map(|event| event["kind"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kinds, ["elected", "resigned", "elected"], "newest first");

    // An election is its lock: breaking it deposes B, whose next extend is refused.
    let broken = api.delete(&format!("/v1/locks/{name}")).await;
    assert_eq!(broken.body["fencing_token"], b_epoch, "{broken:?}");
    let b_owner = b.body["owner"].as_str().unwrap();
    let lost = api.post(&path("/extend"), json!({"owner": b_owner})).await;
    assert_eq!(lost.problem_type(), "/problems/leadership-lost");
    let (_, nobody) = observer.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!(nobody["leading"], false, "{nobody}");
}

#[tokio::test]
async fn elections_over_http_on_sqlite() {
    election_lifecycle(&Service::sqlite()).await;
}

#[tokio::test]
async fn elections_over_http_on_redis() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let service = Service::start(&shared_redis().url(), &[], dir);
    election_lifecycle(&service).await;
}

/// Bad campaigns change nothing; tenants campaign inside their own names; the number
/// of open streams is bounded; a stream ends at shutdown.
#[tokio::test]
async fn elections_refuse_bad_input_keep_tenants_apart_and_bound_their_streams() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!("sqlite://{}", dir.path().join("locks.sqlite3").display());
    let mut service = Service::start_with(
        &store,
        &["--max-observers", "1"],
        dir,
        Some(&tokens_document()),
    );
    let admin = service.as_token(ADMIN);
    for (body, expected) in [
        (json!({"value": "a\u{0}b"}), "/problems/invalid-request"),
        (
            json!({"value": "x".repeat(16 * 1024 + 1)}),
            "/problems/invalid-request",
        ),
        (json!({"ttl_ms": 1}), "/problems/invalid-request"),
        (json!({"value": 7}), "/problems/invalid-request"),
        (json!({"wait_ms": 3_600_000}), "/problems/invalid-request"),
    ] {
        let answer = admin.post("/v1/elections/bad/campaign", body.clone()).await;
        assert!(answer.status.is_client_error(), "{body}: {answer:?}");
        assert_eq!(answer.problem_type(), expected, "{body}: {answer:?}");
    }
    let nobody = admin.get("/v1/elections/bad").await;
    assert_eq!(
        nobody.body["leading"], false,
        "a refused campaign took nothing"
    );
    let bad_owner = admin
        .post("/v1/elections/bad/resign", json!({"owner": "not-an-owner"}))
        .await;
    assert_eq!(bad_owner.status, StatusCode::BAD_REQUEST, "{bad_owner:?}");

    // Two tenants lead elections of the same name, each inside its own names.
    let acme = service.as_token(ACME);
    let globex = service.as_token(GLOBEX);
    let a = acme
        .post("/v1/elections/leader/campaign", json!({"value": "acme"}))
        .await;
    let g = globex
        .post("/v1/elections/leader/campaign", json!({"value": "globex"}))
        .await;
    assert_eq!(
        (a.status, g.status),
        (StatusCode::OK, StatusCode::OK),
        "{a:?} {g:?}"
    );
    assert_eq!(
        admin.get("/v1/elections/acme%2Fleader").await.body["value"],
        "acme"
    );
    assert_eq!(
        admin.get("/v1/elections/globex%2Fleader").await.body["value"],
        "globex"
    );
    let reader = service.as_token(READER);
    let refused = reader.post("/v1/elections/x/campaign", json!({})).await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN, "{refused:?}");
    let acme_view = acme.get("/v1/dashboard").await;
    let names: Vec<_> = acme_view.body["elections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|election| election["address"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["leader"], "a tenant sees its own elections only");

    // One stream at a time (--max-observers 1); it ends at SIGTERM.
    let mut stream = EventStream::open(&reader, "/v1/elections/acme%2Fleader/observe")
        .await
        .unwrap();
    let (_, first) = stream.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!(first["value"], "acme");
    let second = EventStream::open(&reader, "/v1/elections/other/observe").await;
    let refused = second.err().expect("a second stream past --max-observers");
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.problem_type(), "/problems/too-many-observers");
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(service.child.id() as i32, libc::SIGTERM) };
    assert!(
        stream.next(Duration::from_secs(5)).await.is_none(),
        "the stream must end at shutdown"
    );
    let status = service.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

/// A Redis idempotency key's first token is the Redis server's `TIME`, read there: the
/// service's own wall clock stepping back an hour after it connected changes nothing
/// (a token made of this host's clock and an offset measured at connect came out an
/// hour behind the server, smaller than tokens the server had issued before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_idempotency_tokens_ignore_the_service_clock() {
    let clock = turnstile_test_support::SteppableClock::new();
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let store = format!(
        "{}?turnstile_prefix={}",
        shared_redis().url(),
        unique_name("idemclock")
    );
    let service = Service::start_on(&store, &[], dir, None, Some(&clock));
    let api = service.anonymous();
    let mut redis = redis::Client::open(shared_redis().url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    for (n, offset) in [(0, 0), (1, -3_600), (2, -7_200)] {
        clock.set_offset(offset);
        let (seconds, micros): (u64, u64) =
            redis::cmd("TIME").query_async(&mut redis).await.unwrap();
        let before = seconds * 1_000_000 + micros;
        let claimed = api
            .post(
                "/v1/idempotency/claim",
                json!({"key": format!("k{n}"), "fingerprint": "a".repeat(64)}),
            )
            .await;
        assert_eq!(claimed.status, StatusCode::OK, "{claimed:?}");
        let token = claimed.body["token"].as_u64().unwrap();
        assert!(
            token >= before,
            "with the service's clock {offset} s off, the token {token} is before the \
             server's time {before}"
        );
    }
}
