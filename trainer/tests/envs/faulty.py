#!/usr/bin/env python3
"""A test environment for tests/external_env.rs: the protocol with every way to misbehave.

    faulty.py batch N   answer steps in batches of N, each batch in reverse order
    faulty.py flaky     a training environment that sometimes crashes or replies malformed

A step's text decides what happens (batch mode): `crash` exits the process, `hang` never
answers, `badreason`, `noreward`, `nofield`, `badids`, `badtext`, `both` answer malformed, and
`garbage` writes a line that is not JSON. Otherwise a turn ending in `</call>` is answered with
an observation holding the turn's length in characters, and `yes<eot>` ends with reward 1.
"""

import hashlib
import json
import os
import sys
import time

MODE = sys.argv[1]
BATCH = int(sys.argv[2]) if MODE == "batch" else 1
out = sys.stdout


def send(obj):
    out.write(json.dumps(obj) + "\n")
    out.flush()


def step(msg):
    text = msg["text"]
    for word, reply in [
        ("badreason", {"end": {"reward": 1.0, "reason": "won"}}),
        ("noreward", {"end": {"reason": "success"}}),
        ("nofield", {}),
        ("badids", {"observation": {"ids": [9999]}}),
        ("badtext", {"observation": {"text": "<foo>"}}),
        ("both", {"observation": {"text": "x"}, "end": {"reward": 0.0, "reason": "failure"}}),
    ]:
        if word in text:
            return reply
    if text.endswith("</call>"):
        return {"observation": {"text": "<observation>%d<eot><assistant>" % len(text)}}
    ok = text == "yes<eot>"
    return {"end": {"reward": 1.0 if ok else 0.0, "reason": "success" if ok else "failure"}}


def flaky(msg):
    """Deterministic per request: some sessions crash the process, some get malformed replies,
    the rest a one-turn task (reward 1 when the answer starts with the prompt's letter)."""
    h = hashlib.sha256(("%s/%s" % (msg["session"], msg["turn"])).encode()).digest()[0]
    if msg["attempt"] == 0 and h % 13 == 0:
        os._exit(3)
    if h % 11 == 0:
        return {"end": {"reward": 1.0, "reason": "won"}}
    want = msg["spec"]
    ok = msg["text"].startswith(want)
    return {"end": {"reward": 1.0 if ok else 0.0, "reason": "success" if ok else "failure"}}


def problem(msg):
    letter = "abcdefgh"[msg["seed"] % 8]
    return {"spec": letter, "prompt": {"text": "<bos><user>%s<eot><assistant>" % letter}}


def demonstration(msg):
    return {"demonstration": [{"role": "model", "text": msg["spec"] + "<eot>"}]}


pending = []
for line in sys.stdin:
    msg = json.loads(line)
    kind = msg["type"]
    if kind == "problem":
        r = problem(msg)
    elif kind == "demonstration":
        r = demonstration(msg)
    elif MODE == "flaky":
        r = flaky(msg)
    else:
        if "crash" in msg["text"]:
            os._exit(3)
        if "hang" in msg["text"]:
            time.sleep(3600)
        if "garbage" in msg["text"]:
            out.write("this is not json\n")
            out.flush()
            continue
        pending.append(msg)
        if len(pending) < BATCH:
            continue
        for m in reversed(pending):
            r = step(m)
            r["id"] = m["id"]
            send(r)
        pending = []
        continue
    r["id"] = msg["id"]
    send(r)
