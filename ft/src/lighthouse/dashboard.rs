//! The lighthouse's HTTP dashboard, on its gRPC port as torchft's: `GET /` and `GET /status`
//! (a page: the rule's decision now, the groups asking, the last quorum, the heartbeats) and
//! `POST /replica/{replica_id}/kill` (the kill button: asks that group's manager to end its
//! process, torchft's `Kill`).

use std::fmt::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Html;
use axum::routing::{get, post};
use axum::Router;

use super::quorum::StatusView;
use super::{LighthouseOptions, Shared};
use crate::proto::manager_service_client::ManagerServiceClient;
use crate::proto::KillRequest;

/// How long the kill button waits for a manager to answer.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// The dashboard's routes over the lighthouse's state.
pub(super) fn routes(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(status))
        .route("/status", get(status))
        .route("/replica/:replica_id/kill", post(kill))
        .with_state(shared)
}

async fn status(State(shared): State<Arc<Shared>>) -> Html<String> {
    let view = shared
        .membership
        .lock()
        .await
        .status(Instant::now(), &shared.opts);
    Html(page(&view, &shared.opts))
}

async fn kill(
    State(shared): State<Arc<Shared>>,
    Path(replica_id): Path<String>,
) -> (StatusCode, String) {
    let address = shared.membership.lock().await.address_of(&replica_id);
    let Some(address) = address else {
        return (
            StatusCode::NOT_FOUND,
            format!("no replica group {replica_id} is asking for a quorum or in the last one"),
        );
    };
    // Only a failed connection is a failure: the manager ends its process while answering,
    // so a call cut short is the usual end of a kill.
    let asked = tokio::time::timeout(KILL_TIMEOUT, async {
        let mut client = ManagerServiceClient::connect(address.clone()).await?;
        let _ = client
            .kill(KillRequest {
                msg: "killed from the lighthouse's dashboard".into(),
            })
            .await;
        Ok::<(), tonic::transport::Error>(())
    })
    .await;
    match asked {
        Ok(Ok(())) => (
            StatusCode::OK,
            format!("asked replica group {replica_id} (its manager at {address}) to exit"),
        ),
        Ok(Err(e)) => (
            StatusCode::BAD_GATEWAY,
            format!("cannot reach replica group {replica_id}'s manager at {address}: {e}"),
        ),
        Err(_) => (
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "replica group {replica_id}'s manager at {address} did not answer within \
                 {KILL_TIMEOUT:?}"
            ),
        ),
    }
}

/// `text` safe inside HTML, attributes included.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` as one URL path segment (every byte outside RFC 3986's unreserved set and `:`
/// percent-encoded).
fn path_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The dashboard's page.
fn page(view: &StatusView, opts: &LighthouseOptions) -> String {
    let mut html = String::from(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>tch-dist lighthouse</title>\
         </head><body>\n<h1>Lighthouse</h1>\n",
    );
    let _ = writeln!(
        html,
        "<p>min_replicas {}, join timeout {:?}, heartbeat timeout {:?}</p>",
        opts.min_replicas, opts.join_timeout, opts.heartbeat_timeout
    );
    let _ = writeln!(
        html,
        "<h2>Next quorum</h2>\n<p>{}</p>",
        escape(&view.decision)
    );
    html.push_str(
        "<table><tr><th>asking</th><th>step</th><th>world size</th><th>manager</th>\
         <th>commit failures</th></tr>\n",
    );
    for m in &view.asking {
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&m.replica_id),
            m.step,
            m.world_size,
            escape(&m.address),
            m.commit_failures
        );
    }
    html.push_str("</table>\n<h2>Last quorum</h2>\n");
    match &view.previous {
        None => html.push_str("<p>none yet</p>\n"),
        Some(q) => {
            let _ = writeln!(
                html,
                "<p>quorum {}, {} groups</p>\n<table><tr><th>replica group</th><th>step</th>\
                 <th>world size</th><th>manager</th><th></th></tr>",
                q.quorum_id,
                q.participants.len()
            );
            for m in &q.participants {
                let _ = writeln!(
                    html,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><form method=\"post\" \
                     action=\"/replica/{}/kill\"><button>kill</button></form></td></tr>",
                    escape(&m.replica_id),
                    m.step,
                    m.world_size,
                    escape(&m.address),
                    escape(&path_segment(&m.replica_id))
                );
            }
            html.push_str("</table>\n");
        }
    }
    html.push_str(
        "<h2>Heartbeats</h2>\n<table><tr><th>replica group</th><th>last heard</th>\
         <th></th></tr>\n",
    );
    for (id, age, alive) in &view.heartbeats {
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{} ms ago</td><td>{}</td></tr>",
            escape(id),
            age.as_millis(),
            if *alive { "alive" } else { "dead" }
        );
    }
    html.push_str("</table>\n</body></html>\n");
    html
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Quorum, QuorumMember};

    #[test]
    fn the_page_escapes_what_groups_send_and_links_each_kill_button() {
        let member = |id: &str, step| QuorumMember {
            replica_id: id.into(),
            address: "http://10.0.0.1:5000".into(),
            step,
            world_size: 2,
            ..Default::default()
        };
        let view = StatusView {
            decision: "waiting: 1 groups ask for a quorum, min_replicas is 2".into(),
            previous: Some(Quorum {
                quorum_id: 7,
                participants: vec![member("replica_0:a b/<c>", 3)],
                created: None,
            }),
            asking: vec![member("replica_1:x", 4)],
            heartbeats: vec![
                ("replica_0:a b/<c>".into(), Duration::from_millis(12), true),
                ("replica_1:x".into(), Duration::from_millis(6000), false),
            ],
        };
        let html = page(&view, &LighthouseOptions::new(2));
        assert!(html.contains("<p>min_replicas 2, join timeout 60s, heartbeat timeout 5s</p>"));
        assert!(html.contains("<p>waiting: 1 groups ask for a quorum, min_replicas is 2</p>"));
        assert!(html.contains(
            "<tr><td>replica_1:x</td><td>4</td><td>2</td><td>http://10.0.0.1:5000</td><td>0</td></tr>"
        ));
        assert!(html.contains("<p>quorum 7, 1 groups</p>"));
        assert!(html.contains("<td>replica_0:a b/&lt;c&gt;</td>"), "{html}");
        assert!(html.contains("action=\"/replica/replica_0:a%20b%2F%3Cc%3E/kill\""));
        assert!(html.contains("<td>replica_1:x</td><td>6000 ms ago</td><td>dead</td>"));
        assert!(!html.contains("<c>"));
    }
}
