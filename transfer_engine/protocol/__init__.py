"""The sans-IO core: pure functions and state machines. Imports no torch, nixl, zmq or anyio."""
