//! Whether a client's user may write the capture exchange, asked once per client connection:
//! it decides how that connection's own queues (exclusive and server-named, which only it can
//! declare) dead-letter.
//!
//! Such a queue is declared on the client's connection, so RabbitMQ checks the client's user's
//! permissions on every argument of it. A user with write permission on the capture exchange
//! (guest, or an application user granted it) gets the queue with the capture exchange and
//! tag, so the proxy dead-letters it like any other (policies apply, x-death as for every
//! proxied queue); any other user gets the queue with its own dead-letter arguments only, and
//! RabbitMQ dead-letters it natively (docs/semantics.md, "Permissions").
//!
//! The question is asked side-effect free on the proxy's check channel of the client's
//! connection ([`super::probe::CheckRequest::Write`]): `tx.select`, an empty `basic.publish` to
//! the capture exchange, `tx.rollback`. RabbitMQ 3.10 checks write permission when the publish
//! arrives, then looks the exchange up, and only then buffers the message in the transaction,
//! which the rollback discards. So tx.rollback-ok, or a 404 for a capture exchange that does
//! not exist yet, means permitted; a 403 means not. Anything else tells nothing: that declare
//! goes natively and the next one asks again. One round trip (plus the channel.open) per
//! connection; the answer is cached for its lifetime, as RabbitMQ caches permissions per
//! connection too.

use amq_protocol::types::ShortString;

use super::probe::{CheckAnswer, CheckRequest};

const ACCESS_REFUSED: u16 = 403;
const NOT_FOUND: u16 = 404;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum State {
    #[default]
    Unasked,
    Asking,
    Known(bool),
}

/// The cached answer of one client connection.
#[derive(Debug, Default)]
pub struct CaptureWrite {
    state: State,
}

impl CaptureWrite {
    /// `Some(permitted)` once the upstream answered.
    pub fn known(&self) -> Option<bool> {
        match self.state {
            State::Known(permitted) => Some(permitted),
            State::Unasked | State::Asking => None,
        }
    }

    /// The probe to send for the capture exchange `capture`; `None` when it was asked already
    /// (the answer is known or on its way).
    pub fn ask(&mut self, capture: &str) -> Option<CheckRequest> {
        if self.state != State::Unasked {
            return None;
        }
        let exchange = ShortString::try_new(capture.to_string()).ok()?;
        self.state = State::Asking;
        Some(CheckRequest::Write { exchange })
    }

    /// Whether a probe is on its way.
    pub fn asking(&self) -> bool {
        self.state == State::Asking
    }

    /// Reads the probe's answer: whether the user may write the capture exchange. Only a
    /// permission verdict is kept; after any other refusal this declare goes natively and the
    /// next one asks again.
    pub fn on_answer(&mut self, answer: &CheckAnswer) -> bool {
        let verdict = match answer {
            CheckAnswer::DeclareOk => Some(true),
            CheckAnswer::Refused { code, .. } if *code == NOT_FOUND => Some(true),
            CheckAnswer::Refused { code, .. } if *code == ACCESS_REFUSED => Some(false),
            CheckAnswer::Refused { .. } => None,
        };
        self.state = verdict.map_or(State::Unasked, State::Known);
        verdict.unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(code: u16) -> CheckAnswer {
        CheckAnswer::Refused {
            code,
            text: "X - text".into(),
        }
    }

    #[test]
    fn asked_once_and_the_answer_is_kept() {
        let mut write = CaptureWrite::default();
        assert_eq!(write.known(), None);
        assert_eq!(
            write.ask("dlx-proxy.capture"),
            Some(CheckRequest::Write {
                exchange: ShortString::from("dlx-proxy.capture")
            })
        );
        assert!(write.asking());
        assert_eq!(write.ask("dlx-proxy.capture"), None, "on its way");
        assert!(write.on_answer(&CheckAnswer::DeclareOk));
        assert_eq!(write.known(), Some(true));
        assert!(!write.asking());
        assert_eq!(write.ask("dlx-proxy.capture"), None, "known");
    }

    #[test]
    fn a_403_refuses_a_404_permits_and_anything_else_asks_again() {
        let mut write = CaptureWrite::default();
        write.ask("c");
        assert!(!write.on_answer(&refused(403)));
        assert_eq!(write.known(), Some(false));

        // The permission check comes before the exchange lookup.
        let mut write = CaptureWrite::default();
        write.ask("c");
        assert!(write.on_answer(&refused(404)));
        assert_eq!(write.known(), Some(true));

        for code in [406, 504, 541] {
            let mut write = CaptureWrite::default();
            write.ask("c");
            assert!(!write.on_answer(&refused(code)));
            assert_eq!(write.known(), None);
            assert!(write.ask("c").is_some(), "asked again");
        }
    }

    #[test]
    fn a_name_that_is_no_short_string_is_never_asked() {
        let mut write = CaptureWrite::default();
        assert_eq!(write.ask(&"c".repeat(256)), None);
        assert_eq!(write.known(), None);
        assert!(!write.asking());
    }
}
