"""Errors nodekv raises for bad input; each message names the problem."""


class NodeKVError(Exception):
    """Base class of nodekv's own errors."""


class ModelLoadError(NodeKVError, ValueError):
    """A model cannot be loaded: unsupported architecture, missing/mis-shaped tensor, corrupt file."""


class ContextOverflowError(NodeKVError, ValueError):
    """A prompt or generation would exceed the model's context window."""


class PoolExhaustedError(NodeKVError, RuntimeError):
    """The KV page pool has no room for the tokens asked for; nothing was changed."""


class SessionReleasedError(NodeKVError, RuntimeError):
    """A session was used after `release()`."""
