"""The remote reward client against real HTTP servers on 127.0.0.1 (http.server in a thread)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mcore_rl.config.reward import RemoteRewardConfig, RewardConfig
from mcore_rl.rewards import RewardManager
from mcore_rl.rewards.remote import RemoteReward, RemoteRewardError
from mcore_rl.types import Sample


class RewardServer:
    """Scores each sample with len(response); `behaviour(n)` picks what the n-th request (1-based) gets."""

    def __init__(self, behaviour):
        self.requests: list[dict] = []
        self.release = threading.Event()  # lets slow handlers finish when the test ends
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                kind = behaviour(len(server.requests))
                if kind == "slow":
                    server.release.wait(timeout=30)
                    kind = "ok"
                if kind == "ok":
                    payload = json.dumps({"rewards": [len(s["response"]) for s in body["samples"]]}).encode()
                    self._send(200, payload)
                elif kind == "malformed":
                    self._send(200, b'{"rewards": [1.0,')
                elif kind == "short":
                    self._send(200, b'{"rewards": []}')
                else:
                    self._send(int(kind), b"busy")

            def _send(self, status, payload):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self):
        if self.thread.is_alive():
            self.release.set()
            self.httpd.shutdown()
            self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(behaviour):
        servers.append(RewardServer(behaviour))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def samples(*responses):
    return [
        Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason="stop", prompt_text="p",
               response_text=r, meta={"answer": "7", "numbers": [1, 2]})
        for r in responses
    ]  # fmt: skip


def client(url, **kwargs):
    return RemoteReward(url, **{"timeout_s": 5.0, "backoff_s": 0.01, "backoff_max_s": 0.02, **kwargs})


def test_scores_a_batch_and_sends_prompt_response_meta(serve):
    server = serve(lambda n: "ok")
    assert client(server.url)(samples("a", "bbb")) == [1.0, 3.0]
    assert server.requests == [
        {"samples": [
            {"prompt": "p", "response": "a", "meta": {"answer": "7", "numbers": [1, 2]}},
            {"prompt": "p", "response": "bbb", "meta": {"answer": "7", "numbers": [1, 2]}},
        ]}
    ]  # fmt: skip


def test_retries_server_errors_then_succeeds(serve):
    server = serve(lambda n: "503" if n <= 2 else "ok")
    assert client(server.url, max_retries=3)(samples("xy")) == [2.0]
    assert len(server.requests) == 3


def test_retries_429(serve):
    server = serve(lambda n: "429" if n == 1 else "ok")
    assert client(server.url, max_retries=1)(samples("xy")) == [2.0]
    assert len(server.requests) == 2


def test_gives_up_after_max_retries(serve):
    server = serve(lambda n: "500")
    with pytest.raises(RemoteRewardError, match=r"failed after 3 attempts; last error: HTTP 500: 'busy'"):
        client(server.url, max_retries=2)(samples("xy"))
    assert len(server.requests) == 3


def test_times_out_on_a_slow_server_and_retries(serve):
    server = serve(lambda n: "slow" if n == 1 else "ok")
    assert client(server.url, timeout_s=0.5, max_retries=1)(samples("abc")) == [3.0]
    assert len(server.requests) == 2
    always_slow = serve(lambda n: "slow")
    with pytest.raises(RemoteRewardError, match="failed after 2 attempts; last error: ReadTimeout"):
        client(always_slow.url, timeout_s=0.5, max_retries=1)(samples("abc"))


def test_malformed_json_is_reported_and_not_retried(serve):
    server = serve(lambda n: "malformed")
    with pytest.raises(RemoteRewardError, match=r"returned malformed JSON: '\{\"rewards\": \[1.0,'"):
        client(server.url, max_retries=3)(samples("a"))
    assert len(server.requests) == 1


def test_wrong_number_of_rewards_is_reported(serve):
    server = serve(lambda n: "short")
    with pytest.raises(RemoteRewardError, match=r'must return \{"rewards": \[...\]\} with 1 numbers'):
        client(server.url)(samples("a"))


def test_client_errors_are_not_retried(serve):
    server = serve(lambda n: "400")
    with pytest.raises(RemoteRewardError, match="refused the request: HTTP 400"):
        client(server.url, max_retries=3)(samples("a"))
    assert len(server.requests) == 1


def test_connection_refused_is_retried_then_reported(serve):
    server = serve(lambda n: "ok")
    url = server.url
    server.close()  # nothing listens on that port any more
    with pytest.raises(RemoteRewardError, match="failed after 2 attempts; last error: ConnectionError"):
        client(url, max_retries=1)(samples("a"))


def test_manager_batches_requests_and_counts_failed_batches(serve):
    server = serve(lambda n: "malformed" if n == 2 else "ok")
    remote = RemoteRewardConfig(url=server.url, batch_size=2, max_retries=0, backoff_s=0.0, backoff_max_s=0.0)
    cfg = RewardConfig(name="remote", remote=remote, num_workers=1, fallback_reward=-1.0)
    with RewardManager(cfg) as manager:
        batch = samples("a", "bb", "ccc", "dddd", "eeeee")
        metrics = manager.score(batch)
    # One worker sends the chunks in order: the second request (samples 2 and 3) gets malformed JSON.
    assert [s.reward for s in batch] == [1.0, 2.0, -1.0, -1.0, 5.0]
    assert metrics["reward/num_errors"] == 2.0 and metrics["reward/num_timeouts"] == 0.0
    assert [len(r["samples"]) for r in server.requests] == [2, 2, 1]
