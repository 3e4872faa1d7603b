"""What crosses a process boundary: the wire format (msgspec structs), the side channel (zmq
request/reply, optionally keyed), the handshake with peers and the shared key.

It may import msgspec, zmq and the standard library only: never torch, numpy, vLLM or
another room of this package (the proxy and other languages' peers build on it alone).
"""
