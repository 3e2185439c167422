//! `turnstile outbox relay` as a process: killed with SIGKILL mid-batch and replaced,
//! then stopped with SIGTERM; every committed message reaches NATS JetStream once, in
//! order per key.

use std::collections::{BTreeMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use turnstile::outbox::nats::JetStreamPublisher;
use turnstile::outbox::sqlite::SqliteOutbox;
use turnstile::outbox::{Message, OutboxStore};
use turnstile_test_support::NatsServer;

fn relay(store: &str, broker: &str, lease: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["outbox", "relay", "--store", store, "--broker", broker])
        .args(["--lease", lease, "--keys", "4"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("cannot start turnstile outbox relay")
}

async fn stream_messages(publisher: &JetStreamPublisher) -> u64 {
    let mut stream = publisher.jetstream().get_stream("OUT").await.unwrap();
    stream.info().await.unwrap().state.messages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_batch_loses_nothing_and_keeps_order() {
    let nats = NatsServer::spawn();
    let publisher = JetStreamPublisher::connect(&nats.url(), Duration::from_secs(5))
        .await
        .unwrap();
    publisher
        .jetstream()
        .create_stream(async_nats::jetstream::stream::Config {
            name: "OUT".to_owned(),
            subjects: vec!["out.>".to_owned()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let store_url = format!("sqlite://{}", path.display());
    let outbox = SqliteOutbox::open(&path).await.unwrap();
    let mut committed = HashSet::new();
    for batch in 0..40 {
        let mut transaction = outbox.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
        for n in 0..50 {
            let message = Message::json(
                "out.event",
                format!("key-{}", (batch * 50 + n) % 20),
                &serde_json::json!({"batch": batch, "n": n}),
            )
            .unwrap();
            outbox.enqueue(&mut transaction, &message).await.unwrap();
            committed.insert(message.id().to_owned());
        }
        outbox.commit(transaction).await.unwrap();
    }

    // The first relay is killed once part of the outbox is out.
    let mut first = relay(&store_url, &nats.url(), "3s");
    let started = Instant::now();
    while stream_messages(&publisher).await < 300 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the relay published nothing"
        );
        assert!(first.try_wait().unwrap().is_none(), "the relay exited");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.kill().unwrap();
    first.wait().unwrap();
    let left = outbox.status(10).await.unwrap().pending;
    assert!(left > 0, "the relay finished before it was killed");

    // A second relay takes over (the dead one's keys once their lease runs out) and
    // stops cleanly on SIGTERM.
    let mut second = relay(&store_url, &nats.url(), "30s");
    let started = Instant::now();
    while outbox.status(10).await.unwrap().pending > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the outbox did not drain"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(second.id() as libc::pid_t, libc::SIGTERM);
    }
    let started = Instant::now();
    let status = loop {
        if let Some(status) = second.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the relay ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "the relay exited with {status}");

    // Every committed message once, each key's in order.
    let mut stream = publisher.jetstream().get_stream("OUT").await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut ids = HashSet::new();
    let mut order: BTreeMap<String, u64> = BTreeMap::new();
    for sequence in 1..=last {
        let message = stream.get_raw_message(sequence).await.unwrap();
        let header = |name: &str| message.headers.get(name).unwrap().as_str().to_owned();
        assert!(
            ids.insert(header("Nats-Msg-Id")),
            "a message reached the stream twice"
        );
        let seq: u64 = header("Turnstile-Seq").parse().unwrap();
        let previous = order.insert(header("Turnstile-Key"), seq).unwrap_or(0);
        assert_eq!(seq, previous + 1, "order broken");
    }
    assert_eq!(ids, committed, "lost messages");

    // The operator's commands.
    let output = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["outbox", "status", "--json", "--store", &store_url])
        .output()
        .unwrap();
    assert!(output.status.success());
    let status: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(status["pending"], 0);
    let output = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["outbox", "redrive", "--store", &store_url, "key-1"])
        .output()
        .unwrap();
    assert_eq!(
        output.status.code(),
        Some(1),
        "redrive of a key that is not parked"
    );
    let relay_to = |broker: &str| {
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["outbox", "relay", "--store", &store_url, "--broker", broker])
            .output()
            .unwrap()
            .status
            .code()
    };
    assert_eq!(
        relay_to("ftp://127.0.0.1:1"),
        Some(64),
        "an unknown broker scheme is bad input"
    );
    assert_eq!(
        relay_to("amqp://127.0.0.1:1"),
        Some(69),
        "a broker that is not there is unavailable"
    );
}
