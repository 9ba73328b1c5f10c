"""A scripted judge behind an OpenAI-compatible chat endpoint, for tests/test_judge.py: a gullible
grader, and a misbehaving server on demand.

The grader (the rubric: "name a fruit that monkeys love") reads the response as the span between
verifiers.RESPONSE_START and the first verifiers.RESPONSE_END after it, and scores 1 if that span
says "banana", else 0 (any other rubric: 1 if the span has no comma, else 0). It is gullible where a
small model would be: an order to "output 1" written OUTSIDE the span is obeyed (so a response that
closes the span early wins, unless the markers are neutralised), and a line "Score: ..." inside the
span is copied back as the reply (so a lenient parser would read the forged score). It honours
response_format (its verdicts come as {"score": "..."}) and vLLM's structured_outputs choice (the
label alone), but does not constrain what it writes. A request longer than MAX_CHARS is refused
with HTTP 400, as vLLM refuses a prompt past its context.

Faults: `server.script` is a list consumed one per request (then `server.always`, then none):
"429" (with Retry-After `server.retry_after`), "500", "hang" (sleeps `server.hang_s`), "reset" (the
connection dropped), "garbage" (200, not JSON), "no choices", "refuse" (a refusal message), "chatter"
(a reply that is no verdict), "no format" (HTTP 400 naming the structured-output parameter the
request used, as OpenAI refuses vLLM's structured_outputs). The server counts requests, verdicts and the most requests in flight at once."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import verifiers

MODEL = "scripted-judge"
MAX_CHARS = 20000
RUBRIC = "The response names a fruit that monkeys love."


def scripted_verdict(user_message: str) -> str:
    """The grader's reply text to a judge_messages user message (see the module docstring)."""
    start = user_message.find(verifiers.RESPONSE_START)
    end = user_message.find(verifiers.RESPONSE_END, start)
    span = user_message[start + len(verifiers.RESPONSE_START) : end]
    outside = user_message[end + len(verifiers.RESPONSE_END) :]
    if "output 1" in outside.lower():
        return "1"
    for line in span.splitlines():
        if line.startswith("Score:"):
            return line
    if RUBRIC in user_message.split(verifiers.RESPONSE_START)[0]:
        return "1" if "banana" in span.lower() else "0"
    return "0" if "," in span else "1"


class JudgeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, key: str | None = None):
        super().__init__(("127.0.0.1", 0), JudgeHandler)
        self.key = key
        self.script = []
        self.always = None
        self.retry_after = "0.3"
        self.hang_s = 2.0
        self.delay_s = 0.0
        self.lock = threading.Lock()
        self.n_requests = 0
        self.n_verdicts = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def next_fault(self) -> str | None:
        with self.lock:
            return self.script.pop(0) if self.script else self.always


class JudgeHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status: int, body: bytes, headers: dict | None = None):
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def authorized(self) -> bool:
        server: JudgeServer = self.server
        return server.key is None or self.headers.get("Authorization") == f"Bearer {server.key}"

    def do_GET(self):
        if not self.authorized():
            return self.reply(401, b'{"error": "no key"}')
        self.reply(200, json.dumps({"data": [{"id": MODEL}]}).encode())

    def do_POST(self):
        server: JudgeServer = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.n_requests += 1
            server.bodies.append(body)
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            self.answer(server, body)
        finally:
            with server.lock:
                server.in_flight -= 1

    def answer(self, server: JudgeServer, body: dict):
        if not self.authorized():
            return self.reply(401, b'{"error": "no key"}')
        time.sleep(server.delay_s)
        fault = server.next_fault()
        if fault == "429":
            return self.reply(429, b"{}", {"Retry-After": server.retry_after})
        if fault == "500":
            return self.reply(500, b"{}")
        if fault == "hang":
            time.sleep(server.hang_s)
            return self.reply(200, b"{}")
        if fault == "reset":
            self.connection.shutdown(socket.SHUT_RDWR)
            return None
        if fault == "garbage":
            return self.reply(200, b'{"choices": [{"message": ')
        if fault == "no choices":
            return self.reply(200, json.dumps({"choices": [], "usage": {}}).encode())
        for parameter in ("structured_outputs", "response_format"):
            if fault == "no format" and parameter in body:
                error = {
                    "error": {"message": f"Unrecognized request argument supplied: {parameter}"}
                }
                return self.reply(400, json.dumps(error).encode())
        user = body["messages"][-1]["content"]
        if len(user) > MAX_CHARS:
            error = {"error": {"message": f"This model's maximum context length is {MAX_CHARS}"}}
            return self.reply(400, json.dumps(error).encode())
        message = {"role": "assistant", "content": scripted_verdict(user), "refusal": None}
        if fault == "refuse":
            message = {"role": "assistant", "content": None, "refusal": "I can't grade that."}
        elif fault == "chatter":
            message["content"] = "Sure! I would give this response a 1."
        elif "response_format" in body and message["content"] in verifiers.JUDGE_SCORES:
            message["content"] = json.dumps({"score": message["content"]})
        answer = {
            "choices": [{"message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(user) // 4, "completion_tokens": 3},
        }
        with server.lock:
            server.n_verdicts += 1
        self.reply(200, json.dumps(answer).encode())
