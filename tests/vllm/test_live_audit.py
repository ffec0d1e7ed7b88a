"""Findings of a live audit of the vLLM layer: real ZMQ and HTTP sockets on loopback, hostile peers and options."""

from __future__ import annotations

import pytest
import zmq

from prefixroute.errors import ConfigurationError
from prefixroute.vllm import KVEventSubscriber
from prefixroute.vllm._checks import check_endpoint

from .test_vllm_blackbox import events_router

# Addresses that look like tcp://HOST:PORT but that libzmq's connect() refuses (EINVAL): the thread would retry them
# for ever, warning, instead of the option being refused when given.
ZMQ_REFUSES = [
    "tcp://127.0.0.1:5558,tcp://gpu0:5559",  # a third endpoint after ENDPOINT,REPLAY on the command line
    "tcp://gpu0/kv:5557",
    "tcp://]:5557",
    "tcp://user@gpu0:5557",
    "tcp://gpu0#x:5557",
    "tcp://gpu0?x:5557",
    "tcp://-:5557",
    "tcp://gpu0:\u0663",  # an Arabic-Indic digit: str.isdigit() says yes, libzmq does not
    "tcp://gpü0:5557",
    "tcp://;gpu0:5557",
    "tcp://gpu0\\x:5557",
    "tcp://gpu0,gpu1:5557",
]
ZMQ_TAKES = ["tcp://gpu0:5557", "tcp://[::1]:5557", "tcp://10.0.0.1:5557", "tcp://gpu_0.local:5557",
             "tcp://eth0;gpu0:5557", "tcp://fe80::1%eth0:5557", "ipc:///tmp/kv", "inproc://kv",
             "tcp://::1:5557", "tcp://gpu-0:5557", "tcp://gpu0;*:5557"]  # fmt: skip


@pytest.mark.parametrize("endpoint", ZMQ_REFUSES)
def test_an_endpoint_libzmq_refuses_is_refused_when_given(endpoint: str) -> None:
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    try:
        with pytest.raises(zmq.ZMQError):
            socket.connect(endpoint)
    finally:
        socket.close(linger=0)
    with pytest.raises(ConfigurationError, match="must be a ZMQ address to connect to"):
        check_endpoint(endpoint, "endpoint", "tcp://gpu0:5557")
    with pytest.raises(ConfigurationError, match="replay_endpoint must be a ZMQ address"):
        KVEventSubscriber(events_router(), "gpu0", "tcp://127.0.0.1:5557", replay_endpoint=endpoint)


@pytest.mark.parametrize("endpoint", ZMQ_TAKES)
def test_an_endpoint_libzmq_takes_is_taken(endpoint: str) -> None:
    assert check_endpoint(endpoint, "endpoint", "tcp://gpu0:5557") == endpoint
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    try:
        socket.connect(endpoint)
    finally:
        socket.close(linger=0)
