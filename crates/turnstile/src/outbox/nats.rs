//! Publishing to NATS JetStream (feature `nats`).
//!
//! Each message goes to the subject named by its topic with its id as `Nats-Msg-Id`, so
//! the stream drops a redelivery inside its duplicate window; the relay waits for the
//! stream's ack before the key's next message. Headers: the message's own, plus
//! `Turnstile-Key` and `Turnstile-Seq` (its key and its place in the key's sequence,
//! which a consumer can use to check order).
//!
//! Before the first publish to a subject the relay checks that a stream takes it and
//! that the stream's duplicate window is longer than the relay's redelivery window
//! (lease + longest backoff): otherwise a redelivery could land outside it, and the
//! relay refuses to run ([`ErrorKind::Configuration`]).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishErrorKind};

use super::relay::Publisher;
use super::telemetry;
use super::{DEFAULT_MAX_DELIVERIES, DeadLetterNote, Failure, Incoming, Message, Processed};
use crate::error::{Error, ErrorKind, Result};
use crate::future::BoxFuture;

/// A JetStream publisher.
///
/// Publishes go over a connection of their own that never reconnects by itself for
/// long: async-nats queues what it is asked to send while it reconnects and sends it
/// once it is back, which for a relay cut off from NATS would be a key's head landing
/// after its lease, behind later messages another relay published. So a publish is
/// handed to that connection only while it is connected; one found down, or whose
/// publish was cut off or timed out, is set aside (it makes a single reconnect attempt,
/// bounded by the connect timeout, then gives up), and the next publish opens a new
/// one. What is not covered: a command async-nats had already taken into a connection
/// whose writes stall (a silent partition with a full send buffer) stays in that
/// client, which async-nats offers no way to empty, and can still go out when the
/// partition heals or over its one reconnect; so can bytes already handed to TCP. The
/// stream's duplicate window absorbs such a copy if it lands inside it, and
/// [`Inbox`](crate::idempotency::inbox::Inbox) drops it in any case (its cursor only
/// moves forward).
#[derive(Clone)]
pub struct JetStreamPublisher {
    /// The application's context (it reconnects on its own): stream checks, and what
    /// [`JetStreamPublisher::jetstream`] hands out.
    jetstream: async_nats::jetstream::Context,
    publishing: Arc<Publishing>,
    url: String,
}

/// The publishing connection, replaced whenever it cannot be trusted to send now.
struct Publishing {
    /// The server's address with its credentials, to open the next connection.
    address: String,
    timeout: Duration,
    current: std::sync::Mutex<Option<PublishConnection>>,
    /// Held while a new connection is opened: other publishes meanwhile fail at once
    /// (and back off) instead of queueing behind a broker that may not answer.
    opening: tokio::sync::Mutex<()>,
    generation: std::sync::atomic::AtomicU64,
}

#[derive(Clone)]
struct PublishConnection {
    client: async_nats::Client,
    jetstream: async_nats::jetstream::Context,
    generation: u64,
}

impl std::fmt::Debug for JetStreamPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamPublisher")
            .field("url", &self.url)
            .finish()
    }
}

impl JetStreamPublisher {
    /// Connects to the NATS server at `url` (`nats://host:port`); fails if it does not
    /// answer within `timeout`.
    pub async fn connect(url: &str, timeout: Duration) -> Result<Self> {
        let redacted = crate::url::redact(url);
        let client = open(url, &redacted, timeout, false).await?;
        let publishing = Arc::new(Publishing {
            address: url.to_owned(),
            timeout,
            current: std::sync::Mutex::new(None),
            opening: tokio::sync::Mutex::new(()),
            generation: std::sync::atomic::AtomicU64::new(0),
        });
        let publisher = JetStreamPublisher {
            jetstream: async_nats::jetstream::new(client),
            publishing,
            url: redacted,
        };
        publisher.publish_connection().await?;
        Ok(publisher)
    }

    /// The JetStream context, for the application's own streams and consumers (on a
    /// connection of its own that reconnects by itself, not the one publishes use).
    pub fn jetstream(&self) -> &async_nats::jetstream::Context {
        &self.jetstream
    }

    /// The publishing connection if it is connected now, or a new one.
    async fn publish_connection(&self) -> Result<PublishConnection> {
        let publishing = &self.publishing;
        // Read out first: the guard must not live on into `discard`, which locks too.
        let current = publishing.slot().clone();
        if let Some(connection) = current {
            if connection.client.connection_state() == async_nats::connection::State::Connected {
                return Ok(connection);
            }
            publishing.discard(connection.generation);
        }
        let Ok(_opening) = publishing.opening.try_lock() else {
            return Err(Error::new(
                ErrorKind::StoreUnavailable,
                format!(
                    "the connection to NATS at {} is being opened again",
                    self.url
                ),
            ));
        };
        let opened = publishing.slot().clone();
        if let Some(connection) = opened {
            return Ok(connection);
        }
        let client = open(&publishing.address, &self.url, publishing.timeout, true).await?;
        let connection = PublishConnection {
            jetstream: async_nats::jetstream::new(client.clone()),
            client,
            generation: publishing
                .generation
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst),
        };
        *publishing.slot() = Some(connection.clone());
        Ok(connection)
    }
}

impl Publishing {
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<PublishConnection>> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sets connection `generation` aside if it is still the current one: no publish
    /// goes to it again, and it gives up after its single reconnect attempt.
    fn discard(&self, generation: u64) {
        let mut slot = self.slot();
        if slot
            .as_ref()
            .is_some_and(|connection| connection.generation == generation)
        {
            *slot = None;
        }
    }
}

/// Sets the publishing connection aside unless the publish it guards finished: a
/// publish cut off (its future dropped at the lease's end) or timed out may still sit
/// in the client, and no later publish should queue behind it.
struct InFlight<'a> {
    publishing: &'a Publishing,
    generation: u64,
    finished: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.publishing.discard(self.generation);
        }
    }
}

/// Opens a client; `publishing` clients make one reconnect attempt at most, so that
/// nothing they queued is sent long after it was asked for.
async fn open(
    url: &str,
    redacted: &str,
    timeout: Duration,
    publishing: bool,
) -> Result<async_nats::Client> {
    let mut options = async_nats::ConnectOptions::new()
        .connection_timeout(timeout)
        .request_timeout(Some(timeout));
    if publishing {
        options = options.max_reconnects(1);
    }
    match tokio::time::timeout(timeout, options.connect(url)).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(error)) => Err(Error::new(
            ErrorKind::StoreUnavailable,
            format!("cannot connect to NATS at {redacted}: {error}"),
        )),
        Err(_) => Err(Error::new(
            ErrorKind::StoreUnavailable,
            format!("NATS at {redacted} did not answer within {timeout:?}"),
        )),
    }
}

fn failure(permanent: bool, reason: String) -> Failure {
    Failure { permanent, reason }
}

impl Publisher for JetStreamPublisher {
    fn publish<'a>(
        &'a self,
        message: &'a Message,
        seq: u64,
    ) -> BoxFuture<'a, std::result::Result<(), Failure>> {
        Box::pin(async move {
            let mut headers = async_nats::HeaderMap::new();
            for (name, value) in super::user_headers(message) {
                headers.append(name.as_str(), value.as_str());
            }
            headers.insert("Nats-Msg-Id", message.id());
            headers.insert("Turnstile-Key", message.key());
            headers.insert("Turnstile-Seq", seq.to_string().as_str());
            let connection = self
                .publish_connection()
                .await
                .map_err(|error| failure(false, error.to_string()))?;
            let mut in_flight = InFlight {
                publishing: &self.publishing,
                generation: connection.generation,
                finished: false,
            };
            let classify = |kind: PublishErrorKind, error: String| match kind {
                // The broker refuses this message for good.
                PublishErrorKind::MaxPayloadExceeded
                | PublishErrorKind::WrongLastMessageId
                | PublishErrorKind::WrongLastSequence => failure(true, error),
                // No stream takes the subject (an operator's fix), or the broker is
                // unreachable or slow: try again later.
                _ => failure(false, error),
            };
            // A broker's answer leaves the connection fit; no answer (a timeout, a
            // broken connection) may leave the message queued in it.
            let settled = |kind: PublishErrorKind| {
                !matches!(
                    kind,
                    PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe
                )
            };
            let ack = match connection
                .jetstream
                .publish_with_headers(
                    message.topic().to_owned(),
                    headers,
                    bytes::Bytes::copy_from_slice(message.payload()),
                )
                .await
            {
                Ok(ack) => ack,
                Err(error) => {
                    in_flight.finished = settled(error.kind());
                    return Err(classify(error.kind(), error.to_string()));
                }
            };
            let acked = ack.await;
            in_flight.finished = acked
                .as_ref()
                .map_or_else(|error| settled(error.kind()), |_| true);
            acked
                .map(|_| ())
                .map_err(|error| classify(error.kind(), error.to_string()))
        })
    }

    fn check<'a>(&'a self, topic: &'a str, redelivery: Duration) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let stream = self
                .jetstream
                .stream_by_subject(topic.to_owned())
                .await
                .map_err(|error| match error.kind() {
                    // Only a stream that is really missing is an operator's fix; a request
                    // that timed out or found no responders (a broker restarting, a
                    // network blip) is tried again, and never parks a key.
                    GetStreamByNameErrorKind::NotFound
                    | GetStreamByNameErrorKind::InvalidSubject => Error::new(
                        ErrorKind::Configuration,
                        format!(
                            "no JetStream stream at {} takes subject {topic:?} ({error}); \
                                 create one before relaying",
                            self.url
                        ),
                    ),
                    _ => Error::new(
                        ErrorKind::StoreUnavailable,
                        format!(
                            "cannot ask {} which stream takes subject {topic:?}: {error}",
                            self.url
                        ),
                    ),
                })?;
            let info = self
                .jetstream
                .get_stream(&stream)
                .await
                .map_err(|error| {
                    Error::new(
                        ErrorKind::StoreUnavailable,
                        format!("cannot read stream {stream:?} at {}: {error}", self.url),
                    )
                })?
                .get_info()
                .await
                .map_err(|error| {
                    Error::new(
                        ErrorKind::StoreUnavailable,
                        format!("cannot read stream {stream:?} at {}: {error}", self.url),
                    )
                })?;
            let window = info.config.duplicate_window;
            if window <= redelivery {
                return Err(Error::new(
                    ErrorKind::Configuration,
                    format!(
                        "stream {stream:?} drops duplicates for {window:?}, but the relay may publish \
                         a message again up to {redelivery:?} later (lease + longest backoff): raise \
                         the stream's duplicate_window above that, or shorten the relay's lease or \
                         backoff"
                    ),
                ));
            }
            Ok(())
        })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }

    fn reachable(&self) -> BoxFuture<'_, bool> {
        // A request JetStream itself answers (its account information), on the
        // application's connection: a server whose JetStream is off answers PINGs but
        // not this ("no responders"). An error answer (an account without JetStream, a
        // cluster without a leader) is still JetStream answering: the relay does not
        // pause as a whole then, and each failing key backs off on its own.
        Box::pin(async move {
            let info = self
                .jetstream
                .request::<_, (), serde_json::Value>("INFO", &());
            tokio::time::timeout(super::relay::REACHABLE_WITHIN, info)
                .await
                .is_ok_and(|answer| answer.is_ok())
        })
    }
}

/// Where a [`JetStreamConsumer`] puts a copy of a message its handler kept failing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetterSubject {
    /// `{prefix}.{subject}`, after the original's subject: the default, with prefix
    /// `dead-letter` (`orders.created` → `dead-letter.orders.created`).
    Prefix(String),
    /// One subject the application names, for every dead-lettered message.
    Subject(String),
}

impl Default for DeadLetterSubject {
    fn default() -> Self {
        DeadLetterSubject::Prefix("dead-letter".to_owned())
    }
}

impl DeadLetterSubject {
    fn for_subject(&self, subject: &str) -> String {
        match self {
            DeadLetterSubject::Prefix(prefix) => format!("{prefix}.{subject}"),
            DeadLetterSubject::Subject(subject) => subject.clone(),
        }
    }
}

/// The header a dead-letter copy carries with the original's `Nats-Msg-Id`: the copy
/// has one of its own (`dead-letter/{stream}/{stream sequence}`), so that a dead-letter
/// stream that also holds the original subject, or a replay dead-lettered again,
/// never drops the copy as a duplicate of the original. Put it back as `Nats-Msg-Id`
/// when replaying.
pub const DEAD_LETTER_MSG_ID_HEADER: &str = "turnstile-dead-letter-msg-id";

/// A durable JetStream pull consumer that acknowledges a message only after its handler
/// succeeded — which, for effectively-once handling, commits the handler's transaction
/// with the message recorded in an [`Inbox`](crate::idempotency::inbox::Inbox) first.
/// A handler that fails (or a process that dies before the ack) gets the message again.
///
/// **Poison messages.** A failed message is sent back with a delay (a JetStream `Nak`
/// with the `retry_after` of [`process`](Self::process)). Once its handler has failed
/// on its [`max_deliveries`](Self::max_deliveries)-th delivery (JetStream's own count,
/// `info.delivered`, which also counts deliveries whose ack wait ran out;
/// [`DEFAULT_MAX_DELIVERIES`] unless told otherwise), the message is
/// **dead-lettered**: a copy — the same payload and headers, with
/// [`DEAD_LETTER_REASON_HEADER`](super::DEAD_LETTER_REASON_HEADER) and the other
/// `turnstile-dead-letter-*` headers — is published to its
/// [`DeadLetterSubject`] (`dead-letter.{subject}` by default), and only once a stream
/// acknowledged the copy is the original terminated (`Term`). Create a stream that
/// takes the dead-letter subjects (and that this consumer does not read): while none
/// does, the message is not terminated but retried after the delay, with an error
/// logged (`turnstile_outbox_dead_letter_failures_total`).
#[derive(Debug)]
pub struct JetStreamConsumer {
    consumer: async_nats::jetstream::consumer::PullConsumer,
    jetstream: async_nats::jetstream::Context,
    name: String,
    max_deliveries: u32,
    dead_letter: DeadLetterSubject,
    early: std::sync::Mutex<super::EarlyDeliveries>,
}

impl JetStreamConsumer {
    /// The durable consumer `name` on `stream` (created if missing, explicit acks,
    /// redelivered `ack_wait` after a delivery that is neither acknowledged nor refused).
    pub async fn durable(
        jetstream: &async_nats::jetstream::Context,
        stream: &str,
        name: &str,
        ack_wait: Duration,
    ) -> Result<Self> {
        let unavailable = |error: String| {
            Error::new(
                ErrorKind::StoreUnavailable,
                format!("cannot open consumer {name:?} on stream {stream:?}: {error}"),
            )
        };
        let stream_handle = jetstream
            .get_stream(stream)
            .await
            .map_err(|error| unavailable(error.to_string()))?;
        let consumer = stream_handle
            .get_or_create_consumer(
                name,
                async_nats::jetstream::consumer::pull::Config {
                    durable_name: Some(name.to_owned()),
                    ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
                    ack_wait,
                    ..Default::default()
                },
            )
            .await
            .map_err(|error| unavailable(error.to_string()))?;
        Ok(JetStreamConsumer {
            consumer,
            jetstream: jetstream.clone(),
            name: name.to_owned(),
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            dead_letter: DeadLetterSubject::default(),
            early: std::sync::Mutex::default(),
        })
    }

    /// Dead-letters a message whose handler failed on its `deliveries`-th delivery
    /// (at least 1; [`DEFAULT_MAX_DELIVERIES`] by default) instead of sending it back.
    pub fn max_deliveries(mut self, deliveries: u32) -> Self {
        self.max_deliveries = deliveries.max(1);
        self
    }

    /// Where dead-lettered messages go (`dead-letter.{subject}` by default).
    pub fn dead_letter_subject(mut self, subject: DeadLetterSubject) -> Self {
        self.dead_letter = subject;
        self
    }

    /// Fetches up to `batch` messages (waiting up to `wait` for them) and runs `handle`
    /// on each, in stream order. A message is acknowledged once `handle` returns `Ok`;
    /// when it returns `Err` the message is sent back for redelivery after
    /// `retry_after`, or, on its [`max_deliveries`](Self::max_deliveries)-th delivery,
    /// dead-lettered (see [`JetStreamConsumer`]).
    pub async fn process<F>(
        &self,
        batch: usize,
        wait: Duration,
        retry_after: Duration,
        mut handle: F,
    ) -> Result<Processed>
    where
        F: AsyncFnMut(&Incoming) -> Result<()>,
    {
        use futures_util::StreamExt;
        let unavailable = |error: String| {
            Error::new(
                ErrorKind::StoreUnavailable,
                format!("consumer {:?}: {error}", self.name),
            )
        };
        let mut messages = self
            .consumer
            .fetch()
            .max_messages(batch.max(1))
            .expires(wait)
            .messages()
            .await
            .map_err(|error| unavailable(error.to_string()))?;
        let mut processed = Processed::default();
        while let Some(message) = messages.next().await {
            let message = message.map_err(|error| unavailable(error.to_string()))?;
            let mut incoming = incoming(&message);
            // JetStream counts the deliveries a handler answered "out of order" too:
            // those it made in this process are taken off.
            let place = message
                .info()
                .map_or_else(|_| String::new(), |info| info.stream_sequence.to_string());
            incoming.deliveries = self
                .early_deliveries()
                .failures(&place, incoming.deliveries);
            match handle(&incoming).await {
                Ok(()) => {
                    message
                        .double_ack()
                        .await
                        .map_err(|error| unavailable(error.to_string()))?;
                    self.early_deliveries().forget(&place);
                    processed.acked += 1;
                }
                Err(error) if error.kind() == ErrorKind::OutOfOrder => {
                    let early = self.early_deliveries().record(&place);
                    telemetry::early("nats", &incoming, early, &error);
                    message
                        .ack_with(async_nats::jetstream::AckKind::Nak(Some(retry_after)))
                        .await
                        .map_err(|error| unavailable(error.to_string()))?;
                    processed.early += 1;
                }
                Err(error) if incoming.deliveries >= u64::from(self.max_deliveries) => {
                    let position = message
                        .info()
                        .ok()
                        .map(|info| format!("{}/{}", info.stream, info.stream_sequence));
                    let note = DeadLetterNote::new(
                        &error,
                        incoming.deliveries,
                        incoming.topic.as_str(),
                        position,
                    );
                    let destination = self.dead_letter.for_subject(&incoming.topic);
                    match self.dead_letter(&message, &note, &destination).await {
                        Ok(()) => {
                            message
                                .double_ack_with(async_nats::jetstream::AckKind::Term)
                                .await
                                .map_err(|error| unavailable(error.to_string()))?;
                            self.early_deliveries().forget(&place);
                            telemetry::dead_lettered("nats", &incoming, &note, &destination);
                            processed.dead_lettered += 1;
                        }
                        Err(failure) => {
                            telemetry::dead_letter_failed(
                                "nats",
                                incoming.id.as_deref(),
                                &note,
                                &destination,
                                &failure,
                            );
                            message
                                .ack_with(async_nats::jetstream::AckKind::Nak(Some(retry_after)))
                                .await
                                .map_err(|error| unavailable(error.to_string()))?;
                            processed.retried += 1;
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(
                        id = ?incoming.id,
                        deliveries = incoming.deliveries,
                        max_deliveries = self.max_deliveries,
                        %error,
                        "handler failed; the message will be redelivered after the delay"
                    );
                    message
                        .ack_with(async_nats::jetstream::AckKind::Nak(Some(retry_after)))
                        .await
                        .map_err(|error| unavailable(error.to_string()))?;
                    processed.retried += 1;
                }
            }
        }
        Ok(processed)
    }

    fn early_deliveries(&self) -> std::sync::MutexGuard<'_, super::EarlyDeliveries> {
        self.early
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Publishes the dead-letter copy of `message` to `destination` and waits for a
    /// stream's ack.
    async fn dead_letter(
        &self,
        message: &async_nats::jetstream::Message,
        note: &DeadLetterNote,
        destination: &str,
    ) -> std::result::Result<(), String> {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(original) = &message.headers {
            for (name, values) in original.iter() {
                let text: &str = name.as_ref();
                // Conditions for the original publish would refuse the copy; its id is
                // kept under another name (see DEAD_LETTER_MSG_ID_HEADER).
                let lower = text.to_ascii_lowercase();
                if lower.starts_with("nats-expected-") || lower == "nats-rollup" {
                    continue;
                }
                if lower == "nats-msg-id" {
                    for value in values {
                        headers.append(DEAD_LETTER_MSG_ID_HEADER, value.as_str());
                    }
                    continue;
                }
                for value in values {
                    headers.append(text, value.as_str());
                }
            }
        }
        for (name, value) in note.headers() {
            headers.insert(name, value.as_str());
        }
        // The copy's own id, the same for every copy of this stream message: a stream
        // with a duplicate window keeps one copy even if the consumer died between the
        // copy's ack and the original's termination.
        if let Some(position) = &note.position {
            headers.insert("Nats-Msg-Id", format!("dead-letter/{position}").as_str());
        }
        let ack = self
            .jetstream
            .publish_with_headers(destination.to_owned(), headers, message.payload.clone())
            .await
            .map_err(|error| error.to_string())?;
        ack.await.map(|_| ()).map_err(|error| error.to_string())
    }
}

fn incoming(message: &async_nats::jetstream::Message) -> Incoming {
    let mut headers = Vec::new();
    if let Some(map) = &message.headers {
        for (name, values) in map.iter() {
            for value in values {
                headers.push((name.to_string(), value.as_str().to_owned()));
            }
        }
    }
    let header = |name: &str| {
        headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.clone())
    };
    let info = message.info().ok();
    Incoming {
        // A message from elsewhere without a Nats-Msg-Id has no id: its place in the
        // stream is not one (a copy published again gets another place).
        id: header("Nats-Msg-Id"),
        producer: header(super::PRODUCER_HEADER),
        key: header("Turnstile-Key"),
        seq: header("Turnstile-Seq").and_then(|seq| seq.parse().ok()),
        topic: message.subject.to_string(),
        payload: message.payload.to_vec(),
        deliveries: info
            .as_ref()
            .map_or(1, |info| u64::try_from(info.delivered).unwrap_or(1)),
        headers,
    }
}
