"""Issue 10's sidecar contract driven black-box, from its text and docs/adapters.md alone: real ``prefixroute serve``
processes, plain HTTP and the command line. What test_serve.py, test_serve_contract_client.py and
test_http_contract_serve.py already check (the common bad bodies, methods, paths, nesting, surrogates, Content-Types,
the answer's fields, UDP lines) is not repeated; this adds the counts a refused request must (and must not) change,
exact unknown-finish counting, a strict reading of the Prometheus exposition, a sidecar without fixed backends, and
backend URLs on the command line that name one engine twice or carry a path."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixroute.adapters.serve.loopback import free_port, start_sidecar

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

BACKENDS = ["http://127.0.0.1:9301", "http://127.0.0.1:9302"]


class Client:
    """What a proxy author holds: the sidecar's base URL."""

    def __init__(self, port: int) -> None:
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20)

    def samples(self) -> Samples:
        reply = self.http.get("/metrics")
        assert reply.status_code == 200
        return parse_exposition(reply.text)

    def value(self, name: str, **labels: str) -> float:
        return self.samples().get((name, tuple(sorted(labels.items()))), 0.0)

    def total(self, name: str) -> float:
        return sum(v for (n, _), v in self.samples().items() if n == name)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Client]:
    """A sidecar with two fixed backends and a tokenizer (any model accepted)."""
    port, options = free_port(), ["--tokenizer", str(model_dir)]
    with start_sidecar(tmp_path_factory.mktemp("sidecar"), BACKENDS, port=port, options=options):
        client = Client(port)
        with client.http:
            yield client


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    """A sidecar started without --backends: every /route names its own."""
    port = free_port()
    with start_sidecar(tmp_path_factory.mktemp("bare"), [], port=port):
        client = Client(port)
        with client.http:
            yield client


# -- a strict reader of the text exposition format 0.0.4 --------------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(rf"({_NAME})(?:\{{((?:{_LABEL})(?:,{_LABEL})*)?,?\}})? (\S+)(?: -?\d+)?")
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], value)


def parse_exposition(text: str) -> Samples:
    """Every sample of ``text``, failing on anything Prometheus' own text parser refuses or a scrape would misread:
    a bad line, a label value with a raw quote or newline, a family typed twice or after its samples, a family's
    samples split apart, a series repeated, a histogram whose buckets fall or disagree with its count."""
    assert text.endswith("\n"), "the exposition must end with a line feed"
    samples: Samples = {}
    typed: dict[str, str] = {}
    done: set[str] = set()
    current: str | None = None
    for line in text[:-1].split("\n"):
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                assert re.fullmatch(_NAME, parts[2]), line
                if parts[1] == "TYPE":
                    assert parts[2] not in typed and parts[2] not in done, f"TYPE repeated or late: {line}"
                    assert len(parts) == 4 and parts[3] in _TYPES, line
                    typed[parts[2]] = parts[3]
            continue
        match = _SAMPLE.fullmatch(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        family = next((f for f, kind in typed.items() for s in _SUFFIXES.get(kind, ("",)) if name == f + s), name)
        if family != current:
            assert family not in done, f"the samples of {family} are split apart"
            if current is not None:
                done.add(current)
            current = family
        pairs = tuple(sorted((k, _unescape(v)) for k, v in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"',
                                                                       labels or "")))  # fmt: skip
        assert len({k for k, _ in pairs}) == len(pairs), f"a label repeated: {line}"
        assert (name, pairs) not in samples, f"series repeated: {line}"
        number = float(value)  # "NaN", "+Inf", "-Inf" too; anything else raises
        if typed.get(family) == "counter" or name.endswith(("_count", "_bucket")):
            assert number >= 0 and not math.isnan(number), line
        samples[(name, pairs)] = number
    for family, kind in typed.items():
        if kind == "histogram":
            buckets = sorted((float(dict(ls)["le"]), v) for (n, ls), v in samples.items() if n == f"{family}_bucket")
            assert buckets and buckets[-1][0] == math.inf, f"{family} has no +Inf bucket"
            assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False)), f"{family} buckets fall"
            assert buckets[-1][1] == samples[(f"{family}_count", ())], f"{family}: +Inf bucket is not the count"
    return samples


def assert_error(reply: httpx.Response, status: int) -> str:
    assert reply.status_code == status, (reply.status_code, reply.text)
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    assert "Traceback" not in body["error"]
    return str(body["error"])


# -- refused requests: a JSON error, counted under their status, and no other count changes ---------------------------

REFUSED: list[tuple[str, bytes, str]] = [
    ("/route", b'{"prompt_token_ids": [1], "lease": true}', "$.lease"),
    ("/route", b'{"prompt_token_ids": [1], "lease": [5]}', "$.lease"),
    ("/route", b'{"prompt_token_ids": [1], "backends": [true]}', "$.backends[0]"),
    ("/route", b'{"prompt_token_ids": "1,2"}', "$.prompt_token_ids"),
    ("/route", b'{"prompt_token_ids": null, "prompt": null, "messages": null}', "exactly one of"),
    ("/route", b'{"messages": []}', "messages"),
    # a content part's type was not checked: one typed 5 or null was silently left out of the prompt routed
    ("/route", b'{"messages": [{"role": "user", "content": [{"type": 5, "text": "x"}]}]}', "content[0].type"),
    ("/route", b'{"messages": [{"role": "user", "content": [{"type": null, "text": "x"}]}]}', "content[0].type"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": ["text"]}]}]}', "content[0].type"),
    ("/first_token", b"{}", "id"),
    ("/finish", b'{"id": "x", "refused": null}', "$.refused"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw", "names"), REFUSED, ids=[f"{p}:{r[:50]!r}" for p, r, _ in REFUSED])
def test_a_refused_body_names_its_field_and_only_counts_as_a_bad_request(
    client: Client, path: str, raw: bytes, names: str
) -> None:
    before = client.samples()
    error = assert_error(client.http.post(path, content=raw), 400)
    assert names in error
    after = client.samples()
    changed = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
    assert changed == {("prefixroute_bad_requests_total", (("status", "400"),))}, changed
    assert after[("prefixroute_bad_requests_total", (("status", "400"),))] == (
        before.get(("prefixroute_bad_requests_total", (("status", "400"),)), 0) + 1
    )


def test_optional_fields_sent_as_null_and_unknown_fields_are_ignored(client: Client) -> None:
    body = {"prompt_token_ids": [1, 2, 3], "model": None, "lease": None, "backends": None, "prompt": None,
            "messages": None, "stream": True, "user": {"nested": [1, {"x": None}]}}  # fmt: skip
    answer = client.http.post("/route", json=body)
    assert answer.status_code == 200, answer.text
    decision = answer.json()["id"]
    assert client.http.post("/finish", json={"id": decision, "extra": [1]}).json() == {"id": decision}
    assert client.total("prefixroute_in_flight") == 0


def test_repeated_and_unknown_reports_are_200_and_each_unknown_one_is_counted(client: Client) -> None:
    unknown = client.value("prefixroute_unknown_finishes_total")
    decision = client.http.post("/route", json={"prompt_token_ids": [9, 9, 9]}).json()["id"]
    for path in ("/first_token", "/first_token", "/finish"):  # the request is in flight for each of these
        assert client.http.post(path, json={"id": decision}).json() == {"id": decision}
    assert client.value("prefixroute_unknown_finishes_total") == unknown
    for path, report in [("/finish", decision), ("/first_token", decision), ("/finish", "never-issued"),
                         ("/first_token", ""), ("/finish", "x" * 10_000)]:  # fmt: skip
        reply = client.http.post(path, json={"id": report})
        assert reply.status_code == 200 and reply.json() == {"id": report}
    assert client.value("prefixroute_unknown_finishes_total") == unknown + 5
    assert client.total("prefixroute_in_flight") == 0


def test_metrics_stay_a_valid_exposition_whatever_backend_ids_requests_name(client: Client) -> None:
    odd = ['a"b', "a\\b", "a\nb", "a\rb", "\t", "é\u2028", "x}y", '{le="1"}', 'a="b",c="d']
    decisions = []
    for backend in odd:
        reply = client.http.post("/route", json={"prompt_token_ids": [1, 2], "backends": [backend]})
        assert reply.status_code == 200 and reply.json()["backend"] == backend, reply.text
        decisions.append(reply.json()["id"])
    client.http.post("/finish", content=b"{")
    client.http.get("/nowhere")
    client.http.put("/route")
    samples = client.samples()  # parse_exposition fails on anything malformed
    for backend in odd:
        assert samples[("prefixroute_in_flight", (("backend", backend),))] == 1
    for decision in decisions:
        client.http.post("/finish", json={"id": decision})
    samples = client.samples()
    assert all(v == 0 for (n, _), v in samples.items() if n == "prefixroute_in_flight")
    for status in ("400", "404", "405"):
        assert samples[("prefixroute_bad_requests_total", (("status", status),))] >= 1


# -- a sidecar without --backends ------------------------------------------------------------------------------------


def test_without_fixed_backends_a_route_must_name_them_and_the_pick_mode_says_to_start_with_them(bare: Client) -> None:
    assert "'backends'" in assert_error(bare.http.post("/route", json={"prompt_token_ids": [1]}), 400)
    # The pick mode forwards the client's OpenAI body, which cannot carry 'backends': the error told it to send them.
    for path, body in [("/v1/completions", {"prompt": [1, 2]}),
                       ("/v1/completions", {"prompt": [1, 2], "backends": ["http://127.0.0.1:9303"]})]:  # fmt: skip
        error = assert_error(bare.http.post(path, json=body), 400)
        assert "start the sidecar with --backends" in error and "send 'backends'" not in error, error
    answer = bare.http.post("/route", json={"prompt_token_ids": [1], "backends": ["http://127.0.0.1:9303"]})
    assert answer.status_code == 200 and answer.json()["backend"] == "http://127.0.0.1:9303"
    bare.http.post("/finish", json={"id": answer.json()["id"]})
    assert bare.total("prefixroute_in_flight") == 0


# -- the command line -------------------------------------------------------------------------------------------------


def test_a_backend_url_with_a_trailing_slash_is_routed_without_it(tmp_path: Path) -> None:
    """nginx's ``proxy_pass $prefixroute_backend`` replaces the request's path with a URL's own: a backend announced
    as ``http://host:port/`` in X-Prefixroute-Backend sent every completion to ``/``."""
    port = free_port()
    with start_sidecar(tmp_path, [BACKENDS[0] + "/", BACKENDS[1]], port=port):
        for prompt in ([1, 2, 3], [4, 5, 6]):  # one request to each backend (the second is the less loaded)
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": prompt})
            assert reply.status_code == 200 and reply.headers["X-Prefixroute-Backend"] in BACKENDS, reply.headers
        metrics = parse_exposition(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
        assert {dict(ls)["backend"] for n, ls in metrics if n == "prefixroute_in_flight"} == set(BACKENDS)


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefixroute", "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=15, check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backends", "http://127.0.0.1:9301", "http://127.0.0.1:09301"], "127.0.0.1:9301"),
        (["--backends", "http://127.0.0.1:80", "http://127.0.0.1"], "127.0.0.1:80"),
        (["--backends", "http://gpu0:8000", "HTTP://GPU0:8000/"], "gpu0:8000"),
        # the second publisher of a backend silently replaced the first
        (["--backends", "http://127.0.0.1:9301", "--kv-events", "http://127.0.0.1:9301=tcp://127.0.0.1:5557",
          "http://127.0.0.1:9301/=tcp://127.0.0.1:5558"], "--kv-events names backend 'http://127.0.0.1:9301' twice"),
    ],
    ids=["leading-zero-port", "default-port", "case-and-slash", "kv-events-twice"],
)  # fmt: skip
def test_one_engine_named_twice_on_the_command_line_exits_2_with_one_line(args: list[str], message: str) -> None:
    """Each spelling passed as a backend of its own: the engine got twice its share and half its cache hits."""
    done = serve(*args)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert message in done.stderr, done.stderr
