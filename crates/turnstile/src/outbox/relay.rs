//! The relay: leases keys, publishes their messages in order, settles.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Backoff, Failure, LeasedKey, Message, OutboxStore, Settled, Settlement, telemetry};
use crate::error::{Error, ErrorKind, Result};
use crate::future::BoxFuture;

/// How often a running relay sets the pending and lag gauges.
const STATUS_EVERY: Duration = Duration::from_secs(5);

/// Where a relay publishes: a broker client. Implementations must hand the message id
/// to the broker's own duplicate detection where it has one, and answer only once the
/// broker has the message (an ack, a publisher confirm).
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `message` (the `seq`-th of its key) and waits for the broker to have it.
    fn publish<'a>(
        &'a self,
        message: &'a Message,
        seq: u64,
    ) -> BoxFuture<'a, std::result::Result<(), Failure>>;

    /// Checks, once per topic before its first publish, that the broker can take
    /// messages for `topic` and that its duplicate detection covers a message
    /// published again up to `redelivery` after its first publish. A refusal stops the
    /// keys whose next message is on `topic` (an [`ErrorKind::Configuration`] error
    /// counts toward parking them, any other only backs them off); the topic is
    /// checked again in the next round.
    fn check<'a>(&'a self, topic: &'a str, redelivery: Duration) -> BoxFuture<'a, Result<()>>;

    /// The broker, for messages.
    fn describe(&self) -> String;

    /// How long after a publish began the broker may still take the message, even if
    /// the call was dropped or timed out (a client that queues and retries on its own,
    /// as librdkafka does); `None` for clients that send once and wait for the ack.
    /// The relay starts no publish so late that it could land after its lease.
    fn longest_publish(&self) -> Option<Duration> {
        None
    }

    /// Whether the broker can be reached at all (a connection and a round trip),
    /// asked when every key of a batch failed. Only a broker that cannot be reached
    /// pauses the whole relay (longer each time, up to the longest backoff) instead of
    /// leasing the next keys only to fail them too; any other failure (one topic, one
    /// partition without a leader) backs off only the keys that had it, and the others
    /// flow. Answer within a couple of seconds. The default, `true`, never pauses the
    /// relay: each failing key still backs off on its own.
    fn reachable(&self) -> BoxFuture<'_, bool> {
        Box::pin(async { true })
    }
}

/// How long a publisher's [`Publisher::reachable`] waits for the broker's answer.
#[cfg_attr(
    not(any(
        feature = "nats",
        feature = "rabbitmq",
        feature = "kafka",
        feature = "redis"
    )),
    allow(dead_code)
)]
pub(crate) const REACHABLE_WITHIN: Duration = Duration::from_secs(2);

/// The default byte budget of one round: without one, 64 keys × 128 messages × 16 MiB
/// could be held at once.
const DEFAULT_ROUND_BYTES: u64 = 64 * 1024 * 1024;

/// How a relay works.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    max_keys: u32,
    per_key: u32,
    max_round_bytes: u64,
    lease: Duration,
    max_attempts: u32,
    backoff: Backoff,
    idle_poll: (Duration, Duration),
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            max_keys: 64,
            // Each round of a key costs the store a claim and a settlement: with 32,
            // four relays draining 64 keys ran at half the bare relay's rate, with 128
            // at 0.83x to 0.90x (benchmarks/history.md, 2026-12-04 (evening)). A key
            // waiting for a slot waits at most one round of another key.
            per_key: 128,
            max_round_bytes: DEFAULT_ROUND_BYTES,
            lease: Duration::from_secs(30),
            max_attempts: 5,
            backoff: Backoff::default(),
            idle_poll: (Duration::from_millis(5), Duration::from_millis(500)),
        }
    }
}

impl RelayOptions {
    /// Defaults: 64 keys a round, up to 128 messages a key and 64 MiB in all, a 30 s lease, park after 5
    /// permanent failures, backoff 100 ms to 60 s, idle polls from 5 ms to 500 ms.
    pub fn new() -> Self {
        RelayOptions::default()
    }

    /// How many keys one round leases (and publishes at once).
    pub fn max_keys(mut self, keys: u32) -> Self {
        self.max_keys = keys.max(1);
        self
    }

    /// How many bytes of messages (payloads and headers) one round holds at most
    /// (default 64 MiB); a round's first message is read whatever its size. Keys
    /// past the budget publish fewer messages this round and are due again at once.
    pub fn max_round_bytes(mut self, bytes: u64) -> Self {
        self.max_round_bytes = bytes;
        self
    }

    /// How many messages of one key a round publishes.
    pub fn per_key(mut self, messages: u32) -> Self {
        self.per_key = messages.max(1);
        self
    }

    /// How long a round's lease on its keys lasts; the relay stops publishing a key
    /// when four fifths of it have passed.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(100));
        self
    }

    /// Permanent failures of a key's head message before the key is parked.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The backoff of a failing key.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The idle poll's first and longest interval (a commit in this process wakes the
    /// relay at once; the poll finds other processes' commits). A relay that still has
    /// keys in flight polls at the longest interval: it leases again as soon as one of
    /// them is done.
    pub fn idle_poll(mut self, min: Duration, max: Duration) -> Self {
        self.idle_poll = (min.max(Duration::from_millis(1)), max.max(min));
        self
    }

    /// The longest time after its first publish that a message may be published again:
    /// a relay that dies mid-publish leaves the key leased for the lease, and a failed
    /// key waits at most the longest backoff.
    pub fn redelivery_window(&self) -> Duration {
        self.lease + self.backoff.max
    }
}

/// What one round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Round {
    /// Keys leased.
    pub keys: usize,
    /// Messages published.
    pub published: usize,
    /// Publishes that failed.
    pub failed: usize,
    /// Keys parked.
    pub parked: usize,
    /// Settlements refused (a lease that ran out).
    pub fenced: usize,
}

/// Publishes an outbox's messages; several may run at once, on one store, with no
/// leader.
#[derive(Clone)]
pub struct Relay {
    store: Arc<dyn OutboxStore>,
    publisher: Arc<dyn Publisher>,
    options: RelayOptions,
    checked: Arc<Mutex<HashSet<String>>>,
}

impl fmt::Debug for Relay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("store", &self.store.describe())
            .field("publisher", &self.publisher.describe())
            .field("options", &self.options)
            .finish()
    }
}

impl Relay {
    /// A relay from `store` to `publisher`, with default options.
    pub fn new(store: impl OutboxStore, publisher: impl Publisher) -> Self {
        Relay::from_arcs(Arc::new(store), Arc::new(publisher))
    }

    /// A relay over shared store and publisher.
    pub fn from_arcs(store: Arc<dyn OutboxStore>, publisher: Arc<dyn Publisher>) -> Self {
        Relay {
            store,
            publisher,
            options: RelayOptions::default(),
            checked: Arc::default(),
        }
    }

    /// The same relay with other options.
    pub fn with_options(mut self, options: RelayOptions) -> Self {
        self.options = options;
        self
    }

    /// Leases up to `keys` due keys and starts publishing each (keys at once, each
    /// key's messages in order, a key stopping at its first failure or when its lease
    /// is nearly over) in `tasks`, tagged with `batch`. Returns how many it leased.
    async fn start_keys(
        &self,
        keys: u32,
        batch: u64,
        tasks: &mut JoinSet<KeyDone>,
    ) -> Result<usize> {
        // Every publish must land inside the lease: past it, another relay may have
        // the key and publish its later messages. So a publish starts only while a
        // fifth of the lease is left, and not so late that a client that keeps sending
        // on its own (`longest_publish`) could still deliver after the lease; each
        // publish is also cut off at the lease's end, less a margin.
        let lease = self.options.lease;
        let margin = lease / 10;
        let longest = self.publisher.longest_publish().unwrap_or_default();
        let Some(start_within) = lease
            .checked_sub(longest + margin)
            .filter(|left| !left.is_zero())
            .map(|left| left.min(lease * 4 / 5))
        else {
            return Err(Error::new(
                ErrorKind::Configuration,
                format!(
                    "{} may deliver a message up to {longest:?} after its publish began, which \
                     does not fit in the relay's lease of {lease:?} with a tenth to spare: \
                     make the lease longer",
                    self.publisher.describe()
                ),
            ));
        };
        let sent = Instant::now();
        let leased = self
            .store
            .claim_within(
                keys,
                self.options.per_key,
                self.options.max_round_bytes,
                self.options.lease,
            )
            .await?;
        let count = leased.len();
        if leased.is_empty() {
            return Ok(0);
        }
        // A topic the broker cannot serve (no stream takes it, a duplicate window too
        // short to keep the promise) stops only the keys that reach it, with the
        // reason: those messages are not published, the keys back off and park after
        // `max_attempts` (visible in `outbox status`), and every other key flows.
        let mut refused: HashMap<String, Failure> = HashMap::new();
        for topic in leased
            .iter()
            .flat_map(|key| key.messages.iter().map(|stored| stored.message.topic()))
            .collect::<HashSet<_>>()
        {
            if let Err(error) = self.check_topic(topic).await {
                telemetry::topic_refused(topic, &error);
                refused.insert(
                    topic.to_owned(),
                    Failure {
                        permanent: error.kind() == ErrorKind::Configuration,
                        reason: error.to_string(),
                    },
                );
            }
        }
        let refused = Arc::new(refused);
        let deadline = PublishDeadline {
            last_start: sent + start_within,
            cut_off: sent + lease - margin,
        };
        let lease_end = sent + lease;
        for key in leased {
            let publisher = Arc::clone(&self.publisher);
            let refused = Arc::clone(&refused);
            let checked = Arc::clone(&self.checked);
            tasks.spawn(async move {
                let (settlement, published) =
                    publish_key(publisher, key, deadline, refused, checked).await;
                KeyDone {
                    settlement,
                    published,
                    lease_end,
                    batch,
                }
            });
        }
        Ok(count)
    }

    /// Records what became of finished keys (one settlement, keys in one order, as
    /// stores lock them), adding to `round`.
    async fn settle_finished(&self, mut finished: Vec<KeyDone>, round: &mut Round) -> Result<()> {
        // Keys in one order in every settlement (stores lock them so).
        finished.sort_by(|a, b| a.settlement.key.cmp(&b.settlement.key));
        let lease_end = finished
            .iter()
            .map(|done| done.lease_end)
            .min()
            .unwrap_or_else(Instant::now);
        let settlements: Vec<Settlement> = finished
            .into_iter()
            .map(|done| {
                round.published += done.published;
                round.failed += usize::from(done.settlement.failure.is_some());
                done.settlement
            })
            .collect();
        let answers = self.settle(&settlements, lease_end).await?;
        for (settlement, answer) in settlements.iter().zip(answers) {
            match answer {
                Settled::Done => {}
                Settled::Parked => {
                    round.parked += 1;
                    telemetry::parked(&settlement.key);
                }
                Settled::Fenced => {
                    round.fenced += 1;
                    telemetry::fenced(&settlement.key);
                }
            }
        }
        Ok(())
    }

    /// One round: lease due keys, publish their messages (keys at once, each key's in
    /// order, a key stopping at its first failure or when its lease is nearly over),
    /// settle them all. A topic the broker cannot serve as promised stops the keys that
    /// reach it (they park with the reason after `max_attempts`), not the relay; a
    /// lease too short for the publisher is an error ([`ErrorKind::Configuration`]).
    /// [`run`](Self::run) does not wait for a round's slowest key; this does.
    pub async fn run_once(&self) -> Result<Round> {
        let mut tasks = JoinSet::new();
        let keys = self
            .start_keys(self.options.max_keys, 0, &mut tasks)
            .await?;
        let mut round = Round {
            keys,
            ..Round::default()
        };
        let mut finished = Vec::with_capacity(keys);
        while let Some(done) = tasks.join_next().await {
            finished.push(done.map_err(task_failed)?);
        }
        if !finished.is_empty() {
            self.settle_finished(finished, &mut round).await?;
        }
        Ok(round)
    }

    /// Records a round's publishes, retrying a store that fails (a deadlock with an
    /// application's transaction, a connection lost) until the round's lease ends:
    /// a settlement given up on publishes the round again, and a copy the broker keeps
    /// past its duplicate window reaches consumers twice. After the lease the store
    /// would refuse the settlement anyway (another relay may hold the keys).
    ///
    /// The keys are settled together in one transaction; if that fails (one key's row
    /// locked by an application's long transaction, say), each key is settled on its
    /// own and only the ones that fail are tried again: one locked row delays only its
    /// key, and never makes the others publish their round again.
    async fn settle(&self, settlements: &[Settlement], lease_end: Instant) -> Result<Vec<Settled>> {
        let (max_attempts, backoff) = (self.options.max_attempts, self.options.backoff);
        let error = match self.store.settle(settlements, max_attempts, backoff).await {
            Ok(answers) => return Ok(answers),
            Err(error) => error,
        };
        telemetry::settle_retried(&error);
        let mut answers: Vec<Option<Settled>> = vec![None; settlements.len()];
        let mut last = error;
        let mut pause = Duration::from_millis(10);
        loop {
            for (settlement, answer) in settlements.iter().zip(answers.iter_mut()) {
                if answer.is_some() {
                    continue;
                }
                match self
                    .store
                    .settle(std::slice::from_ref(settlement), max_attempts, backoff)
                    .await
                {
                    Ok(mut one) => *answer = one.pop(),
                    Err(error) => {
                        telemetry::settle_retried(&error);
                        last = error;
                    }
                }
            }
            if answers.iter().all(Option::is_some) {
                return Ok(answers.into_iter().flatten().collect());
            }
            if Instant::now() + pause >= lease_end {
                let left = answers.iter().filter(|answer| answer.is_none()).count();
                return Err(Error::new(
                    last.kind(),
                    format!(
                        "{left} of {} keys could not be settled before their lease ended",
                        settlements.len()
                    ),
                )
                .with_source(last));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }

    async fn check_topic(&self, topic: &str) -> Result<()> {
        if self
            .checked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(topic)
        {
            return Ok(());
        }
        self.publisher
            .check(topic, self.options.redelivery_window())
            .await?;
        self.checked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(topic.to_owned());
        Ok(())
    }

    /// Runs until `shutdown` is cancelled; the keys in flight are finished and settled
    /// first, so nothing is left half-marked. Keys are leased while fewer than
    /// `max_keys` are being published, and each is settled as soon as it is done, with
    /// whatever else finished meanwhile: a slow key (a Kafka partition without a
    /// leader) holds only itself, not the next messages of every other key. Idle, it
    /// waits for a commit in this process or polls with a backoff; a store or broker
    /// that fails makes it wait and try again. Returns early only for a configuration
    /// the broker cannot serve.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let (poll_min, poll_max) = self.options.idle_poll;
        let max_keys = self.options.max_keys as usize;
        let mut idle = poll_min;
        let mut reported: Option<Instant> = None;
        let mut tasks: JoinSet<KeyDone> = JoinSet::new();
        // Per batch of keys leased together: how many are still in flight, and whether
        // any of them published. When every key of a batch fails and the broker cannot
        // be reached (it is down, not one topic or one partition), the whole relay
        // pauses, longer each time up to the longest backoff, instead of leasing the
        // next keys at once only to fail them too. Otherwise the failing keys back off
        // on their own and every other key flows.
        let mut batches: HashMap<u64, (usize, bool)> = HashMap::new();
        let mut next_batch = 0_u64;
        let mut outage: Option<Duration> = None;
        let mut paused_until: Option<Instant> = None;
        loop {
            if shutdown.is_cancelled() && tasks.is_empty() {
                break;
            }
            // The lag gauges, now and then (one read of the store).
            if reported.is_none_or(|at| at.elapsed() >= STATUS_EVERY) {
                reported = Some(Instant::now());
                if let Ok(status) = self.store.status(1000).await {
                    telemetry::status(&status);
                }
                // Kept messages past their retention, a bounded batch at a time.
                if let Err(error) = self.store.sweep(1000).await {
                    tracing::warn!(%error, "cannot sweep delivered outbox messages");
                }
            }
            let paused = paused_until.is_some_and(|until| Instant::now() < until);
            if !shutdown.is_cancelled() && !paused && tasks.len() < max_keys {
                let room = u32::try_from(max_keys - tasks.len()).unwrap_or(u32::MAX);
                match self.start_keys(room, next_batch, &mut tasks).await {
                    Ok(0) => {}
                    Ok(count) => {
                        batches.insert(next_batch, (count, false));
                        next_batch += 1;
                        idle = poll_min;
                    }
                    Err(error) if error.kind() == ErrorKind::Configuration => {
                        // Finish what is in flight before giving up.
                        self.drain(&mut tasks).await;
                        self.store.relay_stopped().await;
                        return Err(error);
                    }
                    Err(error) => {
                        tracing::warn!(%error, "outbox relay could not lease keys; retrying");
                        idle = poll_max;
                    }
                }
            }
            if tasks.is_empty() {
                let wake = paused_until.filter(|_| paused);
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = self.store.committed(idle) => {}
                    () = async { if let Some(at) = wake { tokio::time::sleep_until(at).await } else { std::future::pending().await } } => {}
                }
                idle = (idle * 2).min(poll_max);
                continue;
            }
            // With room for more keys, a commit is worth waking for; otherwise only a
            // key finishing is. The poll (for commits that send no wake-up) is at its
            // longest here: this relay leases again as soon as one of its keys is
            // done, and short polls while it publishes were empty claims that cost
            // the store a statement each, several relays' worth while a backlog drains.
            let room = tasks.len() < max_keys && !paused && !shutdown.is_cancelled();
            let first = tokio::select! {
                done = tasks.join_next() => done,
                () = self.store.committed(poll_max), if room => continue,
                () = shutdown.cancelled(), if !shutdown.is_cancelled() => continue,
            };
            let mut finished = Vec::new();
            for done in first
                .into_iter()
                .chain(std::iter::from_fn(|| tasks.try_join_next()))
            {
                match done {
                    Ok(done) => finished.push(done),
                    Err(error) => tracing::error!(%error, "an outbox publishing task failed"),
                }
            }
            if finished.is_empty() {
                continue;
            }
            let mut settled = Round::default();
            let mut batch_outcomes = Vec::new();
            for done in &finished {
                if let Some((left, published)) = batches.get_mut(&done.batch) {
                    *left -= 1;
                    *published |= done.published > 0 || done.settlement.failure.is_none();
                    if *left == 0 {
                        batch_outcomes.push(*published);
                        batches.remove(&done.batch);
                    }
                }
            }
            if let Err(error) = self.settle_finished(finished, &mut settled).await {
                tracing::warn!(%error, "outbox relay could not record a settlement; its keys are published again after their lease");
            }
            // The broker is asked once per pass, however many batches ended in it, so
            // that an outage does not hold the next keys' settlements behind one probe
            // per batch, and the pause doubles once per pass.
            if !batch_outcomes.is_empty() {
                if batch_outcomes.contains(&true) || self.publisher.reachable().await {
                    outage = None;
                    paused_until = None;
                } else {
                    let pause = outage.map_or(self.options.backoff.base, |last| {
                        (last * 2).min(self.options.backoff.max)
                    });
                    outage = Some(pause);
                    paused_until = Some(Instant::now() + pause);
                    telemetry::relay_paused(pause, settled.failed);
                }
            }
        }
        self.store.relay_stopped().await;
        Ok(())
    }

    /// Waits for the keys in flight and settles them.
    async fn drain(&self, tasks: &mut JoinSet<KeyDone>) {
        let mut finished = Vec::new();
        while let Some(done) = tasks.join_next().await {
            if let Ok(done) = done {
                finished.push(done);
            }
        }
        if !finished.is_empty()
            && let Err(error) = self.settle_finished(finished, &mut Round::default()).await
        {
            tracing::warn!(%error, "outbox relay could not record a settlement");
        }
    }
}

/// A key whose publishing ended: how it went, and the lease it had.
struct KeyDone {
    settlement: Settlement,
    published: usize,
    lease_end: Instant,
    /// The keys leased together with it.
    batch: u64,
}

fn task_failed(error: tokio::task::JoinError) -> Error {
    Error::new(
        ErrorKind::Store,
        format!("a publishing task failed: {error}"),
    )
}

/// Publishes one key's messages in order, stopping at the first failure or the
/// deadline; says how far it got.
/// When a round's publishes must start by, and finish by.
#[derive(Clone, Copy)]
struct PublishDeadline {
    last_start: Instant,
    cut_off: Instant,
}

async fn publish_key(
    publisher: Arc<dyn Publisher>,
    key: LeasedKey,
    deadline: PublishDeadline,
    refused: Arc<HashMap<String, Failure>>,
    checked: Arc<Mutex<HashSet<String>>>,
) -> (Settlement, usize) {
    let mut settlement = Settlement {
        key: key.key,
        token: key.token,
        delivered_through: 0,
        failure: None,
    };
    // A missing message is never stepped over: publishing past it would settle it as
    // delivered. Enqueue is atomic on every store, so a gap means a lost or deleted
    // row (or a writer outside the store's rules): the messages before it go out, and
    // the gap counts as a permanent failure, which parks the key if it does not fill.
    let in_order = key
        .messages
        .iter()
        .zip(key.acked + 1..)
        .take_while(|(stored, expected)| stored.seq == *expected)
        .count();
    let gap = (in_order < key.messages.len() || (key.messages.is_empty() && !key.over_budget))
        .then(|| {
            let expected = key.acked + 1 + in_order as u64;
            let found = key.messages.get(in_order).map(|stored| stored.seq);
            telemetry::gap(&settlement.key, expected, found);
            gap_failure(expected, found)
        });
    let mut published = 0;
    for stored in &key.messages[..in_order] {
        if Instant::now() >= deadline.last_start {
            return (settlement, published);
        }
        if let Some(failure) = refused.get(stored.message.topic()) {
            telemetry::failed(&stored.message, stored.seq, failure);
            settlement.failure = Some(failure.clone());
            return (settlement, published);
        }
        let started = Instant::now();
        let publish = publisher.publish(&stored.message, stored.seq);
        let answer = tokio::time::timeout_at(deadline.cut_off, publish)
            .await
            .unwrap_or_else(|_| {
                Err(Failure {
                    permanent: false,
                    reason: "the broker did not confirm the publish before the relay's lease \
                             was nearly over"
                        .to_owned(),
                })
            });
        match answer {
            Ok(()) => {
                telemetry::published(&stored.message, stored.seq, started.elapsed(), stored.age);
                settlement.delivered_through = stored.seq;
                published += 1;
            }
            Err(failure) => {
                telemetry::failed(&stored.message, stored.seq, &failure);
                // The topic is checked again before its next publish: a stream deleted
                // since it was checked then parks its keys with that reason, instead of
                // failing them as "transient" for ever.
                checked
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .remove(stored.message.topic());
                settlement.failure = Some(failure);
                return (settlement, published);
            }
        }
    }
    settlement.failure = gap;
    (settlement, published)
}

/// The failure a gap is settled with: permanent, so that a gap that does not fill
/// parks its key after the relay's attempts, with this reason in `outbox status`.
fn gap_failure(expected: u64, found: Option<u64>) -> Failure {
    let found = found.map_or_else(|| "none".to_owned(), |seq| seq.to_string());
    Failure {
        permanent: true,
        reason: format!(
            "sequence gap: message {expected} is missing (the next stored is {found}); \
             `turnstile outbox skip KEY {expected}` moves past it"
        ),
    }
}
