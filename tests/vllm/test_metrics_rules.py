"""Rules of reading /metrics that the broader tests in test_metrics.py leave open: each pins one documented rule."""

from __future__ import annotations

import gzip
import math
import re
import threading
import time
import types
import zlib

import httpx
import pytest

from prefixroute.errors import ConfigurationError, MetricsError
from prefixroute.vllm import metrics as metrics_module
from prefixroute.vllm.metrics import fetch_metrics, metrics_url, parse_metrics

from .conftest import SMALL_BODY

URL = "http://gpu0:8000/metrics"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://gpu0:8000/v1", "http://gpu0:8000/v1/metrics"),  # a path of its own gets /metrics after it
        ("http://gpu0:8000/metrics/v1", "http://gpu0:8000/metrics/v1/metrics"),  # /metrics not at the end
        ("https://gw/engines/gpu0?token=abc", "https://gw/engines/gpu0/metrics?token=abc"),
    ],
)
def test_metrics_url_appends_to_a_path_that_does_not_end_in_metrics(url: str, expected: str) -> None:
    assert metrics_url(url) == expected


@pytest.mark.parametrize(("url", "name"), [(8000, "int"), (b"http://gpu0:8000", "bytes"), (None, "NoneType")])
def test_metrics_url_of_a_non_str_names_the_type_it_was_given(url: object, name: str) -> None:
    with pytest.raises(TypeError, match=f"not {name}$"):
        metrics_url(url)  # type: ignore[arg-type]


def test_a_corrupt_compressed_body_names_the_url_it_came_from() -> None:
    def engine(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Encoding": "gzip"}, stream=httpx.ByteStream(b"not gzip at all"))

    with (
        httpx.Client(transport=httpx.MockTransport(engine)) as client,
        pytest.raises(MetricsError, match=f"^cannot read {URL}: its gzip body is corrupt"),
    ):
        fetch_metrics(URL, client=client)
    # Each refusal of the body's bytes names it, the cap and a cut-short stream too.
    cut = metrics_module._Body(URL, "gzip")
    cut.add(gzip.compress(SMALL_BODY)[:-12])
    with pytest.raises(MetricsError, match=f"^cannot read {URL}: its gzip body ends before its stream does"):
        cut.finish()


def _pieces_kept_under_a_cap_of(cap: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Lower MAX_METRICS_BYTES to ``cap``; the list returned fills with the length of each piece a body keeps."""
    monkeypatch.setattr(metrics_module, "MAX_METRICS_BYTES", cap)
    kept: list[int] = []
    keep = metrics_module._Body._keep

    def spy(self: metrics_module._Body, piece: bytes) -> None:
        kept.append(len(piece))
        keep(self, piece)

    monkeypatch.setattr(metrics_module._Body, "_keep", spy)
    return kept


def test_each_inflated_piece_is_at_most_a_byte_past_what_is_left_of_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    # The docstring's promise: the body is inflated at most a byte past MAX_METRICS_BYTES at a time. A byte past the
    # cap proves the body over it; two, or the whole chunk inflated at once, would hold more than needed.
    cap = 1000
    kept = _pieces_kept_under_a_cap_of(cap, monkeypatch)
    bomb = metrics_module._Body(URL, "gzip")
    packer = zlib.compressobj(9, wbits=zlib.MAX_WBITS | 16)
    first = packer.compress(bytes(cap // 2)) + packer.flush(zlib.Z_SYNC_FLUSH)
    rest = packer.compress(bytes(10 * cap)) + packer.flush()
    bomb.add(first)
    assert sum(kept) == cap // 2
    with pytest.raises(MetricsError, match=f"the body is over {cap} bytes"):
        bomb.add(rest)
    assert kept[1:] == [cap // 2 + 1]  # what was left of the cap and one byte: no more was inflated


def test_a_deflate_body_corrupt_after_its_first_bytes_is_not_retried_as_raw_deflate() -> None:
    # HTTP's deflate is zlib-wrapped; some servers send it raw, which shows in its first bytes. Once a zlib-wrapped
    # stream has inflated, a later fault is corruption: here a wrong checksum at its end.
    packer = zlib.compressobj(wbits=zlib.MAX_WBITS)
    first = packer.compress(SMALL_BODY) + packer.flush(zlib.Z_FULL_FLUSH)  # a fresh dictionary after this
    rest = bytearray(packer.compress(SMALL_BODY) + packer.flush())
    rest[-1] ^= 0xFF  # the Adler-32 checksum no longer matches
    body = metrics_module._Body(URL, "deflate")
    body.add(first)
    with pytest.raises(MetricsError, match="its deflate body is corrupt"):
        body.add(bytes(rest))


def test_the_deadline_is_looked_at_once_more_than_64_kib_of_text_has_been_read() -> None:
    # The first line ends exactly at 64 KiB: not more than 64 KiB yet, so the clock is first read after the next line,
    # and the error says how far the parsing got, of how much.
    first = "#" + "x" * ((1 << 16) - 2) + "\n"
    sample = "vllm:num_requests_waiting 1\n"
    text = first + sample * 10
    assert len(first) == 1 << 16
    read = len(first) + len(sample)
    with pytest.raises(MetricsError, match=f"^not parsed by the deadline: {read} of {len(text)} characters read$"):
        parse_metrics(text, deadline=time.monotonic() - 1.0)
    assert parse_metrics(text).waiting == 1  # the same series ten times: one figure


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: parse_metrics(b"vllm:num_requests_running 1\n"), "not bytes$"),  # type: ignore[arg-type]
        (lambda: parse_metrics("vllm:num_requests_running 1\n", deadline="soon"), "not str$"),  # type: ignore[arg-type]
        (lambda: parse_metrics("vllm:num_requests_running 1\n", deadline=True), "not bool$"),
    ],
)
def test_parse_metrics_type_errors_name_the_type_given(call: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        call()  # type: ignore[operator]


TTFT = "# TYPE vllm:time_to_first_token_seconds histogram\n"


def test_a_ttft_bucket_bounded_at_zero_is_not_negative_and_is_read() -> None:
    text = (
        TTFT + 'vllm:time_to_first_token_seconds_bucket{le="0"} 0\n'
        'vllm:time_to_first_token_seconds_bucket{le="0.5"} 2\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 3\n'
    )
    assert parse_metrics(text).ttft_buckets == ((0.0, 0.0), (0.5, 2.0), (math.inf, 3.0))


def test_untyped_samples_named_without_their_suffix_are_read_too() -> None:
    # Exposition without TYPE lines keeps a sample's name as written: the counters without _total and the cache
    # config without _info are the same figures.
    text = (
        "vllm:prefix_cache_queries 10\n"
        "vllm:prefix_cache_hits 4\n"
        'vllm:cache_config{block_size="32",num_gpu_blocks="500"} 1\n'
    )
    metrics = parse_metrics(text)
    assert (metrics.prefix_queries, metrics.prefix_hits, metrics.hit_rate) == (10, 4, 0.4)
    assert (metrics.block_size, metrics.num_gpu_blocks) == (32, 500)
    legacy = parse_metrics("vllm:gpu_prefix_cache_queries 8\nvllm:gpu_prefix_cache_hits 2\n")
    assert (legacy.prefix_queries, legacy.prefix_hits) == (8, 2)


def test_engines_gpu_blocks_are_the_server_s_total_each_so_two_near_the_limit_are_not_refused() -> None:
    # Was refused, as a sum past 2^40: each engine's series carries the server's total (vLLM sums at start-up).
    info = "# TYPE vllm:cache_config_info gauge\n"
    info += "".join(
        f'vllm:cache_config_info{{block_size="16",engine="{i}",num_gpu_blocks="{2**39 + 1}"}} 1\n' for i in range(2)
    )
    assert parse_metrics(info).num_gpu_blocks == 2**39 + 1


def test_figures_of_other_exporters_never_fail_the_scrape() -> None:
    # Only vllm: figures are checked: a process collector's huge, negative or NaN figures are not the engine's.
    text = (
        'process_virtual_memory_bytes{pid="1"} 1e308\n'
        'process_virtual_memory_bytes{pid="2"} 1e308\n'
        "python_gc_objects_collected_total -1\n"
        "some_ratio NaN\n"
        "vllm:num_requests_running 2\n"
    )
    assert parse_metrics(text).running == 2


def test_text_without_a_vllm_figure_says_so_in_full() -> None:
    message = r"^no vLLM metrics found \(expected vllm:num_requests_running and others\): is this vLLM\?$"
    with pytest.raises(MetricsError, match=message):
        parse_metrics("process_virtual_memory_bytes 1\n")


def test_without_a_ttft_histogram_or_its_sum_the_ttft_figures_are_zero() -> None:
    # EngineMetrics: no histogram is no samples (count 0, sum 0, no buckets), not unknown; a histogram without its
    # _sum has a sum of 0.
    none = parse_metrics("vllm:num_requests_running 1\n")
    assert (none.ttft_buckets, none.ttft_count, none.ttft_sum) == ((), 0.0, 0.0)
    assert isinstance(none.ttft_sum, float)
    no_sum = parse_metrics(TTFT + 'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 3\n')
    assert (no_sum.ttft_count, no_sum.ttft_sum) == (3.0, 0.0)
    assert isinstance(no_sum.ttft_sum, float)


def redirecting(hops: int) -> httpx.MockTransport:
    """An engine behind ``hops`` redirects in a row: /metrics → /r1 → … → /r<hops>, which serves the figures."""

    def engine(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        step = 0 if path == "/metrics" else int(path.removeprefix("/r"))
        if step < hops:
            return httpx.Response(302 if step % 2 else 301, headers={"Location": f"/r{step + 1}"})
        return httpx.Response(200, stream=httpx.ByteStream(SMALL_BODY))

    return httpx.MockTransport(engine)


def test_redirects_are_followed_up_to_twenty_in_a_row() -> None:
    # As Prometheus does: a /metrics behind a proxy that redirects it is still read, up to 20 redirects in a row.
    for hops in (1, 20):
        with httpx.Client(transport=redirecting(hops)) as client:
            assert fetch_metrics(URL, client=client).waiting == 3
    with (
        httpx.Client(transport=redirecting(21)) as client,
        pytest.raises(MetricsError, match=f"^cannot read {URL}: "),
    ):
        fetch_metrics(URL, client=client)


def test_a_nonsense_timeout_is_refused_by_its_name() -> None:
    with pytest.raises(ConfigurationError, match="^timeout must be a finite positive number of seconds"):
        fetch_metrics(URL, timeout=-1.0)


def test_the_parsing_of_an_abandoned_scrape_stops_at_its_deadline_too() -> None:
    # The caller waits at most the timeout; the parsing in the scrape's thread stops at the same deadline (it checks
    # every 64 KiB), so the abandoned thread ends soon after, not once seconds of parsing are done.
    text = "# TYPE vllm:num_requests_waiting gauge\n" + "".join(
        f'vllm:num_requests_waiting{{engine="{i}"}} 1\n' for i in range(600_000)
    )  # 26 MB: seconds to parse in full
    body = text.encode()

    def engine(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=httpx.ByteStream(body))

    before = set(threading.enumerate())
    with (
        httpx.Client(transport=httpx.MockTransport(engine)) as client,
        pytest.raises(MetricsError, match="not parsed within 0.2s"),
    ):
        fetch_metrics(URL, client=client, timeout=0.2)
    scrapes = [t for t in threading.enumerate() if t not in before]
    for thread in scrapes:
        thread.join(1.0)
    assert not any(thread.is_alive() for thread in scrapes)


def test_a_scrape_held_past_its_timeout_is_left_in_a_daemon_thread_named_for_it() -> None:
    # fetch_metrics' docstring: the request runs in a daemon thread, so one the caller gave up on never holds the
    # interpreter's exit; its name tells it apart (the tests waiting for abandoned scrapes to end look for it).
    release = threading.Event()

    def engine(request: httpx.Request) -> httpx.Response:
        release.wait(10)
        return httpx.Response(200, stream=httpx.ByteStream(SMALL_BODY))

    before = set(threading.enumerate())
    try:
        with (
            httpx.Client(transport=httpx.MockTransport(engine)) as client,
            pytest.raises(MetricsError, match=f"^cannot read {URL}: no complete answer within 0.1s$"),
        ):
            fetch_metrics(URL, client=client, timeout=0.1)
        held = [t for t in threading.enumerate() if t not in before]
        assert [(t.name, t.daemon, t.is_alive()) for t in held] == [("prefixroute-scrape", True, True)]
    finally:
        release.set()
    held[0].join(5)
    assert not held[0].is_alive()


def test_the_deadline_is_looked_at_again_after_each_further_64_kib_and_only_once_past(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A clock that reads exactly the deadline at the first check (not past it yet), past it at the second: the second
    # check comes once more than 64 KiB has been read since the first, here after the line following a 64 KiB one.
    readings = iter([5.0, 10.0, 10.0])
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(monotonic=lambda: next(readings)))
    first = "#" + "x" * ((1 << 16) - 1) + "\n"  # 64 KiB and a character: checked after it
    second = "#" + "y" * ((1 << 16) - 2) + "\n"  # exactly 64 KiB more: not yet
    sample = "vllm:num_requests_waiting 1\n"
    text = first + second + sample * 3
    read = len(first) + len(second) + len(sample)
    with pytest.raises(MetricsError, match=f"^not parsed by the deadline: {read} of {len(text)} characters read$"):
        parse_metrics(text, deadline=5.0)


def test_a_body_is_decoded_in_the_charset_its_content_type_declares() -> None:
    def engine(request: httpx.Request) -> httpx.Response:
        body = SMALL_BODY.decode().encode("utf-16")
        headers = {"Content-Type": "text/plain; version=0.0.4; charset=utf-16"}
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(body))

    with httpx.Client(transport=httpx.MockTransport(engine)) as client:
        assert fetch_metrics(URL, client=client).waiting == 3


@pytest.mark.parametrize(
    ("error", "detail"),
    [
        (httpx.ConnectError("[Errno 111] Connection refused\nwhile connecting"), "[Errno 111] Connection refused"),
        (httpx.ReadError("  "), "ReadError"),  # no text: the error's type says what failed
    ],
)
def test_a_network_failure_is_one_line_naming_the_url_and_what_failed(error: Exception, detail: str) -> None:
    def engine(request: httpx.Request) -> httpx.Response:
        raise error

    with (
        httpx.Client(transport=httpx.MockTransport(engine)) as client,
        pytest.raises(MetricsError, match="^" + re.escape(f"cannot read {URL}: {detail}") + "$") as refused,
    ):
        fetch_metrics(URL, client=client)
    assert refused.value.__cause__ is error


def test_a_raw_deflate_body_is_inflated_a_byte_past_the_cap_at_most_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # A body labelled deflate that turns out raw (as some servers send it) is bounded like any other.
    cap = 1000
    kept = _pieces_kept_under_a_cap_of(cap, monkeypatch)
    packer = zlib.compressobj(9, wbits=-zlib.MAX_WBITS)
    with pytest.raises(MetricsError, match=f"the body is over {cap} bytes"):
        metrics_module._Body(URL, "deflate").add(packer.compress(bytes(10 * cap)) + packer.flush())
    assert kept == [cap + 1]


def test_figures_the_router_does_not_read_may_hold_what_an_engine_reports() -> None:
    """vLLM V0 reports its prefix-cache hit rate as -1 with prefix caching off ("not supported or disabled") and its
    speculative decoding acceptance rate as NaN before a draft token: every scrape of such an engine failed, so a
    Fleet marked it unhealthy for good (the proxy's /healthz answered 503). Only the figures read are checked."""
    text = (
        "vllm:num_requests_running 2\n"
        "vllm:num_requests_waiting 1\n"
        "vllm:gpu_cache_usage_perc 0.25\n"
        "vllm:gpu_prefix_cache_hit_rate -1.0\n"
        "vllm:cpu_prefix_cache_hit_rate -1.0\n"
        "vllm:spec_decode_draft_acceptance_rate NaN\n"
        "vllm:spec_decode_efficiency NaN\n"
    )
    figures = parse_metrics(text)
    assert (figures.running, figures.waiting, figures.kv_usage) == (2.0, 1.0, 0.25)
    for read in ("vllm:num_requests_waiting -1\n", "vllm:gpu_cache_usage_perc NaN\n"):  # still refused
        with pytest.raises(MetricsError, match="finite, non-negative"):
            parse_metrics(read + text)
