//! With the `opentelemetry` feature, an outbox message carries the W3C `traceparent` of
//! the `tracing` span it was made in, so that a consumer's trace continues the
//! producer's.

use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use turnstile::outbox::Message;

fn traceparent(message: &Message) -> Option<String> {
    message
        .headers()
        .iter()
        .find(|(name, _)| name == "traceparent")
        .map(|(_, value)| value.clone())
}

#[test]
fn messages_carry_the_current_spans_traceparent() {
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!("create payment");
        let _entered = span.enter();
        let message = Message::new("payments.created", "acct-1", b"{}".to_vec()).unwrap();
        let context = span.context();
        let expected = context.span().span_context().clone();
        assert!(expected.is_valid());
        assert_eq!(
            traceparent(&message).expect("no traceparent"),
            format!(
                "00-{}-{}-{:02x}",
                expected.trace_id(),
                expected.span_id(),
                expected.trace_flags().to_u8()
            )
        );
    });
    // Outside any traced span there is nothing to carry.
    let message = Message::new("payments.created", "acct-1", b"{}".to_vec()).unwrap();
    assert_eq!(traceparent(&message), None);
}
