//! `ids next`, `status`, `adopt-places` and `clear-unconfirmed-places`:
//! ticket sequences and servers.

use crate::cli::args::IdsAction;
use crate::cli::commands::output::Outcome;
use crate::cluster::Cluster;
use crate::error::Result;
use serde_json::json;

/// Runs an `ids` action.
pub(super) async fn ids(cluster: &Cluster, action: IdsAction) -> Result<Outcome> {
    match action {
        IdsAction::Next { sequence } => {
            let id = cluster.ids().next(&sequence).await?;
            Ok(Outcome {
                json: json!({ "sequence": sequence, "id": id }),
                text: format!("{id}\n"),
                problem: false,
            })
        }
        IdsAction::Status => {
            let ids = cluster.ids();
            let servers: Vec<&str> = ids.servers().collect();
            let sequences = if servers.is_empty() {
                Ok(Vec::new())
            } else {
                cluster.ids().sequences().await
            };
            let places = cluster.ids().places().await;
            let mut text = format!(
                "ticket servers: {}\nsequences: {}\n",
                if servers.is_empty() {
                    "none configured".to_owned()
                } else {
                    servers.join(", ")
                },
                match &sequences {
                    Ok(names) if names.is_empty() => "none".to_owned(),
                    Ok(names) => names.join(", "),
                    Err(err) => format!("unknown ({})", err.report()),
                }
            );
            let mut rows = Vec::new();
            for server in &places {
                let (state, row) = match &server.recorded {
                    Err(err) => (
                        format!("unreachable: {}", err.report()),
                        json!({ "error": err.report().to_string() }),
                    ),
                    Ok(None) => ("no place recorded".to_owned(), json!({})),
                    Ok(Some(place)) => (
                        format!(
                            "server {} of {} {}, {}",
                            place.position,
                            place.servers.len(),
                            serde_json::to_string(&place.servers).unwrap_or_default(),
                            if place.confirmed {
                                "confirmed"
                            } else {
                                "unconfirmed"
                            }
                        ),
                        json!({
                            "position": place.position,
                            "list": place.servers,
                            "confirmed": place.confirmed,
                        }),
                    ),
                };
                let serves = if server.serves {
                    "serves"
                } else {
                    "SERVES NO TICKET"
                };
                text.push_str(&format!("  {}: {state} ({serves})\n", server.name));
                let mut row = row;
                row["name"] = json!(server.name);
                row["serves"] = json!(server.serves);
                rows.push(row);
            }
            Ok(Outcome {
                text,
                json: json!({
                    "servers": servers,
                    "sequences": sequences.as_ref().ok(),
                    "places": rows,
                }),
                problem: sequences.is_err() || places.iter().any(|p| !p.serves),
            })
        }
        IdsAction::AdoptPlaces => {
            cluster.ids().adopt_places().await?;
            let ids = cluster.ids();
            let servers: Vec<&str> = ids.servers().collect();
            Ok(Outcome {
                text: format!("ticket servers' places recorded: {}\n", servers.join(", ")),
                json: json!({ "recorded": servers }),
                problem: false,
            })
        }
        IdsAction::ClearUnconfirmedPlaces => {
            let removed = cluster.ids().clear_unconfirmed_places().await?;
            Ok(Outcome {
                text: format!("unconfirmed places removed: {removed}\n"),
                json: json!({ "removed": removed }),
                problem: false,
            })
        }
    }
}
