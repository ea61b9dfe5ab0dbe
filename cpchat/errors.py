"""The two ways a request fails, as every front end reports them: the user's input (exit 2) or the
backend (exit 3). Plain exceptions, so that reading a document or a setting needs no gRPC."""


class BadInput(ValueError):
    """The user asked for something that cannot work (bad model path, bad address)."""


class BackendError(RuntimeError):
    """A rank failed, stopped answering, or refused; the message names it."""
