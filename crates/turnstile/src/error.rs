//! The crate's one error type.

use std::error::Error as StdError;
use std::fmt;

/// What went wrong, in terms a caller can act on.
///
/// Match on [`Error::kind`] to decide what to do; the driver's own error, when
/// there is one, is kept as [`std::error::Error::source`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A lock name (or resource name) is empty, too long or contains a control character.
    InvalidName,
    /// An option is out of range: a zero TTL, a drift allowance larger than the TTL, and so on.
    InvalidOptions,
    /// A store URL could not be parsed, or names a scheme this build does not know.
    InvalidUrl,
    /// The store URL is valid but support for it was not compiled in (a cargo feature is off).
    UnsupportedStore,
    /// The store could not be reached, did not answer in time, or refused for now what
    /// it can do later: a row lock not granted in time, a deadlock or serialization
    /// failure, a read-only replica during a failover, memory full, a server loading or
    /// shutting down (Redis `BUSY`, `LOADING`, `READONLY`, `OOM`, `MASTERDOWN`;
    /// PostgreSQL 55P03, 40001, 40P01, 25006, 57014; MySQL 1205, 1213, 1290). Worth
    /// retrying; Turnstile itself retries it where giving up would lose work (storing an
    /// idempotent request's outcome).
    StoreUnavailable,
    /// The store refused this client for good: wrong credentials, an unknown database,
    /// a missing permission. Retrying does not help; the configuration must change.
    Configuration,
    /// The store answered with an error or with data Turnstile did not expect.
    Store,
    /// `acquire` waited as long as it was allowed to and the lock was still held.
    AcquireTimeout,
    /// The lock is held by someone else and this call does not wait (a
    /// transaction-scoped lock meeting a lease, for example).
    Held,
    /// An optimistic update kept meeting concurrent changes until its retries ran out.
    Conflict,
    /// An earlier request with the same idempotency key is still being worked on.
    InProgress,
    /// An idempotency key was used before for a request with another fingerprint.
    KeyMismatch,
    /// The lock was lost while the protected work was running (see [`Error::loss_reason`]).
    LockLost,
    /// A fencing token was rejected or cannot be represented by the protected store.
    Fencing,
    /// The request with this idempotency key ran, but its outcome could not be stored
    /// (too large for the store): repeats are told so and do not run again; use a new
    /// key for a new request.
    OutcomeNotStored,
    /// (Consumers) A message came before an earlier message of its ordering key was
    /// handled ([`Delivery::Early`](crate::idempotency::inbox::Delivery::Early)): a
    /// handler returns it (see [`Error::out_of_order`]) so that the consumer sends the
    /// message back for later without counting the delivery toward its
    /// `max_deliveries`: waiting for its turn is not failing, and a message that only
    /// waited is never dead-lettered.
    OutOfOrder,
}

impl ErrorKind {
    fn describe(self) -> &'static str {
        match self {
            ErrorKind::InvalidName => "invalid name",
            ErrorKind::InvalidOptions => "invalid options",
            ErrorKind::InvalidUrl => "invalid store URL",
            ErrorKind::UnsupportedStore => "unsupported store",
            ErrorKind::StoreUnavailable => "store unavailable",
            ErrorKind::Configuration => "store configuration error",
            ErrorKind::Store => "store error",
            ErrorKind::AcquireTimeout => "lock not acquired in time",
            ErrorKind::Held => "lock held",
            ErrorKind::Conflict => "conflicting update",
            ErrorKind::InProgress => "request in progress",
            ErrorKind::KeyMismatch => "idempotency key reused",
            ErrorKind::LockLost => "lock lost",
            ErrorKind::Fencing => "fencing error",
            ErrorKind::OutcomeNotStored => "outcome not stored",
            ErrorKind::OutOfOrder => "message out of order",
        }
    }
}

/// The error type of every fallible Turnstile operation.
pub struct Error {
    kind: ErrorKind,
    message: String,
    loss: Option<LossReason>,
    retry_after: Option<std::time::Duration>,
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
    /// Whether `Display` repeats the source: not when the message already says all it
    /// has to say (a server's own sentence, quoted).
    show_source: bool,
}

/// `Result` with Turnstile's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Makes an error of `kind` with a message that says what to do about it.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            loss: None,
            retry_after: None,
            source: None,
            show_source: true,
        }
    }

    /// Attaches the underlying error (a driver's, an I/O error) as the source.
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// Attaches the source without repeating it in `Display` (the message already quotes
    /// what matters of it).
    #[allow(dead_code)]
    pub(crate) fn with_quiet_source(
        mut self,
        source: impl StdError + Send + Sync + 'static,
    ) -> Self {
        self.source = Some(Box::new(source));
        self.show_source = false;
        self
    }

    /// What a consumer's handler returns for a message of `key` numbered `seq` that
    /// came while its key waits for message `expected`
    /// ([`Delivery::Early`](crate::idempotency::inbox::Delivery::Early)): the consumer
    /// sends it back for later and does not count the delivery as a failure
    /// ([`ErrorKind::OutOfOrder`]).
    pub fn out_of_order(key: &str, seq: u64, expected: u64) -> Self {
        Error::new(
            ErrorKind::OutOfOrder,
            format!(
                "message {seq} of key {key:?} came before message {expected}: it waits for its \
                 turn (if message {expected} was dead-lettered, replay its copy or skip it with \
                 Inbox::skip)"
            ),
        )
    }

    pub(crate) fn lost(reason: LossReason) -> Self {
        let mut error = Error::new(ErrorKind::LockLost, reason.to_string());
        error.loss = Some(reason);
        error
    }

    /// When trying again makes sense, where the store said: for
    /// [`ErrorKind::InProgress`], how long the request in flight's lease has left.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        self.retry_after
    }

    pub(crate) fn with_retry_after(mut self, after: Option<std::time::Duration>) -> Self {
        self.retry_after = after;
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// For [`ErrorKind::LockLost`], why ownership could no longer be assumed.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.loss
    }

    /// Whether trying the same call again later can succeed without any change by the caller:
    /// the store was unreachable, or the lock was busy.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::StoreUnavailable
                | ErrorKind::AcquireTimeout
                | ErrorKind::Held
                | ErrorKind::Conflict
                | ErrorKind::InProgress
                | ErrorKind::OutOfOrder
        )
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.describe(), self.message)?;
        if let Some(source) = self.source.as_ref().filter(|_| self.show_source) {
            write!(f, " ({source})")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("loss", &self.loss)
            .field("source", &self.source)
            .finish()
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn StdError + 'static))
    }
}

/// Why a held lock can no longer be assumed to be held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LossReason {
    /// A renewal found the lock held by another acquisition.
    TakenOver,
    /// A renewal found no lock at all: the lease had expired in the store or an
    /// operator broke it.
    Expired,
    /// Renewals kept failing (store unreachable or too slow) until the local validity
    /// deadline passed.
    RenewalFailed,
    /// The watchdog is off and the lease's local validity deadline passed.
    LeaseElapsed,
    /// The cap on total hold time was reached.
    MaxHoldReached,
}

impl LossReason {
    /// The reason as a metric label: `taken_over`, `expired`, `renewal_failed`,
    /// `lease_elapsed`, `max_hold_reached`.
    pub(crate) fn as_label(self) -> &'static str {
        match self {
            LossReason::TakenOver => "taken_over",
            LossReason::Expired => "expired",
            LossReason::RenewalFailed => "renewal_failed",
            LossReason::LeaseElapsed => "lease_elapsed",
            LossReason::MaxHoldReached => "max_hold_reached",
        }
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossReason::TakenOver => "another owner holds the lock",
            LossReason::Expired => "the lease expired in the store (or was broken)",
            LossReason::RenewalFailed => "renewals failed until the local validity deadline passed",
            LossReason::LeaseElapsed => "the lease ran out (watchdog off)",
            LossReason::MaxHoldReached => "the cap on hold time was reached",
        })
    }
}
