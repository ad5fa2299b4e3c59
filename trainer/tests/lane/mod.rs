//! `sluice serve`'s lane endpoints, a part of trainer/tests/serve.rs (its server and helpers).

use super::*;
use sluice_runtime::orchestrator::{EngineCmd, MemberRef};
use sluice_runtime::remote::wire::{StepRequest, WireCmd, WireEvent};

/// `/lane/join` and `/lane/step` (trainer/src/serve/lane.rs): a joined server applies a unit
/// of work's commands and one engine step as an in-process replica does (ids and log-prob
/// bits equal an in-process engine's on the joined image), and every bad lane request is a
/// 4xx with nothing applied, the server still serving.
#[test]
fn lane_join_step_and_bad_lane_requests() {
    let dir = scratch("serve-lane");
    let (w0, _) = checkpoint(&dir, 1);
    let (w1, m1) = checkpoint(&dir, 2);
    let server = Server::start(&w0);
    let image = arena_bytes(m1.compute_weights()).unwrap();
    let hash = ContentHash::of(&image).to_hex();
    let oct = "application/octet-stream";
    let step = |instance: &str, cmds: Vec<EngineCmd>| {
        let body = StepRequest {
            instance: instance.into(),
            cmds: cmds.into_iter().map(WireCmd::from).collect(),
        };
        server.post("/lane/step", &serde_json::to_value(&body).unwrap())
    };
    // Before any join: a step is a 409.
    let (s, v) = step("x", vec![]);
    assert_eq!(s, 409, "{v}");
    assert!(v["error"].as_str().unwrap().contains("/lane/join"), "{v}");
    // Joins that are refused, nothing installed: no query, a wrong hash, a short image.
    let refused = [
        (
            "/lane/join".to_string(),
            image.clone(),
            "version=N and blake3",
        ),
        (
            format!("/lane/join?version=3&blake3={}", "0".repeat(64)),
            image.clone(),
            "damaged",
        ),
        (
            format!("/lane/join?version=3&blake3={hash}"),
            image[..image.len() - 4].to_vec(),
            "another model",
        ),
        (
            "/lane/join?version=3&blake3=zz".to_string(),
            image.clone(),
            "64 hex",
        ),
    ];
    for (path, body, word) in refused {
        let (s, v) = server.send(&path, oct, &body);
        assert_eq!(s, 400, "{path}: {v}");
        assert!(v["error"].as_str().unwrap().contains(word), "{path}: {v}");
    }
    assert_eq!(server.get("/health")["version"], 0);
    assert_eq!(server.get("/health")["driven"], false);
    // A join at version 3 (any version: the trainer owns the server now).
    let (s, j) = server.send(&format!("/lane/join?version=3&blake3={hash}"), oct, &image);
    assert_eq!(s, 200, "{j}");
    assert_eq!(
        (j["version"].clone(), j["blake3"].clone()),
        (json!(3), json!(hash))
    );
    let token = j["instance"].as_str().unwrap().to_string();
    assert_eq!(server.get("/health")["instance"], json!(token));
    // Session endpoints are off while driven.
    let (s, v) = server.post("/generate", &json!({"prompt": [1, 2]}));
    assert_eq!(s, 409, "{v}");
    // Malformed and unknown commands, a stale token: 4xx, nothing applied.
    let (s, v) = server.send("/lane/step", "application/json", b"{\"instance\":");
    assert_eq!(s, 400, "{v}");
    let (s, v) = server.post(
        "/lane/step",
        &json!({"instance": token, "cmds": [{"cmd": "explode"}]}),
    );
    assert_eq!(s, 400, "{v}");
    let (s, v) = step("stale.0", vec![]);
    assert_eq!(s, 409, "{v}");
    assert!(v["error"].as_str().unwrap().contains("restarted"), "{v}");
    // A unit of work: submit a single-turn request, then step until it finishes. The tokens
    // and log-prob bits are an in-process engine's on the same image.
    let mut req = request("lane-0", vec![1, 4, 9, 2], 5, 17, 1.0);
    req.multi_turn = false;
    let (s, a) = step(
        &token,
        vec![EngineCmd::Submit {
            group: 0,
            request: req.clone(),
        }],
    );
    assert_eq!(s, 200, "{a}");
    assert_eq!(
        a["results"][0]["handles"]["Ok"].as_array().map(Vec::len),
        Some(1),
        "{a}"
    );
    let mut events: Vec<WireEvent> = serde_json::from_value(a["events"].clone()).unwrap();
    let mut units = 1;
    while events.is_empty() {
        let (s, a) = step(&token, vec![]);
        assert_eq!(s, 200, "{a}");
        assert_eq!(a["version"], 3);
        events = serde_json::from_value(a["events"].clone()).unwrap();
        units += 1;
        assert!(units < 50, "no event after {units} units of work");
    }
    let WireEvent::Finished { sample, .. } = &events[0] else {
        panic!("{events:?}")
    };
    let mut eng = engine(&w1, 3);
    let h = eng.submit(req).unwrap()[0];
    let mut local = None;
    while eng.has_work() {
        for e in eng.step().unwrap() {
            if let Event::Finished { handle, sample, .. } = e {
                assert_eq!(handle, h);
                local = Some(sample);
            }
        }
    }
    let local = local.unwrap();
    assert_eq!(sample.tokens, local.tokens);
    assert_eq!(bits(&sample.behavior_logp), bits(&local.behavior_logp));
    assert_eq!(sample.weight_version, local.weight_version);
    assert!(sample.weight_version[4..].iter().all(|v| v.0 == 3));
    // A command the engine refuses is answered in its slot, as in process.
    let (s, a) = step(
        &token,
        vec![EngineCmd::Finish {
            member: MemberRef { group: 0, index: 0 },
            handle: sluice_runtime::engine::SeqHandle(99),
            reward: 0.0,
            reason: TerminalReason::Budget,
        }],
    );
    assert_eq!(s, 200, "{a}");
    assert!(a["results"][0]["result"]["Err"].is_string(), "{a}");
    let h = server.get("/health");
    assert_eq!(h["counters"]["lane_joins"], 1, "{h}");
    assert_eq!(h["counters"]["lane_steps"], units + 1, "{h}");
    assert!(h["counters"]["rejected"].as_u64().unwrap() >= 9, "{h}");
    // A second trainer joins at an older version (a new run): a fresh engine on its image,
    // and the first join's token is stale.
    let (s, j2) = server.send(&format!("/lane/join?version=1&blake3={hash}"), oct, &image);
    assert_eq!(s, 200, "{j2}");
    assert_eq!(j2["version"], 1, "{j2}");
    assert_ne!(j2["instance"], json!(token));
    let (s, v) = step(&token, vec![]);
    assert_eq!(s, 409, "{v}");
    let (s, a) = step(j2["instance"].as_str().unwrap(), vec![]);
    assert_eq!(
        (s, a["version"].clone(), a["has_work"].clone()),
        (200, json!(1), json!(false))
    );
}
