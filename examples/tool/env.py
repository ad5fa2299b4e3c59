#!/usr/bin/env python3
"""A port of sluice's built-in `tool` task (trainer/src/tasks/tool.rs) as an external
environment: the product of two numbers, with a calculator the model may call.

    <bos><user>37*52<eot><assistant>           prompt
    <call>37*52</call>                         turn 0: a tool call
    <observation>1924<eot><assistant>          the environment runs it
    1924<eot>                                  turn 1: the answer (or `37*52=1924<eot>`)

Rewards match the built-in task for every (problem, response) pair (a test holds them to it:
tests/external_env.rs). Problems: `--train FILE` / `--held-out FILE` serve the built-in task's
own problems (`sluice tasks export tool --split train|held_out --n N --out FILE`); without them
operands are drawn here (1..=`--digits` digits, at least `--min-digits`), held-out problems
being those whose spec's sha256 is odd. `--tool-fraction F`: the warm-up's share of
demonstrations that call the tool (the rest answer directly, restating the problem).
"""

import hashlib
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sluice_env import arg, serve  # noqa: E402

MAX_CALLS = 3
I64_MIN, I64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_LEN, MAX_DEPTH, MAX_NUMBER_DIGITS = 256, 32, 18

DIGITS = arg("--digits", 2, int)
MIN_DIGITS = arg("--min-digits", 1, int)
TOOL_FRACTION = arg("--tool-fraction", 0.4, float)


def load(path):
    if path is None:
        return None
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


LISTS = {"train": load(arg("--train")), "held_out": load(arg("--held-out"))}


class CalcError(Exception):
    pass


def i64(v):
    if not I64_MIN <= v <= I64_MAX:
        raise CalcError("error: overflow")
    return v


def trunc_div(a, b):
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


class Calc:
    """sluice's calculator (trainer/src/tasks/calc.rs): + - * / % ( ) and unary minus on
    64-bit integers, spaces ignored, the same error messages."""

    def __init__(self, chars):
        self.c, self.at = chars, 0

    def peek(self):
        return self.c[self.at] if self.at < len(self.c) else None

    def unexpected(self):
        if self.peek() is None:
            return CalcError("error: unexpected end")
        return CalcError("error: syntax at %d" % self.at)

    def expr(self, depth):
        v = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.peek()
            self.at += 1
            r = self.term(depth)
            v = i64(v + r if op == "+" else v - r)
        return v

    def term(self, depth):
        v = self.factor(depth)
        while self.peek() in ("*", "/", "%"):
            op = self.peek()
            self.at += 1
            r = self.factor(depth)
            if op != "*" and r == 0:
                raise CalcError("error: division by zero")
            if op == "*":
                v = i64(v * r)
            elif op == "/":
                v = i64(trunc_div(v, r))
            else:
                v = i64(v - r * trunc_div(v, r))
        return v

    def factor(self, depth):
        if depth >= MAX_DEPTH:
            raise CalcError("error: nested too deep")
        c = self.peek()
        if c == "-":
            self.at += 1
            return i64(-self.factor(depth + 1))
        if c == "(":
            self.at += 1
            v = self.expr(depth + 1)
            if self.peek() != ")":
                raise self.unexpected()
            self.at += 1
            return v
        if c is not None and c.isdigit():
            start, v = self.at, 0
            while self.peek() is not None and self.peek().isdigit():
                if self.at - start == MAX_NUMBER_DIGITS:
                    raise CalcError("error: number too long at %d" % start)
                v = v * 10 + int(self.peek())
                self.at += 1
            return v
        raise self.unexpected()


def calc(program):
    chars = [c for c in program if c != " "]
    if not chars:
        raise CalcError("error: empty program")
    if len(chars) > MAX_LEN:
        raise CalcError("error: program of %d chars is too long" % len(chars))
    p = Calc(chars)
    v = p.expr(0)
    if p.peek() is not None:
        raise CalcError("error: syntax at %d" % p.at)
    return v


def run_call(text):
    """The observation text answering a turn that ends in `</call>`."""
    body = text[: -len("</call>")]
    i = body.rfind("<call>")
    if i < 0:
        return "error: no call start"
    program = body[i + len("<call>"):]
    # `<` only ever starts a special token (or an id outside the vocabulary, `<?N>`).
    if "<" in program:
        return "error: bad token in program"
    try:
        return str(calc(program))
    except CalcError as e:
        return str(e)


def end(ok):
    return {"end": {"reward": 1.0, "reason": "success"}} if ok else {
        "end": {"reward": 0.0, "reason": "failure"}}


def parse(spec):
    a, b = spec.split("*")
    return int(a), int(b)


def step(msg):
    a, b = parse(msg["spec"])
    text = msg["text"]
    if text.endswith("</call>"):
        # Turn t is call number t + 1: every earlier turn was a call.
        if msg["turn"] >= MAX_CALLS:
            return {"end": {"reward": 0.0, "reason": "budget"}}
        return {"observation": {"text": "<observation>%s<eot><assistant>" % run_call(text)}}
    if not text.endswith("<eot>"):
        return end(False)
    body, want = text[: -len("<eot>")], str(a * b)
    return end(body == want or body == "%s=%s" % (msg["spec"], want))


def operand(rng):
    d = rng.randint(MIN_DIGITS, DIGITS)
    return rng.randint(1 if d == 1 else 10 ** (d - 1), 10 ** d - 1)


def problem(msg):
    listed = LISTS[msg["split"]]
    if listed:
        p = listed[msg["seed"] % len(listed)]
        return {"spec": p["spec"], "prompt": {"text": p["prompt"]["text"]}}
    rng = random.Random(msg["seed"])
    want_odd = msg["split"] == "held_out"
    while True:
        spec = "%d*%d" % (operand(rng), operand(rng))
        if (hashlib.sha256(spec.encode()).digest()[0] & 1 == 1) == want_odd:
            return {"spec": spec, "prompt": {"text": "<bos><user>%s<eot><assistant>" % spec}}


def demonstration(msg):
    a, b = parse(msg["spec"])
    rng = random.Random(msg["seed"])
    p = str(a * b)
    if rng.random() < TOOL_FRACTION:
        return {"demonstration": [
            {"role": "model", "text": "<call>%s</call>" % msg["spec"]},
            {"role": "given", "text": "<observation>%s<eot><assistant>" % p},
            {"role": "model", "text": p + "<eot>"},
        ]}
    return {"demonstration": [{"role": "model", "text": "%s=%s<eot>" % (msg["spec"], p)}]}


HANDLERS = {"problem": problem, "step": step, "demonstration": demonstration}

if __name__ == "__main__":
    serve(lambda msg: HANDLERS[msg["type"]](msg))
