#!/usr/bin/env python3
"""`chain`: a multi-turn environment with several tool calls per episode (new; not a port).

The model is asked for `A*B+C` (operands of 1 to `--digits` digits). Its calculator does one
operation per call, so the tool-using answer takes two calls, then the answer:

    <bos><user>37*52+18<eot><assistant>        prompt
    <call>37*52</call>                         turn 0: first call
    <observation>1924<eot><assistant>
    <call>1924+18</call>                       turn 1: second call, on the first's result
    <observation>1942<eot><assistant>
    1942<eot>                                  turn 2: the answer (or `37*52+18=1942<eot>`)

A call whose program is not `X op Y` (two non-negative integers, op one of + - *) is answered
`error: one operation per call` (or `error: syntax`), and the model may try again; at most
`MAX_CALLS` calls, a further one ends the episode as `budget`. Any other turn is the answer:
reward 1 and `success` when it is the value (alone, or after `A*B+C=`), else 0 and `failure`.
A turn that ends in neither `</call>` nor `<eot>` (cut by the token limit) is a failure.

The warm-up (`demonstration`) mixes two strategies as the built-in tool task does: a share
`--tool-fraction` of demonstrations chain the two calls, the rest answer directly
(`37*52+18=1942`). A small model cannot multiply in its head, so direct answers fail on all but
the smallest problems; RL has to learn from reward to use the tool. Held-out problems are those
whose spec's sha256 is odd.
"""

import hashlib
import os
import random
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sluice_env import arg, serve  # noqa: E402

MAX_CALLS = 4
DIGITS = arg("--digits", 2, int)
TOOL_FRACTION = arg("--tool-fraction", 0.4, float)
CALL = re.compile(r"^([0-9]{1,9})([-+*])([0-9]{1,9})$")


def parse(spec):
    m = re.fullmatch(r"([0-9]+)\*([0-9]+)\+([0-9]+)", spec)
    if m is None:
        raise ValueError("spec %r is not A*B+C" % spec)
    return [int(x) for x in m.groups()]


def value(spec):
    a, b, c = parse(spec)
    return a * b + c


def run_call(text):
    body = text[: -len("</call>")]
    i = body.rfind("<call>")
    if i < 0:
        return "error: no call start"
    program = body[i + len("<call>"):].replace(" ", "")
    m = CALL.match(program)
    if m is None:
        if "<" not in program and len(re.findall(r"[-+*/%]", program)) > 1:
            return "error: one operation per call"
        return "error: syntax"
    x, op, y = int(m.group(1)), m.group(2), int(m.group(3))
    return str({"+": x + y, "-": x - y, "*": x * y}[op])


def step(msg):
    want = str(value(msg["spec"]))
    text = msg["text"]
    if text.endswith("</call>"):
        if msg["turn"] >= MAX_CALLS:
            return {"end": {"reward": 0.0, "reason": "budget"}}
        return {"observation": {"text": "<observation>%s<eot><assistant>" % run_call(text)}}
    ok = text.endswith("<eot>") and text[: -len("<eot>")] in (want, "%s=%s" % (msg["spec"], want))
    if ok:
        return {"end": {"reward": 1.0, "reason": "success"}}
    return {"end": {"reward": 0.0, "reason": "failure"}}


def number(rng):
    d = rng.randint(1, DIGITS)
    return rng.randint(1 if d == 1 else 10 ** (d - 1), 10 ** d - 1)


def problem(msg):
    rng = random.Random(msg["seed"])
    want_odd = msg["split"] == "held_out"
    while True:
        spec = "%d*%d+%d" % (number(rng), number(rng), number(rng))
        if (hashlib.sha256(spec.encode()).digest()[0] & 1 == 1) == want_odd:
            return {"spec": spec, "prompt": {"text": "<bos><user>%s<eot><assistant>" % spec}}


def demonstration(msg):
    a, b, c = parse(msg["spec"])
    rng = random.Random(msg["seed"])
    p, r = a * b, a * b + c
    if rng.random() < TOOL_FRACTION:
        return {"demonstration": [
            {"role": "model", "text": "<call>%d*%d</call>" % (a, b)},
            {"role": "given", "text": "<observation>%d<eot><assistant>" % p},
            {"role": "model", "text": "<call>%d+%d</call>" % (p, c)},
            {"role": "given", "text": "<observation>%d<eot><assistant>" % r},
            {"role": "model", "text": "%d<eot>" % r},
        ]}
    return {"demonstration": [{"role": "model", "text": "%s=%d<eot>" % (msg["spec"], r)}]}


HANDLERS = {"problem": problem, "step": step, "demonstration": demonstration}

if __name__ == "__main__":
    serve(lambda msg: HANDLERS[msg["type"]](msg))
