"""Thin adapters that turn a gateway's request into :meth:`prefixroute.Router.route` and back.

Each holds no routing logic of its own. :mod:`prefixroute.adapters.tokenize` serves gateways that see text, not
token ids.
"""
