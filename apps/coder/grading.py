"""Grading a submission out of its own process: its reward depends only on the plain values it returns.

    server (trusted test code) --args, JSON--> sandboxed child (the submission) --value, JSON--> server

The submission runs in a sandboxed child (`Sandbox.process`) that loads it and then answers calls of
its entry point: the server sends the arguments, the child sends back the return value as plain data
(None, bool, int, float, str, bytes, and lists, tuples, sets, dicts of them). The tests run here, in
the server, with `candidate` bound to a stub that makes those calls; each test passes if it runs
without raising. So nothing the program does can reach the verdict except the values it returns: what
it prints goes nowhere, the exit status it forces only ends its own process (every later call then
fails), patched builtins, `AssertionError` or harness functions live in its process only, and an object
whose `__eq__` always answers True is not plain data (the child's encoder refuses it; if the program
patches that encoder, what arrives is still decoded here into plain values by code it cannot touch).
The tests and expected values never enter the child: it sees arguments, one call at a time.

A call gets no answer past the grading's deadline (the sandbox's timeout from the child's start): a
program that sleeps or loops fails every test it did not answer in time. A child that never started is
the sandbox's failure, not the program's: `grade` raises SandboxError and returns no errors at all.
"""

from __future__ import annotations

import inspect
import json
import os
import select
import time

MAX_REPLY_BYTES = 1 << 20
MAX_DEPTH = 32


class CandidateError(Exception):
    """The submission gave no plain value for a call (it raised, died, timed out or sent garbage)."""


def encode(value, depth=0):
    """Plain data -> JSON-able: None, bool, int, float and str as themselves, containers tagged by type."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if kind in (list, tuple, set, frozenset):
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    raise TypeError(f"{kind.__name__} is not plain data")


def decode(data, depth=0):
    """What `encode` produced -> the value, built only from plain types; anything else raises."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not dict or len(data) != 1 or depth > MAX_DEPTH:
        raise ValueError("not an encoded value")
    ((tag, body),) = data.items()
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"bad {tag!r} body")
    if tag == "dict":
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    containers = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
    if tag not in containers:
        raise ValueError(f"unknown tag {tag!r}")
    return containers[tag](decode(v, depth + 1) for v in body)


# The child: the codec above, then load the program (its stdout and stderr go nowhere; replies leave on
# a copy of the original stdout) and answer one call per request line until stdin closes.
_CHILD = (
    "import json, os, sys\n"
    + f"MAX_DEPTH = {MAX_DEPTH}\n"
    + inspect.getsource(encode)
    + inspect.getsource(decode)
    + r"""
out = os.dup(1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
entry = sys.argv[1]
def reply(message):
    os.write(out, (json.dumps(message) + "\n").encode())
ns = {"__name__": "__main__"}
try:
    exec(compile(json.loads(sys.stdin.readline()), "main.py", "exec"), ns)
    reply({"ready": callable(ns.get(entry)), "error": None if callable(ns.get(entry)) else f"no function {entry}()"})
except BaseException as e:
    reply({"ready": False, "error": f"{type(e).__name__}: {e}"[:300]})
for line in sys.stdin:
    try:
        reply({"value": encode(ns[entry](*decode(json.loads(line))))})
    except BaseException as e:
        reply({"error": f"{type(e).__name__}: {e}"[:300]})
"""
)


class Callee:
    """The server's end of the child: `callee(*args)` sends one call and returns the decoded value.
    After the first failure of the channel (death, timeout, garbage) every call fails at once."""

    def __init__(self, proc, deadline: float):
        self.proc, self.deadline = proc, deadline
        self.buffer = b""
        self.failed: str | None = None
        os.set_blocking(proc.stdin.fileno(), False)

    def send(self, message) -> None:
        data, sent = (json.dumps(message) + "\n").encode(), 0
        while sent < len(data):
            if not select.select([], [self.proc.stdin], [], self._remaining())[1]:
                raise CandidateError("timed out")
            try:
                sent += os.write(self.proc.stdin.fileno(), data[sent : sent + 65536])
            except BlockingIOError:
                continue
            except OSError:
                raise CandidateError("its process exited") from None

    def receive(self) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_REPLY_BYTES:
                raise CandidateError(f"reply over {MAX_REPLY_BYTES} bytes")
            if not select.select([fd], [], [], self._remaining())[0]:
                raise CandidateError("timed out")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise CandidateError("its process exited")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:  # the program can write here too: 60,000 nested [ make json raise RecursionError
            message = json.loads(line)
        except Exception:
            raise CandidateError("garbled reply") from None
        if type(message) is not dict:
            raise CandidateError("garbled reply")
        return message

    def __call__(self, *args):
        if self.failed:
            raise CandidateError(self.failed)
        request = encode(list(args))  # the test's own arguments: a failure here is the test's, not the program's
        try:
            self.send(request)
            message = self.receive()
            raised = "error" in message or "value" not in message
            value = None if raised else decode(message["value"])
        except Exception as e:
            # No reply, or one that does not parse: the channel is gone, or out of step with the calls (a
            # program that wrote a reply of its own), so this call and every later one fail.
            self.failed = str(e) if isinstance(e, CandidateError) else f"not plain data: {type(e).__name__}: {e}"[:300]
            raise CandidateError(self.failed) from None
        if raised:
            raise CandidateError(f"raised {str(message.get('error'))[:300]}")
        return value

    def _remaining(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise CandidateError("timed out")
        return remaining


def grade(sandbox, code: str, entry_point: str, tests: list[str], setup: str = "", timeout_s: float | None = None) -> list[str | None]:
    """Run each test (Python source calling `candidate` or `entry_point`) against `code`'s entry point;
    returns each test's error, None where it passed. `setup`: trusted source run before each test in its
    namespace (HumanEval's prompt and check module: helpers such as `poly` that tests call)."""
    timeout = min(timeout_s or sandbox.limits.timeout_s, sandbox.limits.timeout_s)
    setup_code = compile(setup, "setup", "exec")
    compiled = [compile(test, f"test_{i}", "exec") for i, test in enumerate(tests)]
    errors: list[str | None] = []
    with sandbox.process(_CHILD, [entry_point], timeout) as proc:  # SandboxError if no child started: no grade
        callee = Callee(proc, time.monotonic() + timeout)
        try:
            callee.send(code)
            ready = callee.receive()
            if ready.get("ready") is not True:
                callee.failed = f"the program did not load: {str(ready.get('error'))[:300]}"
        except CandidateError as e:
            callee.failed = f"the program did not load: {e}"
        for test in compiled:
            namespace = {"__name__": "tests"}
            exec(setup_code, namespace)
            namespace["candidate"] = namespace[entry_point] = callee
            try:
                exec(test, namespace)
                errors.append(None)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}"[:300])
    return errors
