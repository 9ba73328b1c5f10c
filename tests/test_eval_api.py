"""eval.py --api-base: generation through an OpenAI-compatible server, against real servers on this
machine's loopback. A fault-injecting server of our own (429 with Retry-After, 500, a hang past the
timeout, a reset connection, malformed JSON, empty choices): every problem answered exactly once,
also across a kill -9 and --resume, the key in no file; the bad-input errors before any request; and
vLLM's own server on the tiny model, whose greedy samples and verdicts equal the local engine's (on
IFEval, where random text follows some instructions: a mix of right and wrong verdicts)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import data
import eval as eval_script
import verifiers

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-Zq81kV3"  # must appear in no file a run writes
N_PROBLEMS = 14
# problem i's first answer: FAULTS[i % 7]
FAULTS = [None, "429", "500", "hang", "reset", "not json", "no choices"]


class FaultServer(ThreadingHTTPServer):
    """/v1/models and /v1/completions (the synthetic task's test problems, answered right after
    r1_zero's "<think>"), with one fault per problem on its first request. Counts the good answers
    it sent for each problem."""

    def __init__(self, delay_s: float = 0.0):
        super().__init__(("127.0.0.1", 0), FaultHandler)
        self.delay_s, self.broken, self.lock = delay_s, set(), threading.Lock()
        self.asked, self.answered = {}, {}  # problem index -> requests, good answers
        examples = data.load("synthetic", "test")
        self.index = {data.render_prompt(ex, "r1_zero"): (i, ex) for i, ex in enumerate(examples)}
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class FaultHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status: int, body: bytes, headers: dict | None = None):
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self.reply(401, b'{"error": "no key"}')
        self.reply(200, json.dumps({"data": [{"id": "teacher"}]}).encode())

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server: FaultServer = self.server
        i, example = server.index[request["prompt"]]
        with server.lock:
            attempt = server.asked[i] = server.asked.get(i, 0) + 1
        time.sleep(server.delay_s)
        fault = FAULTS[i % 7] if attempt == 1 else None
        if i in server.broken:
            fault = "500"
        if fault == "429":
            return self.reply(429, b"{}", {"Retry-After": "0.2"})
        if fault == "500":
            return self.reply(500, b"{}")
        if fault == "hang":
            time.sleep(3)  # past the client's timeout of 1 s
            return self.reply(200, b"{}")
        if fault == "reset":
            self.connection.shutdown(socket.SHUT_RDWR)
            return None
        if fault == "not json":
            return self.reply(200, b'{"choices": [{"text": ')
        if fault == "no choices":
            return self.reply(200, json.dumps({"choices": [], "usage": {}}).encode())
        # An OpenAI server leaves out the stop string it stopped at ("</answer>"): eval.py puts it
        # back.
        answer = {
            "choices": [
                {"text": f" I add. </think> <answer> {example['answer']} ", "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 50 + i, "completion_tokens": 7},
        }
        with server.lock:
            server.answered[i] = server.answered.get(i, 0) + 1
        self.reply(200, json.dumps(answer).encode())


def api_args(server_url: str, out_dir: Path, **overrides) -> eval_script.Args:
    settings = dict(
        dataset="synthetic",
        split="test",
        limit=N_PROBLEMS,
        template="r1_zero",
        max_tokens=32,
        api_base=server_url,
        api_model="teacher",
        api_endpoint="completions",
        request_timeout=1.0,
        max_retries=2,
        out_dir=str(out_dir),
        api_key_env="TEST_TEACHER_KEY",
    )
    return eval_script.Args(**{**settings, **overrides})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_key_in_no_file(folder: Path, *more: Path):
    for path in [*folder.rglob("*"), *more]:
        if path.is_file():
            assert KEY not in path.read_text(errors="replace"), path


def test_every_fault_is_retried_each_problem_answered_once_and_resume_asks_only_the_failed(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("TEST_TEACHER_KEY", KEY)
    server = FaultServer()
    server.broken = {13}  # always HTTP 500: its retries run out
    pairs = tmp_path / "pairs.jsonl"
    run_dir = eval_script.main(api_args(server.url, tmp_path, save_sft_pairs=str(pairs)))
    records = read_jsonl(run_dir / "samples.jsonl")
    assert len(records) == N_PROBLEMS == len({r["id"] for r in records})  # each problem once
    (failed,) = [r for r in records if "failed" in r]
    assert failed["failed"] == "3 attempts; the last: HTTP 500"
    # each fault retried, once
    assert server.asked[13] == 3 and server.answered == {i: 1 for i in range(13)}
    # the fault, then the answer
    assert [server.asked[i] for i in range(7)] == [1, 2, 2, 2, 2, 2, 2]
    answered = [r for r in records if "failed" not in r]
    assert all(
        r["responses"][0].endswith("</answer>") and r["rewards"][0]["reward"] == 1 for r in answered
    )
    summary = json.loads((run_dir / "summary.json").read_text())["metrics"]
    assert (
        summary["eval/n_failed"] == 1
        and summary["eval/n_problems"] == 13
        and summary["eval/accuracy"] == 1
    )
    assert summary["usage/completion_tokens"] == 13 * 7 and summary["usage/prompt_tokens"] == sum(
        50 + i for i in range(13)
    )
    # the accepted samples, as sft.py reads them (the verifier's fields too)
    assert len(read_jsonl(pairs)) == 13
    rows = data.read_sft_file(str(pairs), ("prompt", "response", "answer", "verifier"))
    assert all(verifiers.score(row["response"], row)["reward"] == 1 for row in rows)

    server.broken = set()
    again = eval_script.main(
        api_args(server.url, tmp_path, resume=str(run_dir), save_sft_pairs=str(pairs))
    )
    assert again == run_dir
    records = read_jsonl(run_dir / "samples.jsonl")
    assert len(records) == N_PROBLEMS == len({r["id"] for r in records}) and not any(
        "failed" in r for r in records
    )
    # only the failed problem was asked again
    assert server.answered == {i: 1 for i in range(N_PROBLEMS)}
    assert json.loads((run_dir / "summary.json").read_text())["metrics"]["eval/n_failed"] == 0
    assert len(read_jsonl(pairs)) == N_PROBLEMS
    out = capsys.readouterr()
    assert KEY not in out.out + out.err
    assert_key_in_no_file(run_dir, pairs)


def test_a_kill_9_loses_at_most_the_requests_in_flight(tmp_path):
    server = FaultServer(delay_s=0.3)  # every request takes 0.3 s; faults as above
    command = [
        sys.executable,
        str(ROOT / "eval.py"),
        "--dataset",
        "synthetic",
        "--split",
        "test",
        "--limit",
        "40",
        "--template",
        "r1_zero",
        "--max-tokens",
        "32",
        "--api-base",
        server.url,
        "--api-model",
        "teacher",
        "--api-endpoint",
        "completions",
        "--request-timeout",
        "1",
        "--max-retries",
        "2",
        "--api-key-env",
        "TEST_TEACHER_KEY",
        "--out-dir",
        str(tmp_path),
        "--concurrency",
        "2",
    ]
    env = {**os.environ, "TEST_TEACHER_KEY": KEY}
    process = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline, samples = time.time() + 120, None
    while time.time() < deadline and process.poll() is None:
        samples = next(tmp_path.glob("*/samples.jsonl"), None)
        if samples and len(samples.read_text().splitlines()) >= 6:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    # killed mid-run, not finished
    assert samples is not None and process.returncode == -signal.SIGKILL
    written = len(samples.read_text().splitlines())
    assert 6 <= written < 40
    resumed = subprocess.run(
        [*command, "--resume", str(samples.parent)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    records = read_jsonl(samples)
    assert len(records) == 40 == len({r["id"] for r in records}) and not any(
        "failed" in r for r in records
    )
    # Answered twice only where the first run's answer was in flight at the kill: at most
    # --concurrency of them.
    assert sum(server.answered.values()) - 40 <= 2
    assert KEY not in resumed.stdout + resumed.stderr
    assert_key_in_no_file(samples.parent)


def test_bad_server_input_fails_before_any_request(tmp_path, monkeypatch):
    server = FaultServer()
    with pytest.raises(ValueError, match="--api-base needs --api-model"):
        eval_script.main(api_args(server.url, tmp_path, api_model=None))
    with pytest.raises(ValueError, match="it needs a key: set \\$TEST_TEACHER_KEY"):
        eval_script.main(api_args(server.url, tmp_path))  # the variable is unset
    monkeypatch.setenv("TEST_TEACHER_KEY", KEY)
    with pytest.raises(ValueError, match="does not serve 'student'.*it serves \\['teacher'\\]"):
        eval_script.main(api_args(server.url, tmp_path, api_model="student"))
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
    with pytest.raises(ValueError, match=f"cannot reach {url}: ConnectError"):
        eval_script.main(api_args(url, tmp_path))
    assert server.asked == {} and not list(tmp_path.iterdir())  # no request, no results folder


# --- vLLM's own OpenAI-compatible server on the tiny model ---


# Completions on IFEval, where the random tiny model's short answers follow some instructions ("no
# commas" & co.): measured 11 of 64 right and 9 distinct texts, so equal verdicts and equal texts
# have something to compare (its synthetic or GSM8K answers all score 0). Chat on the synthetic task:
# the random model writes one same text to every problem there (measured: 1 distinct, all 0), so
# the texts' equality proves little there; the prompt tokens the server counts, equal to our
# rendering's, show that its chat template renders the message as ours does (were the rendered
# prompt sent as the message, the server would wrap it twice). Texts equal, measured: 64 of 64 on
# both rows (AVX-512, 2 loaded cores).
@pytest.mark.parametrize(
    ("endpoint", "dataset", "template"),
    [("completions", "ifeval", "question"), ("chat", "synthetic", "chat")],
)
def test_vllm_serve_gives_the_local_engines_samples(
    vllm_server, tiny_model_dir, shared_data, tmp_path, endpoint, dataset, template
):
    common = dict(
        model=str(tiny_model_dir),
        dataset=dataset,
        split="test",
        data_dir=str(shared_data),
        limit=64,
        template=template,
        max_tokens=24,
        max_model_len=2048,
        out_dir=str(tmp_path),
    )
    local = read_jsonl(eval_script.main(eval_script.Args(**common)) / "samples.jsonl")
    served = eval_script.main(
        eval_script.Args(**common, api_base=vllm_server, api_model="tiny", api_endpoint=endpoint)
    )
    served = {r["id"]: r for r in read_jsonl(served / "samples.jsonl")}
    assert len(served) == 64 and not any("failed" in r for r in served.values())
    right = sum(r["rewards"][0]["reward"] == 1.0 for r in local)
    texts = {r["responses"][0] for r in local}
    same = [r for r in local if r["responses"] == served[r["id"]]["responses"]]
    print(f"{endpoint}: {len(same)} of 64 texts equal; {right} right; {len(texts)} distinct")
    if dataset == "ifeval":
        # a mix of right and wrong, and texts that differ between problems, or the equalities
        # below prove little
        assert 0 < right < 64 and len(texts) >= 5
    assert len(same) >= 62, [(r["responses"], served[r["id"]]["responses"]) for r in local][:3]
    for record in same:  # the same text: the same prompt, verdicts, token counts and finish
        for key in ("prompt", "rewards", "n_tokens", "finish_reasons"):
            assert served[record["id"]][key] == record[key], key
    # the prompt the server tokenized has ours's length: with chat, its template renders the user
    # message as ours does (the record's "prompt" is our rendering, on both sides)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for record in local:
        n_prompt = len(tokenizer(record["prompt"], add_special_tokens=False)["input_ids"])
        assert served[record["id"]]["usage"]["prompt_tokens"] == n_prompt, record["prompt"]
