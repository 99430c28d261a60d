//! The client side of `dlx-proxy policy set|clear|list`: a running instance's runtime policies
//! edited and listed through its admin API, with the names and output of `rabbitmqctl
//! set_policy` / `clear_policy` / `list_policies`.
//!
//! [`AdminClient`] sends the requests (over [`crate::admin::request_with_token`]); the pure
//! pieces, [`set_body`] (the `PUT` body from the command's arguments) and [`table`] (what
//! `list` prints), are tested directly. `src/main.rs` only parses the arguments.

use crate::admin::{self, PolicyView};
use crate::secret::Secret;
use std::time::Duration;

/// The column titles of `list`, in `rabbitmqctl list_policies` order.
pub const COLUMNS: [&str; 6] = [
    "vhost",
    "name",
    "pattern",
    "apply-to",
    "definition",
    "priority",
];

/// A running instance's admin API.
pub struct AdminClient {
    /// `host:port` of `listen.admin`.
    pub address: String,
    /// The admin token, sent on writes and on reads of message contents.
    pub token: Option<Secret<String>>,
    pub timeout: Duration,
}

impl AdminClient {
    /// `PUT /api/policies/{vhost}/{name}` with `body` (see [`set_body`]).
    pub fn set(&self, vhost: &str, name: &str, body: &str) -> Result<(), String> {
        self.call("PUT", &policy_path(vhost, name), Some(body))
            .map(drop)
    }

    /// `DELETE /api/policies/{vhost}/{name}`; an error if there is no such policy.
    pub fn clear(&self, vhost: &str, name: &str) -> Result<(), String> {
        self.call("DELETE", &policy_path(vhost, name), None)
            .map(drop)
    }

    /// The policies of `vhost` (`GET /api/policies`, filtered), in the server's order.
    pub fn list(&self, vhost: &str) -> Result<Vec<PolicyView>, String> {
        let text = self.call("GET", "/api/policies", None)?;
        let policies: Vec<PolicyView> = serde_json::from_str(&text)
            .map_err(|e| format!("GET /api/policies: unexpected answer: {e}"))?;
        Ok(policies.into_iter().filter(|p| p.vhost == vhost).collect())
    }

    /// One request; the body of a 2xx answer, else an error with the status and the
    /// server's explanation.
    pub fn call(&self, method: &str, path: &str, body: Option<&str>) -> Result<String, String> {
        let url = format!("http://{}{path}", self.address);
        let (status, text) = admin::request_with_token(
            &self.address,
            method,
            path,
            body,
            self.token.as_ref(),
            self.timeout,
        )
        .map_err(|e| format!("{method} {url}: {e}"))?;
        if (200..300).contains(&status) {
            Ok(text)
        } else {
            Err(format!("{method} {url}: HTTP {status}: {}", text.trim()))
        }
    }
}

fn policy_path(vhost: &str, name: &str) -> String {
    format!(
        "/api/policies/{}/{}",
        admin::encode_path_segment(vhost),
        admin::encode_path_segment(name)
    )
}

/// The `PUT` body for `set NAME PATTERN DEFINITION`; `Err` says what is wrong with
/// DEFINITION (the server checks the keys and values themselves).
pub fn set_body(
    pattern: &str,
    definition: &str,
    priority: i32,
    apply_to: &str,
) -> Result<String, String> {
    let definition: serde_json::Value = serde_json::from_str(definition)
        .map_err(|e| format!("DEFINITION is not valid JSON: {e}"))?;
    if !definition.is_object() {
        return Err(format!(
            "DEFINITION must be a JSON object such as '{{\"dead-letter-exchange\": \"dlx\"}}', \
             not {definition}"
        ));
    }
    let body = serde_json::json!({
        "pattern": pattern,
        "definition": definition,
        "priority": priority,
        "apply-to": apply_to,
    });
    Ok(body.to_string())
}

/// `policies` as `rabbitmqctl list_policies` prints them: one line per policy, tab-separated
/// columns ([`COLUMNS`]), the definition as compact JSON; a title line first if `headers`.
pub fn table(policies: &[PolicyView], headers: bool) -> String {
    let mut out = String::new();
    if headers {
        out.push_str(&COLUMNS.join("\t"));
        out.push('\n');
    }
    for policy in policies {
        let definition = serde_json::to_string(&policy.definition).unwrap_or_default();
        let cells = [
            cell(&policy.vhost),
            cell(&policy.name),
            cell(&policy.pattern),
            cell(&policy.apply_to),
            definition,
            policy.priority.to_string(),
        ];
        out.push_str(&cells.join("\t"));
        out.push('\n');
    }
    out
}

/// A text cell with tabs and line breaks escaped, so each policy stays on one line
/// (backslashes are left alone: a pattern reads as the regex it is).
fn cell(text: &str) -> String {
    text.replace('\t', "\\t")
        .replace('\n', "\\n")
        .replace('\r', "\\r")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_carries_every_argument() {
        let body = set_body("^q$", r#"{"message-ttl": 5}"#, -3, "exchanges").unwrap();
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"pattern": "^q$", "definition": {"message-ttl": 5},
                               "priority": -3, "apply-to": "exchanges"})
        );
    }

    #[test]
    fn a_bad_definition_says_what_is_wrong() {
        let error = set_body(".*", "{oops", 0, "queues").unwrap_err();
        assert!(
            error.starts_with("DEFINITION is not valid JSON: key must be a string"),
            "{error}"
        );
        let error = set_body(".*", "[1]", 0, "queues").unwrap_err();
        assert!(
            error.starts_with("DEFINITION must be a JSON object") && error.ends_with("not [1]"),
            "{error}"
        );
    }

    fn view(name: &str, pattern: &str) -> PolicyView {
        PolicyView {
            vhost: "/".into(),
            name: name.into(),
            pattern: pattern.into(),
            apply_to: "queues".into(),
            priority: 7,
            definition: [
                ("message-ttl".to_string(), serde_json::json!(100)),
                ("dead-letter-exchange".to_string(), serde_json::json!("dlx")),
            ]
            .into_iter()
            .collect(),
        }
    }

    #[test]
    fn the_table_has_rabbitmqctls_columns() {
        let policies = [view("a", "^a$"), view("b", "x\ty")];
        assert_eq!(
            table(&policies, true),
            "vhost\tname\tpattern\tapply-to\tdefinition\tpriority\n\
             /\ta\t^a$\tqueues\t{\"dead-letter-exchange\":\"dlx\",\"message-ttl\":100}\t7\n\
             /\tb\tx\\ty\tqueues\t{\"dead-letter-exchange\":\"dlx\",\"message-ttl\":100}\t7\n"
        );
        assert_eq!(table(&policies[..1], false).lines().count(), 1);
        assert_eq!(
            table(&[], true),
            "vhost\tname\tpattern\tapply-to\tdefinition\tpriority\n"
        );
    }
}
