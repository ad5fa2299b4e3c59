//! `rollout.servers`: the rollout servers a run drives instead of in-process replicas, and the
//! keys they cannot be combined with (each error names both keys).

use super::{err, ConfigError, TrainConfig};
use toml::Value;

/// The list as written: each entry `http://host:port` (a trailing `/` is dropped), no two the
/// same.
pub(super) fn parse(v: &Value) -> Result<Vec<String>, ConfigError> {
    let key = "rollout.servers";
    let Value::Array(items) = v else {
        return Err(err(
            key,
            "expected an array of URLs such as [\"http://10.0.0.2:8000\"]",
        ));
    };
    let mut out: Vec<String> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("{key}[{i}]");
        let Some(text) = item.as_str() else {
            return Err(err(&at, "expected a string (http://host:port)"));
        };
        let url = normalize(text).map_err(|m| err(&at, format!("{text:?}: {m}")))?;
        if let Some(j) = out.iter().position(|u| *u == url) {
            return Err(err(
                &at,
                format!("{url} is listed twice (also {key}[{j}]): each server is one replica"),
            ));
        }
        out.push(url);
    }
    Ok(out)
}

fn normalize(text: &str) -> Result<String, String> {
    let uri: ureq::http::Uri = text
        .parse()
        .map_err(|e| format!("not a URL ({e}); write http://host:port"))?;
    if uri.scheme_str() != Some("http") {
        return Err("only http:// is served (sluice serve speaks plain HTTP)".into());
    }
    let Some(auth) = uri.authority() else {
        return Err("no host; write http://host:port".into());
    };
    if auth.port_u16().is_none() {
        return Err("no port; write http://host:port (sluice serve prints its own)".into());
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err("a server is named by host and port only, without a path or query".into());
    }
    Ok(format!("http://{auth}"))
}

/// The keys `rollout.servers` conflicts with; sets `rollout.replicas` to the number of servers.
pub(super) fn check(cfg: &mut TrainConfig, replicas_written: usize) -> Result<(), ConfigError> {
    let servers = &cfg.rollout.servers;
    if servers.is_empty() {
        return Ok(());
    }
    let n = servers.len();
    let key = "rollout.servers";
    if cfg.run.replay {
        return Err(err(
            key,
            "conflicts with run.replay = true: the virtual clock cannot charge a server's wall \
             time; set run.replay = false or drop rollout.servers",
        ));
    }
    if cfg.sync.path != "delta" {
        return Err(err(
            key,
            format!(
                "conflicts with sync.path = {:?}: weights reach a server over HTTP, so \
                 sync.path must be \"delta\"",
                cfg.sync.path
            ),
        ));
    }
    if cfg.rollout.heartbeat_timeout_s.is_none() {
        return Err(err(
            key,
            "conflicts with rollout.heartbeat_timeout_s = 0: a server that stops answering is \
             found by heartbeats; set a timeout (seconds)",
        ));
    }
    if cfg.rollout.fail.is_some() {
        return Err(err(
            key,
            "conflicts with rollout.fail_kind: injected failures strike in-process engines; \
             stop a server process instead",
        ));
    }
    if replicas_written != 1 && replicas_written != n {
        return Err(err(
            key,
            format!(
                "lists {n} server(s) and rollout.replicas = {replicas_written}: each server is \
                 one replica (leave rollout.replicas at 1 or set it to {n})"
            ),
        ));
    }
    cfg.rollout.replicas = n;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::load;

    fn with(sets: &[&str]) -> Result<super::super::TrainConfig, super::super::ConfigError> {
        load(
            None,
            &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
    }

    #[test]
    fn servers_parse_and_conflicts_name_both_keys() {
        let ok = with(&[
            r#"rollout.servers=["http://127.0.0.1:8000/", "http://127.0.0.1:8001"]"#,
            "sync.path=delta",
        ])
        .unwrap();
        assert_eq!(
            ok.rollout.servers,
            ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
        );
        assert_eq!(ok.rollout.replicas, 2);
        assert!(with(&[]).unwrap().rollout.servers.is_empty());
        let cases: [(&[&str], &str); 8] = [
            (&[r#"rollout.servers=["127.0.0.1:8000"]"#], "http"),
            (&[r#"rollout.servers=["https://a:1"]"#], "only http"),
            (&[r#"rollout.servers=["http://a"]"#], "no port"),
            (&[r#"rollout.servers=["http://a:1/x"]"#], "path"),
            (
                &[
                    r#"rollout.servers=["http://a:1", "http://a:1/"]"#,
                    "sync.path=delta",
                ],
                "twice",
            ),
            (&[r#"rollout.servers=["http://a:1"]"#], "sync.path"),
            (
                &[
                    r#"rollout.servers=["http://a:1"]"#,
                    "sync.path=delta",
                    "run.replay=true",
                ],
                "run.replay",
            ),
            (
                &[
                    r#"rollout.servers=["http://a:1"]"#,
                    "sync.path=delta",
                    "rollout.replicas=3",
                ],
                "rollout.replicas",
            ),
        ];
        for (sets, word) in cases {
            let e = with(sets).unwrap_err();
            assert!(e.key.starts_with("rollout.servers"), "{sets:?}: {e}");
            assert!(e.message.contains(word), "{sets:?}: {e}");
        }
        let e = with(&[
            r#"rollout.servers=["http://a:1"]"#,
            "sync.path=delta",
            "rollout.heartbeat_timeout_s=0",
        ])
        .unwrap_err();
        assert!(e.message.contains("rollout.heartbeat_timeout_s"), "{e}");
    }
}
