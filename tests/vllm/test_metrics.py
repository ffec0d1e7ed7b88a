"""Parsing vLLM /metrics (nonsense figures rejected) and reading it within a deadline, over real HTTP."""

from __future__ import annotations

import gzip
import math
import re
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.errors import ConfigurationError, MetricsError
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import metrics as metrics_module
from prefixroute.vllm.metrics import MAX_METRICS_BYTES, TTFT_BUCKETS, fetch_metrics, metrics_url, parse_metrics

from ..conftest import DEADLINE_S, returns, wait_until
from .conftest import SMALL_BODY, answer, http_server


@pytest.mark.parametrize("legacy", [False, True])
def test_parse_reads_load_cache_config_counters_and_histogram(legacy: bool) -> None:
    with FakeVLLM(num_blocks=333, legacy_metric_names=legacy) as engine:
        engine.complete(list(range(64)))
        engine.complete(list(range(64)), hold=True)
        engine.set_load(running=2, waiting=5)
        metrics = parse_metrics(engine.metrics_text())
    assert (metrics.running, metrics.waiting) == (3, 5)
    assert metrics.kv_usage == pytest.approx(4 / 333)
    assert (metrics.prefix_queries, metrics.prefix_hits, metrics.hit_rate) == (
        128,
        48,
        0.375,
    )  # 3 of 4 blocks: vLLM computes the last token
    assert (metrics.block_size, metrics.num_gpu_blocks) == (16, 333)
    assert metrics.ttft_count == 2 and metrics.ttft_buckets[-1] == (math.inf, 2.0)
    assert [b for b, _ in metrics.ttft_buckets] == sorted(b for b, _ in metrics.ttft_buckets)


@pytest.mark.parametrize("legacy", [False, True])
def test_the_fake_engines_metrics_are_vllms_families_types_and_label_sets(legacy: bool) -> None:
    # What a Prometheus scraper of vLLM reads (vllm/v1/metrics/loggers.py): each family's name and type, and every
    # series labelled model_name and engine, vllm:cache_config_info by the cache config and its engine
    # (log_metrics_info adds "engine" to the config's labels); prometheus_client's registry adds a _created gauge
    # to each counter and histogram, and its process collector process_start_time_seconds (no labels), as vLLM's
    # single-process one does. Was: the info gauge without its engine; no process start time.
    with FakeVLLM(num_blocks=333, model="m", legacy_metric_names=legacy) as engine:
        engine.complete(list(range(40)))
        families = {family.name: family for family in text_string_to_metric_families(engine.metrics_text())}
    prefix, usage = ("vllm:gpu_", "vllm:gpu_cache_usage_perc") if legacy else ("vllm:", "vllm:kv_cache_usage_perc")
    assert {name: family.type for name, family in families.items() if not name.endswith("_created")} == {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", usage: "gauge",
        f"{prefix}prefix_cache_queries": "counter", f"{prefix}prefix_cache_hits": "counter",
        "vllm:time_to_first_token_seconds": "histogram", "vllm:cache_config_info": "gauge",
        "process_start_time_seconds": "gauge"}  # fmt: skip
    info = {"block_size": "16", "num_gpu_blocks": "333", "enable_prefix_caching": "True", "engine": "0"}
    for name, family in families.items():
        for sample in family.samples:
            labels = {key: value for key, value in sample.labels.items() if key != "le"}
            expected = {"vllm:cache_config_info": info, "process_start_time_seconds": {}}
            assert labels == expected.get(name, {"engine": "0", "model_name": "m"})
    values = {sample.name: sample.value for family in families.values() for sample in family.samples}
    assert (values[f"{prefix}prefix_cache_queries_total"], values[f"{prefix}prefix_cache_hits_total"]) == (40, 0)
    assert values["vllm:cache_config_info"] == 1 and values["vllm:time_to_first_token_seconds_count"] == 1
    ttft = families["vllm:time_to_first_token_seconds"].samples
    assert [float(s.labels["le"]) for s in ttft if s.name.endswith("_bucket")] == [*TTFT_BUCKETS, math.inf]


def test_parse_reads_the_histograms_count_and_sum_and_a_full_kv_cache() -> None:
    text = (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} 2\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 3\n'
        "vllm:time_to_first_token_seconds_count 4\n"
        "vllm:time_to_first_token_seconds_sum 1.25\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        "vllm:kv_cache_usage_perc 1.0\n"
    )
    metrics = parse_metrics(text)
    assert (metrics.ttft_count, metrics.ttft_sum) == (4.0, 1.25)  # the histogram's own _count, not its last bucket
    assert metrics.kv_usage == 1.0  # a full cache is a fraction in [0, 1]


def test_parse_sums_engines_and_averages_kv_usage() -> None:
    text = """
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2
vllm:num_requests_waiting{engine="1",model_name="m"} 3
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"} 1
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 2
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1"} 3
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf"} 3
vllm:time_to_first_token_seconds_count{engine="0"} 2
vllm:time_to_first_token_seconds_count{engine="1"} 3
"""
    metrics = parse_metrics(text)
    assert metrics.waiting == 5 and metrics.kv_usage == pytest.approx(0.4) and metrics.running is None
    assert metrics.num_gpu_blocks is None
    # Was 4 x 1000 blocks, four times the server's: vLLM sums its data-parallel engines' blocks into the one cache
    # config at start-up (wait_for_engine_startup, "Sum values from all engines in DP case") and its metrics logger
    # labels that config with every engine index, so each series carries the server's total.
    info = 'vllm:cache_config_info{{block_size="16",engine="{}",num_gpu_blocks="{}"}} 1\n'
    lines = [info.format(engine, 1000) for engine in range(4)]
    both = parse_metrics(text + "# TYPE vllm:cache_config_info gauge\n" + "".join(lines))
    assert (both.block_size, both.num_gpu_blocks) == (16, 1000)
    # Series that disagree (not what vLLM writes): the largest, not a sum.
    lines[2] = info.format(2, 1200)
    assert parse_metrics(text + "".join(lines)).num_gpu_blocks == 1200
    assert metrics.ttft_buckets == ((0.1, 4.0), (math.inf, 5.0)) and metrics.ttft_count == 5
    assert metrics.hit_rate is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("this is { not prometheus\n", "not Prometheus text"),
        ('vllm:num_requests_waiting{engine="0"} lots\n', "not Prometheus text"),
        ("# TYPE http_requests_total counter\nhttp_requests_total 3\n", "no vLLM metrics"),
        ("", "no vLLM metrics"),
    ],
)
def test_unreadable_text_raises_metrics_error(text: str, message: str) -> None:
    with pytest.raises(MetricsError, match=message):
        parse_metrics(text)


GOOD = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 2
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1
"""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOOD.replace("} 2", "} NaN"), "is nan"),
        (GOOD.replace("} 2", "} +Inf"), "is inf"),
        (GOOD.replace("} 2", "} -3"), "is -3"),
        (GOOD.replace("} 2", '} 1e308\nvllm:num_requests_waiting{engine="1"} 1e308'), "waiting sums to inf"),
        (
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 1e308\n'
            'vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf"} 1e308\n',
            "bucket.*sums to inf",
        ),
        ('# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 1.5\n', "KV cache usage"),
        (GOOD.replace('block_size="16"', 'block_size="0"'), "block_size is '0'"),
        (GOOD.replace('block_size="16"', 'block_size="-16"'), "block_size"),
        (GOOD.replace('block_size="16"', 'block_size="nan"'), "block_size"),
        (GOOD.replace('block_size="16"', 'block_size="sixteen"'), "not a number"),
        (GOOD.replace('num_gpu_blocks="100"', 'num_gpu_blocks="0"'), "num_gpu_blocks"),
        (GOOD.replace('num_gpu_blocks="100"', 'num_gpu_blocks="1e400"'), "num_gpu_blocks"),
        (GOOD.replace('num_gpu_blocks="100"', 'num_gpu_blocks="1e30"'), "at most"),
        (GOOD.replace('num_gpu_blocks="100"', 'num_gpu_blocks="12.5"'), "positive int"),
        (GOOD.replace('block_size="16"', f'block_size="{2**20 + 1}"'), "block_size is '1048577': .* at most 1048576"),
        (
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            'vllm:time_to_first_token_seconds_bucket{le="0.1"} 5\n'
            'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 3\n',
            "not cumulative",
        ),
        (
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            'vllm:time_to_first_token_seconds_bucket{le="-5"} 50\n'
            'vllm:time_to_first_token_seconds_bucket{le="-1"} 100\n'
            'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 100\n',
            "le=-5: a time to first token is not negative",
        ),
    ],
)
def test_nonsense_figures_are_metrics_errors_naming_the_figure(text: str, message: str) -> None:
    with pytest.raises(MetricsError, match=message):
        parse_metrics(text)


def test_unset_cache_config_labels_are_unknown_not_errors() -> None:
    metrics = parse_metrics(GOOD.replace('num_gpu_blocks="100"', 'num_gpu_blocks="None"'))
    assert (metrics.block_size, metrics.num_gpu_blocks) == (16, None)
    # An empty label is no label (Prometheus reads them alike).
    assert parse_metrics(GOOD.replace('block_size="16"', 'block_size=""')).block_size is None
    # One engine's unset block size leaves the one another engine reported.
    second = 'vllm:cache_config_info{block_size="None",engine="1",num_gpu_blocks="50"} 1\n'
    assert parse_metrics(GOOD + second).block_size == 16


def test_a_histogram_bucket_without_a_bound_is_passed_over() -> None:
    text = (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} 2\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0"} 9\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 3\n'
    )
    assert parse_metrics(text).ttft_buckets == ((0.1, 2.0), (math.inf, 3.0))


def test_cache_config_takes_every_positive_int_up_to_its_bound() -> None:
    # A block of one token up to 2**20 tokens; a block count far past that (2**40 engines' blocks at most).
    for block_size, blocks in ((1, 1), (2**20, 2**20 + 1), (16, 2**40)):
        text = GOOD.replace('block_size="16"', f'block_size="{block_size}"')
        metrics = parse_metrics(text.replace('num_gpu_blocks="100"', f'num_gpu_blocks="{blocks}"'))
        assert (metrics.block_size, metrics.num_gpu_blocks) == (block_size, blocks)


def test_fetch_reads_a_live_engine_and_reports_failures_as_metrics_errors(refused_port: Callable[[], int]) -> None:
    with FakeVLLM(num_blocks=77) as engine:
        engine.set_load(waiting=3)
        assert fetch_metrics(engine.url + "/metrics", timeout=2).num_gpu_blocks == 77
        with pytest.raises(MetricsError, match="404"):
            fetch_metrics(engine.url + "/nothing", timeout=2)
        engine.set_metrics_fault(text="<html>502</html>")
        with pytest.raises(MetricsError, match="not Prometheus text"):
            fetch_metrics(engine.url + "/metrics", timeout=2)
    with pytest.raises(MetricsError, match="cannot read"):
        fetch_metrics(f"http://127.0.0.1:{refused_port()}/metrics", timeout=2)
    with pytest.raises(MetricsError, match="cannot read"):
        fetch_metrics("http://", timeout=2)


# An answer that outlasts the test (DEADLINE_S): ten minutes late, or a megabyte trickled one byte every 0.05 s, each
# read well within the timeout; so only the timeout of the whole read can end it.
_NEVER: dict[str, dict[str, Any]] = {"slow": {"delay": 600.0}, "trickling": {"text": "#" * 2**20, "trickle": 0.05}}


@pytest.mark.parametrize("fault", sorted(_NEVER))
def test_the_timeout_bounds_the_whole_read_of_a_slow_or_trickling_engine(fault: str) -> None:
    with FakeVLLM() as engine:
        engine.set_metrics_fault(**_NEVER[fault])
        with pytest.raises(MetricsError, match="no complete answer within 0.5s"):
            returns(lambda: fetch_metrics(engine.url + "/metrics", timeout=0.5), what="fetch_metrics(timeout=0.5)")


@pytest.mark.parametrize(
    "fault", [{"delay": 0.05}, {"trickle": 0.001}, {"delay": 0.05, "trickle": 0.001}], ids=["late", "trickled", "both"]
)
def test_a_late_or_trickled_metrics_answer_arrives_whole_as_vllms(fault: dict[str, float]) -> None:
    # What a client reads from an engine that is slow but does answer: the whole body, with vLLM's status and
    # headers (its length in bytes, not characters). Was untested: a late answer that never came, a trickled one
    # with bytes lost or repeated, a 201 or headers missing would all have passed the timeout tests above.
    text = SMALL_BODY.decode() + 'vllm:num_requests_running{engine="0",model_name="modèle"} 1\n'
    with FakeVLLM() as engine:
        engine.set_metrics_fault(text=text, **fault)
        reply = httpx.get(engine.url + "/metrics", timeout=DEADLINE_S)
        assert reply.status_code == 200 and reply.text == text
        assert reply.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert reply.headers["content-length"] == str(len(text.encode()))
        assert fetch_metrics(engine.url + "/metrics", timeout=DEADLINE_S).waiting == 3


@pytest.fixture
def header_trickler() -> Iterator[str]:
    """A URL whose server answers every request with a status line, then one byte of a header every 20 ms, for ever
    (while the client keeps the connection open)."""
    with http_server(lambda _: None) as (url, _):
        yield url


@pytest.mark.parametrize("shared_client", [False, True])
def test_an_abandoned_read_of_an_endpoint_trickling_its_headers_ends(header_trickler: str, shared_client: bool) -> None:
    """Was: each read of the headers is bounded by the timeout, but a byte arriving within it starts the next one, so
    the abandoned request's thread (and its connection) lived as long as the endpoint trickled: one more per scrape
    of a Fleet polling that engine."""
    with httpx.Client() as client:
        for _ in range(3):
            with pytest.raises(MetricsError, match="no complete answer within 0.2s"):
                fetch_metrics(header_trickler, timeout=0.2, client=client if shared_client else None)
        wait_until(
            lambda: not [t for t in threading.enumerate() if t.name == "prefixroute-scrape"],
            what="the abandoned requests' threads to end",
        )


def test_with_a_client_that_keeps_no_connection_a_read_trickled_on_a_later_request_ends_too() -> None:
    """The advice of fetch_metrics' docs (and what the Fleet does): each request connects afresh, so each socket is
    one the request opened and can shut down when it is abandoned."""
    later_requests_trickle = http_server(lambda n: answer(SMALL_BODY) if n == 0 else None)
    with later_requests_trickle as (url, accepted), httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
        assert fetch_metrics(url, timeout=2, client=c).waiting == 3
        with pytest.raises(MetricsError, match="no complete answer within 0.2s"):
            fetch_metrics(url, timeout=0.2, client=c)
        wait_until(
            lambda: not [t for t in threading.enumerate() if t.name == "prefixroute-scrape"],
            what="the abandoned request's thread to end",
        )
        assert len(accepted) == 2


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    ("coding", "pack"),
    [("gzip", gzip.compress), ("x-gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", raw_deflate),
     ("identity", bytes), ("", bytes)],
    ids=["gzip", "x-gzip", "deflate", "raw-deflate", "identity", "none"],
)  # fmt: skip
def test_a_compressed_body_is_inflated(coding: str, pack: Callable[[bytes], bytes]) -> None:
    with http_server(lambda _: answer(pack(SMALL_BODY), f"Content-Encoding: {coding}")) as (url, _):
        metrics = fetch_metrics(url, timeout=5)
    assert (metrics.waiting, metrics.running) == (3, 1)


def test_a_compressed_bomb_is_refused_with_about_the_cap_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: the cap was checked on what httpx had inflated, a whole network chunk at a time (up to 64 KiB of gzip,
    ~1000 times that inflated) before the first check."""
    cap = 1 << 20
    monkeypatch.setattr(metrics_module, "MAX_METRICS_BYTES", cap)
    packer = zlib.compressobj(9, wbits=zlib.MAX_WBITS | 16)
    zeros = bytes(1 << 20)
    bomb = b"".join(packer.compress(zeros) for _ in range(256)) + packer.flush()  # 256 MiB in ~250 KiB
    with http_server(lambda _: answer(bomb, "Content-Encoding: gzip")) as (url, _), httpx.Client() as client:
        tracemalloc.start()
        try:
            with pytest.raises(MetricsError, match=f"the body is over {cap} bytes"):
                fetch_metrics(url, timeout=5, client=client)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < cap + (2 << 20)  # the cap, a network chunk, and change


def test_a_body_inflated_over_several_chunks_holds_at_most_a_byte_past_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    # Half the cap arrives inflated from a first chunk; the next may inflate to no more than what is left of the cap
    # and a byte (a byte past it proves the body over it), not a whole cap more on top of what is held.
    cap = 1 << 20
    monkeypatch.setattr(metrics_module, "MAX_METRICS_BYTES", cap)
    packer = zlib.compressobj(9, wbits=zlib.MAX_WBITS | 16)
    first = packer.compress(bytes(cap // 2)) + packer.flush(zlib.Z_SYNC_FLUSH)
    bomb = b"".join(packer.compress(bytes(1 << 20)) for _ in range(8)) + packer.flush()
    body = metrics_module._Body("http://gpu0:8000/metrics", "gzip")
    body.add(first)
    tracemalloc.start()
    try:
        with pytest.raises(MetricsError, match=f"the body is over {cap} bytes"):
            body.add(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # zlib's output grows to about twice what it returns: the half left of the cap costs about the cap, where a whole
    # cap on top of what is held (1.5 caps) would cost about three.
    assert peak < 2 * cap


def test_a_body_of_exactly_the_cap_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "MAX_METRICS_BYTES", 1000)
    body = metrics_module._Body("http://gpu0:8000/metrics", "")
    body.add(b"#" * 1000)
    assert len(body.finish()) == 1000
    with pytest.raises(MetricsError, match="the body is over 1000 bytes"):
        body.add(b"#")


def test_fetch_asks_only_for_the_coding_it_inflates_within_the_cap() -> None:
    asked: list[str | None] = []

    def engine(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("Accept-Encoding"))
        return httpx.Response(200, stream=httpx.ByteStream(SMALL_BODY))

    with httpx.Client(transport=httpx.MockTransport(engine)) as client:
        assert fetch_metrics("http://gpu0:8000/metrics", client=client).waiting == 3
    assert asked == ["gzip"]  # not httpx's default, which adds deflate, and br or zstd where installed


def test_each_read_is_bounded_by_the_timeout_two_seconds_by_default() -> None:
    timeouts: list[dict[str, float]] = []

    def engine(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"])
        return httpx.Response(200, stream=httpx.ByteStream(SMALL_BODY))

    with httpx.Client(transport=httpx.MockTransport(engine)) as client:
        fetch_metrics("http://gpu0:8000/metrics", client=client)
        fetch_metrics("http://gpu0:8000/metrics", client=client, timeout=0.5)
    assert timeouts == [dict.fromkeys(("connect", "read", "write", "pool"), seconds) for seconds in (2.0, 0.5)]


def test_a_body_of_many_chunks_of_text_is_parsed_within_a_timeout_that_allows_it() -> None:
    text = many_engines_text(10_000).encode()  # 430 KB: the parsing looks at its deadline several times

    def engine(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=httpx.ByteStream(text))

    with httpx.Client(transport=httpx.MockTransport(engine)) as client:
        assert fetch_metrics("http://gpu0:8000/metrics", client=client, timeout=60).waiting == 10_000


def test_a_stray_byte_that_is_not_utf8_does_not_cost_the_scrape() -> None:
    def engine(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=httpx.ByteStream(b"# built by \xff\xfe\n" + SMALL_BODY))

    with httpx.Client(transport=httpx.MockTransport(engine)) as client:
        assert fetch_metrics("http://gpu0:8000/metrics", client=client).waiting == 3


def test_identity_beside_one_coding_is_that_coding() -> None:
    body = metrics_module._Body("http://gpu0:8000/metrics", "identity, GZIP")
    body.add(gzip.compress(SMALL_BODY))
    assert body.finish() == SMALL_BODY
    # Only a body labelled deflate may turn out to be raw deflate (as some servers send it): gzip is gzip.
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    with pytest.raises(MetricsError, match="its gzip body is corrupt"):
        metrics_module._Body("http://gpu0:8000/metrics", "gzip").add(raw.compress(SMALL_BODY) + raw.flush())


@pytest.mark.parametrize(
    ("body", "coding", "message"),
    [(gzip.compress(SMALL_BODY), "br", "encoded 'br'; prefixroute reads gzip, deflate or none"),
     (gzip.compress(gzip.compress(SMALL_BODY)), "gzip, gzip", "encoded 'gzip, gzip'"),
     (b"not gzip at all", "gzip", "gzip body is corrupt"),
     (gzip.compress(SMALL_BODY)[:-12], "gzip", "gzip body ends before its stream does"),
     (gzip.compress(SMALL_BODY) + b"trailing", "gzip", "goes on after the end of its gzip stream")],
    ids=["brotli", "stacked", "corrupt", "cut-short", "trailing-bytes"],
)  # fmt: skip
def test_a_body_whose_coding_cannot_be_read_is_a_metrics_error(body: bytes, coding: str, message: str) -> None:
    with (
        http_server(lambda _: answer(body, f"Content-Encoding: {coding}")) as (url, _),
        pytest.raises(MetricsError, match=message) as refused,
    ):
        fetch_metrics(url, timeout=5)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "timeout",
    [
        0,
        -1.0,
        float("nan"),
        float("inf"),
        "2",
        pytest.param(10**400, id="10**400"),
        pytest.param(10**5000, id="10**5000"),
        1e300,
    ],
)
def test_fetch_rejects_a_nonsense_timeout(timeout: object) -> None:
    with pytest.raises(ConfigurationError, match="timeout"):
        fetch_metrics("http://127.0.0.1:1", timeout=timeout)  # type: ignore[arg-type]


NAMES = st.sampled_from(
    [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:cache_config_info",
        "other_metric",
    ]
)
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(["NaN", "+Inf", "-Inf", "x", ""])
)
LABELS = st.dictionaries(
    st.sampled_from(["le", "block_size", "num_gpu_blocks", "engine"]),
    st.one_of(VALUES, st.text(max_size=6)),
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(NAMES, LABELS, VALUES), max_size=8), st.binary(max_size=40))
def test_any_text_parses_or_raises_metrics_error_and_what_parses_is_sane(
    samples: list[tuple[str, dict[str, str], str]], noise: bytes
) -> None:
    lines = []
    for name, labels, value in samples:
        rendered = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{name}{{{rendered}}} {value}")
    text = "\n".join(lines) + "\n" + noise.decode("latin-1")
    try:
        metrics = parse_metrics(text)
    except MetricsError:
        return
    figures = [metrics.running, metrics.waiting, metrics.kv_usage, metrics.prefix_queries, metrics.prefix_hits]
    assert all(f is None or (math.isfinite(f) and f >= 0) for f in figures)
    assert metrics.kv_usage is None or metrics.kv_usage <= 1
    assert all(v is None or v >= 1 for v in (metrics.block_size, metrics.num_gpu_blocks))
    counts = [count for _, count in metrics.ttft_buckets]
    assert counts == sorted(counts) and all(math.isfinite(c) for c in counts)


def test_a_series_repeated_in_the_text_counts_once() -> None:
    """One series (name and labels) is one figure, as Prometheus keeps it: a repeated line is not a second engine."""
    line = 'vllm:num_requests_waiting{engine="0",model_name="m"} 4\n'
    bucket = 'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7\n'
    text = line + line + 'vllm:num_requests_waiting{engine="1",model_name="m"} 1\n' + bucket + bucket
    metrics = parse_metrics(text)
    assert metrics.waiting == 5 and metrics.ttft_buckets == ((math.inf, 7.0),)
    # Under a TYPE line the three are one family: the repeat is passed over, not the rest of the family.
    assert parse_metrics("# TYPE vllm:num_requests_waiting gauge\n" + text).waiting == 5


def test_what_real_exposition_allows_parses() -> None:
    """Escaped label values, exponents, timestamps after values, comments anywhere, CRLF, a UTF-8 BOM."""
    text = (
        "\ufeff# a comment before anything\r\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting.\r\n"
        "# TYPE vllm:num_requests_waiting gauge\r\n"
        'vllm:num_requests_waiting{engine="0",model_name="a \\"quoted\\"\\nname\\\\"} 1e1 1700000000000\r\n'
        "# an odd comment between samples\r\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.5E0\r\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1e3",cache_dtype="auto"} 1.0\r\n'
    )
    metrics = parse_metrics(text)
    assert (metrics.waiting, metrics.running, metrics.block_size, metrics.num_gpu_blocks) == (10, 2.5, 16, 1000)


def test_an_empty_200_and_a_huge_body_are_metrics_errors() -> None:
    with FakeVLLM() as engine:
        engine.set_metrics_fault(text="")
        with pytest.raises(MetricsError, match="no vLLM metrics"):
            fetch_metrics(engine.url + "/metrics", timeout=5)
        engine.set_metrics_fault(text="#" * (MAX_METRICS_BYTES + 1024))
        with pytest.raises(MetricsError, match="over"):
            fetch_metrics(engine.url + "/metrics", timeout=5)


def test_without_a_count_the_histogram_counts_its_samples_by_its_last_bucket() -> None:
    text = (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} 40\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 100\n'
    )
    assert parse_metrics(text).ttft_count == 100
    assert parse_metrics(text + "vllm:time_to_first_token_seconds_count 100\n").ttft_count == 100


def many_engines_text(engines: int) -> str:
    lines = "".join(f'vllm:num_requests_waiting{{engine="{i}"}} 1\n' for i in range(engines))
    return "# TYPE vllm:num_requests_waiting gauge\n" + lines


@pytest.mark.parametrize("url", ["http://127.0.0.1:65537/metrics", "http://127.0.0.1:0", "ftp://gpu0", "http://"])
def test_fetch_metrics_refuses_a_url_it_cannot_reach_before_any_request(url: str) -> None:
    with pytest.raises(MetricsError, match=f"^cannot read {re.escape(url)}: .*{re.escape(repr(url))}"):
        fetch_metrics(url, timeout=1.0)


def test_parsing_stops_at_its_deadline() -> None:
    text = many_engines_text(10_000)
    with pytest.raises(MetricsError, match="not parsed by the deadline"):
        parse_metrics(text, deadline=time.monotonic() - 1.0)  # already past: stops at the first check
    assert parse_metrics(text, deadline=time.monotonic() + 600).waiting == 10_000
    assert parse_metrics(text).waiting == 10_000  # no deadline: 430 KB read without a look at the clock
    with pytest.raises(ConfigurationError, match="^deadline must be a time.monotonic"):
        parse_metrics(text, deadline=math.nan)  # was taken as no deadline: no instant is past NaN
    assert parse_metrics(text, deadline=10**400).waiting == 10_000  # an int past any float: was an OverflowError


def test_the_timeout_bounds_the_parsing_of_a_huge_valid_body_too() -> None:
    with FakeVLLM() as engine:
        engine.set_metrics_fault(text=many_engines_text(500_000))  # 22 MB: seconds to parse, far past 1 s
        with pytest.raises(MetricsError, match="within 1s"):  # parsed in full, it would be figures, not an error
            returns(lambda: fetch_metrics(engine.url + "/metrics", timeout=1.0), what="fetch_metrics(timeout=1.0)")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://gpu0:8000", "http://gpu0:8000/metrics"),
        ("http://gpu0:8000/", "http://gpu0:8000/metrics"),
        ("http://gpu0:8000/metrics", "http://gpu0:8000/metrics"),
        ("https://gpu0/vllm/metrics/", "https://gpu0/vllm/metrics"),
        ("http://gpu0:8000/?token=abc", "http://gpu0:8000/metrics?token=abc"),
        ("http://gpu0:8000/metrics?token=abc", "http://gpu0:8000/metrics?token=abc"),
        ("http://gpu0:8000#top", "http://gpu0:8000/metrics#top"),
        ("http://metrics", "http://metrics/metrics"),  # a host called metrics: no /metrics path yet
        ("http://gpu0:8000/?next=/a?b", "http://gpu0:8000/metrics?next=/a?b"),  # the query starts at the first ?
        ("http://gpu0:8000#a#b", "http://gpu0:8000/metrics#a#b"),  # and the fragment at the first #
        ("http://gpuX", "http://gpuX/metrics"),  # only slashes are trimmed
    ],
)
def test_metrics_url_adds_the_path_before_any_query(url: str, expected: str) -> None:
    assert metrics_url(url) == expected


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: parse_metrics(b"vllm:num_requests_running 1\n"), "text must be"),  # type: ignore[arg-type]
        (lambda: parse_metrics(None), "text must be the metrics text as a str"),  # type: ignore[arg-type]
        (lambda: parse_metrics("vllm:num_requests_running 1\n", deadline="soon"), "deadline"),  # type: ignore[arg-type]
        (lambda: metrics_url(8000), "url must be a str"),  # type: ignore[arg-type]
    ],
)
def test_arguments_of_the_wrong_type_are_type_errors_that_say_what_to_pass(call: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        call()  # type: ignore[operator]
